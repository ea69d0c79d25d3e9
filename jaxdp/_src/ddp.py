"""The train step: forward, backward with bucket reductions, optimizer update.

One step (Megatron's DDP + DistributedOptimizer timeline):

1. Inside `jax.shard_map` over the data axes: params are made varying (each device
   differentiates its own copy), the grad-ready hook of every bucket is applied to that
   bucket's params, and `jax.grad` runs the backward. Each hook reduces its bucket as soon
   as the bucket's grads exist: `psum` for `no_shard`, `psum_scatter` for the sharded
   strategies. With `grad_accum_steps=k`, k-1 micro-batches accumulate local grads and the
   last one carries them into the hooks (Megatron's `no_sync`); `optim_grads` reduces
   every micro-batch and keeps only its shard.
2. Outside, in the global view, the optax transformation updates the optimizer's copy of
   the params: the whole tree replicated (`no_shard`), or each device's 1/dp rows
   (`optim*`: leaves of shape `(rows, ...)` sharded on dim 0, so global norms and masks
   are exact).
3. Sharded strategies gather the updated params per bucket, either at the start of the
   next step's forward (`overlap_param_gather`) or right after the update.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp._src import checks, collectives, distributed_optimizer
from jaxdp._src.aot import compiler_options
from jaxdp._src.buffer import bucket_ravel, bucket_unravel, pad_rows, shard_unravel, unpad_rows
from jaxdp._src.collectives import DATA, REPLICA
from jaxdp._src.config import DDPConfig
from jaxdp._src.layout import Frozen, Layout, default_bucket_size, make_layout

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["step", "params", "master", "opt_state"],
                   meta_fields=["layout", "config", "mesh_shape"])
@dataclasses.dataclass(frozen=True)
class TrainState:
  """Everything a step reads and writes; a pytree whose static part is the layout.

  Leaves that a field does not hold are None (e.g. `master` of an f32 param under DDP).
  """

  step: jax.Array
  """Number of optimizer steps taken (int32 scalar)."""
  params: PyTree
  """The model params, replicated. Under a sharded strategy with `overlap_param_gather`
  the trainable leaves are None: they are gathered from `master` inside the next step."""
  master: PyTree
  """The optimizer's copy of each trainable param ("main params"): sharded strategies
  hold each device's rows `(rows, ...)` sharded over "data", in fp32 (or wider); DDP holds
  fp32 copies of low-precision params only."""
  opt_state: PyTree
  """The optax state, built on `master`'s shapes and sharded like it."""
  layout: Layout
  config: DDPConfig
  mesh_shape: tuple[tuple[str, int], ...]


# ----------------------------------------------------------------------------- helpers

def _leaves(tree) -> list[Any]:
  return jax.tree.flatten(tree, is_leaf=lambda x: x is None)[0]


def _tree(layout: Layout, leaves) -> PyTree:
  return jax.tree.unflatten(layout.treedef, list(leaves))


def _sharded(config: DDPConfig) -> bool:
  return config.data_parallel_sharding_strategy != "no_shard"


def _fsdp_branch(config: DDPConfig, fsdp) -> bool:
  """True for `optim_grads_params` (implemented in fsdp.py); refuses `fsdp=` elsewhere."""
  if config.data_parallel_sharding_strategy == "optim_grads_params":
    return True
  if fsdp is not None:
    raise ValueError(f"fsdp={fsdp} is for data_parallel_sharding_strategy="
                     "'optim_grads_params'; leave it out for "
                     f"{config.data_parallel_sharding_strategy!r}")
  return False


def _data_axes(mesh) -> tuple[str, ...]:
  return (REPLICA, DATA) if REPLICA in mesh.axis_names else (DATA,)


def _dp(mesh) -> int:
  return math.prod(mesh.shape[a] for a in _data_axes(mesh))


def _master_dtype(dtype) -> np.dtype:
  return np.dtype(jnp.promote_types(dtype, jnp.float32))


