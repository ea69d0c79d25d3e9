"""The distributed optimizer (ZeRO-1 `optim`, ZeRO-2 `optim_grads`; FSDP's optimizer too).

The sharded strategies run the user's optax transformation in the global view on the
*row shards* of the layout (see `layout.py`): a trainable leaf is seen with its shard dim
(`Leaf.shard_axis`) padded up to a multiple of dp and sharded over "data" on that dim, its
padding rows zero. Elementwise transformations, global norms, schedules and per-leaf
masks are exact on such leaves by construction. A transformation whose result
depends on a leaf's *shape* (a mean over elements, factored moments, an element count) is
exact on leaves that need no padding and silently different on padded ones, so
`check_exact` probes it before training and refuses it with a message that says what to do.

The fused update (Megatron's distributed optimizer, whose fused multi-tensor Adam updates
each bucket's shard as one flat array). XLA:CPU runs about one kernel per leaf and moment
of a per-leaf update whatever the leaf's size, so on a GPT of 52 leaves the flat update is
several times faster, and XLA compiles it in a fraction of the time (docs/bench.md). Under
`optim`, `optim_grads` and `optim_grads_params` (FSDP, whose buckets are its units; not with
stacked units, see `use_fused`), when `fuses` finds that `tx` gives the same updates on the flat buckets as on the param tree (it runs both for
a few steps with the same values: elementwise transformations, global norms and schedules
pass; masks of the param tree, per-leaf statistics such as lamb's trust ratio and
shape-dependent ones such as muon or adafactor do not, and keep the per-leaf update,
silently), the state keeps `master` as `{bucket name: flat}` (`state.bucket_names`: each
bucket's `(dp * shard_size,)` elements in the layout's shard-major order, sharded over
"data", so device `d` holds shard `d`) and the optax state of that tree. A step then runs
one `tx.update` on it: the reduce-scattered bucket shards *are* the flat grads (no slicing
into leaves), and the params are gathered per bucket from the flat master
(`collectives.all_gather_shards`; FSDP's unit gathers read it too,
`collectives.unit_collectives_flat`). DDP (`no_shard`) fuses the same way when asked
(`fused_update=True`; `use_fused` says why not by default) and its params need no fp32
master: the optax state is the flat buckets, replicated; the all-reduced buckets are the
grads; the params, which DDP keeps as the forward's leaves, are raveled into the buckets
for the update (`fused_master`) and each gets its slice of the flat updates
(`unravel_flat`): a transient of the params' size during the update, the price of having
no views into a buffer. `DDPConfig.fused_update=False` turns it off, True requires it. Exactness: every element sees the same arithmetic; a global norm sums its
squares per bucket instead of per leaf (another order, padding zeros add nothing).

Readers never see the flat form: `per_leaf_state` (and its inverse `fused_state`) is the
one conversion between the two, and `get_params`, `get_opt_state`, checkpoints (saved
per-leaf, restored into either form, padding from `like`) and eval use it; the ledger
predicts the flat state's bytes (its buckets' end padding included).

This module holds what every sharded strategy needs of the optimizer side: the exactness
guard, a leaf padded to the shape the optimizer sees and back (`pad_leaf`, `unpad_leaf`),
the all-gather of the updated params after the update (`gather_params`, Megatron's
`start_param_sync` without overlap), the check that expert params divide over "data", and
the fused update's probe and conversions. What each device holds per strategy is
`ledger.py`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdp._src import collectives, loop
from jaxdp._src.compiler import known_options
from jaxdp._src.config import DDPConfig
from jaxdp._src.buffer import (
  bucket_ravel,
  bucket_unravel,
  pad_dim,
  shard_ravel,
  shard_unravel,
  unpad_dim,
)
from jaxdp._src.layout import Layout, make_layout, master_dtype, sharded_shape
from jaxdp._src.mesh import (
  DATA,
  EXPERT,
  constrain,
  data_axes,
  manual_spec,
  pspec,
  run_manual,
  runs_auto,
  view_dims,
  with_data,
)
from jaxdp._src.state import (
  TrainState,
  bucket_names,
  leaf_specs,
  leaves_of,
  model_spec,
  state_specs,
  tree_of,
)

PyTree = Any
P = jax.sharding.PartitionSpec
_log = logging.getLogger(__name__)

_PROBE_STEPS = 3
"""Optimizer steps the exactness probe runs (later steps see the state earlier ones left)."""
_PROBE_RTOL = 1e-9
"""Relative mismatch (of the leaf's largest update) the probe tolerates in float64: far
above reassociation noise (~1e-15) and far below any shape effect (>= 1/rows)."""
_PROBE_RTOL_NATIVE = 1e-5
"""The same when the probe has to run in the master dtype (float32)."""
_SHRINK = 2
"""Non-padded leaves are probed with every dim cut to at most this (their result is exact
anyway; they only take part so that cross-leaf terms such as global norms exist)."""


# ----------------------------------------------------------------------------- exactness


# [Note: exact on padded leaves]
# The sharded optimizer hands `tx` every trainable leaf padded with zero rows on its shard
# dim (`sharded_shape`), where a single device hands it the leaf itself. A transformation
# that works element by element (adamw, sgd) or only sums over elements (global norms,
# lamb's per-leaf norms) gives the real rows the same updates either way, and the padding
# rows zero updates (zero params with zero grads). One that reads the leaf's shape (a mean
# over elements, factored moments, an element count) or moves zero entries (added noise)
# does not, and nothing downstream would notice: training would just differ. So
# `check_exact` runs `tx` on both forms before training and refuses it when the real rows'
# updates differ or a padding row's update is non-zero. A layout with no padded leaf needs
# no probe.
@dataclasses.dataclass(frozen=True)
class _Leaf:
  """A trainable leaf as a single device has it and as the sharded optimizer sees it."""

  index: int
  path: str
  shape: tuple[int, ...]
  """The param's own shape."""
  seen: tuple[int, ...]
  """The shape the optimizer sees: rows on `axis` padded to a multiple of dp."""
  axis: int

  @property
  def padded(self) -> bool:
    return self.seen != self.shape

  @property
  def base(self) -> tuple[int, ...]:
    """`shape` with a scalar as `(1,)`: `seen` differs from it on `axis` only."""
    return self.shape or (1,)


def trainable_leaves(layout: Layout) -> list[_Leaf]:
  """Every trainable leaf, with the shape the sharded optimizer sees for it."""
  out = []
  for leaf in layout.leaves:
    if leaf.trainable:
      seen, axis = sharded_shape(layout, leaf.index)
      out.append(_Leaf(leaf.index, leaf.path, leaf.shape, tuple(seen), axis))
  return out


def _probe_values(rng: np.random.Generator, shape, scale: float) -> np.ndarray:
  """Small dyadic values, mostly non-zero: sums of their squares are exact in any order."""
  return rng.integers(-4, 5, size=shape).astype(np.float64) * scale


_PROBE_COMPILER_OPTIONS = {
  "xla_backend_optimization_level": 0,
  "xla_llvm_disable_expensive_passes": True,
}
"""The probe runs once on small arrays: compile it fast rather than well."""


def _run_both(tx, runs, treedefs):
  """For each `(params, [grads per step])` in `runs`, leaves of the matching tree in
  `treedefs`: the updates `tx` makes at every step.

  All runs are one program, compiled once.
  """

  def run(treedef, tree, grads):
    # the scan carries `(params, optax state)` and emits each step's updates as leaves
    unflat = lambda leaves: jax.tree.unflatten(treedef, leaves)

    def step(carry, g):
      params, state = carry
      updates, state = loop.call_update(tx, unflat(g), state, params)
      return (optax.apply_updates(params, updates), state), treedef.flatten_up_to(updates)

    params = unflat(tree)
    return jax.lax.scan(step, (params, tx.init(params)), grads)[1]

  # per run, each leaf's grads stacked over the steps (the scan's xs); None where no grad
  args = [
    (tree, [None if g[0] is None else np.stack(g) for g in zip(*grads)]) for tree, grads in runs
  ]
  both = lambda args: [run(d, *a) for d, a in zip(treedefs, args)]
  compiled = (
    jax.jit(both).lower(args).compile(compiler_options=known_options(_PROBE_COMPILER_OPTIONS))
  )
  out = jax.device_get(compiled(args))
  # back as run -> step -> leaf
  return [[[None if u is None else u[s] for u in o] for s in range(_PROBE_STEPS)] for o in out]


def _probe(tx, layout: Layout, shrink: bool, x64: bool):
  """Runs `tx` on the true shapes and on the padded shapes with the same values.

  Returns `[(step, leaf, rel_err, padding_nonzero)]` for every trainable leaf.
  """
  # See [Note: exact on padded leaves]. A padded leaf is drawn at its true shape and padded
  # with zeros for the second run. A leaf that needs no padding is the same in both runs, so
  # it may be shrunk: it is there only for cross-leaf terms such as a global norm.
  leaves_ = {x.index: x for x in trainable_leaves(layout)}
  rng = np.random.default_rng(0)
  shapes = {}  # the shape values are drawn in
  for i, x in leaves_.items():
    if x.padded:
      shapes[i] = x.base
    else:
      shapes[i] = tuple(min(d, _SHRINK) for d in x.shape) if shrink else x.shape
  dtype = {i: np.float64 if x64 else master_dtype(layout.leaves[i].dtype) for i in leaves_}

  def tree(values, pad):
    out = [None] * len(layout.leaves)
    for i, v in values.items():
      x = leaves_[i]
      # padded leaves: zero rows on the shard dim, or the true shape (a scalar drawn as `(1,)`)
      if x.padded and pad:
        widths = [(0, 0)] * v.ndim
        widths[x.axis] = (0, x.seen[x.axis] - v.shape[x.axis])
        v = np.pad(v, widths)
      elif x.padded:
        v = v.reshape(x.shape)
      out[i] = np.asarray(v, dtype[i])
    return out

  # the same draws feed both runs, so any difference is `tx`'s
  params = {i: _probe_values(rng, shapes[i], 1 / 16) for i in leaves_}
  grads = [{i: _probe_values(rng, shapes[i], 1 / 4) for i in leaves_} for _ in range(_PROBE_STEPS)]

  true, pad = _run_both(
    tx,
    [(tree(params, pad), [tree(g, pad) for g in grads]) for pad in (False, True)],
    [layout.treedef] * 2,
  )
  results = []
  for step, (ut, up) in enumerate(zip(true, pad)):
    for i, x in leaves_.items():
      # Shard dim first: the padded run's first `n` rows are the real ones, compared with the
      # true run; the rest are padding, whose updates must be zero.
      a = np.asarray(ut[i], np.float64).reshape(shapes[i])
      b = np.moveaxis(np.asarray(up[i], np.float64), x.axis, 0)
      a = np.moveaxis(a, x.axis, 0)
      real, rest = b[: a.shape[0]], b[a.shape[0] :]
      scale = max(float(np.max(np.abs(a), initial=0.0)), np.finfo(np.float64).tiny)
      err = float(np.max(np.abs(real - a), initial=0.0)) / scale
      # non-finite updates agree only with NaNs at the same places and equal values elsewhere
      # (infs included, which `nan_to_num` makes large finite numbers)
      if not np.all(np.isfinite(real)) or not np.all(np.isfinite(a)):
        err = (
          0.0
          if np.array_equal(np.isnan(real), np.isnan(a))
          and np.array_equal(np.nan_to_num(real), np.nan_to_num(a))
          else math.inf
        )
      results.append((step, x, err, bool(np.any(rest != 0))))
  return results


def _shape_dependent_state(tx, layout: Layout) -> list[str]:
  """State leaves that are neither scalars nor shaped like a param as the optimizer sees it."""
  leaves_ = trainable_leaves(layout)
  tree = [None] * len(layout.leaves)
  for x in leaves_:
    tree[x.index] = jax.ShapeDtypeStruct(x.seen, master_dtype(layout.leaves[x.index].dtype))
  state = jax.eval_shape(tx.init, jax.tree.unflatten(layout.treedef, tree))
  shapes = {x.seen for x in leaves_}
  return [
    ("opt_state" + jax.tree_util.keystr(path), tuple(x.shape))
    for path, x in jax.tree_util.tree_leaves_with_path(state)
    if x.ndim and tuple(x.shape) not in shapes
  ]


def check_exact(tx: optax.GradientTransformation, layout: Layout) -> None:
  """Refuses an optax transformation that the sharded optimizer would run inexactly.

  The sharded strategies feed `tx` each trainable leaf with its shard dim
  (`Leaf.shard_axis`) padded to a multiple of dp with zeros.
  Leaves that need no padding see exactly what a single device sees, whatever `tx` does
  with shapes. When some leaf is padded this runs `tx` for a few steps on one host device
  twice, on the true and on the padded shapes with the same values (leaves that need no
  padding shrunk to keep it cheap), in float64 where it can, and requires the same
  updates on the real rows and zero updates on the padding rows.

  Args:
    tx: the optax transformation.
    layout: the layout of the sharded strategy (from `make_layout` with the data axis size).

  Raises:
    NotImplementedError: `tx` depends on the shape of a padded leaf; the message names
      the leaf, its shapes, what differs, and what to use instead.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxdp
    >>> from jaxdp._src.distributed_optimizer import check_exact
    >>> layout = jaxdp.layout.make_layout({"w": jnp.zeros((130, 130)), "b": jnp.zeros((3,))}, dp=8)
    >>> check_exact(optax.lamb(1e-3), layout)  # per-leaf norms: exact on zero padding
    >>> check_exact(optax.adafactor(1e-3), layout)
    Traceback (most recent call last):
    ...
    NotImplementedError: optax transformation is not exact on padded leaves ...
  """
  # See [Note: exact on padded leaves]. No padded leaf: `tx` sees what one device sees.
  if not any(x.padded for x in trainable_leaves(layout)):
    return
  # on a host CPU device where there is one, else on the default device
  try:
    cpu = jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    cpu = None
  results = error = None
  # Cheapest first: unpadded leaves shrunk, in float64. A `tx` that fails there (on float64,
  # or on the cut shapes) is probed in the master dtype, then both again at the true shapes;
  # only when every probe fails is the last error raised.
  for shrink in (True, False):
    for x64 in (True, False):
      try:
        with jax.default_device(cpu), jax.enable_x64(x64):
          results = _probe(tx, layout, shrink, x64)
        break
      except Exception as e:  # noqa: BLE001 - any failure: try the next probe, else report it
        error = e
    if results is not None:
      break
  if results is None:
    raise error
  # `x64` is still the flag of the probe that ran: float32 gets the looser tolerance
  rtol = _PROBE_RTOL if x64 else _PROBE_RTOL_NATIVE
  # a leaf fails on its real rows' mismatch or on any non-zero update of its padding rows;
  # the message names the first failure (earliest step, then tree order)
  bad = [(s, x, err, pad) for s, x, err, pad in results if err > rtol or pad]
  if not bad:
    return
  step, x, err, pad = bad[0]
  n = x.base[x.axis]
  dim = "leading dim" if x.axis == 0 else f"dim {x.axis}"
  if err > rtol:
    state = [
      f"{name}: {shape}"
      for name, shape in _shape_dependent_state(tx, layout)
      if name.endswith(x.path)
    ]
    what = (
      f"its update differs by {err:.2g} (relative) at step {step + 1} when the leaf "
      "carries zero padding rows: "
    )
    if state:
      what += (
        "its state for this leaf is neither a scalar nor param-shaped ("
        f"{'; '.join(state[:3])}{' ...' if len(state) > 3 else ''}): factored "
        "second moments, as in optax.adafactor"
      )
    else:
      what += (
        "it depends on the leaf's shape (a mean over elements, an RMS or an element "
        "count, as in optax.adafactor's update clipping and parameter scaling)"
      )
  else:
    what = (
      "it gives zero params with zero grads non-zero updates (e.g. added noise), so "
      "the padding rows drift and would enter later per-leaf statistics"
    )
  others = sorted({q.path for _, q, _, _ in bad} - {x.path})
  raise NotImplementedError(
    f"optax transformation is not exact on padded leaves under a sharded "
    f"data_parallel_sharding_strategy: params{x.path} has shape {x.shape}; the "
    f"distributed optimizer sees it as {x.seen} ({dim} {n} padded to "
    f"{x.seen[x.axis]}, a multiple of dp={layout.dp}), and {what}."
    + (
      f" Also affected: {', '.join('params' + q for q in others[:4])}"
      f"{' ...' if len(others) > 4 else ''}."
      if others
      else ""
    )
    + " Use a shape-independent transformation for these leaves (elementwise ones such "
    "as adamw, lion, sgd; global-norm clipping; lamb), "
    + (f"or a data-parallel size that divides the {dim} ({n}), " if x.shape else "")
    + "or data_parallel_sharding_strategy='no_shard'."
  )


# ----------------------------------------------------------------------------- the fused update


# [Note: flat and per-leaf forms]
# A fused state keeps `master` and every per-element optax leaf as `{bucket name: flat}`
# (`state.bucket_names`), each flat array a whole bucket in shard-major order (see [Note:
# shard-major buckets] in layout.py), split over "data" so that device `d` holds shard `d`
# (`no_shard`: replicated, and its params are not padded per leaf). Shard `d` is block `d`
# of every param of the bucket, so a device converts between the two forms alone:
# `shard_unravel` cuts its shard into its blocks of the padded leaves, `shard_ravel` packs
# them back, and nothing is gathered. The per-leaf form has no place for a bucket's tail
# (`no_shard`: for any of its padding): flat -> per-leaf drops it, per-leaf -> flat takes
# it from `like`, what `init_state` put there (adagrad's initial accumulator value, say),
# else zeros. `per_leaf_state` and `fused_state` are the one pair of conversions; `fuses`
# decides whether `tx` may run on the flat form at all.
def fuses(tx: optax.GradientTransformation, layout: Layout) -> bool:
  """Does `tx` update the flat buckets exactly as it updates the param tree?

  Runs `tx` for a few steps on one host device twice with the same values: on the param
  tree and on `{bucket name: flat}` (`state.bucket_names`, the layout's shard-major order,
  padding zero), each dim of every leaf cut to at most 2 (the tree's ndims and paths stay,
  so masks by path or by ndim still differ on the flat tree; one by a size threshold above
  the cut sizes would not), in float64 where it can. True when the updates agree leaf by leaf and the padding's stay zero: elementwise
  transformations, global norms and schedules (adamw, lion, sgd, clip_by_global_norm).
  False, never an error, for the rest: a mask given as a pytree or callable of the params,
  per-leaf statistics (lamb's trust ratio), shape-dependent state (adafactor, muon), or a
  transformation that fails on the flat tree.

  Examples:
    >>> import jax.numpy as jnp, optax, jaxdp
    >>> from jaxdp._src.distributed_optimizer import fuses
    >>> layout = jaxdp.layout.make_layout({"w": jnp.zeros((130, 130)), "b": jnp.zeros((3,))}, dp=8)
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    >>> fuses(tx, layout), fuses(optax.lamb(1e-3), layout)
    (True, False)
  """
  # The probe runs on a copy of the layout with every dim cut to at most `_SHRINK`: the same
  # paths, ndims, dtypes, frozen leaves and units, so that a mask by path or ndim acts on the
  # tree run as on the real params (and differently on the flat run), on small arrays.
  static = {leaf.path for leaf in layout.leaves if not leaf.trainable}
  shrunk = [
    jax.ShapeDtypeStruct(tuple(min(d, _SHRINK) for d in leaf.shape), leaf.dtype)
    for leaf in layout.leaves
  ]
  small = make_layout(
    jax.tree.unflatten(layout.treedef, shrunk),
    layout.dp,
    frozen=lambda path, _: path in static,
    units=None if layout.units is None else {leaf.path: leaf.unit for leaf in layout.leaves},
  )
  try:
    return _fuses_small(tx, small)
  except TypeError:  # a `tx` that cannot be a cache key
    return _fuses_small.__wrapped__(tx, small)


@functools.lru_cache(maxsize=32)
def _fuses_small(tx, small: Layout) -> bool:
  """`fuses` on the cut layout, remembered: every `init_state` with the same `tx` and tree
  (a state and the `like` of a restore, a config sweep) asks again, and the probe compiles
  a program (~1 s)."""
  names = bucket_names(small)
  # float64 first, then the master dtypes; failing both, the per-leaf update (logged at debug)
  for x64 in (True, False):
    try:
      # eagerly, also where init_state is traced (`jax.eval_shape` of aot)
      cpu = jax.local_devices(backend="cpu")[0]
      with jax.ensure_compile_time_eval(), jax.default_device(cpu), jax.enable_x64(x64):
        return _fused_probe(tx, small, names, x64)
    except Exception as e:  # noqa: BLE001 - tx cannot run on the flat tree: per-leaf update
      error = e
  _log.debug("fused update off: the probe failed (%s: %s)", type(error).__name__, error)
  return False


def _fused_probe(tx, layout: Layout, names, x64: bool) -> bool:
  """`fuses` on a small layout, in float64 (`x64`) or the master dtypes."""
  rng = np.random.default_rng(0)
  dtype = {
    p.index: np.float64 if x64 else master_dtype(layout.leaves[p.index].dtype)
    for p in layout.params
  }
  draw = lambda scale: {
    p.index: _probe_values(rng, p.shape, scale).astype(dtype[p.index]) for p in layout.params
  }
  params = draw(1 / 16)
  grads = [draw(1 / 4) for _ in range(_PROBE_STEPS)]

  def tree(values):
    return [values.get(leaf.index) for leaf in layout.leaves]

  def flat(values):  # leaves of `{name: flat}`, in key order
    return jax.tree.leaves(
      {
        named.name: bucket_ravel(
          [values[p.index] for p in named.bucket.params],
          named.bucket,
          layout.dp,
          dtype[named.bucket.params[0].index],
        )
        for named in names
      }
    )

  # run 1: the param tree; run 2: the same values raveled into `{bucket name: flat}`, padding
  # zero, as a fused state holds them
  flat_def = jax.tree.structure({named.name: 0 for named in names})
  true, fused = _run_both(
    tx,
    [(tree(params), [tree(g) for g in grads]), (flat(params), [flat(g) for g in grads])],
    [layout.treedef, flat_def],
  )
  rtol = _PROBE_RTOL if x64 else _PROBE_RTOL_NATIVE
  for ut, uf in zip(true, fused):
    by_name = jax.tree.unflatten(flat_def, uf)
    for named in names:
      got = np.asarray(by_name[named.name])
      # Ravel writes zeros into every padding element (rows and tail), so unravel + ravel gives
      # back `got` exactly iff `tx` left all of the bucket's padding at zero.
      parts = bucket_unravel(got, named.bucket, layout.dp)
      if not np.array_equal(np.asarray(bucket_ravel(parts, named.bucket, layout.dp)), got):
        _log.debug("fused update off: %s updates the padding of bucket %s", tx, named.name)
        return False
      for p, x in zip(named.bucket.params, parts):
        a = np.asarray(ut[p.index], np.float64)
        scale = max(float(np.max(np.abs(a), initial=0.0)), np.finfo(np.float64).tiny)
        err = float(np.max(np.abs(np.asarray(x, np.float64) - a), initial=0.0)) / scale
        # `not <=`, so that a NaN error fails too
        if not err <= rtol:
          _log.debug("fused update off: params%s differs by %.2g (relative)", p.path, err)
          return False
  return True


def use_fused(tx, layout: Layout, config: DDPConfig, model_specs=(), chunked=False) -> bool:
  """Does the state keep flat buckets (`DDPConfig.fused_update`, `distributed_optimizer`)?

  Needs params the caller did not shard (no tensor or expert parallelism), no stacked FSDP
  units and no FSDP param gathered by row blocks (`chunked`: `FSDPConfig(chunks=...)`),
  under `no_shard` trainable params that need no fp32 copy (DDP keeps a bf16 model's
  master per leaf), and `tx` exact on the flat buckets (`fuses`); None decides by these,
  True requires them. `no_shard` fuses only when asked (`fused_update=True`): its update is
  a small share of DDP's step and raveling the replicated params for it every step costs
  more than the per-leaf kernels it saves, though it compiles faster (docs/design.md,
  "The flat update").
  """
  sharded = config.use_distributed_optimizer
  if config.fused_update is False or (not sharded and config.fused_update is None):
    return False
  # the first reason that applies, in this order; `fuses`, which compiles a probe, last
  why = None
  if any(any(dims) for dims in model_specs) or any(buf.expert for buf in layout.buffers):
    why = "some params are sharded over other mesh axes (tensor or expert parallel)"
  elif layout.stacked:
    why = (
      "some params are stacked FSDP units (FSDPConfig(stacked=...)), whose master is "
      "(layers, rows, ...) with one layer gathered per scan iteration: they update per leaf"
    )
  elif layout.outer > 1:
    why = (
      "outer_dp_sharding_strategy='optim' splits each param's block again across "
      "'replica' (the master and optimizer state): they update per leaf"
    )
  elif chunked:
    why = (
      "FSDPConfig(chunks=...) gathers some params by row blocks of their own master: they "
      "update per leaf"
    )
  elif not sharded and any(
    buf.param_dtype != master_dtype(buf.param_dtype) for buf in layout.buffers
  ):
    why = "no_shard keeps an fp32 copy of low-precision params per leaf"
  elif not fuses(tx, layout):
    why = (
      "the optax transformation updates the flat buckets differently from the param tree "
      "(a mask, per-leaf statistics or a shape-dependent transformation)"
    )
  if why and config.fused_update:
    raise ValueError(f"fused_update=True: {why}; use fused_update=None (decide) or False")
  return why is None


def fused_master(leaves, layout: Layout) -> dict[str, jax.Array]:
  """A fused state's `master` from the trainable params (tree order): one flat array per
  bucket in the master dtype, padding zero. (`no_shard`'s fused update sees its params so.)"""
  return {
    named.name: bucket_ravel(
      [leaves[p.index] for p in named.bucket.params],
      named.bucket,
      layout.dp,
      master_dtype(named.buffer.param_dtype),
    )
    for named in bucket_names(layout)
  }


def unravel_flat(flat: dict[str, jax.Array], layout: Layout) -> list[Any]:
  """Inverse of `fused_master` on whole buckets: the trainable leaves (tree order, None for
  the rest), in the flat arrays' dtype."""
  out = [None] * len(layout.leaves)
  for named in bucket_names(layout):
    bucket = named.bucket
    for p, x in zip(bucket.params, bucket_unravel(flat[named.name], bucket, layout.dp)):
      out[p.index] = x
  return out


def per_leaf_state(state: TrainState, mesh) -> TrainState:
  """A fused state in the form the per-leaf update keeps: `master` and every per-element
  optax leaf (`mu[name]`) back as the param tree, each leaf padded on its shard dim.

  The one conversion from flat to per-leaf: `get_params`, `get_opt_state`, checkpoints and
  eval read a fused state through it. Traceable; returns an unfused state as it is. Under a
  sharded strategy every device converts its own shard (`shard_unravel`: device `d`'s shard
  of a bucket *is* block `d` of each of its params' shard dims), so nothing is gathered;
  `master` and `opt_state` come out where `state_specs` places an unfused state, `params`
  stay as they are. `no_shard`'s flat buckets are replicated and unravel as they are.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
    >>> state = jaxdp.init_state({"w": jnp.ones((12, 4))}, optax.adam(1e-3), mesh, config)
    >>> leafy = per_leaf_state(state, mesh)
    >>> leafy.master["w"].shape, leafy.master["w"].sharding.spec
    ((16, 4), P('data', None))
  """
  if not state.fused:
    return state
  layout = state.layout
  names = {named.name for named in bucket_names(layout)}
  # See [Note: flat and per-leaf forms]. A flat tree is a dict keyed by exactly the bucket
  # names: the master and each per-element optax leaf group (`mu`, `nu`).
  is_flat = lambda x: isinstance(x, dict) and set(x) == names
  flats = [
    x for x in jax.tree.leaves((state.master, state.opt_state), is_leaf=is_flat) if is_flat(x)
  ]
  if state.config.use_distributed_optimizer:
    trees = iter(leaves_of_shards(flats, layout, mesh))
  else:
    trees = iter(
      unravel_flat({k: constrain(x, mesh, P()) for k, x in f.items()}, layout) for f in flats
    )
  # `flats` were collected master first, then `opt_state` in `jax.tree` order; the same
  # traversal below takes the converted trees from `trees` in that order
  tree = lambda flat: jax.tree.unflatten(layout.treedef, next(trees)) if is_flat(flat) else flat
  master = tree(state.master)
  out = dataclasses.replace(
    state,
    master=master,
    opt_state=jax.tree.map(tree, state.opt_state, is_leaf=is_flat),
    fused=False,
  )
  return _placed(out, mesh)


def _leaf_shard_specs(layout: Layout, axes) -> list[P | None]:
  """Each trainable leaf's padded per-leaf form as `shard_map` sees it: split over "data" on
  its shard dim (a fused state has no tensor- or expert-parallel leaf); None elsewhere."""
  return [
    manual_spec(with_data(((),) * len(leaf.shape), axes, leaf.shard_axis), axes)
    if leaf.trainable
    else None
    for leaf in layout.leaves
  ]


def leaves_of_shards(flats: list[dict], layout: Layout, mesh) -> list[list[Any]]:
  """Each flat tree of a sharded fused state (`{bucket name: flat}`) as padded per-leaf
  arrays (tree order, None for leaves without a bucket), each device unraveling its own
  shard. Traced."""
  axes = data_axes(mesh)

  def local(flats):
    out = []
    for flat in flats:
      leaves = [None] * len(layout.leaves)
      for named in bucket_names(layout):
        bucket, shard = named.bucket, flat[named.name]
        if not hasattr(shard, "shape"):
          # optax.masked's `MaskedNode` (of `multi_transform`, a mask): no state for this
          # bucket, and none for each of its leaves
          for p in bucket.params:
            leaves[p.index] = shard
          continue
        for p, x in zip(bucket.params, shard_unravel(shard, bucket, layout.dp)):
          leaves[p.index] = x
      out.append(leaves)
    return out

  specs, leaf_specs_ = flat_master_specs(layout, axes), _leaf_shard_specs(layout, axes)
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=([specs] * len(flats),),
    out_specs=[leaf_specs_] * len(flats),
    axis_names=set(axes),
  )(flats)


