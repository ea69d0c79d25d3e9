"""A checkpoint read into a state laid out like `like`: the stored key of each leaf, and the fill.

`targets_of` pairs every leaf of `like` (its per-leaf form, or its flat buckets where the
checkpoint's are laid out the same: `same_flat_layout`) with the stored key that fills it, and
`groups_of` cuts them into groups of about an eighth of the state. `LikeLeaves` writes each
group orbax read (`read_args`) into `like`'s own buffers, moving every leaf onto `like`'s
padding ([Note: a leaf moved between layouts]), and gives the restored state. An abstract `like`
(`is_abstract`) takes a checkpoint only where no padding comes from it (`abstract_fits`).
`CheckpointManager.restore` runs them group by group.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp._src import checks, train
from jaxdp._src.checkpoint_format import (
  Description,
  LeafRow,
  Metadata,
  describe_window,
  flat_items,
  is_flat,
  per_leaf_program,
  stored_key,
)
from jaxdp._src.distributed_optimizer import fused_state, per_leaf_state
from jaxdp._src.layout import master_dtype
from jaxdp._src.mesh import run_auto
from jaxdp._src.state import (
  FLAT_SPEC,
  HOST,
  TrainState,
  bucket_names,
  leaves_of,
  to_device,
  tree_of,
)


# [Note: a leaf moved between layouts]
# A stored leaf and the `like` leaf it fills may differ in padding (another dp pads the
# shard dim to another multiple) and in form (a block of a flat bucket, a padded scalar).
# Both hold the leaf's logical region first on every dim and padding after it, so moving a
# leaf takes three cuts, each at the end of a dim and never inside the logical region:
# 1. orbax reads the stored key straight into the target's shape and sharding
#    (`read_args`, `strict=False`: cut or zero-extended at each dim's end, shard by shard);
#    a key inside a flat bucket is read as its whole bucket instead (`CheckpointManager.restore`);
# 2. `_value` cuts a flat bucket's key out (`_FlatSlice`): the leaf in its saved padded shape;
# 3. `_fit` puts that into `like`'s shape and keeps `like`'s own elements past the logical
#    region (the padding rows `init_state` computed, e.g. an optimizer's initial state),
#    or, where nothing of `like` is kept (`_keeps`), `_cut` drops the saved padding.
# Each step is elementwise or a slice at dims' ends, so a resume on the same layout reads
# every element back unchanged (bitwise).
def _fit(x: jax.Array, like: jax.Array, logical: tuple[int, ...]) -> jax.Array:
  """Traced: a stored leaf `x` in `like`'s shape and dtype. The stored leaf holds its logical
  region `logical` first on every dim, then padding rows; every element outside the logical
  region is `like`'s (the padding `init_state` put there).

  orbax read `x` into `like`'s shape and sharding where it could (cut or zero-extended at
  the end of each dim, shard by shard), so this is elementwise on each device's shard. A
  leaf cut from a flat bucket (in its saved padded shape) is cut or extended here, and a
  scalar stored as one padded dim (or the other way round) is reshaped."""
  if x.ndim != like.ndim or not logical:  # a scalar: its one element
    # Its logical region is the one element: stored first, so element 0 of `x`, and
    # placed at index 0 of a padded `like`, whose other elements are `like`'s padding
    value = x.reshape(-1)[0].astype(like.dtype)
    if like.ndim == 0:
      return value
    first = jax.lax.broadcasted_iota(jnp.int32, like.shape, 0) == 0
    return jnp.where(first, value, like)
  x = x.astype(like.dtype)
  # Step 3 of [Note: a leaf moved between layouts]: same rank, cut or zero-extended at the
  # end of each dim (a no-op where orbax already read it in `like`'s shape)
  if tuple(x.shape) != tuple(like.shape):
    x = x[tuple(slice(0, min(a, b)) for a, b in zip(x.shape, like.shape))]
    x = jnp.pad(x, [(0, b - a) for a, b in zip(x.shape, like.shape)])
  if tuple(like.shape) == tuple(logical):
    return x
  # The logical region as a mask over the dims that have padding; `x` inside, `like` outside
  inside = functools.reduce(
    jnp.logical_and,
    [
      jax.lax.broadcasted_iota(jnp.int32, like.shape, d) < n
      for d, n in enumerate(logical)
      if like.shape[d] > n
    ],
  )
  return jnp.where(inside, x, like)


# ----------------------------------------------------------------------------- restore


class _BucketIndex(NamedTuple):
  """Where a "flat" `_Target` sits in `like`: one flat bucket of its master or of one item
  of its optax state."""

  item: int | None
  """The optax state item (`flat_items`) the bucket belongs to; None: the master's."""
  name: str
  """The bucket's name (`bucket_names`)."""