def _keeps_master(config: DDPConfig, dtype) -> bool:
  return _sharded(config) or _master_dtype(dtype) != np.dtype(dtype)


def _constrain(x, mesh, spec):
  sharding = NamedSharding(mesh, spec)
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


# ----------------------------------------------------------------------------- layout

def layout_for(params: PyTree, mesh, config: DDPConfig, frozen: Frozen = None) -> Layout:
  """The layout a train step uses for `params` on `mesh` under `config`."""
  if config.overlap_grad_reduce:
    bucket_size = config.bucket_size or default_bucket_size(_dp(mesh))
  else:
    bucket_size = sys.maxsize  # one bucket per buffer, reduced after backward
  layout = make_layout(params, dp=mesh.shape[DATA], bucket_size=bucket_size,
                       grad_dtype=jnp.float32 if config.grad_reduce_in_fp32 else None,
                       frozen=frozen)
  if not layout.buffers:
    raise ValueError(
        "params have no trainable floating-point leaf (all are frozen or integer): there "
        "is nothing to train; pass float params, or unfreeze some")
  return layout


def _check_mesh(mesh, config: DDPConfig):
  if DATA not in mesh.axis_names:
    raise ValueError(f"mesh axes {mesh.axis_names} have no {DATA!r} axis: jaxdp shards "
                     f"the batch over it; make the mesh with jax.make_mesh((n,), ({DATA!r},))")
  replicas = mesh.shape.get(REPLICA, 1)
  if _sharded(config) and replicas != config.num_distributed_optimizer_instances:
    raise ValueError(
        f"num_distributed_optimizer_instances={config.num_distributed_optimizer_instances} "
        f"but the mesh has {REPLICA!r} axis size {replicas}: they must agree; use a mesh "
        f"with axes ({REPLICA!r}, {DATA!r}) of shape "
        f"({config.num_distributed_optimizer_instances}, n)")


# ----------------------------------------------------------------------------- state

def _spec(x, sharded: bool) -> P:
  """Full-length spec (`P(None, None)`, not `P()`): jit's cache key tells the two apart."""
  return P(*([DATA] if sharded else [None]), *[None] * (x.ndim - 1)) if x.ndim else P()


def _state_specs(state: TrainState) -> TrainState:
  """The PartitionSpec of every leaf of a state (a tree like `state`)."""
  layout, config = state.layout, state.config
  sharded = _sharded(config)
  padded = {p.padded_shape for p in layout.params}
  by_path = [(p.path, p.padded_shape) for p in layout.params]

  def opt_sharded(path, x) -> bool:
    """A per-param leaf (path ending with the param's) is sharded when it has the param's
    padded shape, else replicated (adafactor's factored moments); any other leaf is sharded
    when it has some param's padded shape."""
    name, shape = jax.tree_util.keystr(path), tuple(x.shape)
    under = [s for p, s in by_path if name.endswith(p)]
    return shape in under if under else shape in padded

  return dataclasses.replace(
      state,
      step=P(),
      params=jax.tree.map(lambda x: _spec(x, False), state.params),
      master=jax.tree.map(lambda x: _spec(x, sharded), state.master),
      opt_state=jax.tree_util.tree_map_with_path(
          lambda path, x: _spec(x, sharded and opt_sharded(path, x)), state.opt_state))


def _opt_params(layout: Layout, params: PyTree, master: PyTree) -> PyTree:
  """The tree the optax transformation sees: trainable leaves, None for the rest."""
  trainable = layout.trainable
  return _tree(layout, [
      (m if m is not None else p) if t else None
      for t, p, m in zip(trainable, _leaves(params), _leaves(master))])