def shards_of_leaves(trees: list[list[Any]], likes: list, layout: Layout, mesh):
  """Inverse of `leaves_of_shards`: each device ravels its blocks of the padded per-leaf
  arrays into its shard of every bucket; a bucket's tail past its last param is `likes'`
  (flat trees of a fused state, or None), else zero. Traced."""
  axes = data_axes(mesh)

  def local(trees, likes):
    out = []
    for leaves, like in zip(trees, likes):
      flat = {}
      for named in bucket_names(layout):
        bucket = named.bucket
        blocks = [leaves[p.index] for p in bucket.params]
        shard = shard_ravel(blocks, bucket, blocks[0].dtype)
        if like is not None:
          used = sum(p.shard_size(layout.dp) for p in bucket.params)
          shard = jnp.concatenate([shard[:used], like[named.name][used:].astype(shard.dtype)])
        flat[named.name] = shard
      out.append(flat)
    return out

  specs, leaf_specs_ = flat_master_specs(layout, axes), _leaf_shard_specs(layout, axes)
  like_specs = [None if like is None else specs for like in likes]
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=([leaf_specs_] * len(trees), like_specs),
    out_specs=[specs] * len(trees),
    axis_names=set(axes),
  )(trees, likes)


def _ravel_whole(leaves, like: dict | None, layout: Layout, mesh) -> dict[str, jax.Array]:
  """`no_shard`'s flat buckets from whole leaves; every padding element `like`'s, else 0."""
  out = {}
  for named in bucket_names(layout):
    bucket = named.bucket
    whole = [constrain(leaves[p.index], mesh, P()) for p in bucket.params]
    flat = bucket_ravel(whole, bucket, layout.dp)
    if like is not None:
      # True at every real element: the ravel puts False at every padding element (rows and tail)
      real = bucket_ravel([np.ones(p.shape, bool) for p in bucket.params], bucket, layout.dp)
      flat = jnp.where(real, flat, constrain(like[named.name], mesh, P()))
    out[named.name] = flat
  return out


