"""What a train step checks outside the compiled program (its inputs), and what it decides
inside it: whether to skip its update (the spike guards and the NaN check).

Megatron's `check_for_nan_in_grad` asserts inside the step. In JAX an error raised from
inside a compiled step (`jax.debug.callback`) breaks the effect bookkeeping, so the step
instead returns one "all finite" flag per trainable leaf, skips its update on the device
when one is False (`guard_step`: the state it returns is the one it was given), and
`TrainStep` reads the flags on the host after the step and raises `NonFiniteGradError`
carrying that returned state (`e.state`): the state stays donated, so the caller's own
arrays are gone, and `e.state` is the one to go on with (skip the batch, lower the
learning rate or restore).

The spike guards (`DDPConfig.grad_norm_skip_threshold`, `skip_step_on_spikes`) skip the
update the same way, on the device, without raising: the step is counted and
`metrics["skipped"]` says so.

Also the two ends every strategy's step shares: `jit_step` (jit, donation, the host-side
`TrainStep` wrapper) and `finish_step` (the new state placed, the metrics, the NaN flags);
and `check_not_donated`, which every function taking a state runs first: a state donated to
a step is deleted, and JAX 0.10 crashes the process (a segfault, not an error) when a
compiled program is handed a deleted multi-device array.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxdp._src.config import DDPConfig, FSDPConfig
from jaxdp._src.layout import sharded_shape
from jaxdp._src.mesh import DATA, REPLICA, constrain, explicit_axes
from jaxdp._src.offload import apply_streamed
from jaxdp._src.state import (
  SpikeWindow,
  TrainState,
  bucket_names,
  flat_master,
  leaves_of,
  memory_kinds,
  to_device,
  to_host,
  tree_of,
)

PyTree = Any

ENV_HEARTBEAT = "JAXDP_HEARTBEAT"
"""A file each train step touches (`heartbeat`): the launcher's sign of progress."""

_HEARTBEAT_EVERY_S = 1.0
_last_heartbeat = [-_HEARTBEAT_EVERY_S]


def heartbeat() -> None:
  """Tells ``python -m jaxdp.launch`` this process is making progress.

  Touches the file `JAXDP_HEARTBEAT` names (at most once a second); does nothing when it is
  unset. Each train step calls it, so that a long silent run is not taken for a hang.
  """
  path = os.environ.get(ENV_HEARTBEAT)
  now = time.monotonic()
  if not path or now - _last_heartbeat[0] < _HEARTBEAT_EVERY_S:
    return
  _last_heartbeat[0] = now
  try:
    with open(path, "a"):
      pass
    os.utime(path)
  except OSError:
    pass  # The launcher's directory is gone (it is exiting): nothing to tell.


class NonFiniteGradError(FloatingPointError):
  """A reduced gradient held NaN or Inf (`check_for_nan_in_grad=True`).

  The step skipped its update on the device, and, as every step, consumed (donated) the
  state it was given: go on with `e.state`, the state as it was before the step (its step
  counter too), to skip the batch, retry it with a lower learning rate, or save it.

  Attributes:
    step: the state's step counter when the step was attempted.
    paths: key paths of the params whose reduced gradient is not finite.
    state: the state the step returned: the one it was given, unchanged.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config, tx = jaxdp.DDPConfig(check_for_nan_in_grad=True), optax.sgd(0.1)
    >>> params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    >>> state = jaxdp.init_state(params, tx, mesh, config)
    >>> step = jaxdp.make_train_step(lambda p, x: jnp.sum(jnp.log(p["a"] * x) + p["b"]),
    ...                              tx, mesh, config)
    >>> try:
    ...   state, metrics = step(state, jnp.zeros((8, 2)))
    ... except jaxdp.NonFiniteGradError as e:
    ...   print(e.step, e.paths)
    ...   state = e.state  # the state passed in was donated: go on with this one
    0 ("['a']",)
    >>> int(state.step), float(state.params["b"][0])  # as before the step
    (0, 1.0)
    >>> state, metrics = step(state, jnp.ones((8, 2)))  # the next batch
    >>> int(state.step), bool(metrics["skipped"])
    (1, False)
  """

  def __init__(self, step: int, paths: Sequence[str], state: Any = None):
    self.step, self.paths, self.state = step, tuple(paths), state
    shown = ", ".join(f"params{p}" for p in self.paths[:8])
    more = f" and {len(self.paths) - 8} more" if len(self.paths) > 8 else ""
    super().__init__(
      f"step {step}: NaN or Inf in the reduced gradient of {shown}{more}. The step skipped "
      "its update; the state passed to it was donated, and this error's `state` "
      "attribute is that state unchanged: continue with `state = e.state` (skip this "
      "batch, lower the learning rate) or restore a checkpoint"
    )

  def __reduce__(self):  # pickled (a process pool) without the state's device arrays
    return (type(self), (self.step, self.paths))


