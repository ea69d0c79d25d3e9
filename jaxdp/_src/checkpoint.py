"""Checkpoints that restore onto any mesh and any strategy, on orbax, moving shards.

A `TrainState` is laid out for one mesh and one strategy: sharded strategies hold master
params and per-param optimizer state as row shards padded on their shard dim, `no_shard`
holds full trees. A checkpoint stores each leaf *as the state holds it* (format 2), so that
every device writes only its own shards (orbax writes a sharded `jax.Array` shard by shard,
each process its addressable shards) and nothing is gathered:

* `params_<i>`: a frozen or integer leaf, and a trainable param whose dtype is already fp32
  or wider (it *is* its master: every strategy keeps the two bitwise equal), in the state's
  shape: padded rows included where the strategy pads it;
* `master_<i>`: the fp32 (or wider) master of a trainable low-precision param (the param is
  its cast);
* `opt_<j>`: every optax state leaf (a fused state's flat buckets are unravelled into the
  per-leaf form first, every device converting its own shard);
* `model_state_<j>` (BatchNorm statistics) and `rng` (the key's raw data), replicated, so
  that a resumed run draws the keys of the uninterrupted one;
* `spike_window_<j>`: the spike guard's recent grad norms (`TrainState.spike_window`),
  replicated; restored where `like` has a window of the same size, else `like`'s (empty)
  window is kept and the guard fills it again;
* the state's step counter and the caller's data position (any JSON value).

Each stored leaf holds its logical region first on every dim and padding rows after it, so
`restore` reads every leaf straight into `like`'s shape and sharding, shard by shard (orbax
cuts or zero-extends the stored array at the end of each dim), and takes the elements past
the logical region from `like` (what `init_state` put there), or from the checkpoint where
its shape is `like`'s very shape (a resume on the same mesh and strategy: bitwise). So a
checkpoint saved with dp=8 under `optim` restores with dp=4 under `optim_grads_params` or
with dp=2 under `no_shard`. Format 1 (every leaf stored in its logical shape, replicated)
restores through the same path.

Each checkpoint carries metadata (jaxdp version, strategy, dp, layout summary, the path,
shape and dtype of every stored leaf, the optax state structure); `restore` compares it to
`like` first and names the first leaf that does not fit, before any array is read.

Atomicity is orbax's: a step is written into `<step>.orbax-checkpoint-tmp` and renamed to
`<step>` only after every file (arrays and metadata) is written, and only renamed steps are
ever listed or restored, so a process killed mid-save leaves the previous checkpoint as the
latest. A manager that opens the directory removes leftover temporary directories in the
background (at the latest before its first save).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import signal
import threading
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import FixedIntervalPolicy
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp._src import __version__
from jaxdp._src import checks, train
from jaxdp._src.distributed_optimizer import (
  fused_state,
  per_leaf_state,
  unpad_view,
)
from jaxdp._src.layout import master_dtype, sharded_shape
from jaxdp._src.mesh import DATA, eager_program, run_auto
from jaxdp._src.state import (
  FLAT_SPEC,
  HOST,
  TrainState,
  bucket_names,
  leaves_of,
  match_opt_leaf,
  memory_kinds,
  model_spec,
  to_device,
  tree_of,
)

PyTree = Any

FORMAT = 2
"""Version of the stored layout; `restore` reads this format and format 1 (every leaf stored
in its logical shape), and refuses checkpoints written by a newer format."""

_STATE, _META = "state", "meta"


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


def _key(kind: str, index: int | None = None, item: int | None = None) -> str:
  """The name of one stored array: every name a checkpoint stores is built here.

  Args:
    kind: "params" or "master" (leaf `index` of the layout: a trainable low-precision
      param is stored as its "master", `_stores_master`), "opt" (leaf `index` of the
      per-leaf optax state, `jax.tree.leaves` order), "model_state" and "spike_window"
      (leaf `index`), "rng" (no index), "flat_master" (bucket `index` of a fused state's master), "flat_opt"
      (bucket `index` of the `item`-th flat tree of a fused optax state).
    index: the leaf's or bucket's number.
    item: "flat_opt" only: the optax state item (`_flat_items`) the bucket belongs to.
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
  """How one optax state leaf is read back in its logical form (`_opt_forms`)."""

  shape: tuple[int, ...]
  """Its full shape: a per-param leaf's is its param's."""
  axis: int
  """A per-param leaf's shard dim (`Leaf.shard_axis`: where a sharded strategy pads it,
  and the dim its sharded view prefers); 0 for any other leaf."""
  param: int | None
  """The param whose per-param state it is (`match_opt_leaf`), or None."""


def _opt_forms(state: TrainState) -> list[_OptForm]:
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


class _LeafRow(NamedTuple):
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
  def from_json(cls, row: list[Any]) -> _LeafRow:
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
class _Description:
  """What a state's canonical form holds (`_describe`): the part of the metadata that
  `restore` checks `like` against, and reads each stored leaf's logical form from. To add a
  field: [Note: metadata records]."""

  params: tuple[_ParamRow, ...]
  master: tuple[int, ...]
  """The params stored with a separate master copy (`_stored_masters`)."""
  opt_state: tuple[_LeafRow, ...]
  """Every optax state leaf of the per-leaf form, in `jax.tree.leaves` order."""
  opt_state_structure: str
  """`str` of the optax state's treedef."""
  model_state: tuple[_LeafRow, ...] = ()
  rng: bool = False
  """Does the state hold a key."""
  spike_window: tuple[_LeafRow, ...] = ()
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
  def from_json(cls, entries: dict[str, Any]) -> _Description:
    return cls(
      params=tuple(_ParamRow.from_json(row) for row in entries["params"]),
      master=tuple(entries["master"]),
      opt_state=tuple(_LeafRow.from_json(row) for row in entries["opt_state"]),
      opt_state_structure=entries["opt_state_structure"],
      # the first format-1 checkpoints were written before states held these two
      model_state=tuple(_LeafRow.from_json(row) for row in entries.get("model_state", [])),
      rng=entries.get("rng", False),
      spike_window=tuple(_LeafRow.from_json(row) for row in entries.get("spike_window", [])),
    )


class _FlatSource(NamedTuple):
  """Where a per-leaf key of a sharded fused state lies in its stored flat bucket (a JSON
  list): on every device's shard of the bucket, its block of that device's rows. To add a
  field: [Note: metadata records]."""

  bucket_key: str
  """The stored flat bucket (`_key("flat_master", ...)` or `_key("flat_opt", ...)`)."""
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
class _Metadata:
  """A checkpoint's metadata: the JSON object `CheckpointManager.metadata` returns, with
  the description's entries (`_Description`) at its top level. To add a field: [Note:
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
  description: _Description
  stored: dict[str, tuple[int, ...]] | None = None
  """Every stored key's shape as stored; None (format 1): each key's logical shape."""
  flat: dict[str, Any] | None = None
  """A sharded fused state's `_FlatLayout` as stored (`_stored_arrays` gives it so; read it
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
  def from_json(cls, entries: dict[str, Any]) -> _Metadata:
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
      description=_Description.from_json(entries),
      stored=None if stored is None else {key: tuple(shape) for key, shape in stored.items()},
      flat=entries.get("flat"),
    )