@dataclasses.dataclass(frozen=True)
class _FlatSlice:
  """A stored per-leaf key that lies inside a stored flat bucket (where the metadata's "flat"
  entry places it), with what cutting it out of the bucket takes (`_value`)."""

  bucket_key: str
  """The stored flat bucket orbax reads."""
  bucket_length: int
  """The bucket's stored length (all dp shards)."""
  offset: int
  """Where the key's block starts in each device's shard of the bucket."""
  local_shape: tuple[int, ...]
  """The block's shape: the leaf's padded shape with its shard dim cut by `dp`."""
  axis: int
  """The leaf's shard dim."""
  dp: int
  """The dp the bucket was saved with: its number of shards."""

  @property
  def stored_shape(self) -> tuple[int, ...]:
    """The key's padded shape as saved: its blocks of all shards along `axis`."""
    local, axis = self.local_shape, self.axis
    return (*local[:axis], local[axis] * self.dp, *local[axis + 1 :])


@dataclasses.dataclass(frozen=True)
class _Target:
  """One leaf of `like` and the stored key that fills it."""

  field: str
  """"params", "master", "opt" (`jax.tree.leaves` order of the per-leaf form), "flat" (a
  fused state's flat bucket, `index` a `_BucketIndex`), "model_state", "rng" or
  "spike_window"."""
  index: int | _BucketIndex
  key: str
  shape: tuple[int, ...]
  dtype: np.dtype
  """The leaf's dtype (a trainable low-precision param: its master's key, cast)."""
  spec: P
  logical: tuple[int, ...]
  stored: tuple[int, ...]
  """The key's shape as stored (per leaf: padded rows included)."""
  stored_dtype: str
  source: _FlatSlice | None = None
  """A key stored inside a flat bucket: where it lies there (the metadata's "flat" entry)."""

  @property
  def read(self) -> str:
    """The stored key orbax reads for this target."""
    return self.source.bucket_key if self.source is not None else self.key

  @property
  def bytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def same_flat_layout(meta: Metadata, like: TrainState) -> bool:
  """Was the checkpoint's fused state laid out exactly as `like` (same dp, buckets and
  shards)? Then each flat bucket is read as it is into `like`'s."""
  flat = meta.flat_layout
  params = leaves_of(like.params, like.layout)
  return bool(
    flat is not None
    and like.fused
    and like.config.use_distributed_optimizer
    and flat.dp == like.layout.dp
    and flat.layout == like.layout.summary()
    # no trainable param held besides the flat master
    and all(param is None for leaf, param in zip(like.layout.leaves, params) if leaf.trainable)
  )


def _saved_leaves(description: Description) -> dict[str, LeafRow]:
  """Every per-leaf key a checkpoint stores, with the logical shape and dtype of its leaf
  (a master: its param's shape, in the master's dtype)."""
  out = {}
  for index, row in enumerate(description.params):
    out[stored_key("params", index)] = LeafRow(path=row.path, shape=row.shape, dtype=row.dtype)
    if index in description.master:
      master = master_dtype(row.dtype).name
      out[stored_key("master", index)] = LeafRow(path=row.path, shape=row.shape, dtype=master)
  for index, row in enumerate(description.opt_state):
    out[stored_key("opt", index)] = row
  for index, row in enumerate(description.model_state):
    out[stored_key("model_state", index)] = row
  if description.rng:  # a key's raw data: two uint32 words
    out[stored_key("rng")] = LeafRow(path="", shape=(2,), dtype="uint32")
  for index, row in enumerate(description.spike_window):
    out[stored_key("spike_window", index)] = row
  return out