def init_state(params: PyTree, tx: optax.GradientTransformation, mesh, config: DDPConfig,
               *, frozen: Frozen = None, fsdp=None) -> TrainState:
  """Places params on the mesh and builds the optimizer state for `config`'s strategy.

  The caller's arrays are copied, never donated.

  Args:
    params: the model params (a pytree of arrays).
    tx: any optax `GradientTransformation`. It sees the param tree with frozen and
      non-float leaves replaced by None (masks given as pytrees may keep any value there).
    mesh: a mesh with a "data" axis (and a "replica" axis for
      `num_distributed_optimizer_instances > 1`).
    config: the `DDPConfig`.
    frozen: params to leave untrained: a boolean pytree (True = frozen) or a function
      `(path, leaf) -> bool`. They get no grads, no optimizer state, no collective.
    fsdp: `optim_grads_params` only: its `FSDPConfig` (units); None for the default.

  Returns:
    A `TrainState` for `make_train_step(loss_fn, tx, mesh, config)`.

  Raises:
    ValueError: the mesh has no "data" axis, params have no trainable float leaf, or
      `frozen` does not match params.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> state = jaxdp.init_state({"w": jnp.ones((4, 2))}, optax.sgd(0.1), mesh, jaxdp.DDPConfig())
    >>> int(state.step), state.layout.num_buckets
    (0, 1)
  """
  if _fsdp_branch(config, fsdp):
    from jaxdp._src import fsdp as fsdp_lib  # noqa: PLC0415 - fsdp imports this module
    return fsdp_lib.init_state(params, tx, mesh, config, frozen=frozen, fsdp=fsdp)
  _check_mesh(mesh, config)
  layout = layout_for(params, mesh, config, frozen)
  sharded, trainable = _sharded(config), layout.trainable
  if sharded:  # the optimizer sees padded leaves: refuse tx that would be silently different
    distributed_optimizer.check_exact(tx, layout)
  gather_in_step = sharded and config.overlap_param_gather
  spec_of = {p.index: p for p in layout.params}

  def build(params):
    leaves = _leaves(params)
    master = [
        pad_rows(x, spec_of[i]).astype(_master_dtype(x.dtype))
        if t and _keeps_master(config, x.dtype) else None
        for i, (t, x) in enumerate(zip(trainable, leaves))]
    if not sharded:
      master = [unpad_rows(m, spec_of[i]) if m is not None else None
                for i, m in enumerate(master)]
    model = [None if (t and gather_in_step) else x for t, x in zip(trainable, leaves)]
    state = TrainState(jnp.zeros((), jnp.int32), _tree(layout, model), _tree(layout, master),
                       None, layout, config, tuple(mesh.shape.items()))
    opt_state = tx.init(_opt_params(layout, state.params, state.master))
    return dataclasses.replace(state, opt_state=opt_state)

  replicated = NamedSharding(mesh, P())
  params = jax.device_put(params, replicated, may_alias=False)
  abstract = jax.eval_shape(build, params)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), _state_specs(abstract))
  return jax.jit(build, out_shardings=shardings)(params)


def get_params(state: TrainState) -> PyTree:
  """The full model param tree of a state, in the params' own dtypes.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
    >>> state = jaxdp.init_state({"w": jnp.ones((3, 2))}, optax.sgd(0.1), mesh, config)
    >>> jaxdp.get_params(state)["w"].shape
    (3, 2)
  """
  layout = state.layout
  if _fsdp_branch(state.config, None):
    from jaxdp._src import fsdp as fsdp_lib  # noqa: PLC0415
    return fsdp_lib.get_params(state)
  if not (_sharded(state.config) and state.config.overlap_param_gather):
    return state.params
  spec_of = {p.index: p for p in layout.params}

  def gather(i, m):
    m = jax.device_put(m, NamedSharding(m.sharding.mesh, P()))
    return unpad_rows(m, spec_of[i]).astype(layout.dtypes[i])

  leaves = [x if x is not None else gather(i, m)
            for i, (x, m) in enumerate(zip(_leaves(state.params), _leaves(state.master)))]
  return _tree(layout, leaves)


# ----------------------------------------------------------------------------- step