# ----------------------------------------------------------------------------- description


def _describe(state: TrainState) -> _Description:
  """What a state's canonical form holds: the metadata a checkpoint is checked by."""
  if state.fused:
    state = jax.eval_shape(functools.partial(per_leaf_state, mesh=state.step.sharding.mesh), state)
  layout = state.layout
  keyed_opt = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
  keyed_model = jax.tree_util.tree_flatten_with_path(state.model_state)[0]
  return _Description(
    params=tuple(
      _ParamRow(path=leaf.path, shape=leaf.shape, dtype=leaf.dtype.name, trainable=leaf.trainable)
      for leaf in layout.leaves
    ),
    master=tuple(_stored_masters(state)),
    opt_state=tuple(
      _LeafRow(path=jax.tree_util.keystr(path), shape=form.shape, dtype=np.dtype(leaf.dtype).name)
      for (path, leaf), form in zip(keyed_opt, _opt_forms(state))
    ),
    opt_state_structure=str(jax.tree.structure(state.opt_state)),
    model_state=tuple(
      _LeafRow(
        path=jax.tree_util.keystr(path),
        shape=tuple(np.shape(leaf)),
        dtype=np.dtype(leaf.dtype).name,
      )
      for path, leaf in keyed_model
    ),
    rng=state.rng is not None,
    spike_window=_describe_window(state),
  )


def _first_mismatch(saved: _Description, want: _Description) -> str | None:
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


def _stored_arrays(state: TrainState) -> tuple[dict[str, jax.Array], dict[str, Any]]:
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
    state = _per_leaf_program(state, state.step.sharding.mesh)
  layout = state.layout
  params, masters = leaves_of(state.params, layout), leaves_of(state.master, layout)
  out = {}
  for leaf in layout.leaves:
    index = leaf.index
    if not leaf.trainable:
      out[_key("params", index)] = params[index]
    elif _stores_master(leaf.dtype):
      out[_key("master", index)] = masters[index]
    else:  # an fp32 param is its own master: stored once
      master = masters[index]
      out[_key("params", index)] = master if master is not None else params[index]
  for index, leaf in enumerate(jax.tree.leaves(state.opt_state)):
    out[_key("opt", index)] = leaf
  out.update(_stored_extras(state))
  return out, {}


def _stored_extras(state: TrainState) -> dict[str, jax.Array]:
  """The stored arrays besides params and optimizer state: the model state's leaves, the
  key and the spike guard's window, all replicated."""
  out = {}
  for index, leaf in enumerate(jax.tree.leaves(state.model_state)):
    out[_key("model_state", index)] = leaf
  for index, leaf in enumerate(jax.tree.leaves(state.spike_window)):
    out[_key("spike_window", index)] = leaf
  if state.rng is not None:
    out[_key("rng")] = state.rng
  return out


def _is_flat(x, layout) -> bool:
  """Is `x` a fused state's flat tree (`{bucket name: flat}`)?"""
  return isinstance(x, dict) and set(x) == {named.name for named in bucket_names(layout)}


def _flat_items(state: TrainState) -> tuple[list[Any], Any]:
  """The optax state of a fused state as `jax.tree.flatten` with each flat tree one item."""
  return jax.tree.flatten(state.opt_state, is_leaf=lambda x: _is_flat(x, state.layout))