def targets_of(meta: Metadata, like: TrainState, mesh, same_flat: bool) -> list[_Target]:
  """Every leaf of `like` (its per-leaf form unless `same_flat`) with the stored key of
  checkpoint `meta` (any format) that fills it, in the order the stored keys are first
  needed."""
  per_leaf = like
  if like.fused and not same_flat:
    per_leaf = jax.eval_shape(functools.partial(per_leaf_state, mesh=mesh), like)
  specs = train.state_specs(per_leaf)
  layout = per_leaf.layout
  masters_saved = set(meta.description.master)
  saved = _saved_leaves(meta.description)
  if meta.stored is None:  # format 1: every key in its logical shape
    stored = {key: row.shape for key, row in saved.items()}
  else:
    stored = dict(meta.stored)
  flat = meta.flat_layout
  slices = {}
  for key, source in (flat.sources if flat is not None else {}).items():
    slices[key] = _FlatSlice(
      bucket_key=source.bucket_key,
      bucket_length=stored[source.bucket_key][0],
      offset=source.offset,
      local_shape=source.local_shape,
      axis=source.axis,
      dp=flat.dp,
    )
    stored[key] = slices[key].stored_shape

  def value_key(index):  # a trainable param's key: its master's where stored apart
    return stored_key("master" if index in masters_saved else "params", index)

  def target(field, index, key, leaf, spec):
    row = saved.get(key)  # None: a flat bucket, read as it is
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    return _Target(
      field=field,
      index=index,
      key=key,
      shape=shape,
      dtype=dtype,
      spec=spec,
      logical=shape if row is None else row.shape,
      stored=stored[key],
      stored_dtype=dtype.name if row is None else row.dtype,
      source=slices.get(key),
    )

  out = []
  if same_flat:  # each flat bucket as it is
    names = [named.name for named in bucket_names(layout)]
    for number, name in enumerate(names):
      out.append(
        target(
          "flat",
          _BucketIndex(item=None, name=name),
          stored_key("flat_master", number),
          like.master[name],
          FLAT_SPEC,
        )
      )
  else:
    masters = zip(leaves_of(per_leaf.master, layout), leaves_of(specs.master, layout))
    for index, (leaf, spec) in enumerate(masters):
      if leaf is not None:
        out.append(target("master", index, value_key(index), leaf, spec))
  params = zip(leaves_of(per_leaf.params, layout), leaves_of(specs.params, layout))
  for index, (leaf, spec) in enumerate(params):
    if leaf is not None:
      key = value_key(index) if layout.leaves[index].trainable else stored_key("params", index)
      out.append(target("params", index, key, leaf, spec))
  if same_flat:
    items, _ = flat_items(like)
    spec_items = jax.tree.flatten(specs.opt_state, is_leaf=lambda x: is_flat(x, layout))[0]
    opt_index = 0  # the per-leaf optax state's numbering
    buckets = [named.bucket for named in bucket_names(layout)]
    for item_index, (item, spec) in enumerate(zip(items, spec_items)):
      if is_flat(item, layout):
        for number, name in enumerate(names):
          if not hasattr(item[name], "shape"):  # optax.masked's `MaskedNode`: no state
            continue
          bucket = _BucketIndex(item=item_index, name=name)
          key = stored_key("flat_opt", number, item_index)
          out.append(target("flat", bucket, key, item[name], FLAT_SPEC))
          opt_index += len(buckets[number].params)  # one per-leaf leaf per param it holds
      else:
        out.append(target("opt", item_index, stored_key("opt", opt_index), item, spec))
        opt_index += 1
  else:
    opt_specs = jax.tree.leaves(specs.opt_state)
    for index, leaf in enumerate(jax.tree.leaves(per_leaf.opt_state)):
      out.append(target("opt", index, stored_key("opt", index), leaf, opt_specs[index]))
  for index, leaf in enumerate(jax.tree.leaves(per_leaf.model_state)):
    out.append(target("model_state", index, stored_key("model_state", index), leaf, P()))
  if per_leaf.rng is not None:
    out.append(target("rng", 0, stored_key("rng"), per_leaf.rng, P()))
  # The spike guard's window, where the checkpoint has one of `like`'s very shapes; else
  # `like`'s own (an empty window) is kept: the guard's statistic, not the training state
  if meta.description.spike_window == describe_window(like):
    for index, leaf in enumerate(jax.tree.leaves(per_leaf.spike_window)):
      out.append(target("spike_window", index, stored_key("spike_window", index), leaf, P()))
  return out