# [Note: one flag per trainable leaf]
# The NaN check's flags travel by position: `finite_leaves` stacks one flag per non-None leaf
# of the grads the strategy's `update` hands back, in tree order, and `TrainStep` pairs flag
# `i` with the `i`-th trainable leaf of the layout. So those grads must have exactly the
# trainable leaves, in tree order: a per-leaf grad tree holds None for the others, and a
# fused state's flat shards are first cut into per-leaf blocks (`grad_blocks`).
def finite_leaves(grads: PyTree) -> jax.Array:
  """Traced: one bool per gradient leaf (tree order, None leaves skipped): all finite?"""
  return jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])


def check_state_structure(state) -> None:
  """Raises if `state.params` / `state.master` no longer fit the state's layout.

  A state whose trees were edited after `init_state` (a leaf added, removed, reshaped or
  recast) would otherwise meet the layout's offsets and fail deep inside the step, or not
  at all.
  """
  layout = state.layout
  flat = flat_master(state)
  if flat:
    want = {named.name: (named.bucket.shard_size * layout.dp,) for named in bucket_names(layout)}
    got = {k: tuple(x.shape) for k, x in state.master.items()}
    if got != want:
      raise ValueError(
        f"state.master holds the flat buckets {got}, but init_state made {want}: the state "
        "changed after init_state; build it again with init_state"
      )
  # None as a leaf on both sides: a field holds None where a leaf is missing, and the
  # params' own Nones (empty subtrees) are None in both
  none_leaf = lambda x: x is None
  want = jax.tree.structure(tree_of(layout, [0] * len(layout.leaves)), is_leaf=none_leaf)
  for field in ("params",) if flat else ("params", "master"):
    tree = getattr(state, field)
    treedef = jax.tree.structure(tree, is_leaf=none_leaf)
    if treedef != want:
      raise ValueError(
        f"state.{field} has the structure {treedef}, but the state's layout (from "
        f"init_state) has {layout.treedef}: the params changed structure after init_state; "
        "build the state again with init_state for these params (or restore a "
        "checkpoint into it)"
      )
  sharded = state.config.use_distributed_optimizer
  for leaf, x, m in zip(
    layout.leaves,
    leaves_of(state.params, layout),
    [None] * len(layout.leaves) if flat else leaves_of(state.master, layout),
  ):
    padded = sharded_shape(layout, leaf.index)[0]
    if x is not None and (
      tuple(x.shape) not in (leaf.shape, padded) or np.dtype(x.dtype) != leaf.dtype
    ):
      raise ValueError(
        f"state.params{leaf.path}: {np.dtype(x.dtype).name}{list(x.shape)}, but init_state "
        f"made it {leaf.dtype.name}{list(leaf.shape)}: the params changed after init_state; "
        "build the state again with init_state"
      )
    if m is not None:
      want = padded if sharded else leaf.shape
      if tuple(m.shape) != tuple(want):
        raise ValueError(
          f"state.master{leaf.path}: shape {tuple(m.shape)}, but init_state made it "
          f"{tuple(want)}: the state changed after init_state; build it again with "
          "init_state"
        )


# ----------------------------------------------------------------------------- inputs