def _placed(state: TrainState, mesh) -> TrainState:
  """`state` with `master` and `opt_state` constrained where `state_specs` places them;
  `params` (unchanged by the conversions; FSDP keeps its frozen params sharded) as given."""
  specs = state_specs(state)
  place = lambda tree, specs: jax.tree.map(lambda x, s: constrain(x, mesh, s), tree, specs)
  return dataclasses.replace(
    state,
    master=place(state.master, specs.master),
    opt_state=place(state.opt_state, specs.opt_state),
  )


def fused_state(state: TrainState, mesh, like: TrainState | None = None) -> TrainState:
  """Inverse of `per_leaf_state`: a per-leaf state in fused form. The padding rows of each
  leaf's shard dim are the per-leaf state's own; a bucket's tail past its last param is
  `like`'s (a fused state: what `init_state` put there), else zero (`no_shard`: every
  padding element `like`'s). Traceable; a sharded state converts shard by shard (nothing
  gathered)."""
  layout = state.layout
  sharded = state.config.use_distributed_optimizer
  trainable = [leaf for leaf in layout.leaves if leaf.trainable]
  tree_def = jax.tree.structure(
    jax.tree.unflatten(layout.treedef, [0 if leaf.trainable else None for leaf in layout.leaves])
  )
  # See [Note: flat and per-leaf forms]. A per-leaf tree is recognised by its structure
  # (trainable leaves only) and the shapes the optimizer sees: the shard dim padded when
  # sharded, the leaf's own shape under `no_shard`.
  padded = {
    leaf.index: sharded_shape(layout, leaf.index)[0] if sharded else leaf.shape
    for leaf in trainable
  }

  def is_tree(x):
    if jax.tree.structure(x) != tree_def:
      return False
    xs = jax.tree.leaves(x)
    return all(tuple(np.shape(v)) == padded[leaf.index] for v, leaf in zip(xs, trainable))

  masked = lambda x: isinstance(x, optax.MaskedNode)

  def is_masked(x):
    """A per-leaf tree of optax.masked's `MaskedNode`s (a `multi_transform` branch that
    no bucket takes): fused, every bucket's node."""
    nodes = jax.tree.leaves(x, is_leaf=masked)
    return (
      bool(nodes)
      and all(masked(v) for v in nodes)
      and jax.tree.structure(x, is_leaf=masked) == tree_def
    )

  trees, likes = [], []

  def collect(x, pad=None):
    if is_tree(x):
      trees.append(layout.treedef.flatten_up_to(x))
      likes.append(pad)
    return x

  # master first, then `opt_state` (with `like`'s alongside), in the order `flat` below
  # takes the converted trees
  if like is None:
    collect(state.master)
    jax.tree.map(collect, state.opt_state, is_leaf=lambda x: is_tree(x) or is_masked(x))
  else:
    collect(state.master, like.master)
    jax.tree.map(
      collect, state.opt_state, like.opt_state, is_leaf=lambda x: is_tree(x) or is_masked(x)
    )
  if sharded:
    flats = iter(shards_of_leaves(trees, likes, layout, mesh))
  else:  # replicated: ravel whole, the padding (rows and tail) `like`'s
    flats = iter(_ravel_whole(leaves, pad, layout, mesh) for leaves, pad in zip(trees, likes))
  names = [named.name for named in bucket_names(layout)]

  def flat(x):
    if is_tree(x):
      return next(flats)
    return {name: optax.MaskedNode() for name in names} if is_masked(x) else x

  master = flat(state.master)
  opt_state = jax.tree.map(flat, state.opt_state, is_leaf=lambda x: is_tree(x) or is_masked(x))
  out = dataclasses.replace(state, master=master, opt_state=opt_state, fused=True)
  return _placed(out, mesh)