def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, mesh,
                    config: DDPConfig, *, grad_accum_steps: int = 1, fsdp=None):
  """Builds the jitted train step of `config`'s strategy.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar`, the mean loss over the batch it gets.
    tx: the optax transformation `init_state` was given.
    mesh: the mesh `init_state` was given.
    config: the `DDPConfig` `init_state` was given.
    grad_accum_steps: micro-batches per step; gradients are communicated once per step
      (every micro-batch under `optim_grads`, which keeps only its shard).
    fsdp: `optim_grads_params` only: the `FSDPConfig` given to `init_state`.

  Returns:
    `train_step(state, batch) -> (state, metrics)`: a `jax.jit` function that donates
    `state` (`.lower`, `.trace` are the jitted function's), wrapped in host-side checks.
    `batch` is a pytree of global arrays whose leading dim (the same for every leaf,
    divisible by data-parallel size × `grad_accum_steps`) is split over the data axes.
    `metrics` holds the global mean `loss` and the global `grad_norm` (before any
    clipping). With `config.check_for_nan_in_grad` the state is not donated, each step
    waits for its grads to be checked, and a NaN/Inf raises `NonFiniteGradError` naming the
    params and the step, the state passed in left as it was (the jitted function then also
    returns one "finite" flag per trainable leaf).

  Raises:
    ValueError: (when called) a batch whose leading dims differ or do not divide, a state
      built for another mesh or config, or whose params changed after `init_state`.
    NonFiniteGradError: (when called, `check_for_nan_in_grad`) a reduced grad is NaN/Inf.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config, tx = jaxdp.DDPConfig(), optax.sgd(0.1)
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> state = jaxdp.init_state({"w": jnp.zeros((3, 1))}, tx, mesh, config)
    >>> step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
    >>> batch = {"x": jnp.ones((16, 3)), "y": jnp.ones((16, 1))}
    >>> state, metrics = step(state, batch)
    >>> float(metrics["loss"])
    1.0
  """
  if _fsdp_branch(config, fsdp):
    from jaxdp._src import fsdp as fsdp_lib  # noqa: PLC0415
    return fsdp_lib.make_train_step(loss_fn, tx, mesh, config,
                                    grad_accum_steps=grad_accum_steps, fsdp=fsdp)
  _check_mesh(mesh, config)
  if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) \
      or grad_accum_steps < 1:
    raise ValueError(f"grad_accum_steps={grad_accum_steps!r}: must be an integer >= 1")
  axes = _data_axes(mesh)
  dp = _dp(mesh)
  strategy = config.data_parallel_sharding_strategy
  sharded = _sharded(config)
  scatter_each_microbatch = strategy in ("optim_grads", "optim_grads_params")
  gather_in_step = sharded and config.overlap_param_gather
  batch_spec = P(axes)

  def local_grads(params, master, batch, layout: Layout):
    """Per device: the reduced grad of every trainable param and the local mean loss."""
    trainable = layout.trainable
    full = _leaves(params)
    if gather_in_step:
      masters = _leaves(master)
      for buf in layout.buffers:
        for b in buf.buckets:
          local = [masters[p.index].astype(buf.param_dtype) for p in b.params]
          for p, x in zip(b.params, collectives.all_gather_bucket(local, b, layout.dp,
                                                                  to="invarying")):
            full[p.index] = x
    full = [collectives.make_varying(x, axes) if t else x for t, x in zip(trainable, full)]

    buckets = [(buf, b) for buf in layout.buffers for b in buf.buckets]
    hooks = [collectives.grad_ready_hook(b, grad_dtype=buf.grad_dtype, dp=dp, scatter=sharded,
                                         axes=axes, average=config.average_in_collective)
             for buf, b in buckets]
    sinks = [collectives.sink_for(b, buf.grad_dtype, sharded) for buf, b in buckets]

    def hooked_loss(sinks, accs, mb):
      leaves = list(full)
      for (_, b), hook, sink, acc in zip(buckets, hooks, sinks, accs):
        out = hook([leaves[p.index] for p in b.params], sink, acc)
        for p, x in zip(b.params, out):
          leaves[p.index] = x
      # Each micro-batch's loss is divided by k (Megatron's schedule does the same), so
      # the k accumulated grads sum to the grad of the mean loss over the k× batch.
      return loss_fn(_tree(layout, leaves), mb) / grad_accum_steps

    def local_accum(mb):
      """Local (unreduced) grads of one micro-batch, ravelled into bucket buffers."""
      def loss_of_trainable(tleaves):
        leaves = list(full)
        for p, x in zip(layout.params, tleaves):
          leaves[p.index] = x
        return loss_fn(_tree(layout, leaves), mb) / grad_accum_steps
      loss, g = jax.value_and_grad(loss_of_trainable)([full[p.index] for p in layout.params])
      g = dict(zip((p.index for p in layout.params), g))
      return loss, [bucket_ravel([g[p.index] for p in b.params], b, layout.dp, buf.grad_dtype)
                    for buf, b in buckets]

    k = grad_accum_steps
    micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
    zeros = [jnp.zeros_like(s) for s in sinks]
    acc_zero = [jnp.zeros((b.shard_size * layout.dp,), buf.grad_dtype) for buf, b in buckets]
    acc_zero = [collectives.make_varying(a, axes) for a in acc_zero]
    last = jax.tree.map(lambda x: x[-1], micro)
    loss_zero = collectives.make_varying(jnp.zeros((), jnp.float32), axes)  # a scan carry
    if scatter_each_microbatch:
      def body(carry, mb):
        loss_sum, red_sum = carry
        loss, red = jax.value_and_grad(hooked_loss)(sinks, acc_zero, mb)
        return (loss_sum + loss, [a + r for a, r in zip(red_sum, red)]), None
      init = (loss_zero, zeros)
      (loss, reduced), _ = jax.lax.scan(body, init, micro) if k > 1 else \
          (body(init, last)[0], None)
    else:
      loss, accs = loss_zero, acc_zero
      if k > 1:
        def body(carry, mb):
          loss_sum, acc = carry
          l, g = local_accum(mb)
          return (loss_sum + l, [a + x for a, x in zip(acc, g)]), None
        first = jax.tree.map(lambda x: x[:-1], micro)
        (loss, accs), _ = jax.lax.scan(body, (loss, accs), first)
      l, reduced = jax.value_and_grad(hooked_loss)(sinks, accs, last)
      loss = loss + l
    # The metrics: global mean loss and grad norm. Sharded: the norm² of the reduced shards
    # (zero padding; replicas hold equal shards) rides in the loss's psum; DDP: every
    # device holds the whole reduced buckets.
    sq = sum(jnp.sum(jnp.square(r.astype(jnp.float32))) for r in reduced)
    if sharded:
      loss, sq = collectives.sum_over(jnp.stack([loss, sq / (dp // layout.dp)]), axes)
      loss = loss / dp
    else:
      loss = jax.lax.pmean(loss, axes)
    grad_norm = jnp.sqrt(sq)

    grads: list[Any] = [None] * len(trainable)
    for (_, b), red in zip(buckets, reduced):
      parts = shard_unravel(red, b, layout.dp) if sharded else bucket_unravel(red, b, layout.dp)
      for p, g in zip(b.params, parts):
        grads[p.index] = g
    return _tree(layout, grads), loss, grad_norm

  def step(state: TrainState, batch):
    layout = state.layout
    _check_state(state, mesh, config)
    _check_batch(batch, dp * grad_accum_steps)
    specs = _state_specs(state)
    batch = jax.tree.map(lambda x: _constrain(x, mesh, batch_spec), batch)
    grad_spec = P(DATA) if sharded else P()
    grads, loss, grad_norm = jax.shard_map(
        functools.partial(local_grads, layout=layout), mesh=mesh,
        in_specs=(specs.params, specs.master, batch_spec),
        out_specs=(jax.tree.map(lambda _: grad_spec, _opt_params(layout, state.params,
                                                                  state.master)), P(), P()),
        axis_names=set(axes))(state.params, state.master, batch)

    opt_params = _opt_params(layout, state.params, state.master)
    updates, opt_state = tx.update(grads, state.opt_state, opt_params)
    new = _leaves(optax.apply_updates(opt_params, updates))

    params, master = _leaves(state.params), _leaves(state.master)
    for i, t in enumerate(layout.trainable):
      if not t:
        continue
      if master[i] is not None:
        master[i] = new[i]
      if params[i] is not None and not sharded:
        params[i] = new[i].astype(layout.dtypes[i])
    if sharded and not config.overlap_param_gather:
      params = _gather_params(master, layout, mesh, params)
    new_state = dataclasses.replace(state, step=state.step + 1, params=_tree(layout, params),
                                    master=_tree(layout, master), opt_state=opt_state)
    new_state = jax.tree.map(lambda x, s: _constrain(x, mesh, s), new_state,
                             _state_specs(new_state))
    metrics = {"loss": loss, "grad_norm": grad_norm}
    if config.check_for_nan_in_grad:  # read on the host by checks.TrainStep
      return new_state, metrics, checks.finite_leaves(grads)
    return new_state, metrics

  platform = mesh.devices.flat[0].platform
  # With the NaN check on, the state is not donated: a step that fails the check leaves the
  # caller's state valid and unchanged (at the cost of holding two states during the step).
  donate = () if config.check_for_nan_in_grad else 0
  jitted = jax.jit(step, donate_argnums=donate, compiler_options=compiler_options(platform))
  return checks.TrainStep(jitted, mesh, config)


def _gather_params(master, layout: Layout, mesh, params):
  """All-gathers the updated params per bucket right after the update."""
  def gather(master):
    out = [None] * len(layout.shapes)
    for buf in layout.buffers:
      for b in buf.buckets:
        local = [master[p.index].astype(buf.param_dtype) for p in b.params]
        for p, x in zip(b.params, collectives.all_gather_bucket(local, b, layout.dp,
                                                                to="invarying")):
          out[p.index] = x
    return out
  specs = [P(DATA) if m is not None else None for m in master]
  gathered = jax.shard_map(gather, mesh=mesh, in_specs=(specs,),
                           out_specs=[P() if m is not None else None for m in master],
                           axis_names={DATA})(master)
  return [g if g is not None else x for g, x in zip(gathered, params)]


# ----------------------------------------------------------------------------- checks

def _check_state(state, mesh, config: DDPConfig):
  if not isinstance(state, TrainState):
    raise TypeError(f"train_step expects the TrainState from jaxdp.init_state, got "
                    f"{type(state).__name__}")
  if state.config != config:
    raise ValueError(f"the state was built for {state.config}, but this step is for {config}; "
                     "build the state with init_state(params, tx, mesh, config) for the same "
                     "config")
  if state.mesh_shape != tuple(mesh.shape.items()):
    raise ValueError(f"the state was built for a mesh of shape {dict(state.mesh_shape)}, but "
                     f"this step runs on {dict(mesh.shape)}; build the state (or restore the "
                     "checkpoint) with init_state on this mesh")
  checks.check_state_structure(state, _leaves)


def _check_batch(batch, divisor: int):
  keyed = jax.tree_util.tree_flatten_with_path(batch)[0]
  if not keyed:
    raise ValueError("batch has no arrays; pass a pytree of arrays with a leading batch dim")
  dims = {}
  for path, x in keyed:
    name = "batch" + jax.tree_util.keystr(path)
    if not getattr(x, "shape", ()):
      raise ValueError(f"{name}: a scalar has no batch dim to split over the data axis; "
                       "pass arrays whose leading dim is the global batch")
    dims.setdefault(x.shape[0], name)
  if len(dims) > 1:
    raise ValueError("batch leaves have different leading dims: " + ", ".join(
        f"{name} has {d}" for d, name in dims.items()) + "; every leaf must hold the same "
        "number of examples")
  (n, name), = dims.items()
  if n % divisor:
    raise ValueError(f"{name}: batch dim {n} is not divisible by {divisor} (data-parallel "
                     "size × grad_accum_steps); use a global batch that is a multiple of "
                     f"{divisor}")