DONATED = (
  "{where}: this state was donated to the previous step; use the state it returned "
  "(`state, metrics = train_step(state, batch)`, then pass the new `state`). A train step "
  "consumes the state it is given: its buffers become the new state's, and the old "
  "arrays are deleted ({deleted}). `CheckpointManager.restore` consumes its `like` the "
  "same way. To keep a copy, take `jaxdp.get_params(state)` before the step"
)


def check_not_donated(state, where: str) -> None:
  """Raises if an array of `state` was donated (deleted): before it reaches a program.

  JAX crashes the process when a compiled program is given a deleted array of several
  devices, so every function that takes a state calls this first: one `is_deleted()` per
  leaf, on the host (a fraction of a microsecond each). A traced state (the step called
  inside another jit) is skipped: nothing is donated inside a trace.

  Raises:
    ValueError: some leaf is deleted, naming the first ones and the fix.
  """
  leaves = jax.tree.leaves(state)
  # A state traced by an outer jit has tracers for leaves: the first leaf tells
  if not leaves or isinstance(leaves[0], jax.core.Tracer):
    return
  # Host values (a learning rate set as a Python float) have no `is_deleted`.
  if not any(getattr(x, "is_deleted", _alive)() for x in leaves):
    return
  # Key paths only on the way to the error: the common path above flattens without them
  keyed = jax.tree_util.tree_flatten_with_path(state)[0]
  gone = [jax.tree_util.keystr(path) for path, x in keyed if getattr(x, "is_deleted", _alive)()]
  shown = ", ".join(f"state{p}" for p in gone[:3])
  more = f" and {len(gone) - 3} more" if len(gone) > 3 else ""
  raise ValueError(
    DONATED.format(where=where, deleted=f"{shown}{more}: {len(gone)} of {len(keyed)} leaves")
  )


def _alive() -> bool:
  return False


def check_mesh(mesh, config: DDPConfig):
  """Raises unless `mesh` has a "data" axis, and a "replica" axis as big as `config` says."""
  if DATA not in mesh.axis_names:
    raise ValueError(
      f"mesh axes {mesh.axis_names} have no {DATA!r} axis: jaxdp shards "
      f"the batch over it; make the mesh with jax.make_mesh((n,), ({DATA!r},))"
    )
  replicas = mesh.shape.get(REPLICA, 1)
  if config.use_distributed_optimizer and replicas != config.num_distributed_optimizer_instances:
    raise ValueError(
      f"num_distributed_optimizer_instances={config.num_distributed_optimizer_instances} "
      f"but the mesh has {REPLICA!r} axis size {replicas}: they must agree; use a mesh "
      f"with axes ({REPLICA!r}, {DATA!r}) of shape "
      f"({config.num_distributed_optimizer_instances}, n)"
    )


def check_state(state, mesh, config: DDPConfig, fsdp: FSDPConfig | None = None):
  """Raises unless `state` is a `TrainState` built for `mesh`, `config` and `fsdp` (None
  for the bucketed strategies; `optim_grads_params`: the step's `FSDPConfig`, default
  included), its trees as `init_state` made them."""
  if not isinstance(state, TrainState):
    raise TypeError(
      f"train_step expects the TrainState from jaxdp.init_state, got {type(state).__name__}"
    )
  if state.config != config:
    raise ValueError(
      f"the state was built for {state.config}, but this step is for {config}; "
      "build the state with init_state(params, tx, mesh, config) for the same "
      "config"
    )
  if state.fsdp != fsdp:
    if state.fsdp is None or fsdp is None:
      differ = f"fsdp={state.fsdp} in the state, fsdp={fsdp} in this step"
    else:
      differ = ", ".join(
        f"{f.name}={getattr(state.fsdp, f.name)!r} in the state, "
        f"{getattr(fsdp, f.name)!r} in this step"
        for f in dataclasses.fields(fsdp)
        if getattr(state.fsdp, f.name) != getattr(fsdp, f.name)
      )
    raise ValueError(
      f"the state was built with another FSDPConfig than this step's ({differ}); pass the "
      "same fsdp= to init_state and make_train_step (and make_eval_step; leaving it out "
      "means FSDPConfig()), the same FSDPConfig object where its units are a function"
    )
  if state.mesh_shape != tuple(mesh.shape.items()):
    raise ValueError(
      f"the state was built for a mesh of shape {dict(state.mesh_shape)}, but "
      f"this step runs on {dict(mesh.shape)}; build the state (or restore the "
      "checkpoint) with init_state on this mesh"
    )
  check_state_structure(state)