def grad_blocks(grads: dict[str, jax.Array], layout: Layout) -> list[jax.Array]:
  """A fused step's grads per trainable leaf (tree order) for the NaN check: each leaf's
  columns of its bucket's `(dp, shard_size)` view, padding included (zeros, finite)."""
  blocks = {}
  for named in bucket_names(layout):
    shards = grads[named.name].reshape(layout.dp, named.bucket.shard_size)
    for p in named.bucket.params:
      # column block `p.offset` of the `(dp, shard_size)` view: the leaf's block on every device
      blocks[p.index] = shards[:, p.offset : p.offset + p.shard_size(layout.dp)]
  return [blocks[i] for i in sorted(blocks)]


def flat_master_specs(layout: Layout, axes) -> dict[str, P]:
  """A fused state's `master` as `shard_map` sees it: each flat bucket split over `axes`."""
  return {named.name: manual_spec(((DATA,),), axes) for named in bucket_names(layout)}


def own_specs(model_specs, shard_axes: Mapping[int, int], manual: Sequence[str]) -> dict[int, P]:
  """The leaves whose collectives run one per param, on this device's slice of the leaf.

  A leaf its caller split over automatic mesh axes ("model": the axes other than the step's
  manual data axes) on dims other than the one it is sharded over "data" on: a
  tensor-parallel leaf that `model_shard_dims` gave a dim of its own, or an expert leaf
  split over "model" too (`P("expert", None, "model")`; "expert" is a manual axis). Inside
  the step's `shard_map` a collective over a manual axis first gathers its operand whole
  over the automatic ones, so each of such a leaf's gathers and reductions runs on its own,
  manual over those axes too (`collectives.manual_over`), and moves this device's slice.

  The one rule for every strategy: ZeRO passes whole leaves and their shard dims
  (`layout_own_specs`; `layer_spec` drops a stacked leaf's layer axis), FSDP each unit's
  leaves of one layer (`fsdp.unit_collectives`).

  Args:
    model_specs: every leaf's caller spec (`model_specs_of`; `()` when no leaf is split).
    shard_axes: leaf -> the dim it is sharded over "data" on, for the leaves to consider.
    manual: the step's manual axes (`data_axes`: "expert" among them).

  Returns:
    {leaf: its spec over the automatic axes alone}.

  Examples:
    >>> own_specs([((), ("model",)), (("expert",), (), ("model",)), (("model",),)],
    ...           {0: 0, 1: 0, 2: 0}, ("expert", "data"))
    {0: P(None, 'model'), 1: P(None, None, 'model')}
  """
  out = {}
  for i, axis in shard_axes.items() if model_specs else ():
    # the caller's spec of the leaf without the manual (data) axes: what automatic axes split
    auto = tuple(tuple(a for a in axes if a not in manual) for axes in model_specs[i])
    if any(auto) and not auto[axis]:
      out[i] = pspec(auto)
  return out


