"""What a train step checks outside the compiled program: its inputs, and NaN/Inf in grads.

Megatron's `check_for_nan_in_grad` asserts inside the step. In JAX an error raised from
inside a compiled step (`jax.debug.callback`) breaks the effect bookkeeping, so the step
instead returns one "all finite" flag per trainable leaf and `TrainStep` reads them on the
host after the step and raises `NonFiniteGradError`. The step does not donate its state
while the check is on, so the state the caller passed in is still valid and unchanged when
the error comes: skip the batch, lower the learning rate or restore, and go on.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp._src import distributed

PyTree = Any


class NonFiniteGradError(FloatingPointError):
  """A reduced gradient held NaN or Inf (`check_for_nan_in_grad=True`).

  Attributes:
    step: the state's step counter when the step was attempted.
    paths: key paths of the params whose reduced gradient is not finite.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config, tx = jaxdp.DDPConfig(check_for_nan_in_grad=True), optax.sgd(0.1)
    >>> params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    >>> state = jaxdp.init_state(params, tx, mesh, config)
    >>> step = jaxdp.make_train_step(lambda p, x: jnp.sum(jnp.log(p["a"] * x) + p["b"]),
    ...                              tx, mesh, config)
    >>> try:
    ...   step(state, jnp.zeros((8, 2)))
    ... except jaxdp.NonFiniteGradError as e:
    ...   print(e.step, e.paths)
    0 ("['a']",)
    >>> float(state.params["b"][0])  # the state passed in is kept
    1.0
  """

  def __init__(self, step: int, paths: Sequence[str]):
    self.step, self.paths = step, tuple(paths)
    shown = ", ".join(f"params{p}" for p in self.paths[:8])
    more = f" and {len(self.paths) - 8} more" if len(self.paths) > 8 else ""
    super().__init__(
        f"step {step}: NaN or Inf in the reduced gradient of {shown}{more}. The state "
        "passed to the step is unchanged (it is not donated while check_for_nan_in_grad is "
        "on): skip this batch, lower the learning rate or restore a checkpoint")


def finite_leaves(grads: PyTree) -> jax.Array:
  """Traced: one bool per gradient leaf (tree order, None leaves skipped): all finite?"""
  return jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])


def sharded_shape(layout, i: int) -> tuple[tuple[int, ...], int]:
  """Leaf `i` as a sharded strategy stores it, and the axis its rows are padded on.

  The leaf's shard dim (`layout.shard_axes[i]`: its leading dim, or one that needs less
  padding; for a stacked FSDP leaf `(layers, n, *rest)` the dim after the layers) is padded
  up to a multiple of dp; a scalar is stored `(rows,)`.
  """
  shape = layout.shapes[i] or (1,)
  axis = layout.shard_axes[i]
  rows = -(-shape[axis] // layout.dp) * layout.dp
  return (*shape[:axis], rows, *shape[axis + 1:]), axis


def check_state_structure(state, leaves_of) -> None:
  """Raises if `state.params` / `state.master` no longer fit the state's layout.

  A state whose trees were edited after `init_state` (a leaf added, removed, reshaped or
  recast) would otherwise meet the layout's offsets and fail deep inside the step, or not
  at all. `leaves_of(tree)` flattens with None as a leaf.
  """
  layout = state.layout
  for field in ("params", "master"):
    tree = getattr(state, field)
    treedef = jax.tree.structure(tree, is_leaf=lambda x: x is None)
    if treedef != layout.treedef:
      raise ValueError(
          f"state.{field} has the structure {treedef}, but the state's layout (from "
          f"init_state) has {layout.treedef}: the params changed structure after init_state; "
          "build the state again with init_state for these params (or restore a "
          "checkpoint into it)")
  sharded = state.config.data_parallel_sharding_strategy != "no_shard"
  for i, (path, shape, dtype, x, m) in enumerate(zip(
      layout.paths, layout.shapes, layout.dtypes, leaves_of(state.params),
      leaves_of(state.master))):
    if x is not None and (tuple(x.shape) not in (shape, sharded_shape(layout, i)[0])
                          or np.dtype(x.dtype) != dtype):
      raise ValueError(
          f"state.params{path}: {np.dtype(x.dtype).name}{list(x.shape)}, but init_state "
          f"made it {dtype.name}{list(shape)}: the params changed after init_state; build "
          "the state again with init_state")
    if m is not None:
      want = sharded_shape(layout, i)[0] if sharded else shape
      if tuple(m.shape) != tuple(want):
        raise ValueError(
            f"state.master{path}: shape {tuple(m.shape)}, but init_state made it "
            f"{tuple(want)}: the state changed after init_state; build it again with "
            "init_state")


class TrainStep:
  """The jitted train step plus the checks that need concrete values.

  Calls straight through to the `jax.jit` function (`.lower`, `.trace`, `.eval_shape` and
  the rest are the jitted function's own). Before the call it checks that the state lives
  on the step's devices; after it, with `check_for_nan_in_grad`, that every reduced
  gradient is finite.
  """

  def __init__(self, jitted, mesh, config):
    self._jitted, self._mesh, self._config = jitted, mesh, config
    self._devices = frozenset(mesh.devices.flat)

  def __call__(self, state, batch):
    self._check_devices(state)
    distributed.heartbeat()  # Progress, for the launcher's hang guard.
    if not self._config.check_for_nan_in_grad:
      return self._jitted(state, batch)
    new_state, metrics, finite = self._jitted(state, batch)
    if isinstance(finite, jax.core.Tracer):
      raise TypeError("check_for_nan_in_grad=True reads the gradients' finiteness on the "
                      "host after each step, so the step cannot be called under jax.jit/"
                      "vmap/grad; call it from Python, or turn the check off")
    # The flags (and the step counter below) are replicated: each process reads its own
    # copy, with no program and no cross-process work of its own.
    finite = np.asarray(jax.device_get(finite))
    if not finite.all():
      layout = state.layout
      paths = [p for p, t in zip(layout.paths, layout.trainable) if t]
      raise NonFiniteGradError(int(jax.device_get(state.step)),
                               [paths[i] for i in np.flatnonzero(~finite)])
    return new_state, metrics

  def _check_devices(self, state):
    sharding = getattr(getattr(state, "step", None), "sharding", None)
    if sharding is None or isinstance(state.step, jax.core.Tracer):
      return
    if getattr(state, "mesh_shape", None) != tuple(self._mesh.shape.items()):
      return  # another mesh shape: the traced step names that
    if frozenset(sharding.device_set) != self._devices:
      raise ValueError(
          f"the state lives on devices {sorted(d.id for d in sharding.device_set)}, but this "
          f"step's mesh has devices {sorted(d.id for d in self._devices)}: build the state "
          "with init_state (or restore the checkpoint) on this step's mesh")

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    return self._jitted.lower(*args, **kwargs)

  def trace(self, *args, **kwargs) -> jax.stages.Traced:
    return self._jitted.trace(*args, **kwargs)

  def __getattr__(self, name):  # eval_shape, _cache_size, clear_cache, ...
    return getattr(self._jitted, name)

  def __repr__(self):
    return f"TrainStep({self._jitted!r})"