def check_batch(batch, divisor: int):
  """Raises unless every leaf of `batch` has the same leading dim, divisible by `divisor`."""
  keyed = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not keyed:
    raise ValueError("batch has no arrays; pass a pytree of arrays with a leading batch dim")
  dims = {}
  for path, x in keyed:
    name = "batch" + jax.tree_util.keystr(path)
    if not getattr(x, "shape", ()):
      raise ValueError(
        f"{name}: a scalar has no batch dim to split over the data axis; "
        "pass arrays whose leading dim is the global batch"
      )
    dims.setdefault(x.shape[0], name)
  if len(dims) > 1:
    raise ValueError(
      "batch leaves have different leading dims: "
      + ", ".join(f"{name} has {d}" for d, name in dims.items())
      + "; every leaf must hold the same "
      "number of examples"
    )
  ((n, name),) = dims.items()
  if n % divisor:
    raise ValueError(
      f"{name}: batch dim {n} is not divisible by {divisor} (data-parallel "
      "size × grad_accum_steps); use a global batch that is a multiple of "
      f"{divisor}"
    )


# ----------------------------------------------------------------------------- the step's ends


def finish_step(
  new_state: TrainState,
  specs: TrainState,
  mesh,
  config: DDPConfig,
  loss,
  grad_norm,
  finite=None,
  aux=None,
  skipped=None,
  tokens=None,
):
  """The end of every strategy's step: the new state placed as `specs` say (as
  `init_state` placed it), the metrics (`aux` under "aux" when the step has one), with the
  NaN check the `finite` flags (`finite_leaves`) under `FINITE` (read and removed on the
  host by `TrainStep`), with a guard (`DDPConfig.skips_steps`) whether the step `skipped`
  its update under `SKIPPED`, and with a per-token loss the step's global token count
  under "tokens"."""
  # The output placed exactly as the input was: the jit cache keys on the sharding of its
  # arguments, so a state placed otherwise (even `P(None, None)` for `P()`) would compile
  # the step a second time when it comes back.
  new_state = jax.tree.map(lambda x, s: constrain(x, mesh, s), new_state, specs)
  # ... and in the memory it came from: offloaded leaves back to the host
  # (`DDPConfig.optimizer_cpu_offload`)
  if config.optimizer_cpu_offload:
    new_state = to_host(new_state, memory_kinds(new_state))
  metrics = {"loss": loss, "grad_norm": grad_norm}
  if aux is not None:
    metrics["aux"] = aux
  if config.check_for_nan_in_grad:
    metrics[FINITE] = finite
  if skipped is not None:
    metrics[SKIPPED] = skipped
  if tokens is not None:
    metrics["tokens"] = tokens
  return new_state, metrics


# ----------------------------------------------------------------------------- skipping a step


@dataclasses.dataclass(frozen=True)
class GuardedStep:
  """What `guard_step` decided."""

  state: TrainState
  """The state the step returns: the updated one, or the one before it (see `guard_step`)."""
  skipped: jax.Array
  """bool scalar: did the step skip its update."""