def layout_own_specs(layout: Layout, model_specs, mesh) -> dict[int, P]:
  """`own_specs` of a ZeRO (`no_shard`, `optim*`) layout: whole leaves on their shard dims."""
  shard_axes = {leaf.index: leaf.shard_axis for leaf in layout.leaves}
  return own_specs(model_specs, shard_axes, data_axes(mesh))


def layer_spec(spec: P) -> P:
  """A stacked leaf's spec (`own_specs`) of one layer: the leading layer axis dropped."""
  return P(*tuple(spec)[1:])


def gather_master(
  master, layout: Layout, out, fused: bool, stacks: bool = True, own=None
) -> list[Any]:
  """Inside `shard_map`: `out` (tree order) with every trainable param all-gathered whole
  over the data axes, one collective per bucket (per param in a `collectives.per_param`
  bucket), from `master`: the per-leaf row shards as a tree of the params' structure, or a
  fused state's flat buckets (`fused`); `stacks=False` leaves the params of the stacks'
  buckets out. `own`: `own_specs`, whose leaves each gather their own slice."""
  if fused:
    shards = [master[named.name] for named in bucket_names(layout)]
    return collectives.all_gather_shards(shards, layout, out, stacks)
  # Always a tree, never its leaves: a params tree may itself be a list (of dicts, say),
  # so a list cannot say which of the two it is.
  masters = leaves_of(master, layout)
  return collectives.all_gather_params(masters, layout, out, stacks, own)