def _stored_flat(state: TrainState) -> tuple[dict[str, jax.Array], dict[str, Any]]:
  """`_stored_arrays` of a sharded fused state: its flat buckets as they are, the leaves
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
      bucket_key=_key(kind, number, item),
      offset=block.offset,
      local_shape=tuple(block.local_shape(layout.dp)),
      axis=block.axis,
    )

  for number, name in enumerate(names):
    out[_key("flat_master", number)] = state.master[name]
  params = leaves_of(state.params, layout)
  for leaf in layout.leaves:
    if not leaf.trainable:
      out[_key("params", leaf.index)] = params[leaf.index]
    else:
      key = _key("master" if _stores_master(leaf.dtype) else "params", leaf.index)
      sources[key] = source("flat_master", leaf.index)
  items, _ = _flat_items(state)
  trainable = [leaf.index for leaf in layout.leaves if leaf.trainable]
  opt_index = 0  # the leaf's number in the per-leaf optax state
  for item_index, item in enumerate(items):
    if _is_flat(item, layout):
      # A bucket whose value is no array is optax.masked's `MaskedNode` (`multi_transform`,
      # a mask): no state, neither here nor for its leaves in the per-leaf form.
      held = {number for number, name in enumerate(names) if hasattr(item[name], "shape")}
      for number in sorted(held):
        out[_key("flat_opt", number, item_index)] = item[names[number]]
      for index in trainable:
        if blocks[index][0] in held:
          sources[_key("opt", opt_index)] = source("flat_opt", index, item_index)
          opt_index += 1
    else:
      out[_key("opt", opt_index)] = item
      opt_index += 1
  out.update(_stored_extras(state))
  flat = _FlatLayout(dp=layout.dp, layout=layout.summary(), sources=sources)
  return out, flat.to_json()


@functools.partial(jax.jit, static_argnums=1)
def _per_leaf_program(state: TrainState, mesh) -> TrainState:
  return per_leaf_state(state, mesh)


# [Note: a leaf moved between layouts]
# A stored leaf and the `like` leaf it fills may differ in padding (another dp pads the
# shard dim to another multiple) and in form (a block of a flat bucket, a padded scalar).
# Both hold the leaf's logical region first on every dim and padding after it, so moving a
# leaf takes three cuts, each at the end of a dim and never inside the logical region:
# 1. orbax reads the stored key straight into the target's shape and sharding
#    (`_read_args`, `strict=False`: cut or zero-extended at each dim's end, shard by shard);
#    a key inside a flat bucket is read as its whole bucket instead (`restore`);
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


def get_opt_state(state: TrainState, *, sharded: bool = False) -> PyTree:
  """The optax state of `state` as one device would hold it: per-param leaves in their
  param's shape (the sharded strategies' padding rows dropped) and placed as
  `get_params(state, sharded=sharded)` places their param, the rest as they are.

  What optax helpers that read the state need, on every strategy: `schedule_free`'s
  `optax.contrib.schedule_free_eval_params(jaxdp.get_opt_state(state),
  jaxdp.get_params(state))`, `inject_hyperparams`' `.hyperparams`. Fresh copies (they
  outlive the next donated step), placed for eager use as `get_params` places the params;
  the state itself is not changed.

  Args:
    state: a `TrainState` of any strategy.
    sharded: False: every leaf whole over the data axes (a tensor- or expert-parallel
      param's moments keep its own split, `P(None, "model")`, `P("expert")`). True: each
      per-param leaf also sharded over "data" as `get_params(state, sharded=True)` shards
      its param, so a device holds `1 / (dp x tp)` of a tensor-parallel weight's moment
      (for a big model).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
    >>> state = jaxdp.init_state({"w": jnp.ones((30,))}, optax.adam(1e-3), mesh, config)
    >>> jax.tree.map(jnp.shape, state.opt_state[0].mu)  # fused: a flat array per bucket
    {'float32/bucket0': (128,)}
    >>> jax.tree.map(jnp.shape, jaxdp.get_opt_state(state)[0].mu)
    {'w': (30,)}
    >>> tp = jax.make_mesh((4, 2), ("data", "model"))  # w split over "model" by its caller
    >>> w = jax.device_put(jnp.ones((8, 64)), jax.NamedSharding(tp, jax.P(None, "model")))
    >>> state = jaxdp.init_state({"w": w}, optax.adam(1e-3), tp, config)
    >>> jaxdp.get_opt_state(state, sharded=True)[0].mu["w"].sharding.spec
    P('data', 'model')
  """
  checks.check_not_donated(state, "jaxdp.get_opt_state(state)")
  return _opt_state_program(state, state.step.sharding.mesh, bool(sharded))


@eager_program
def _opt_state_program(state: TrainState, mesh, sharded: bool) -> PyTree:
  """One program for the whole tree (never eager per-leaf ops: see `get_params`). A
  per-param leaf is placed as `get_params` places its param: over the param's own axes and,
  if `sharded`, over "data" on the dim `view_dims` picks (`unpad_view`)."""
  # an offloaded state (`DDPConfig.optimizer_cpu_offload`) is read on the device
  state = dataclasses.replace(
    state, master=to_device(state.master), opt_state=to_device(state.opt_state)
  )
  state = per_leaf_state(state, mesh)
  outer = state.layout.outer > 1  # HFSDP: over ("data", "replica")
  leaves, treedef = jax.tree.flatten(state.opt_state)
  out = []
  for x, form in zip(leaves, _opt_forms(state)):
    if form.param is None and tuple(x.shape) == form.shape and not sharded:
      out.append(jnp.copy(x))  # a step count, a factored moment: as the state holds it
      continue
    dims = () if form.param is None else model_spec(state, form.param, len(form.shape))
    out.append(jnp.copy(unpad_view(x, form.shape, form.axis, mesh, dims, sharded, outer)))
  return jax.tree.unflatten(treedef, out)


# ----------------------------------------------------------------------------- restore


class _BucketIndex(NamedTuple):
  """Where a "flat" `_Target` sits in `like`: one flat bucket of its master or of one item
  of its optax state."""

  item: int | None
  """The optax state item (`_flat_items`) the bucket belongs to; None: the master's."""
  name: str
  """The bucket's name (`bucket_names`)."""


@dataclasses.dataclass(frozen=True)
class _FlatSlice:
  """A stored per-leaf key that lies inside a stored flat bucket (`_FlatSource`), with what
  cutting it out of the bucket takes (`_value`)."""

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
  """A key stored inside a flat bucket: where it lies there (`_stored_flat`)."""

  @property
  def read(self) -> str:
    """The stored key orbax reads for this target."""
    return self.source.bucket_key if self.source is not None else self.key

  @property
  def bytes(self) -> int:
    return math.prod(self.shape) * self.dtype.itemsize


def _same_flat_layout(meta: _Metadata, like: TrainState) -> bool:
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


def _saved_leaves(description: _Description) -> dict[str, _LeafRow]:
  """Every per-leaf key a checkpoint stores, with the logical shape and dtype of its leaf
  (a master: its param's shape, in the master's dtype)."""
  out = {}
  for index, row in enumerate(description.params):
    out[_key("params", index)] = _LeafRow(path=row.path, shape=row.shape, dtype=row.dtype)
    if index in description.master:
      master = master_dtype(row.dtype).name
      out[_key("master", index)] = _LeafRow(path=row.path, shape=row.shape, dtype=master)
  for index, row in enumerate(description.opt_state):
    out[_key("opt", index)] = row
  for index, row in enumerate(description.model_state):
    out[_key("model_state", index)] = row
  if description.rng:  # a key's raw data: two uint32 words
    out[_key("rng")] = _LeafRow(path="", shape=(2,), dtype="uint32")
  for index, row in enumerate(description.spike_window):
    out[_key("spike_window", index)] = row
  return out


def _targets(meta: _Metadata, like: TrainState, mesh, same_flat: bool) -> list[_Target]:
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
    return _key("master" if index in masters_saved else "params", index)

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
          _key("flat_master", number),
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
      key = value_key(index) if layout.leaves[index].trainable else _key("params", index)
      out.append(target("params", index, key, leaf, spec))
  if same_flat:
    items, _ = _flat_items(like)
    spec_items = jax.tree.flatten(specs.opt_state, is_leaf=lambda x: _is_flat(x, layout))[0]
    opt_index = 0  # the per-leaf optax state's numbering
    buckets = [named.bucket for named in bucket_names(layout)]
    for item_index, (item, spec) in enumerate(zip(items, spec_items)):
      if _is_flat(item, layout):
        for number, name in enumerate(names):
          if not hasattr(item[name], "shape"):  # optax.masked's `MaskedNode`: no state
            continue
          bucket = _BucketIndex(item=item_index, name=name)
          key = _key("flat_opt", number, item_index)
          out.append(target("flat", bucket, key, item[name], FLAT_SPEC))
          opt_index += len(buckets[number].params)  # one per-leaf leaf per param it holds
      else:
        out.append(target("opt", item_index, _key("opt", opt_index), item, spec))
        opt_index += 1
  else:
    opt_specs = jax.tree.leaves(specs.opt_state)
    for index, leaf in enumerate(jax.tree.leaves(per_leaf.opt_state)):
      out.append(target("opt", index, _key("opt", index), leaf, opt_specs[index]))
  for index, leaf in enumerate(jax.tree.leaves(per_leaf.model_state)):
    out.append(target("model_state", index, _key("model_state", index), leaf, P()))
  if per_leaf.rng is not None:
    out.append(target("rng", 0, _key("rng"), per_leaf.rng, P()))
  # The spike guard's window, where the checkpoint has one of `like`'s very shapes; else
  # `like`'s own (an empty window) is kept: the guard's statistic, not the training state
  if meta.description.spike_window == _describe_window(like):
    for index, leaf in enumerate(jax.tree.leaves(per_leaf.spike_window)):
      out.append(target("spike_window", index, _key("spike_window", index), leaf, P()))
  return out


def _describe_window(state: TrainState) -> tuple[_LeafRow, ...]:
  """The metadata rows of `state`'s spike window (`_Description.spike_window`)."""
  keyed = jax.tree_util.tree_flatten_with_path(state.spike_window)[0]
  return tuple(
    _LeafRow(path=jax.tree_util.keystr(path), shape=tuple(leaf.shape), dtype=leaf.dtype.name)
    for path, leaf in keyed
  )


def _groups(targets: list[_Target]) -> list[list[_Target]]:
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


def _read_args(abstract: dict[str, jax.ShapeDtypeStruct]) -> dict[str, Any]:
  """orbax's restore arguments: each key read into its target's shape and sharding, shard by
  shard, cut or zero-extended at the end of each dim where the stored shape differs."""
  return {
    k: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype, strict=False)
    for k, x in abstract.items()
  }


