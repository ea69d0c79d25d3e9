"""The distributed optimizer (ZeRO-1 `optim`, ZeRO-2 `optim_grads`): exactness and memory.

The sharded strategies run the user's optax transformation in the global view on the
*row shards* of the layout (see `layout.py`): a trainable leaf of shape `(n, *rest)` is seen
as `(rows, *rest)` with `rows` = `n` padded up to a multiple of dp, sharded over "data" on
dim 0, its padding rows zero. Elementwise transformations, global norms, schedules and
per-leaf masks are exact on such leaves by construction. A transformation whose result
depends on a leaf's *shape* (a mean over elements, factored moments, an element count) is
exact on leaves that need no padding and silently different on padded ones, so
`check_exact` probes it before training and refuses it with a message that says what to do.

`memory_ledger` predicts what each device holds per strategy (DESIGN.md's table, with the
layout's real padding) and `measured_bytes` reads what a `TrainState` does hold.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdp._src.checks import sharded_shape
from jaxdp._src.config import STRATEGIES
from jaxdp._src.layout import Frozen, Layout, default_bucket_size, make_layout

PyTree = Any

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

def _master_dtype(dtype) -> np.dtype:
  return np.promote_types(dtype, np.float32)


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


def _trainable_leaves(layout: Layout) -> list[_Leaf]:
  out = []
  for i, t in enumerate(layout.trainable):
    if t:
      seen, axis = sharded_shape(layout, i)
      out.append(_Leaf(i, layout.paths[i], layout.shapes[i], tuple(seen), axis))
  return out


def _probe_values(rng: np.random.Generator, shape, scale: float) -> np.ndarray:
  """Small dyadic values, mostly non-zero: sums of their squares are exact in any order."""
  return rng.integers(-4, 5, size=shape).astype(np.float64) * scale


_PROBE_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0,
                           "xla_llvm_disable_expensive_passes": True}
"""The probe runs once on small arrays: compile it fast rather than well."""


def _run_both(tx, runs, layout: Layout):
  """For each `(params, [grads per step])` in `runs`: the updates `tx` makes at every step.

  All runs are one program, compiled once.
  """
  unflat = lambda leaves: jax.tree.unflatten(layout.treedef, leaves)
  flat = lambda tree: jax.tree.flatten(tree, is_leaf=lambda x: x is None)[0]

  def run(tree, grads):
    def step(carry, g):
      params, state = carry
      updates, state = tx.update(unflat(g), state, params)
      return (optax.apply_updates(params, updates), state), flat(updates)
    params = unflat(tree)
    return jax.lax.scan(step, (params, tx.init(params)), grads)[1]

  args = [(tree, [None if g[0] is None else np.stack(g) for g in zip(*grads)])
          for tree, grads in runs]
  both = lambda args: [run(*a) for a in args]
  compiled = jax.jit(both).lower(args).compile(compiler_options=_PROBE_COMPILER_OPTIONS)
  out = jax.device_get(compiled(args))
  return [[[None if u is None else u[s] for u in o] for s in range(_PROBE_STEPS)] for o in out]


def _probe(tx, layout: Layout, shrink: bool, x64: bool):
  """Runs `tx` on the true shapes and on the padded shapes with the same values.

  Returns `[(step, leaf, rel_err, padding_nonzero)]` for every trainable leaf.
  """
  leaves_ = {x.index: x for x in _trainable_leaves(layout)}
  rng = np.random.default_rng(0)
  shapes = {}  # the shape values are drawn in
  for i, x in leaves_.items():
    if x.padded:
      shapes[i] = x.base
    else:
      shapes[i] = tuple(min(d, _SHRINK) for d in x.shape) if shrink else x.shape
  dtype = {i: np.float64 if x64 else _master_dtype(layout.dtypes[i]) for i in leaves_}

  def tree(values, pad):
    out = [None] * len(layout.shapes)
    for i, v in values.items():
      x = leaves_[i]
      if x.padded and pad:
        widths = [(0, 0)] * v.ndim
        widths[x.axis] = (0, x.seen[x.axis] - v.shape[x.axis])
        v = np.pad(v, widths)
      elif x.padded:
        v = v.reshape(x.shape)
      out[i] = np.asarray(v, dtype[i])
    return out

  params = {i: _probe_values(rng, shapes[i], 1 / 16) for i in leaves_}
  grads = [{i: _probe_values(rng, shapes[i], 1 / 4) for i in leaves_}
           for _ in range(_PROBE_STEPS)]

  true, pad = _run_both(tx, [(tree(params, pad), [tree(g, pad) for g in grads])
                             for pad in (False, True)], layout)
  results = []
  for step, (ut, up) in enumerate(zip(true, pad)):
    for i, x in leaves_.items():
      a = np.asarray(ut[i], np.float64).reshape(shapes[i])
      b = np.moveaxis(np.asarray(up[i], np.float64), x.axis, 0)
      a = np.moveaxis(a, x.axis, 0)
      real, rest = b[: a.shape[0]], b[a.shape[0]:]
      scale = max(float(np.max(np.abs(a), initial=0.0)), np.finfo(np.float64).tiny)
      err = float(np.max(np.abs(real - a), initial=0.0)) / scale
      if not np.all(np.isfinite(real)) or not np.all(np.isfinite(a)):
        err = 0.0 if np.array_equal(np.isnan(real), np.isnan(a)) and np.array_equal(
            np.nan_to_num(real), np.nan_to_num(a)) else math.inf
      results.append((step, x, err, bool(np.any(rest != 0))))
  return results


def _shape_dependent_state(tx, layout: Layout) -> list[str]:
  """State leaves that are neither scalars nor shaped like a param as the optimizer sees it."""
  leaves_ = _trainable_leaves(layout)
  tree = [None] * len(layout.shapes)
  for x in leaves_:
    tree[x.index] = jax.ShapeDtypeStruct(x.seen, _master_dtype(layout.dtypes[x.index]))
  state = jax.eval_shape(tx.init, jax.tree.unflatten(layout.treedef, tree))
  shapes = {x.seen for x in leaves_}
  return [("opt_state" + jax.tree_util.keystr(path), tuple(x.shape))
          for path, x in jax.tree_util.tree_leaves_with_path(state)
          if x.ndim and tuple(x.shape) not in shapes]


def check_exact(tx: optax.GradientTransformation, layout: Layout) -> None:
  """Refuses an optax transformation that the sharded optimizer would run inexactly.

  The sharded strategies feed `tx` each trainable leaf with its rows (leading dim; the
  dim after the layer axis of a stacked FSDP leaf) padded to a multiple of dp with zeros.
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
    >>> layout = jaxdp.make_layout({"w": jnp.zeros((130, 130)), "b": jnp.zeros((3,))}, dp=8)
    >>> check_exact(optax.lamb(1e-3), layout)  # per-leaf norms: exact on zero padding
    >>> check_exact(optax.adafactor(1e-3), layout)
    Traceback (most recent call last):
    ...
    NotImplementedError: optax transformation is not exact on padded leaves ...
  """
  if not any(x.padded for x in _trainable_leaves(layout)):
    return
  try:
    cpu = jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    cpu = None
  results = error = None
  for shrink in (True, False):
    for x64 in (True, False):
      try:
        with jax.default_device(cpu), jax.enable_x64(x64):
          results = _probe(tx, layout, shrink, x64)
        break
      except Exception as e:  # pylint: disable=broad-except
        error = e
    if results is not None:
      break
  if results is None:
    raise error
  rtol = _PROBE_RTOL if x64 else _PROBE_RTOL_NATIVE
  bad = [(s, x, err, pad) for s, x, err, pad in results if err > rtol or pad]
  if not bad:
    return
  step, x, err, pad = bad[0]
  n = x.base[x.axis]
  dim = "leading dim" if x.axis == 0 else f"dim {x.axis}"
  if err > rtol:
    state = [f"{name}: {shape}" for name, shape in _shape_dependent_state(tx, layout)
             if name.endswith(x.path)]
    what = (f"its update differs by {err:.2g} (relative) at step {step + 1} when the leaf "
            "carries zero padding rows: ")
    if state:
      what += ("its state for this leaf is neither a scalar nor param-shaped ("
               f"{'; '.join(state[:3])}{' ...' if len(state) > 3 else ''}): factored "
               "second moments, as in optax.adafactor")
    else:
      what += ("it depends on the leaf's shape (a mean over elements, an RMS or an element "
               "count, as in optax.adafactor's update clipping and parameter scaling)")
  else:
    what = ("it gives zero params with zero grads non-zero updates (e.g. added noise), so "
            "the padding rows drift and would enter later per-leaf statistics")
  others = sorted({q.path for _, q, _, _ in bad} - {x.path})
  raise NotImplementedError(
      f"optax transformation is not exact on padded leaves under a sharded "
      f"data_parallel_sharding_strategy: params{x.path} has shape {x.shape}; the "
      f"distributed optimizer sees it as {x.seen} ({dim} {n} padded to "
      f"{x.seen[x.axis]}, a multiple of dp={layout.dp}), and {what}."
      + (f" Also affected: {', '.join('params' + q for q in others[:4])}"
         f"{' ...' if len(others) > 4 else ''}." if others else "")
      + " Use a shape-independent transformation for these leaves (elementwise ones such "
      "as adamw, lion, sgd; global-norm clipping; lamb), "
      + (f"or a data-parallel size that divides the {dim} ({n}), " if x.shape else "")
      + "or data_parallel_sharding_strategy='no_shard'.")


# ----------------------------------------------------------------------------- memory

@dataclasses.dataclass(frozen=True)
class MemoryLedger:
  """Bytes one device holds, by kind (DESIGN.md's table with the layout's padding).

  `params` are the model params in their own dtypes as a step uses them (all of them for
  `no_shard`, `optim`, `optim_grads`; for `optim_grads_params` only the frozen params'
  shards and integer leaves: its trainable params live only in `master`, and the gathered
  units are not counted). Of those, `gathered_in_step` bytes are not kept between steps
  (`overlap_param_gather`: the trainable params are gathered from `master` at the start of
  each step), so `TrainState.params` holds `params - gathered_in_step`. `grads` are the
  reduced (main) grads: whole buffers, or a 1/dp shard of each under `optim_grads`; they
  live only inside the step. `master` and `opt_state` are what `TrainState` holds.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jaxdp.inspect import memory_ledger
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)}
    >>> ledger = memory_ledger(params, "optim", dp=8)  # bf16 params, fp32 grads and Adam
    >>> ledger.params // 2**20, ledger.grads // 2**20, ledger.master // 2**19
    (2, 4, 1)
    >>> ledger.state["params"]  # gathered from master inside each step
    0
  """

  params: int
  grads: int
  master: int
  opt_state: int
  gathered_in_step: int = 0

  @property
  def total(self) -> int:
    """params + grads + master + opt_state."""
    return self.params + self.grads + self.master + self.opt_state

  @property
  def state(self) -> dict[str, int]:
    """What `measured_bytes` should find in the `TrainState` (all but the step counter)."""
    return {"params": self.params - self.gathered_in_step, "master": self.master,
            "opt_state": self.opt_state}


def _nbytes(shape, dtype) -> int:
  return math.prod(shape) * np.dtype(dtype).itemsize


def _is_sharded_state(path, x, layout: Layout) -> bool:
  """Does a sharded strategy shard this optax state leaf over "data" (as `init_state` does)?

  A per-param leaf (Adam's `mu['w']`) has its param's padded shape and a key path ending
  with the param's path; one under a param's path with another shape (factored moments) is
  replicated; a leaf under no param's path is sharded when it has a padded param shape.
  """
  name, shape = jax.tree_util.keystr(path), tuple(x.shape)
  leaves_ = _trainable_leaves(layout)
  if any(name.endswith(p.path) and shape == p.seen for p in leaves_):
    return True
  if any(name.endswith(p.path) for p in leaves_):
    return False
  return any(shape == p.seen for p in leaves_)


def memory_ledger(params: PyTree, strategy: str, dp: int,
                  tx: optax.GradientTransformation | None = None, *,
                  grad_reduce_in_fp32: bool = True, bucket_size: int | None = None,
                  overlap_grad_reduce: bool = True, overlap_param_gather: bool = True,
                  frozen: Frozen = None) -> MemoryLedger:
  """Predicts the bytes per device of params, grads, master params and optimizer state.

  The numbers follow the layout `init_state` builds (leading dims padded to a multiple
  of dp, buckets padded to `lcm(dp, 128)`), so they equal what `measured_bytes` reads
  off the state, byte for byte.

  Args:
    params: the model params (arrays or `jax.ShapeDtypeStruct`s).
    strategy: a `data_parallel_sharding_strategy`.
    dp: size of the mesh's "data" axis (the shards; a "replica" axis holds copies).
    tx: the optax transformation; None: Adam (two moments in the master dtype).
    grad_reduce_in_fp32, bucket_size, overlap_grad_reduce, overlap_param_gather: as in
      `DDPConfig`.
    frozen: as in `init_state`.

  Returns:
    A `MemoryLedger`.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxdp
    >>> from jaxdp._src.distributed_optimizer import memory_ledger
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)}  # psi = 2**20
    >>> [round(memory_ledger(params, s, dp=8).total / 2**20, 3)  # bytes per param
    ...  for s in ("no_shard", "optim", "optim_grads")]
    [18.0, 7.5, 4.0]
  """
  if strategy not in STRATEGIES:
    raise ValueError(f"strategy={strategy!r}: use one of {', '.join(STRATEGIES)}")
  size = (bucket_size or default_bucket_size(dp)) if overlap_grad_reduce else sys.maxsize
  # FSDP shards every param on its leading dim (its units' layout); the others pick theirs.
  leading = (lambda path, leaf: True) if strategy == "optim_grads_params" else None
  layout = make_layout(params, dp=dp, bucket_size=size, frozen=frozen, leading=leading,
                       grad_dtype=jnp.float32 if grad_reduce_in_fp32 else None)
  sharded = strategy != "no_shard"
  fsdp = strategy == "optim_grads_params"
  leaves_ = _trainable_leaves(layout)

  model = sum(_nbytes(s, d) for s, d in zip(layout.shapes, layout.dtypes))
  trainable_model = sum(_nbytes(x.shape, layout.dtypes[x.index]) for x in leaves_)
  if fsdp:  # trainable params live only in `master`; frozen float params are sharded too
    model = 0
    for i in layout.static:
      shape, dtype = layout.shapes[i] or (1,), layout.dtypes[i]
      if jnp.issubdtype(dtype, jnp.floating):
        shape = (-(-shape[0] // dp), *shape[1:])  # this device's rows, padding included
      model += _nbytes(shape, dtype)
  grads = sum(buf.size * buf.grad_dtype.itemsize for buf in layout.buffers)
  if strategy in ("optim_grads", "optim_grads_params"):
    grads //= dp

  opt_tree = [None] * len(layout.shapes)
  master = 0
  for x in leaves_:
    i, dtype = x.index, _master_dtype(layout.dtypes[x.index])
    shape = x.seen if sharded else x.shape
    opt_tree[i] = jax.ShapeDtypeStruct(shape, dtype)
    if sharded:
      master += _nbytes(shape, dtype) // dp
    elif dtype != layout.dtypes[i]:
      master += _nbytes(shape, dtype)
  if tx is None:
    tx = optax.scale_by_adam()
  state = jax.eval_shape(tx.init, jax.tree.unflatten(layout.treedef, opt_tree))
  opt = 0
  for path, x in jax.tree_util.tree_leaves_with_path(state):
    n = _nbytes(x.shape, x.dtype)
    opt += n // dp if sharded and _is_sharded_state(path, x, layout) else n

  gathered = trainable_model if sharded and not fsdp and overlap_param_gather else 0
  return MemoryLedger(params=model, grads=grads, master=master, opt_state=opt,
                      gathered_in_step=gathered)


def measured_bytes(state, device=None) -> dict[str, int]:
  """Bytes that one device holds of each field of a `TrainState`.

  Sums `addressable_shards` on `device` (default: this process's first device of the
  state's mesh). Reads only this process's shards' sizes: no cross-process work.

  Returns:
    `{"step": .., "params": .., "master": .., "opt_state": ..}`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> from jaxdp.inspect import measured_bytes, memory_ledger
    >>> params, tx = {"w": jnp.zeros((64, 32))}, optax.adam(1e-3)
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
    >>> state = jaxdp.init_state(params, tx, jax.make_mesh((8,), ("data",)), config)
    >>> measured_bytes(state)  # 1/8 of w, of mu and of nu; Adam's step count whole
    {'step': 4, 'params': 0, 'master': 1024, 'opt_state': 2052}
    >>> memory_ledger(params, "optim", dp=8, tx=tx).state
    {'params': 0, 'master': 1024, 'opt_state': 2052}
  """
  leaves = [x for x in jax.tree.leaves(state.params) + jax.tree.leaves(state.master)
            if isinstance(x, jax.Array)]
  if device is None:
    me = jax.process_index()
    device = min((d for x in leaves for d in x.sharding.device_set if d.process_index == me),
                 key=lambda d: d.id)

  def field(tree):
    total = 0
    for x in jax.tree.leaves(tree):
      if isinstance(x, jax.Array):
        total += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
    return total

  return {"step": field(state.step), "params": field(state.params),
          "master": field(state.master), "opt_state": field(state.opt_state)}