def master_blocks(master, layout: Layout, fused: bool) -> dict[int, Any]:
  """Inside `shard_map`: {leaf: this device's block of its master} of every param of a
  stack's bucket; `master` as `gather_master` takes it."""
  out = {}
  leaves = None if fused else leaves_of(master, layout)
  for named in bucket_names(layout):
    bucket = named.bucket
    if bucket.stack is None:
      continue
    if fused:
      blocks = shard_unravel(master[named.name], bucket, layout.dp)
      out.update(zip((p.index for p in bucket.params), blocks))
    else:
      out.update((p.index, leaves[p.index]) for p in bucket.params)
  return out


# ----------------------------------------------------------------------------- the sharded state


def pad_leaf(x, layout: Layout, i: int):
  """Leaf `i` (whole) as a sharded strategy stores it: zero rows added on its shard dim."""
  shape, axis = sharded_shape(layout, i)
  return pad_dim(x, layout.leaves[i].shape, axis, shape[axis])


def unpad_leaf(x, layout: Layout, i: int):
  """Inverse of `pad_leaf`."""
  leaf = layout.leaves[i]
  return unpad_dim(x, leaf.shape, leaf.shard_axis)


def unpad_view(x, shape: tuple[int, ...], axis: int, mesh, dims, sharded: bool, outer=False):
  """Traced: a leaf `x` padded on dim `axis` back in its own `shape`, in the params' dtype
  unchanged, placed over its own axes `dims` and, if `sharded`, over "data" on a dim that dp
  divides (`view_dims`); replicated over "data" otherwise.

  Shard by shard where it can: a leaf whose padded dim is sharded moves to the view's dim
  first (an all-to-all, each device keeping `1 / dp` of the leaf), then drops its padding
  rows, so no device holds the whole leaf unless the view is replicated. `outer`: a leaf
  sharded over ("data", "replica") on `axis` (HFSDP's master and optimizer state), which is
  all-gathered across "replica" first (the compiler has no direct path from it to another
  dim over "data" and would gather it whole).
  """
  ndim = len(shape)
  dims = tuple(dims) if dims else ((),) * ndim
  view = view_dims(shape, dims, mesh.shape[DATA], axis) if sharded else dims
  if tuple(x.shape) != tuple(shape):
    if outer and x.ndim == ndim:
      x = constrain(x, mesh, pspec(with_data(dims, (), axis)))
    # `view` splits no padded dim (dp divides none of them): the padded leaf takes it as it
    # is, rows to drop included; a scalar stored as one padded dim is gathered (it is tiny)
    mid = view if x.ndim == ndim else ((),)
    x = unpad_dim(constrain(x, mesh, pspec(mid)), shape, axis)
  return constrain(x, mesh, pspec(view))