class _LikeLeaves:
  """The arrays of `like`, overwritten group by group with a checkpoint's values: each
  group's program takes the leaves it pads from `like` as donated buffers and writes into
  them, and frees the others, so a restore holds one state and one group's reads.

  A sharded fused state saved with the very same layout (`_same_flat_layout`: a resume) is
  filled bucket by bucket in its flat form, each device reading its own shard. Any other
  fused state is filled in its per-leaf form and made flat at the end (a restore onto
  another dp or strategy: two states at that point)."""

  def __init__(self, like: TrainState, mesh, same_flat: bool):
    self.mesh, self.given = mesh, like
    self.flat = same_flat
    self.abstract = _is_abstract(like)
    if not self.abstract:  # else nothing to overwrite: each leaf is allocated as it is read
      if like.fused and not same_flat:
        like = _per_leaf_program(like, mesh)
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
    items, self.opt_def = _flat_items(like) if same_flat else jax.tree.flatten(like.opt_state)
    self.items = [dict(x) if _is_flat(x, like.layout) else x for x in items]
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
    # abstract like's targets all take nothing: `_abstract_fits`)
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
      # (read on the device: `like`'s offloaded leaves too; `_in_memory` moves them back)
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


def _abstract_fits(like: TrainState, targets: list[_Target], same_flat: bool) -> str | None:
  """Why an abstract `like` cannot take this checkpoint, or None: a leaf restored onto other
  padding needs the padding rows `init_state` computes (an optimizer's initial state, e.g.
  Adagrad's accumulator of 0.1), which shapes alone do not give."""
  if like.fused and not same_flat:
    return "the checkpoint's flat buckets are laid out for another dp or strategy"
  for target in targets:
    if not _keeps(target):
      return f"{target.key} is stored as {target.stored} and is {target.shape} here"
  return None