def groups_of(targets: list[_Target]) -> list[list[_Target]]:
  """The targets in groups of about an eighth of the state (at least one leaf each), read
  and fitted one group at a time: a restore holds the state plus one group. A key read
  into two shapes (a param and its master) is read once per group."""
  budget = sum(target.bytes for target in targets) / 8
  groups, current, size = [], [], 0
  for target in targets:
    if current and size + target.bytes > budget:
      groups.append(current)
      current, size = [], 0
    current.append(target)
    size += target.bytes
  if current:
    groups.append(current)
  # One orbax read takes a dict keyed by stored key, one shape each: a key that two targets
  # of a group read per leaf (an fp32 param is its own master, stored once, read into the
  # param's and the master's shapes) goes to a group of its own right after. Keys cut from
  # a flat bucket all read the same whole bucket, so they may share a read.
  out = []
  for group in groups:
    seen, first, again = set(), [], []
    for target in group:
      twice = target.source is None and target.read in seen
      (again if twice else first).append(target)
      seen.add(target.read)
    out += [first] + ([again] if again else [])
  return out


def _value(stored: dict[str, jax.Array], target: _Target) -> jax.Array:
  """Traced: the stored value of `target`'s key; a key stored in a flat bucket
  (`target.source`) is cut from it: block `d` of its shard dim is its columns of the
  bucket's shard `d`."""
  if target.source is None:
    return stored[target.key]
  piece = target.source
  # Step 2 of [Note: a leaf moved between layouts]. A bucket is stored shard-major: device
  # d's shard holds its rows of every param of the bucket, one block after another.
  # (dp, shard length): row d is device d's shard of the bucket, the block its columns
  shards = stored[piece.bucket_key].reshape(piece.dp, -1)
  block = shards[:, piece.offset : piece.offset + math.prod(piece.local_shape)]
  blocks = block.reshape(piece.dp, *piece.local_shape)  # (dp, *local_shape)
  # Device d's block is rows [d r, (d+1) r) of the shard dim: moving the device axis next
  # to it and merging the two lays the blocks end to end, the leaf's padded shape as saved
  return jnp.moveaxis(blocks, 0, piece.axis).reshape(target.stored)


def _as_read(target: _Target, old: jax.Array, read: jax.Array) -> bool:
  """Is the leaf orbax read for `target` the restored leaf itself (same shape, dtype and
  sharding as `like`'s, nothing cut from a flat bucket)?"""
  return (
    target.source is None
    and _keeps(target)
    and read.shape == old.shape
    and read.dtype == old.dtype
    and read.sharding == old.sharding
  )


def _keeps(target: _Target) -> bool:
  """Is the stored leaf `target`'s value as it is (stored in the target's very shape, or
  the target has no padding): nothing of `like` is kept."""
  return len(target.stored) == len(target.shape) and (
    target.stored == target.shape or target.logical == target.shape
  )


def _fitted(stored: dict[str, jax.Array], likes: list, targets) -> list[jax.Array]:
  """Traced: each target's leaf holding its stored value (`_fit`); `likes` has the `like`
  leaf of each target that takes padding from it, None for the others."""
  likes = to_device(likes)  # an offloaded like's leaves (`optimizer_cpu_offload`) are read here
  out = []
  for target, like_leaf in zip(targets, likes):
    value = _value(stored, target)
    if like_leaf is None:  # stored in like's very shape, or like has no padding: as stored
      out.append(_cut(value, target.shape).astype(target.dtype))
    else:
      out.append(_fit(value, like_leaf, target.logical))
  return out


def _cut(x: jax.Array, shape) -> jax.Array:
  """`x` cut to `shape` (of its rank) at the end of each dim (a flat-stored leaf's padding
  rows)."""
  return x if tuple(x.shape) == tuple(shape) else x[tuple(slice(0, n) for n in shape)]