def check_expert_rows(layout: Layout, mesh):
  """Sharded strategies split each rank's experts over "data" (an expert param sharded on its
  expert dim: every one of `optim*`'s, an FSDP one with no other dim): they must divide
  evenly."""
  for buf in layout.buffers:
    for p in buf.params if buf.expert else ():
      # sharded on its expert dim, and that dim padded: dp does not divide the rank's experts
      if p.axis == 0 and p.rows != p.shape[0]:
        raise ValueError(
          f"params{p.path}: {p.shape[0]} experts per expert-parallel rank do not divide "
          f"over the {mesh.shape[DATA]} devices of the {DATA!r} axis, which the sharded "
          "optimizer splits them over; use a number of experts that is a multiple of "
          f"{mesh.shape[EXPERT] * mesh.shape[DATA]} (expert x data axis sizes), or "
          "data_parallel_sharding_strategy='no_shard'"
        )


def check_model_rows(layout: Layout, model_specs, mesh, leaves):
  """Each of `leaves` (indices) a sharded strategy pads and splits over "data" on its shard
  dim must divide there over the other axes its caller split that dim over, too (a
  column-parallel bias `P("model")`: its rows over "data" x "model")."""
  dp = mesh.shape[DATA]
  for i in leaves:
    dims = model_specs[i] if model_specs else ()
    shape, axis = sharded_shape(layout, i)
    own = [a for a in (dims[axis] if dims else ()) if a not in data_axes(mesh)]
    # the padded shard dim splits over "data" and over the caller's own axes on that dim: it
    # must divide by their product
    ways = dp * math.prod(mesh.shape[a] for a in own)
    if own and shape[axis] % ways:
      leaf = layout.leaves[i]
      rows = (leaf.shape or (1,))[axis]
      raise ValueError(
        f"params{leaf.path} is split over {own} on dim {axis} ({rows} rows), which the "
        f"sharded optimizer also splits over {DATA!r}: padded to {shape[axis]} rows for "
        f"{dp} devices they do not divide over {DATA!r} x {' x '.join(map(repr, own))} "
        f"= {ways}; give that dim a size that is a multiple of {ways}, or split another "
        "dim over the other axes"
      )


