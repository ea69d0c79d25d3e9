"""What a checkpoint stores, and the metadata that says so.

Every name a checkpoint stores is built by `stored_key`; `stored_arrays` gives a state's arrays
under those names, each as the state holds it (a sharded fused state's flat buckets as they
are), so a save runs no program. The JSON metadata is written and read through the records of
[Note: metadata records]: `Metadata`, with the `Description` of what the state holds that
`first_mismatch` holds `like` against before a restore reads anything. `FORMAT` is the version
of this layout; `jaxdp._src.checkpoint`'s docstring lists what each key holds.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxdp._src.distributed_optimizer import per_leaf_state
from jaxdp._src.layout import master_dtype, sharded_shape
from jaxdp._src.state import TrainState, bucket_names, leaves_of, match_opt_leaf

FORMAT = 2
"""Version of the stored layout; `CheckpointManager.restore` reads this format and format 1
(every leaf stored in its logical shape), and refuses checkpoints written by a newer format."""


# ----------------------------------------------------------------------------- stored keys

_KEY_KINDS = (
  "params",
  "master",
  "opt",
  "model_state",
  "rng",
  "flat_master",
  "flat_opt",
  "spike_window",
)


def stored_key(kind: str, index: int | None = None, item: int | None = None) -> str:
  """The name of one stored array: every name a checkpoint stores is built here.

  Args:
    kind: "params" or "master" (leaf `index` of the layout: a trainable low-precision
      param is stored as its "master", `_stores_master`), "opt" (leaf `index` of the
      per-leaf optax state, `jax.tree.leaves` order), "model_state" and "spike_window"
      (leaf `index`), "rng" (no index), "flat_master" (bucket `index` of a fused state's
      master), "flat_opt" (bucket `index` of the `item`-th flat tree of a fused optax state).
    index: the leaf's or bucket's number.
    item: "flat_opt" only: the optax state item (`flat_items`) the bucket belongs to.
  """
  if kind not in _KEY_KINDS:
    raise ValueError(f"stored key kind {kind!r}: expected one of {_KEY_KINDS}")
  if kind == "rng":
    return "rng"
  if kind == "flat_opt":
    return f"flat_opt{item}_{index}"
  return f"{kind}_{index}"


# ----------------------------------------------------------------------------- shapes


def _sharded(state: TrainState) -> bool:
  return state.config.use_distributed_optimizer


def _stores_master(dtype) -> bool:
  """Is a trainable param of this dtype stored with a separate master copy."""
  return master_dtype(dtype) != np.dtype(dtype)


def _stored_masters(state: TrainState) -> list[int]:
  """Trainable leaves stored with a separate master copy (low-precision params)."""
  layout = state.layout
  return [leaf.index for leaf in layout.leaves if leaf.trainable and _stores_master(leaf.dtype)]


class _OptForm(NamedTuple):
  """How one optax state leaf is read back in its logical form (`opt_forms`)."""

  shape: tuple[int, ...]
  """Its full shape: a per-param leaf's is its param's."""
  axis: int
  """A per-param leaf's shard dim (`Leaf.shard_axis`: where a sharded strategy pads it,
  and the dim its sharded view prefers); 0 for any other leaf."""
  param: int | None
  """The param whose per-param state it is (`match_opt_leaf`), or None."""


def opt_forms(state: TrainState) -> list[_OptForm]:
  """The `_OptForm` of every optax state leaf, in `jax.tree.leaves` order.

  Under a sharded strategy a per-param leaf has the param's padded shape (`sharded_shape`);
  under `no_shard` its very shape. It is matched to its param by `match_opt_leaf` (its key
  path ends with the param's path, `[0].mu['w']` for `['w']`, and it has that shape). A leaf
  that matches no param is stored as it is (a dp change then shows up as a shape mismatch,
  never as a wrong value).
  """
  keyed = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
  shapes = [tuple(int(d) for d in np.shape(x)) for _, x in keyed]
  layout = state.layout
  sharded = _sharded(state)
  seen = {
    leaf.index: sharded_shape(layout, leaf.index)[0] if sharded else leaf.shape
    for leaf in layout.leaves
    if leaf.trainable
  }
  out = []
  for (path, _), shape in zip(keyed, shapes):
    param = match_opt_leaf(path, shape, layout.paths, seen).param
    if param is None:
      out.append(_OptForm(shape=shape, axis=0, param=None))
    else:
      leaf = layout.leaves[param]
      out.append(_OptForm(shape=leaf.shape, axis=leaf.shard_axis, param=param))
  return out


# ----------------------------------------------------------------------------- metadata
#
# [Note: metadata records] A checkpoint's JSON metadata is written and read through the
# records below, each field by its name (`restore` reads "format" from the JSON itself, and
# `data_position()` hands back "data_position" as saved). A record's `to_json` writes it and
# its `from_json` reads it back, the two side by side: a row (one leaf: a NamedTuple) as a
# JSON list in its fields' order, any other record as a JSON object keyed by its fields'
# names. To add a field: declare it in its record with the default that a checkpoint saved
# without it (an older one) reads as, after the other fields (a row is stored by position);
# write it in `to_json`; read it in `from_json`, falling back to that default where an older
# checkpoint lacks it (`entries.get(name, default)`; a row: a shorter list). Where an older
# jaxdp would misread the new checkpoint (a field renamed or changed in meaning, a longer
# row: readers unpack a row by its length), bump `FORMAT` too: `restore` refuses a newer
# format, and `from_json` reads every older one.


class LeafRow(NamedTuple):
  """One optax state or model state leaf, as the metadata stores it (a JSON list). To add a
  field: [Note: metadata records]."""

  path: str
  """`jax.tree_util.keystr` of its path in its tree."""
  shape: tuple[int, ...]
  """Its logical shape: a per-param optax leaf's is its param's, without padding."""
  dtype: str
  """`np.dtype(...).name`."""

  def to_json(self) -> list[Any]:
    return [self.path, list(self.shape), self.dtype]

  @classmethod
  def from_json(cls, row: list[Any]) -> LeafRow:
    path, shape, dtype = row
    return cls(path=path, shape=tuple(shape), dtype=dtype)


class _ParamRow(NamedTuple):
  """One param of the layout, as the metadata stores it (a JSON list). To add a field:
  [Note: metadata records]."""

  path: str
  """`jax.tree_util.keystr` of its path in the params (`Layout.paths`)."""
  shape: tuple[int, ...]
  """Its logical shape, without padding."""
  dtype: str
  """The param's own dtype (`np.dtype(...).name`), not its master's."""
  trainable: bool

  def to_json(self) -> list[Any]:
    return [self.path, list(self.shape), self.dtype, self.trainable]

  @classmethod
  def from_json(cls, row: list[Any]) -> _ParamRow:
    path, shape, dtype, trainable = row
    return cls(path=path, shape=tuple(shape), dtype=dtype, trainable=trainable)


@dataclasses.dataclass(frozen=True)
class Description:
  """What a state's canonical form holds (`describe`): the part of the metadata that
  `restore` checks `like` against, and reads each stored leaf's logical form from. To add a
  field: [Note: metadata records]."""

  params: tuple[_ParamRow, ...]
  master: tuple[int, ...]
  """The params stored with a separate master copy (`_stored_masters`)."""
  opt_state: tuple[LeafRow, ...]
  """Every optax state leaf of the per-leaf form, in `jax.tree.leaves` order."""
  opt_state_structure: str
  """`str` of the optax state's treedef."""
  model_state: tuple[LeafRow, ...] = ()
  rng: bool = False
  """Does the state hold a key."""
  spike_window: tuple[LeafRow, ...] = ()
  """The spike guard's window (`TrainState.spike_window`) leaves; () without one."""

  def to_json(self) -> dict[str, Any]:
    out = {
      "params": [row.to_json() for row in self.params],
      "master": list(self.master),
      "opt_state": [row.to_json() for row in self.opt_state],
      "opt_state_structure": self.opt_state_structure,
      "model_state": [row.to_json() for row in self.model_state],
      "rng": self.rng,
    }
    if self.spike_window:  # written only where there is one: other metadata as before
      out["spike_window"] = [row.to_json() for row in self.spike_window]
    return out

  @classmethod
  def from_json(cls, entries: dict[str, Any]) -> Description:
    return cls(
      params=tuple(_ParamRow.from_json(row) for row in entries["params"]),
      master=tuple(entries["master"]),
      opt_state=tuple(LeafRow.from_json(row) for row in entries["opt_state"]),
      opt_state_structure=entries["opt_state_structure"],
      # the first format-1 checkpoints were written before states held these two
      model_state=tuple(LeafRow.from_json(row) for row in entries.get("model_state", [])),
      rng=entries.get("rng", False),
      spike_window=tuple(LeafRow.from_json(row) for row in entries.get("spike_window", [])),
    )


class _FlatSource(NamedTuple):
  """Where a per-leaf key of a sharded fused state lies in its stored flat bucket (a JSON
  list): on every device's shard of the bucket, its block of that device's rows. To add a
  field: [Note: metadata records]."""

  bucket_key: str
  """The stored flat bucket (`stored_key("flat_master", ...)` or `stored_key("flat_opt", ...)`)."""
  offset: int
  """Where its block starts in each device's shard of the bucket."""
  local_shape: tuple[int, ...]
  """The block's shape: the leaf's padded shape with its shard dim cut by dp."""
  axis: int
  """The leaf's shard dim."""

  def to_json(self) -> list[Any]:
    return [self.bucket_key, self.offset, list(self.local_shape), self.axis]

  @classmethod
  def from_json(cls, row: list[Any]) -> _FlatSource:
    bucket_key, offset, local_shape, axis = row
    return cls(bucket_key=bucket_key, offset=offset, local_shape=tuple(local_shape), axis=axis)


@dataclasses.dataclass(frozen=True)
class _FlatLayout:
  """How a sharded fused state was stored as its flat buckets (`_stored_flat`): the
  metadata's "flat" entry. To add a field: [Note: metadata records]."""

  dp: int
  layout: str
  """`Layout.summary()`: a restore with the very same layout reads each bucket as it is."""
  sources: dict[str, _FlatSource]
  """Each per-leaf key held in a flat bucket, and where."""

  def to_json(self) -> dict[str, Any]:
    return {
      "dp": self.dp,
      "layout": self.layout,
      "sources": {key: source.to_json() for key, source in self.sources.items()},
    }

  @classmethod
  def from_json(cls, entries: dict[str, Any]) -> _FlatLayout:
    return cls(
      dp=entries["dp"],
      layout=entries["layout"],
      sources={key: _FlatSource.from_json(row) for key, row in entries["sources"].items()},
    )


@dataclasses.dataclass(frozen=True)
class Metadata:
  """A checkpoint's metadata: the JSON object `CheckpointManager.metadata` returns, with
  the description's entries (`Description`) at its top level. To add a field: [Note:
  metadata records]."""

  format: int
  """`FORMAT` of the jaxdp that wrote it."""
  jaxdp_version: str
  state_step: int
  """The state's step counter."""
  data_position: Any
  """The caller's `data_position` (any JSON value)."""
  strategy: str
  dp: int
  mesh_shape: dict[str, int]
  layout: str
  """`Layout.summary()` of the saved state."""
  description: Description
  stored: dict[str, tuple[int, ...]] | None = None
  """Every stored key's shape as stored; None (format 1): each key's logical shape."""
  flat: dict[str, Any] | None = None
  """A sharded fused state's `_FlatLayout` as stored (`stored_arrays` gives it so; read it
  through `flat_layout`); None: every key is stored in its per-leaf form."""

  @property
  def flat_layout(self) -> _FlatLayout | None:
    return None if self.flat is None else _FlatLayout.from_json(self.flat)

  def to_json(self) -> dict[str, Any]:
    out = {
      "format": self.format,
      "jaxdp_version": self.jaxdp_version,
      "state_step": self.state_step,
      "data_position": self.data_position,
      "strategy": self.strategy,
      "dp": self.dp,
      "mesh_shape": dict(self.mesh_shape),
      "layout": self.layout,
      **self.description.to_json(),
    }
    if self.stored is not None:
      out["stored"] = {key: list(shape) for key, shape in self.stored.items()}
    if self.flat is not None:
      out["flat"] = self.flat
    return out

  @classmethod
  def from_json(cls, entries: dict[str, Any]) -> Metadata:
    stored = entries.get("stored")
    return cls(
      format=entries["format"],
      jaxdp_version=entries["jaxdp_version"],
      state_step=entries["state_step"],
      data_position=entries["data_position"],
      strategy=entries["strategy"],
      dp=entries["dp"],
      mesh_shape=entries["mesh_shape"],
      layout=entries["layout"],
      description=Description.from_json(entries),
      stored=None if stored is None else {key: tuple(shape) for key, shape in stored.items()},
      flat=entries.get("flat"),
    )


# ----------------------------------------------------------------------------- description


def describe(state: TrainState) -> Description:
  """What a state's canonical form holds: the metadata a checkpoint is checked by."""
  if state.fused:
    state = jax.eval_shape(functools.partial(per_leaf_state, mesh=state.step.sharding.mesh), state)
  layout = state.layout
  keyed_opt = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
  keyed_model = jax.tree_util.tree_flatten_with_path(state.model_state)[0]
  return Description(
    params=tuple(
      _ParamRow(path=leaf.path, shape=leaf.shape, dtype=leaf.dtype.name, trainable=leaf.trainable)
      for leaf in layout.leaves
    ),
    master=tuple(_stored_masters(state)),
    opt_state=tuple(
      LeafRow(path=jax.tree_util.keystr(path), shape=form.shape, dtype=np.dtype(leaf.dtype).name)
      for (path, leaf), form in zip(keyed_opt, opt_forms(state))
    ),
    opt_state_structure=str(jax.tree.structure(state.opt_state)),
    model_state=tuple(
      LeafRow(
        path=jax.tree_util.keystr(path),
        shape=tuple(np.shape(leaf)),
        dtype=np.dtype(leaf.dtype).name,
      )
      for path, leaf in keyed_model
    ),
    rng=state.rng is not None,
    spike_window=describe_window(state),
  )


def describe_window(state: TrainState) -> tuple[LeafRow, ...]:
  """The metadata rows of `state`'s spike window (`Description.spike_window`)."""
  keyed = jax.tree_util.tree_flatten_with_path(state.spike_window)[0]
  return tuple(
    LeafRow(path=jax.tree_util.keystr(path), shape=tuple(leaf.shape), dtype=leaf.dtype.name)
    for path, leaf in keyed
  )


def first_mismatch(saved: Description, want: Description) -> str | None:
  """A sentence naming the first leaf where a checkpoint and `like` disagree, or None."""

  def leaf(kind, saved_rows, like_rows):
    # Paired by path: a leaf only one side has is named as such, not compared with
    # whatever leaf sits at its position on the other side.
    # Stored keys are numbered by position (`params_<i>`, `opt_<j>`), so a leaf added or
    # removed shifts every key after it: compared by position, the error would name the
    # first shifted leaf (a shape mismatch far from the change), or, where shapes happen
    # to agree, none at all. By path, the added or removed leaf itself is named, and an
    # order that differs is refused last, since the keys would then fill the wrong leaves.
    saved_paths, like_paths = [row.path for row in saved_rows], [row.path for row in like_rows]
    extra = [path for path in saved_paths if path not in set(like_paths)]
    missing = [path for path in like_paths if path not in set(saved_paths)]
    if extra or missing:
      named = lambda paths: (
        ", ".join(f"{kind}{path}" for path in paths[:4])
        + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")
      )
      parts = []
      if extra:
        parts.append(f"only the checkpoint has {named(extra)}")
      if missing:
        parts.append(f"only `like` has {named(missing)}")
      return (
        " and ".join(parts)
        + f" ({len(saved_rows)} {kind} leaves in the checkpoint, {len(like_rows)} in `like`)"
      )
    by_path = {row.path: row for row in saved_rows}
    for like_row in like_rows:
      saved_row = by_path[like_row.path]
      if saved_row.shape != like_row.shape:
        return (
          f"{kind}{saved_row.path}: shape {saved_row.shape} in the checkpoint, "
          f"{like_row.shape} in `like`"
        )
      if saved_row.dtype != like_row.dtype:
        return (
          f"{kind}{saved_row.path}: dtype {saved_row.dtype} in the checkpoint, "
          f"{like_row.dtype} in `like`"
        )
    if saved_paths != like_paths:
      return f"the {kind} leaves are the same but in another order in the checkpoint"
    return None

  role = lambda trainable: "trainable" if trainable else "frozen"
  if msg := leaf("params", saved.params, want.params):
    return msg
  # Same paths in the same order here, so the rows pair by position
  for saved_row, like_row in zip(saved.params, want.params):
    if saved_row.trainable != like_row.trainable:
      return (
        f"params{saved_row.path}: {role(saved_row.trainable)} in the checkpoint, "
        f"{role(like_row.trainable)} in `like`; use the same `frozen`"
      )
  if msg := leaf("opt_state", saved.opt_state, want.opt_state):
    return msg + " (another optimizer?)"
  if saved.opt_state_structure != want.opt_state_structure:
    return (
      "the optimizer state has the structure "
      f"{saved.opt_state_structure} in the checkpoint but "
      f"{want.opt_state_structure} in `like` (another optimizer?)"
    )
  if msg := leaf("model_state", saved.model_state, want.model_state):
    return msg + " (init_state(..., model_state=) for the same model?)"
  if saved.rng != want.rng:
    return (
      "the checkpoint holds a key (init_state(..., rng=)) and `like` does not"
      if not want.rng
      else "`like` holds a key (init_state(..., rng=)) and the "
      "checkpoint does not; build `like` without rng="
    )
  return None


# ----------------------------------------------------------------------------- conversion


def stored_arrays(state: TrainState) -> tuple[dict[str, jax.Array], dict[str, Any]]:
  """What a checkpoint stores: `(arrays, flat)`. The arrays, keyed `params_<i>`,
  `master_<i>`, `opt_<j>`, `model_state_<j>`, `rng`, are the state's own, each in the shape
  and sharding the state holds it (padded rows included), so each device writes its own
  shards and no program runs.

  A sharded fused state stores its flat buckets as they are (`flat_master_<n>`,
  `flat_opt<k>_<n>`: bucket `n` of `master` and of the `k`-th flat tree of the optax state);
  `flat`, the metadata's "flat" entry (a `_FlatLayout` as stored; `{}` for any other
  state), says where each per-leaf key's values lie in them (`_stored_flat`). `no_shard`'s
  fused state, replicated, is stored in its per-leaf form."""
  if state.fused and state.config.use_distributed_optimizer:
    return _stored_flat(state)
  if state.fused:
    state = per_leaf_program(state, state.step.sharding.mesh)
  layout = state.layout
  params, masters = leaves_of(state.params, layout), leaves_of(state.master, layout)
  out = {}
  for leaf in layout.leaves:
    index = leaf.index
    if not leaf.trainable:
      out[stored_key("params", index)] = params[index]
    elif _stores_master(leaf.dtype):
      out[stored_key("master", index)] = masters[index]
    else:  # an fp32 param is its own master: stored once
      master = masters[index]
      out[stored_key("params", index)] = master if master is not None else params[index]
  for index, leaf in enumerate(jax.tree.leaves(state.opt_state)):
    out[stored_key("opt", index)] = leaf
  out.update(_stored_extras(state))
  return out, {}


def _stored_extras(state: TrainState) -> dict[str, jax.Array]:
  """The stored arrays besides params and optimizer state: the model state's leaves, the
  key and the spike guard's window, all replicated."""
  out = {}
  for index, leaf in enumerate(jax.tree.leaves(state.model_state)):
    out[stored_key("model_state", index)] = leaf
  for index, leaf in enumerate(jax.tree.leaves(state.spike_window)):
    out[stored_key("spike_window", index)] = leaf
  if state.rng is not None:
    out[stored_key("rng")] = state.rng
  return out


def is_flat(x, layout) -> bool:
  """Is `x` a fused state's flat tree (`{bucket name: flat}`)?"""
  return isinstance(x, dict) and set(x) == {named.name for named in bucket_names(layout)}


def flat_items(state: TrainState) -> tuple[list[Any], Any]:
  """The optax state of a fused state as `jax.tree.flatten` with each flat tree one item."""
  return jax.tree.flatten(state.opt_state, is_leaf=lambda x: is_flat(x, state.layout))


def _stored_flat(state: TrainState) -> tuple[dict[str, jax.Array], dict[str, Any]]:
  """`stored_arrays` of a sharded fused state: its flat buckets as they are, the leaves
  outside them per leaf, and the metadata's "flat" entry (a `_FlatLayout`) saying where
  each per-leaf key lies in the buckets."""
  layout = state.layout
  names = [named.name for named in bucket_names(layout)]
  # param index -> (its bucket's number, its block in that bucket)
  blocks = {
    block.index: (number, block)
    for number, named in enumerate(bucket_names(layout))
    for block in named.bucket.params
  }
  out, sources = {}, {}

  def source(kind, index, item=None):
    number, block = blocks[index]
    return _FlatSource(
      bucket_key=stored_key(kind, number, item),
      offset=block.offset,
      local_shape=tuple(block.local_shape(layout.dp)),
      axis=block.axis,
    )

  for number, name in enumerate(names):
    out[stored_key("flat_master", number)] = state.master[name]
  params = leaves_of(state.params, layout)
  for leaf in layout.leaves:
    if not leaf.trainable:
      out[stored_key("params", leaf.index)] = params[leaf.index]
    else:
      key = stored_key("master" if _stores_master(leaf.dtype) else "params", leaf.index)
      sources[key] = source("flat_master", leaf.index)
  items, _ = flat_items(state)
  trainable = [leaf.index for leaf in layout.leaves if leaf.trainable]
  opt_index = 0  # the leaf's number in the per-leaf optax state
  for item_index, item in enumerate(items):
    if is_flat(item, layout):
      # A bucket whose value is no array is optax.masked's `MaskedNode` (`multi_transform`,
      # a mask): no state, neither here nor for its leaves in the per-leaf form.
      held = {number for number, name in enumerate(names) if hasattr(item[name], "shape")}
      for number in sorted(held):
        out[stored_key("flat_opt", number, item_index)] = item[names[number]]
      for index in trainable:
        if blocks[index][0] in held:
          sources[stored_key("opt", opt_index)] = source("flat_opt", index, item_index)
          opt_index += 1
    else:
      out[stored_key("opt", opt_index)] = item
      opt_index += 1
  out.update(_stored_extras(state))
  flat = _FlatLayout(dp=layout.dp, layout=layout.summary(), sources=sources)
  return out, flat.to_json()


@functools.partial(jax.jit, static_argnums=1)
def per_leaf_program(state: TrainState, mesh) -> TrainState:
  return per_leaf_state(state, mesh)