def read_args(abstract: dict[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
  """orbax's restore arguments: each key read into its target's shape and sharding, shard by
  shard, cut or zero-extended at the end of each dim where the stored shape differs."""
  return {
    k: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype, strict=False)
    for k, x in abstract.items()
  }


class LikeLeaves:
  """The arrays of `like`, overwritten group by group with a checkpoint's values: each
  group's program takes the leaves it pads from `like` as donated buffers and writes into
  them, and frees the others, so a restore holds one state and one group's reads.

  A sharded fused state saved with the very same layout (`same_flat_layout`: a resume) is
  filled bucket by bucket in its flat form, each device reading its own shard. Any other
  fused state is filled in its per-leaf form and made flat at the end (a restore onto
  another dp or strategy: two states at that point)."""

  def __init__(self, like: TrainState, mesh, same_flat: bool):
    self.mesh, self.given = mesh, like
    self.flat = same_flat
    self.abstract = is_abstract(like)
    if not self.abstract:  # else nothing to overwrite: each leaf is allocated as it is read
      if like.fused and not same_flat:
        like = per_leaf_program(like, mesh)
      # a leaf held twice (jit returns one array for two equal outputs, e.g. an fp32 param
      # and its unpadded master): donated once, so the second holder gets a copy
      seen = set()

      def own(x):
        if x is None or id(x) not in seen:
          seen.add(id(x))
          return x
        return jnp.copy(x)

      like = jax.tree.map(own, like)
    self.like = like
    items, self.opt_def = flat_items(like) if same_flat else jax.tree.flatten(like.opt_state)
    self.items = [dict(x) if is_flat(x, like.layout) else x for x in items]
    self.values = {
      "params": leaves_of(like.params, like.layout),
      "master": None if same_flat else leaves_of(like.master, like.layout),
      "model_state": jax.tree.leaves(like.model_state),
      "rng": [like.rng],
      "spike_window": jax.tree.leaves(like.spike_window),
    }
    self.master_flat = dict(like.master) if same_flat else None

  def _get(self, target: _Target):
    if target.field == "flat":
      bucket = target.index
      flat = self.master_flat if bucket.item is None else self.items[bucket.item]
      return flat[bucket.name]
    if target.field == "opt":
      return self.items[target.index]
    return self.values[target.field][target.index]

  def _set(self, target: _Target, leaf):
    if target.field == "flat":
      bucket = target.index
      flat = self.master_flat if bucket.item is None else self.items[bucket.item]
      flat[bucket.name] = leaf
    elif target.field == "opt":
      self.items[target.index] = leaf
    else:
      self.values[target.field][target.index] = leaf

  def fill(self, stored: dict[str, jax.Array], group: list[_Target]) -> None:
    olds = [self._get(target) for target in group]
    # An offloaded leaf of `like` (`DDPConfig.optimizer_cpu_offload`) goes back to host
    # memory as soon as its group is read, so that the device never holds more than a group
    # (but a fused state read per leaf, made flat at the end on the device, moves then)
    homes = [_memory_kind(old) for old in olds]
    self._fill(stored, group, olds)
    if self.given.fused and not self.flat:
      return
    moved = {}  # id of a device leaf -> its host copy (two targets may hold one array)
    for target, home in zip(group, homes):
      leaf = self._get(target)
      if home == HOST and _memory_kind(leaf) != HOST:
        if id(leaf) not in moved:
          moved[id(leaf)] = (leaf, jax.device_put(leaf, leaf.sharding.with_memory_kind(HOST)))
        self._set(target, moved[id(leaf)][1])
    for leaf, _ in moved.values():
      leaf.delete()

  def _fill(self, stored: dict[str, jax.Array], group: list[_Target], olds: list) -> None:
    if self.abstract:  # where the state will place it
      olds = [
        jax.ShapeDtypeStruct(
          target.shape, target.dtype, sharding=NamedSharding(self.mesh, target.spec)
        )
        for target in group
      ]
    # A group read in `like`'s very shapes, dtypes and shardings needs no program: orbax's
    # arrays are the restored leaves, and `like`'s are deleted at once
    if all(_as_read(target, old, stored[target.read]) for target, old in zip(group, olds)):
      for target, old in zip(group, olds):  # read as they are, into like's very shardings
        if not self.abstract:
          old.delete()
        self._set(target, stored[target.read])
      return
    # Otherwise one program for the group (step 2 and 3 of [Note: a leaf moved between
    # layouts]), which writes each leaf that keeps padding from `like` into that leaf's
    # donated buffer: no second copy of those leaves
    specs = [x.sharding.spec for x in olds]
    fit = jax.jit(
      run_auto(functools.partial(_fitted, targets=tuple(group)), self.mesh, specs),
      donate_argnums=1,  # written into where the padding comes from `like`
    )
    # a leaf that takes nothing from `like` needs none of its buffer: freed below (an
    # abstract like's targets all take nothing: `abstract_fits`)
    likes = [None if _keeps(target) else old for target, old in zip(group, olds)]
    new = fit({target.read: stored[target.read] for target in group}, likes)
    for target, old, leaf in zip(group, olds, new):
      if not self.abstract and _keeps(target) and not old.is_deleted():
        old.delete()
      self._set(target, leaf)

  def state(self, step: int) -> TrainState:
    like = self.like
    layout = like.layout
    step = jax.device_put(np.asarray(step, like.step.dtype), NamedSharding(self.mesh, P()))
    if not self.abstract:
      like.step.delete()
    out = dataclasses.replace(
      like,
      step=step,
      params=tree_of(layout, self.values["params"]),
      master=self.master_flat if self.flat else tree_of(layout, self.values["master"]),
      opt_state=jax.tree.unflatten(self.opt_def, self.items),
      model_state=jax.tree.unflatten(
        jax.tree.structure(like.model_state), self.values["model_state"]
      ),
      rng=self.values["rng"][0],
      spike_window=self._spike_window(),
    )
    if self.given.fused and not self.flat:
      # (read on the device: `like`'s offloaded leaves too; `CheckpointManager.restore`
      # moves them back)
      fuse = lambda state, like: fused_state(to_device(state), self.mesh, to_device(like))
      out = jax.jit(fuse)(out, self.given)
      jax.tree.map(lambda x: x.delete(), self.given)  # consumed, as every other `like`
    return out

  def _spike_window(self):
    """The restored spike window, placed as the step places it; an abstract `like`'s,
    where the checkpoint had none to read into it, made empty on the mesh (as `init_state`
    makes it)."""
    window = self.like.spike_window
    if window is None:
      return None
    leaves = self.values["spike_window"]
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
      return checks.empty_spike_window(self.like.config, self.mesh)
    # as the step places it: orbax's read of a replicated 1-D leaf has another spec
    return checks.place_spike_window(
      jax.tree.unflatten(jax.tree.structure(window), leaves), self.mesh
    )


def _memory_kind(x) -> str | None:
  """The memory kind `x` (an array or a `jax.ShapeDtypeStruct`) is placed in, if it says."""
  sharding = getattr(x, "sharding", None)
  return getattr(sharding, "memory_kind", None)


def abstract_fits(like: TrainState, targets: list[_Target], same_flat: bool) -> str | None:
  """Why an abstract `like` cannot take this checkpoint, or None: a leaf restored onto other
  padding needs the padding rows `init_state` computes (an optimizer's initial state, e.g.
  Adagrad's accumulator of 0.1), which shapes alone do not give."""
  if like.fused and not same_flat:
    return "the checkpoint's flat buckets are laid out for another dp or strategy"
  for target in targets:
    if not _keeps(target):
      return f"{target.key} is stored as {target.stored} and is {target.shape} here"
  return None


def is_abstract(like: TrainState) -> bool:
  """Is `like` shapes only (`abstract_state`)? Refuses a mix and an abstract mesh."""
  leaves = jax.tree.leaves(like)
  abstract = [isinstance(x, jax.ShapeDtypeStruct) for x in leaves]
  if any(abstract) and not all(abstract):
    raise ValueError(
      "like: some leaves are arrays and some jax.ShapeDtypeStructs; pass the state of "
      "jaxdp.init_state or of jaxdp.abstract_state, as it is"
    )
  mesh = getattr(getattr(like.step, "sharding", None), "mesh", None)
  if any(abstract) and not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(
      "like: its shardings are on an abstract mesh (jax.eval_shape of init_state); build "
      "it with jaxdp.abstract_state(params, tx, mesh, config), which places it on `mesh`"
    )
  return all(abstract)