def guard_step(
  config: DDPConfig,
  before: TrainState,
  after: TrainState,
  specs: TrainState,
  mesh,
  grad_norm,
  finite,
) -> GuardedStep:
  """Traced, with `config.skips_steps`: `after` (the optimizer's update of `before`), or,
  where a guard says skip, `before` with its step counted (the NaN check: `before` as it
  is, for `TrainStep` to hand back in `NonFiniteGradError`).

  A select, leaf by leaf, inside the step (no host round trip, no branch): XLA fuses it
  into the update's elementwise loops, so the donated state's buffers are still written in
  place. `specs` places both sides alike first (an Explicit mesh selects only between
  arrays of one sharding), on the device (offloaded leaves are selected there).

  Args:
    config: the step's config: which guards are on.
    before: the state the step was given.
    after: the state after the update, its step counted.
    specs: where `init_state` places each leaf of both.
    mesh: the step's mesh.
    grad_norm: the global grad norm (float32 scalar, replicated).
    finite: the NaN check's flags (`finite_leaves`), None without it.
  """
  # An offloaded state's master and optimizer state: selected a piece at a time on the
  # device, written back into `after`'s host buffers (`offload.apply_streamed`), so that
  # the device never holds both states whole.
  streamed = config.optimizer_cpu_offload
  offloaded = (before.master, before.opt_state), (after.master, after.opt_state)
  offloaded_specs = (specs.master, specs.opt_state)
  if streamed:
    drop = lambda state: dataclasses.replace(state, master=None, opt_state=None)
    specs, before, after = drop(specs), drop(before), drop(after)
  # The others on the device (a select takes operands of one memory space), placed alike
  place = lambda state: to_device(jax.tree.map(lambda x, s: constrain(x, mesh, s), state, specs))
  before, after = place(before), place(after)
  bad_grads = ~jnp.isfinite(grad_norm)
  raises = None
  if finite is not None:
    raises = ~jnp.all(finite)
    bad_grads = bad_grads | raises
  skipped = bad_grads
  if config.grad_norm_skip_threshold != math.inf:
    skipped = skipped | (grad_norm > config.grad_norm_skip_threshold)
  window = before.spike_window
  if config.skip_step_on_spikes:
    skipped = skipped | is_spike(window, grad_norm, config.skip_step_scaling_factor)
  step = before.step + 1
  if raises is not None:  # handed back by the error as it was given: not counted
    step = jnp.where(raises, before.step, step)
  kept = dataclasses.replace(before, step=step)
  select = lambda old, new: jax.tree.map(lambda o, n: jnp.where(skipped, o, n), old, new)
  state = select(kept, after)
  if streamed:
    both = (offloaded_specs, offloaded_specs)
    master, opt_state = apply_streamed(select, *offloaded, both, dict(mesh.shape))
    state = dataclasses.replace(state, master=master, opt_state=opt_state)
  if config.skip_step_on_spikes:
    # a skipped step's norm stays out of the window: a spike must not raise the mean
    # and the deviation that the next steps are judged by
    pushed = push_norm(window, grad_norm)
    window = jax.tree.map(lambda old, new: jnp.where(skipped, old, new), window, pushed)
    state = dataclasses.replace(state, spike_window=window)
  return GuardedStep(state, skipped)