def gather_params(master, layout: Layout, mesh, params, state: TrainState):
  """All-gathers the updated params per bucket right after the update; `master`: a fused
  state's flat buckets when `state.fused`, else the per-leaf master rows in tree order."""

  own = layout_own_specs(layout, state.model_specs, mesh)

  def gather(master):
    tree = master if state.fused else tree_of(layout, master)
    return gather_master(tree, layout, [None] * len(layout.leaves), state.fused, own=own)

  axes = data_axes(mesh)
  if state.fused:
    specs = flat_master_specs(layout, axes)
  else:
    specs = [
      manual_spec(d, axes) if m is not None else None for m, d in zip(master, leaf_specs(state)[1])
    ]
  dims = [model_spec(state, leaf.index, len(leaf.shape)) for leaf in layout.leaves]
  out_specs = [
    manual_spec(d, axes) if leaf.trainable else None for leaf, d in zip(layout.leaves, dims)
  ]
  placed = [pspec(d) if leaf.trainable else None for leaf, d in zip(layout.leaves, dims)]
  if not runs_auto(mesh, state.model_specs):
    placed = None
  gathered = run_manual(gather, mesh, (specs,), out_specs, placed)(master)
  # leaves without a gathered param (frozen, not float) keep their value from `params`
  return [g if g is not None else x for g, x in zip(gathered, params)]