def _is_abstract(like: TrainState) -> bool:
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


def _check_shards_fit(arrays: dict[str, jax.Array], concurrent_gb: float) -> None:
  """Raises unless each device's shard of every array is below `concurrent_gb` GB: orbax
  writes a shard in one piece, reserving its bytes first."""
  for key, x in arrays.items():
    shard = max((s.data.nbytes for s in x.addressable_shards), default=0)
    if shard >= concurrent_gb * 10**9:
      raise ValueError(
        f"CheckpointManager(save_concurrent_gb={concurrent_gb}): the stored array {key!r} "
        f"{x.shape} has a shard of {shard / 10**9:.3g} GB per device, which is written in "
        f"one piece; give save_concurrent_gb above {shard / 10**9:.3g}"
      )


# ----------------------------------------------------------------------------- preemption
#
# [Note: preemption] A scheduler that needs a job's machines back sends it a signal (SLURM,
# Kubernetes: SIGTERM) and kills it a grace period later. `CheckpointManager.
# reached_preemption(step)` turns that signal into one step at which every process saves:
#
# * One process (`jax.distributed` not running): a Python handler for the signal sets a
#   flag, and the first step boundary after it is the step.
# * Several processes: JAX's preemption sync manager, which `jax.distributed.initialize`
#   starts, catches SIGTERM itself (a C handler, not a Python one), tells the coordination
#   service, and every process reports the last step it asked about; the step is the
#   largest of those plus one (`multihost_utils.reached_preemption_sync_point`). So a
#   process signalled later than another, or never, still saves at the same step. A
#   Python handler for SIGTERM would replace JAX's handler and the other processes would
#   never hear, so none is installed for SIGTERM; another signal (SLURM's `--signal=USR1`)
#   gets a Python handler that raises SIGTERM in its own process, for JAX's handler.
#
# The handler is installed at the first `reached_preemption` call, not before: a loop that
# never asks keeps the signal's previous behaviour (SIGTERM ends the process), and before
# the first step boundary there is nothing newer than the restored state to save. One
# handler per signal serves every open manager that listens on it; the handler that was
# there before comes back when the last of them is closed (or collected).


@dataclasses.dataclass
class _Notice:
  """What one manager heard of its preemption signal."""

  received: bool = False
  """The signal arrived (one process; under `jax.distributed`, JAX keeps its own record)."""
  step: int | None = None
  """The step at which `reached_preemption` answered True."""


@dataclasses.dataclass
class _Listener:
  """The one Python handler of a signal, shared by the managers that listen on it."""

  previous: Any
  """The handler it replaced (`signal.signal`'s return value), put back by the last one."""
  notices: list[_Notice]
  forward_to_jax: bool
  """Raise SIGTERM on receipt, for JAX's preemption sync manager ([Note: preemption])."""


_listeners: dict[signal.Signals, _Listener] = {}


def _on_signal(signum: int, frame) -> None:
  sig = signal.Signals(signum)
  listener = _listeners.get(sig)
  if listener is None:  # removed while this signal was pending
    return
  if not listener.notices:  # its last manager was collected off the main thread
    _unlisten(sig, None)
    signal.raise_signal(sig)  # to the handler it had before
    return
  for notice in listener.notices:
    notice.received = True
  if listener.forward_to_jax:
    signal.raise_signal(signal.SIGTERM)


def _listen(sig: signal.Signals, notice: _Notice, forward_to_jax: bool) -> None:
  if sig not in _listeners:
    if threading.current_thread() is not threading.main_thread():
      raise ValueError(
        f"CheckpointManager(preemption_signal={sig.name}): Python handles signals in the "
        "main thread only; call reached_preemption from the main thread, or construct the "
        "manager with preemption_signal=None"
      )
    previous = signal.signal(sig, _on_signal)
    _listeners[sig] = _Listener(previous=previous, notices=[], forward_to_jax=forward_to_jax)
  _listeners[sig].notices.append(notice)


def _unlisten(sig: signal.Signals, notice: _Notice | None) -> None:
  """Stops `notice` hearing `sig`; with no notice left, puts the previous handler back (on
  the main thread: elsewhere the handler does it when the signal comes)."""
  listener = _listeners.get(sig)
  if listener is None:
    return
  listener.notices = [n for n in listener.notices if n is not notice]
  if listener.notices or threading.current_thread() is not threading.main_thread():
    return
  del _listeners[sig]
  # None: the previous handler was not set from Python; the default is what Python knew
  signal.signal(sig, signal.SIG_DFL if listener.previous is None else listener.previous)