def is_spike(window: SpikeWindow, grad_norm, scaling_factor: float) -> jax.Array:
  """Traced: is `grad_norm` more than `scaling_factor` standard deviations (Bessel's) above
  the mean of the norms in `window` (MaxText's `skip_step_on_spikes`, on the grad norm)?
  False until the window holds `max(2, interval // 2)` norms."""
  interval = window.norms.shape[0]
  held = jnp.minimum(window.count, interval)
  used = jnp.arange(interval) < held  # the ring's written entries
  mean = jnp.sum(jnp.where(used, window.norms, 0.0)) / jnp.maximum(held, 1)
  squares = jnp.sum(jnp.where(used, (window.norms - mean) ** 2, 0.0))
  deviation = jnp.sqrt(squares / jnp.maximum(held - 1, 1))
  judged = held >= max(2, interval // 2)
  return judged & (grad_norm - mean > scaling_factor * deviation)


def push_norm(window: SpikeWindow, grad_norm) -> SpikeWindow:
  """Traced: `window` with `grad_norm` written over its oldest entry."""
  interval = window.norms.shape[0]
  norms = window.norms.at[window.count % interval].set(grad_norm.astype(window.norms.dtype))
  return SpikeWindow(norms, window.count + 1)


def with_spike_window(state: TrainState, mesh) -> TrainState:
  """`state` (from `init_state`) with an empty `SpikeWindow` when its config has the spike
  guard (`skip_step_on_spikes`), placed as the step places it; else `state` as it is."""
  if not state.config.skip_step_on_spikes:
    return state
  return dataclasses.replace(state, spike_window=empty_spike_window(state.config, mesh))


def empty_spike_window(config: DDPConfig, mesh) -> SpikeWindow:
  """A `SpikeWindow` of `config.skip_step_interval` entries holding no norm, placed as the
  step places it (`place_spike_window`)."""
  window = SpikeWindow(np.zeros((config.skip_step_interval,), np.float32), np.zeros((), np.int32))
  return place_spike_window(window, mesh)


def place_spike_window(window: SpikeWindow, mesh) -> SpikeWindow:
  """A copy of `window` replicated on `mesh` as the step places its output (on an Explicit
  mesh a jitted constraint gives a 1-D array another spec than `device_put` does), so that
  a step given it reuses the program of the step before."""
  replicated = jax.sharding.PartitionSpec()
  window = jax.device_put(window, jax.sharding.NamedSharding(mesh, replicated), may_alias=False)
  return jax.jit(lambda w: jax.tree.map(lambda x: constrain(x, mesh, replicated), w))(window)


FINITE = "finite"
"""The metric that carries the NaN check's flags out of the jitted step to `TrainStep`."""

SKIPPED = "skipped"
"""The metric that says a guarded step skipped its update (`DDPConfig.skips_steps`)."""


def place_host_leaves(state, mesh):
  """`state` with the optax state's scalars that the caller set on the host (a learning rate
  by `optax.tree_utils.tree_set`, a `jnp.asarray` on one device) put on `mesh`, replicated,
  where every strategy keeps them; any other leaf off the mesh is an error naming it.

  Raises:
    ValueError: a non-scalar optax state leaf that is not on the step's mesh.
  """
  if not isinstance(state, TrainState) or state.mesh_shape != tuple(mesh.shape.items()):
    return state  # not ours, or another mesh shape: the traced step names that

  def on_mesh(x) -> bool:
    sharding = getattr(x, "sharding", None)
    return isinstance(x, jax.core.Tracer) or (
      isinstance(sharding, jax.sharding.NamedSharding)
      and (sharding.mesh is mesh or sharding.mesh == mesh)
    )

  # Every step calls this: the common case (nothing set on the host) reads no key paths.
  if all(on_mesh(x) for x in jax.tree.leaves(state.opt_state)):
    return state
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state.opt_state)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  placed = []
  for path, x in leaves:
    # A scalar can be placed without asking where: every strategy keeps the optax state's
    # scalars replicated. A larger array has a sharding the step expects (1/dp rows of a
    # master, say), which this function cannot guess, so it is refused.
    if on_mesh(x):
      placed.append(x)
    elif np.ndim(x) == 0:
      # One value on every device, from every process alike (a multi-process mesh too).
      value = np.asarray(jax.device_get(x))
      value = value.astype(jax.dtypes.canonicalize_dtype(value.dtype))  # a Python float: f32
      placed.append(jax.make_array_from_callback((), replicated, lambda _, v=value: v))
    else:
      raise ValueError(
        f"state.opt_state{jax.tree_util.keystr(path)}: an array of shape {np.shape(x)} "
        f"placed off this step's mesh ({getattr(x, 'sharding', type(x).__name__)}); a step "
        "takes scalars set on the host (a learning rate by optax.tree_utils.tree_set) as "
        "they are, an array only where the state had it: jax.device_put(new, "
        "old.sharding), with old the leaf it replaces"
      )
  return dataclasses.replace(state, opt_state=jax.tree_util.tree_unflatten(treedef, placed))