def _check_signal(preemption_signal) -> signal.Signals | None:
  """`preemption_signal` as a `signal.Signals`, or a clear error."""
  if preemption_signal is None:
    return None
  if isinstance(preemption_signal, bool) or not isinstance(preemption_signal, int):
    raise TypeError(
      f"preemption_signal={preemption_signal!r}: expected a signal such as signal.SIGTERM "
      "or signal.SIGUSR1 (a signal.Signals or its number), or None to never stop for one"
    )
  try:
    sig = signal.Signals(preemption_signal)
  except ValueError:
    raise ValueError(
      f"preemption_signal={preemption_signal!r}: no such signal on this system; use one "
      "of signal.SIGTERM, signal.SIGUSR1, ..., or None"
    ) from None
  if sig in (signal.SIGKILL, signal.SIGSTOP):
    raise ValueError(
      f"preemption_signal={sig.name}: a process cannot catch {sig.name}; use the signal "
      "the scheduler sends first (SIGTERM, or the one given to SLURM's --signal)"
    )
  return sig


def _check_jax_hears(sig: signal.Signals) -> None:
  """Under `jax.distributed`: refuses what would keep JAX's preemption sync from hearing
  the signal ([Note: preemption])."""
  if not jax.config.jax_enable_preemption_service:
    raise ValueError(
      f"CheckpointManager(preemption_signal={sig.name}): the processes agree on the step "
      "to save at through JAX's preemption service, which is off "
      "(jax_enable_preemption_service=False); turn it on before jax.distributed starts, or "
      "pass preemption_signal=None"
    )
  if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
    raise ValueError(
      f"CheckpointManager(preemption_signal={sig.name}): a handler set from Python "
      f"({signal.getsignal(signal.SIGTERM)!r}) holds SIGTERM, in place of the one "
      "jax.distributed installs for its preemption sync, so no process would hear of a "
      "preemption; remove it (signal.signal(signal.SIGTERM, signal.SIG_DFL) before "
      "jax.distributed.initialize), or pass preemption_signal=None"
    )


# ----------------------------------------------------------------------------- manager


class CheckpointManager:
  """Saves and restores `TrainState`s in a topology-free form, asynchronously and atomically.

  A checkpoint saved on one mesh under one strategy restores on any other mesh (any dp)
  under any strategy: see the module docstring for what is stored.

  Args:
    directory: where the checkpoints go (one sub-directory per step); created if missing.
    max_to_keep: keep the newest this many checkpoints; None keeps all.
    save_interval_steps: `save` only writes steps that are multiples of this (unless
      `force=True`).
    save_concurrent_gb: at most this many GB (10^9 bytes) of arrays being written by this
      process at once (orbax's `save_concurrent_gb`): a bound on the host memory a save's
      writes hold, at the price of fewer writes in flight. None: orbax's default (no bound
      below the state's own size). Each device's shard of every array must be smaller,
      since a shard is written in one piece; `save` refuses a state with a larger one.
    preemption_signal: the signal a scheduler sends before it stops the job (SIGTERM by
      default; SLURM's `--signal=USR1@90`: `signal.SIGUSR1`); `reached_preemption` says
      at which step every process saves after it. None: never stop for a signal.

  Examples:
    >>> import tempfile, jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config, tx = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim"), optax.adam(1e-3)
    >>> state = jaxdp.init_state({"w": jnp.ones((5, 3))}, tx, mesh, config)
    >>> folder = tempfile.TemporaryDirectory()  # removed by folder.cleanup() below
    >>> mgr = jaxdp.CheckpointManager(folder.name, max_to_keep=2)
    >>> mgr.save(0, state, data_position=0)
    True
    >>> mgr.wait_until_finished()
    >>> small = jax.sharding.Mesh(jax.devices()[:2], ("data",))
    >>> like = jaxdp.init_state({"w": jnp.zeros((5, 3))}, tx, small, jaxdp.DDPConfig())
    >>> jaxdp.get_params(mgr.restore(like))["w"].sum()
    Array(15., dtype=float32)
    >>> mgr.data_position()
    0
    >>> mgr.close()

    On preemption, a loop saves at the next step boundary and stops (`reached_preemption`):

    >>> import os, signal
    >>> train_step = jaxdp.make_train_step(lambda p, b: jnp.sum(p["w"]) * jnp.mean(b), tx, mesh, config)
    >>> mgr = jaxdp.CheckpointManager(folder.name + "/run", save_interval_steps=100)
    >>> for step in range(1, 1000):
    ...   state, _ = train_step(state, jnp.ones((8, 3)))
    ...   if step == 3:
    ...     os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends
    ...   if mgr.reached_preemption(step):
    ...     saved = mgr.save(step, state, force=True)
    ...     break
    >>> mgr.wait_until_finished(); mgr.all_steps()
    [3]
    >>> mgr.close(); folder.cleanup()  # SIGTERM's previous handler is back
  """

  def __init__(
    self,
    directory,
    *,
    max_to_keep: int | None = None,
    save_interval_steps: int = 1,
    save_concurrent_gb: float | None = None,
    preemption_signal: int | signal.Signals | None = signal.SIGTERM,
  ):
    self.preemption_signal = _check_signal(preemption_signal)
    self._notice = _Notice()
    self._listening = False
    if max_to_keep is not None and (
      isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
    ):
      raise ValueError(f"max_to_keep={max_to_keep!r}: must be a positive integer or None")
    if (
      isinstance(save_interval_steps, bool)
      or not isinstance(save_interval_steps, int)
      or save_interval_steps < 1
    ):
      raise ValueError(f"save_interval_steps={save_interval_steps!r}: must be a positive integer")
    if save_concurrent_gb is not None and (
      isinstance(save_concurrent_gb, bool)
      or not isinstance(save_concurrent_gb, (int, float))
      or not save_concurrent_gb > 0
    ):
      raise ValueError(
        f"save_concurrent_gb={save_concurrent_gb!r}: must be a positive number of GB, or None"
      )
    self.save_concurrent_gb = save_concurrent_gb
    self.directory = os.path.abspath(os.fspath(directory))  # orbax takes absolute paths
    self._mgr = ocp.CheckpointManager(
      self.directory,
      item_handlers={
        _STATE: ocp.PyTreeCheckpointHandler(save_concurrent_gb=save_concurrent_gb),
        _META: ocp.JsonCheckpointHandler(),
      },
      options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=True,
        cleanup_tmp_directories=True,
        enable_async_checkpointing=True,
        # exactly the multiples (orbax's default also saves the first step it sees)
        save_decision_policy=FixedIntervalPolicy(save_interval_steps),
      ),
    )

  # -- save

  def save(
    self, step: int, state: TrainState, *, data_position: Any = None, force: bool = False
  ) -> bool:
    """Starts writing `state` as checkpoint `step`; returns once the arrays are on the host.

    The write finishes in the background (call `wait_until_finished` to block); until it
    does, the step is not listed and `restore` cannot see it. The state may be donated to the
    next train step as soon as `save` returns.

    Args:
      step: the checkpoint's number (usually the number of steps taken).
      state: a `TrainState` on any mesh, under any strategy.
      data_position: where the input pipeline is (any JSON value), given back by
        `data_position()`.
      force: save even if `step` is not a multiple of `save_interval_steps`.

    Returns:
      Whether a checkpoint was started (False: `step` is not a multiple of
      `save_interval_steps`, or not newer than the latest checkpoint).

    Raises:
      TypeError: `state` is not a `TrainState`.
      ValueError: the state was donated to a train step (save the state it returned).
    """
    _check_is_state(state, "state")
    checks.check_not_donated(state, "CheckpointManager.save(step, state)")
    step = int(step)
    if not force and not self._mgr.should_save(step):
      return False
    description = _describe(state)
    arrays, flat = _stored_arrays(state)
    if self.save_concurrent_gb is not None:
      _check_shards_fit(arrays, self.save_concurrent_gb)
    meta = _Metadata(
      format=FORMAT,
      jaxdp_version=__version__,
      state_step=int(jax.device_get(state.step)),
      data_position=data_position,
      strategy=state.config.data_parallel_sharding_strategy,
      dp=state.layout.dp,
      mesh_shape=dict(state.mesh_shape),
      layout=state.layout.summary(),
      description=description,
      stored={key: tuple(array.shape) for key, array in arrays.items()},
      flat=flat or None,
    )
    return self._mgr.save(
      step,
      args=ocp.args.Composite(
        **{_STATE: ocp.args.PyTreeSave(arrays), _META: ocp.args.JsonSave(meta.to_json())}
      ),
      force=force,
    )

  def reached_preemption(self, step: int) -> bool:
    """Whether to save now and stop: True at the one step where every process saves after
    the `preemption_signal` reached any of them.

    Call it at every step boundary, on every process, with the step counter that `save`
    takes (increasing by one per step): after a signal, it answers True at one step, the
    same on every process (under `jax.distributed`, JAX's preemption sync point: the step
    after the furthest any process had asked about; alone, the first call after the
    signal), and False before and after it (docs/multi-host.md, "Preemption").

    The first call installs the handler (none for SIGTERM under `jax.distributed`, whose
    own handler hears it); `close` puts the previous one back. From then on the signal no
    longer ends the process: the loop must stop itself.

    Args:
      step: the step just taken.

    Returns:
      True: save `step` now (`save(step, state, force=True)`) and stop.

    Raises:
      ValueError: the handler cannot be installed here (not the main thread), or, under
        `jax.distributed`, JAX's preemption service could not hear the signal (turned off,
        or SIGTERM taken by a Python handler).
    """
    sig = self.preemption_signal
    if sig is None:
      return False
    step = int(step)
    synced = jax.distributed.is_initialized()
    if not self._listening:
      if synced:
        _check_jax_hears(sig)
      if not (synced and sig == signal.SIGTERM):
        _listen(sig, self._notice, forward_to_jax=synced)
        weakref.finalize(self, _unlisten, sig, self._notice)
      self._listening = True
    if self._notice.step is None:
      reached = (
        multihost_utils.reached_preemption_sync_point(step) if synced else self._notice.received
      )
      if reached:
        self._notice.step = step
    return self._notice.step == step

  def wait_until_finished(self) -> None:
    """Blocks until every started save is written and committed."""
    self._mgr.wait_until_finished()

  # -- read

  def all_steps(self) -> list[int]:
    """The committed checkpoints, oldest first (never a half-written one)."""
    self._mgr.reload()
    return sorted(self._mgr.all_steps())

  def latest_step(self) -> int | None:
    """The newest committed checkpoint, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def metadata(self, step: int | None = None) -> dict[str, Any]:
    """The checkpoint's metadata: jaxdp version, strategy, dp, layout, stored leaves."""
    step = self._step(step)
    return self._mgr.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[
      _META
    ]

  def data_position(self, step: int | None = None) -> Any:
    """The `data_position` saved with checkpoint `step` (default: the latest)."""
    return self.metadata(step)["data_position"]

  def restore(self, like: TrainState, step: int | None = None) -> TrainState:
    """Reads checkpoint `step` into a state laid out like `like`.

    The checkpoint is read in groups of leaves (about an eighth of the state each), each
    group straight into `like`'s shardings. Into `abstract_state(...)` each leaf is
    allocated as it is read: the restore holds one state. Into a state of `init_state`,
    each group is written into `like`'s own buffers, which are donated: one state's memory
    and an eighth of one, not two states.

    Args:
      like: the state of `abstract_state` (shapes only; the way at scale) or of
        `init_state`, for the *target* mesh, strategy and config. Its values are not used,
        except the padding rows of sharded leaves restored onto another dp (an abstract
        `like`'s are zeros). A state of `init_state` is consumed (its arrays are donated
        to the result): build it for this call. A restore that is refused leaves it as it
        was.
      step: the checkpoint to read; None: the latest.

    Returns:
      A `TrainState` with `like`'s layout, config and shardings, holding the checkpoint's
      params, master params, optimizer state, step counter, model state and key.

    Raises:
      FileNotFoundError: there is no committed checkpoint (at `step`).
      ValueError: the checkpoint does not fit `like` (another model, dtype, optimizer or
        `frozen` set); the message names the leaves only one of them has, or else the
        first leaf that differs. Nothing is read or written, and `like` is left as it
        was. Or `like` was donated (to a train step, or to an earlier restore).
    """
    _check_is_state(like, "like")
    _is_abstract(like)
    checks.check_not_donated(like, "CheckpointManager.restore(like)")
    step = self._step(step)
    entries = self.metadata(step)
    # checked on the JSON itself: a newer format's metadata need not read as `_Metadata`
    if entries.get("format", 0) > FORMAT:
      raise ValueError(
        f"checkpoint {step} in {self.directory} has format {entries['format']} (jaxdp "
        f"{entries.get('jaxdp_version')}); this jaxdp reads format {FORMAT} or older: "
        "upgrade jaxdp"
      )
    meta = _Metadata.from_json(entries)
    if problem := _first_mismatch(meta.description, _describe(like)):
      raise ValueError(
        f"checkpoint {step} in {self.directory} does not fit `like`: {problem}. Build "
        f"`like` with init_state for the same model and optimizer (saved: "
        f"{meta.strategy}, dp={meta.dp}, jaxdp {meta.jaxdp_version})"
      )

    mesh = like.step.sharding.mesh
    kinds = memory_kinds(like)  # where `like` keeps each leaf: the restored state goes there
    same_flat = _same_flat_layout(meta, like)
    targets = _targets(meta, like, mesh, same_flat)
    if _is_abstract(like) and (why := _abstract_fits(like, targets, same_flat)):
      raise ValueError(
        f"checkpoint {step} in {self.directory} restores onto other padding than it was "
        f"saved with ({why}; saved: {meta.strategy}, dp={meta.dp}): the padding "
        "rows come from `like`'s values, which an abstract_state has not. Pass "
        "like=jaxdp.init_state(...) for this restore"
      )
    leaves = _LikeLeaves(like, mesh, same_flat)
    for group in _groups(targets):
      abstract = {}
      for target in group:
        # How orbax reads each key (step 1 of [Note: a leaf moved between layouts])
        if target.source is not None:  # its whole flat bucket, split over "data" if it divides
          length = target.source.bucket_length
          divides = length % mesh.shape[DATA] == 0
          shape, spec = (length,), P(DATA) if divides else P()
        elif len(target.shape) != len(target.stored) or not target.logical:  # a scalar
          shape, spec = target.stored, P()
        else:
          shape, spec = target.shape, target.spec
        abstract[target.read] = jax.ShapeDtypeStruct(
          shape, np.dtype(target.stored_dtype), sharding=NamedSharding(mesh, spec)
        )
      stored = self._mgr.restore(
        step,
        args=ocp.args.Composite(
          **{
            _STATE: ocp.args.PyTreeRestore(
              abstract, restore_args=_read_args(abstract), partial_restore=True
            )
          }
        ),
      )[_STATE]
      leaves.fill(stored, group)
      del stored  # before the next group is read
    return _in_memory(leaves.state(meta.state_step), kinds)

  def _step(self, step: int | None) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
      return steps[-1]
    if int(step) not in steps:
      raise FileNotFoundError(
        f"no committed checkpoint {step} in {self.directory}; committed: {steps}"
      )
    return int(step)

  # -- lifetime

  def close(self) -> None:
    """Waits for pending saves, releases orbax's resources and gives the preemption signal
    back to the handler it had before `reached_preemption` was first called."""
    if self.preemption_signal is not None:
      _unlisten(self.preemption_signal, self._notice)
    self._mgr.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _in_memory(state: TrainState, kinds: TrainState) -> TrainState:
  """`state` with each leaf that `kinds` (`memory_kinds`) puts in host memory moved there,
  leaf by leaf, each device copy freed once moved, its sharding kept."""
  if not jax.tree.leaves(kinds):
    return state

  def place(x, kind):
    if kind is None or x.sharding.memory_kind == kind:
      return x
    moved = jax.device_put(x, x.sharding.with_memory_kind(kind))
    x.delete()  # the device copy, before the next leaf moves
    return moved

  return jax.tree.map(place, state, kinds, is_leaf=lambda x: x is None)


def _check_is_state(state, name: str):
  if not isinstance(state, TrainState):
    raise TypeError(
      f"{name}: expected the TrainState from jaxdp.init_state, got {type(state).__name__}"
    )