def jit_step(step, mesh, config: DDPConfig, options) -> TrainStep:
  """`step` jitted with `options`, the state donated, wrapped in the host-side checks; the
  metrics come back replicated on `mesh`, for the caller's code.

  The NaN check keeps donation too: a step whose grads are not finite skips its update on
  the device and returns the state it was given, which `NonFiniteGradError` carries.
  """
  # Donating argument 0 (the state) lets XLA write the new state into the old one's buffers:
  # one state's memory during the step, and the caller's arrays deleted afterwards
  # (`check_not_donated` catches their reuse).
  placed = {}
  if explicit_axes(mesh):
    # The state where the step placed it (None: unspecified); the metrics (and the NaN
    # flags), replicated, on the caller's mesh, like the views (`mesh.EagerProgram`).
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    placed["out_shardings"] = (None, replicated)
  jitted = jax.jit(step, donate_argnums=0, compiler_options=options, **placed)
  return TrainStep(jitted, mesh, config, nests=not options)


class StepFunction:
  """A jitted function of a state wrapped in host-side checks; `.lower`, `.trace`,
  `.eval_shape` and the rest are the jitted function's own."""

  def __init__(self, jitted):
    self._jitted = jitted

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    return self._jitted.lower(*args, **kwargs)

  def trace(self, *args, **kwargs) -> jax.stages.Traced:
    return self._jitted.trace(*args, **kwargs)

  def __getattr__(self, name):  # eval_shape, _cache_size, clear_cache, ...
    return getattr(self._jitted, name)

  def __repr__(self):
    return f"{type(self).__name__}({self._jitted!r})"


class EvalStep(StepFunction):
  """The jitted eval step (`make_eval_step`), refusing a donated state before the call."""

  def __call__(self, state, batch):
    check_not_donated(state, "eval_step(state, batch)")
    return self._jitted(state, batch)


class TrainStep(StepFunction):
  """The jitted train step plus the checks that need concrete values.

  Calls straight through to the `jax.jit` function (`.lower`, `.trace`, `.eval_shape` and
  the rest are the jitted function's own). Before the call it checks that no array of the
  state was donated to an earlier step and that the state lives on the step's devices;
  after it, with `check_for_nan_in_grad`, that every reduced gradient is finite (else
  `NonFiniteGradError`, carrying the state the step returned: the one it was given).
  """

  def __init__(self, jitted, mesh, config, nests=True):
    super().__init__(jitted)
    self._mesh, self._config = mesh, config
    self._devices = frozenset(mesh.devices.flat)
    self._nests = nests  # no compiler options: it can run inside another jit

  def __call__(self, state, batch):
    if not self._nests and isinstance(getattr(state, "step", None), jax.core.Tracer):
      raise TypeError(
        "the train step is jitted already, with XLA options (compiler_options) that "
        "jax.jit takes only at the top level: call it from Python, not inside jax.jit, "
        "lax.scan or another transformation"
      )
    # The order matters: a donated array must be refused before anything touches it (a
    # compiled program given one crashes the process), and host-set scalars are put on the
    # mesh before the jitted call, which would otherwise get arrays off the step's devices.
    check_not_donated(state, "train_step(state, batch)")
    self._check_devices(state)
    state = place_host_leaves(state, self._mesh)
    heartbeat()  # Progress, for the launcher's hang guard.
    if not self._config.check_for_nan_in_grad:
      return self._jitted(state, batch)
    new_state, metrics = self._jitted(state, batch)
    metrics = dict(metrics)
    finite = metrics.pop(FINITE)
    if isinstance(finite, jax.core.Tracer):
      raise TypeError(
        "check_for_nan_in_grad=True reads the gradients' finiteness on the "
        "host after each step, so the step cannot be called under jax.jit/"
        "vmap/grad; call it from Python, or turn the check off"
      )
    # The flags (and the step counter below) are replicated: each process reads its own
    # copy, with no program and no cross-process work of its own.
    finite = np.asarray(jax.device_get(finite))
    if not finite.all():
      layout = state.layout
      paths = [leaf.path for leaf in layout.leaves if leaf.trainable]
      # `state` was donated; the step returned it unchanged (`guard_step`) as `new_state`
      raise NonFiniteGradError(
        int(jax.device_get(new_state.step)),
        [paths[i] for i in np.flatnonzero(~finite)],
        new_state,
      )
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
        "with init_state (or restore the checkpoint) on this step's mesh"
      )
