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
   (`optim*`: each leaf padded on its shard dim and sharded on it, so global norms and
   masks are exact).
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

from jaxdp._src import checks, collectives, distributed_optimizer, loop
from jaxdp._src.aot import compiler_options
from jaxdp._src.buffer import bucket_ravel, bucket_unravel, pad_dim, shard_unravel, unpad_dim
from jaxdp._src.checks import sharded_shape
from jaxdp._src.collectives import DATA, EXPERT, REPLICA
from jaxdp._src.config import DDPConfig
from jaxdp._src.layout import Frozen, Layout, default_bucket_size, make_layout

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]
ModelSpec = tuple[tuple[str, ...], ...]
"""One leaf's own sharding: per dim, the mesh axes it is split over (() = not split)."""


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["step", "params", "master", "opt_state", "rng",
                                "model_state"],
                   meta_fields=["layout", "config", "mesh_shape", "model_specs"])
@dataclasses.dataclass(frozen=True)
class TrainState:
  """Everything a step reads and writes; a pytree whose static part is the layout.

  Leaves that a field does not hold are None (e.g. `master` of an f32 param under DDP).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
    >>> state = jaxdp.init_state({"w": jnp.ones((12, 4))}, optax.adam(1e-3), mesh, config)
    >>> int(state.step), state.params["w"]  # gathered inside the next step
    (0, None)
    >>> state.master["w"].shape, state.master["w"].sharding.spec  # rows padded to 16
    ((16, 4), P('data', None))
    >>> state.layout.num_buckets
    1
  """

  step: jax.Array
  """Number of optimizer steps taken (int32 scalar)."""
  params: PyTree
  """The model params, replicated over the data axes (over other axes as the caller placed
  them). Under a sharded strategy with `overlap_param_gather` the trainable leaves are
  None: they are gathered from `master` inside the next step."""
  master: PyTree
  """The optimizer's copy of each trainable param ("main params"): sharded strategies
  hold each device's rows of the leaf's shard dim (`Layout.shard_axes`) sharded over
  "data", in fp32 (or wider); DDP holds
  fp32 copies of low-precision params only."""
  opt_state: PyTree
  """The optax state, built on `master`'s shapes and sharded like it."""
  layout: Layout
  config: DDPConfig
  mesh_shape: tuple[tuple[str, int], ...]
  model_specs: tuple[ModelSpec, ...] = ()
  """Per leaf in tree order: the mesh axes the caller sharded each dim of the param over
  (tensor or expert parallel; see `model_specs_of`); () = every leaf replicated."""
  rng: jax.Array | None = None
  """`init_state(..., rng=)`: the raw data (`uint32[2]`) of the key every step's keys are
  derived from (with the step counter and the data shard; see `make_train_step`), replicated;
  None: `loss_fn` gets no key."""
  model_state: PyTree = None
  """`init_state(..., model_state=)`: the model's mutable non-trainable state (BatchNorm
  running statistics), replicated, updated by every step; None: the step carries none."""


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
  """The data-parallel axes present, `DATA` last: the axes the train step runs manual."""
  return _data_axes_in(mesh.axis_names)


def _data_axes_in(axis_names) -> tuple[str, ...]:
  return tuple(a for a in (REPLICA, EXPERT) if a in axis_names) + (DATA,)


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


# ----------------------------------------------------------------------------- placement
#
# jaxdp runs its step manual over the data axes (`_data_axes`) and leaves every other mesh
# axis (e.g. "model") to the compiler. A param keeps the sharding its caller gave it over
# those other axes (Megatron-style tensor parallel weights) and over "expert" (expert
# params): its `ModelSpec`. jaxdp adds "data" on dim 0 where it shards (master params and
# optimizer state of the sharded strategies): after the leaf's manual axes, because a
# bucket holds the slice that one expert-parallel rank sees, and before its automatic ones,
# because inside the step the compiler splits the device's block further.

def model_specs_of(params: PyTree, mesh) -> tuple[ModelSpec, ...]:
  """The caller's own sharding of each param (tensor/expert parallel), read from its placement.

  A leaf placed with a `NamedSharding` on `mesh` keeps its spec; anything else (host arrays,
  single-device arrays) is replicated.

  Raises:
    ValueError: a leaf sharded over a data axis ("data", "replica": jaxdp shards over those
      itself), over "expert" on a dim other than its leading one, or with a non-trivial
      sharding on another mesh.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((4, 2), ("data", "model"))
    >>> w = jax.device_put(jnp.zeros((4, 6)), NamedSharding(mesh, P(None, "model")))
    >>> model_specs_of({"w": w, "b": jnp.zeros(6)}, mesh)
    (((),), ((), ('model',)))
  """
  keyed = jax.tree_util.tree_flatten_with_path(params)[0]
  out = []
  for path, x in keyed:
    name = "params" + jax.tree_util.keystr(path)
    ndim = len(np.shape(x))
    sharding = getattr(x, "sharding", None)
    entries = sharding.spec if isinstance(sharding, NamedSharding) else P()
    dims = tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e)
                 for e in tuple(entries) + (None,) * (ndim - len(entries)))
    if not any(dims):
      out.append(((),) * ndim)
      continue
    other = sharding.mesh
    if (tuple(other.axis_names) != tuple(mesh.axis_names)
        or other.devices.shape != mesh.devices.shape
        or [d.id for d in other.devices.flat] != [d.id for d in mesh.devices.flat]):
      raise ValueError(
          f"{name} is sharded {sharding.spec} on another mesh ({dict(other.shape)}) than the "
          f"train mesh ({dict(mesh.shape)}); place it on the train mesh, e.g. "
          "jax.device_put(x, NamedSharding(mesh, spec))")
    for d, axes in enumerate(dims):
      if REPLICA in axes or DATA in axes:
        raise ValueError(
            f"{name} is sharded {sharding.spec}: over a data axis. jaxdp shards over "
            f"{DATA!r} and {REPLICA!r} itself; place params replicated over them (e.g. "
            "P(None, 'model') for a column-parallel weight)")
      if EXPERT in axes and (d != 0 or axes != (EXPERT,)):
        raise ValueError(
            f"{name} is sharded {sharding.spec}: expert params are sharded over {EXPERT!r} "
            f"on their leading (expert) dim alone; place them with P({EXPERT!r}, ...)")
    out.append(dims)
  return tuple(out)


def _model_spec(state: TrainState, i: int, ndim: int) -> ModelSpec:
  return state.model_specs[i] if state.model_specs else ((),) * ndim


def _pspec(dims: ModelSpec) -> P:
  """Full-length spec (`P(None, None)`, not `P()`): jit's cache key tells the two apart."""
  return P(*[None if not a else a[0] if len(a) == 1 else a for a in dims]) if dims else P()


def _with_data(dims: ModelSpec, manual: tuple[str, ...], axis: int = 0) -> ModelSpec:
  """A leaf's spec with `DATA` added on its shard dim `axis` (after its manual axes, before
  its automatic ones); a scalar becomes one padded dim."""
  dims = dims or ((),)
  on = dims[axis]
  return (*dims[:axis], tuple(a for a in on if a in manual) + (DATA,)
          + tuple(a for a in on if a not in manual), *dims[axis + 1:])


def _manual(dims: ModelSpec, manual: tuple[str, ...]) -> P:
  """The part of a spec over the step's manual axes: a `shard_map` in/out spec."""
  return _pspec(tuple(tuple(a for a in axes if a in manual) for axes in dims))


def _own_axes(dims: ModelSpec, manual: tuple[str, ...]) -> tuple[str, ...]:
  """The manual axes a leaf is itself sharded over (e.g. "expert")."""
  return tuple(a for axes in dims for a in axes if a in manual)


def _experts(model_specs: tuple[ModelSpec, ...]) -> list[bool]:
  return [any(EXPERT in axes for axes in dims) for dims in model_specs]


# ----------------------------------------------------------------------------- layout

def layout_for(params: PyTree, mesh, config: DDPConfig, frozen: Frozen = None,
               model_specs: tuple[ModelSpec, ...] = ()) -> Layout:
  """The layout a train step uses for `params` on `mesh` under `config`.

  `model_specs`: the caller's own sharding of each leaf (`model_specs_of`): expert params
  (sharded over "expert") get buffers of their own, and a leaf sharded over any other axis
  (tensor parallel) is sharded over "data" on its leading dim.
  """
  treedef = jax.tree.structure(params)
  experts = leading = None
  if model_specs:
    experts = jax.tree.unflatten(treedef, _experts(model_specs))
    leading = jax.tree.unflatten(treedef, [any(dims) for dims in model_specs])
  if config.overlap_grad_reduce:
    bucket_size = config.bucket_size or default_bucket_size(_dp(mesh))
  else:
    bucket_size = sys.maxsize  # one bucket per buffer, reduced after backward
  layout = make_layout(params, dp=mesh.shape[DATA], bucket_size=bucket_size,
                       grad_dtype=jnp.float32 if config.grad_reduce_in_fp32 else None,
                       frozen=frozen, experts=experts, leading=leading,
                       expert_parallel=mesh.shape.get(EXPERT, 1))
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

def _leaf_specs(state: TrainState) -> tuple[list[ModelSpec | None], list[ModelSpec | None]]:
  """`(params, master)`: each leaf's full spec as a `ModelSpec` (None where the leaf is)."""
  manual = _data_axes_in(dict(state.mesh_shape))
  sharded = _sharded(state.config)
  params = [None if x is None else _model_spec(state, i, x.ndim)
            for i, x in enumerate(_leaves(state.params))]
  master = [None if m is None else
            _with_data(_model_spec(state, i, len(state.layout.shapes[i])), manual,
                       state.layout.shard_axes[i])
            if sharded else _model_spec(state, i, m.ndim)
            for i, m in enumerate(_leaves(state.master))]
  return params, master


def _opt_state_specs(state: TrainState, master_specs: list[ModelSpec | None]) -> PyTree:
  """Each optax state leaf sharded like the param it belongs to.

  A per-param leaf (Adam's `mu['w']`) has its param's optimizer-side shape and a key path
  ending with the param's path; the longest such path wins. A leaf under a param's path with
  another shape (adafactor's factored moments) is replicated. Failing that, a leaf takes the
  spec that every param of its shape shares; anything else (step counts) is replicated.
  """
  layout = state.layout
  views = {}  # trainable leaf -> (the shape the optimizer sees, its spec)
  for i, (t, x, m) in enumerate(zip(layout.trainable, _leaves(state.params),
                                    _leaves(state.master))):
    if t:
      views[i] = ((m if m is not None else x).shape,
                  master_specs[i] if m is not None else _model_spec(state, i, x.ndim))
  by_shape: dict[tuple[int, ...], set] = {}
  for shape, spec in views.values():
    by_shape.setdefault(tuple(shape), set()).add(spec)

  def spec_of(path, x):
    shape, name = tuple(x.shape), jax.tree_util.keystr(path)
    matches = [i for i, (s, _) in views.items()
               if tuple(s) == shape and name.endswith(layout.paths[i])]
    if matches:
      return _pspec(views[max(matches, key=lambda i: len(layout.paths[i]))][1])
    if any(name.endswith(layout.paths[i]) for i in views):
      # a per-param leaf of another shape (adafactor's factored moments): replicated
      return _pspec(((),) * len(shape))
    specs = by_shape.get(shape, set())
    return _pspec(next(iter(specs)) if len(specs) == 1 else ((),) * len(shape))

  return jax.tree_util.tree_map_with_path(spec_of, state.opt_state)


def _state_specs(state: TrainState) -> TrainState:
  """The PartitionSpec of every leaf of a state (a tree like `state`)."""
  layout = state.layout
  params, master = _leaf_specs(state)
  return dataclasses.replace(
      state,
      step=P(),
      params=_tree(layout, [None if d is None else _pspec(d) for d in params]),
      master=_tree(layout, [None if d is None else _pspec(d) for d in master]),
      opt_state=_opt_state_specs(state, master), **loop.extra_specs(state))


def _padded(x, layout: Layout, i: int):
  """Leaf `i` (whole) as a sharded strategy stores it: zero rows added on its shard dim."""
  shape, axis = sharded_shape(layout, i)
  return pad_dim(x, layout.shapes[i], axis, shape[axis])


def _unpadded(x, layout: Layout, i: int):
  """Inverse of `_padded`."""
  return unpad_dim(x, layout.shapes[i], layout.shard_axes[i])


def _opt_params(layout: Layout, params: PyTree, master: PyTree) -> PyTree:
  """The tree the optax transformation sees: trainable leaves, None for the rest."""
  trainable = layout.trainable
  return _tree(layout, [
      (m if m is not None else p) if t else None
      for t, p, m in zip(trainable, _leaves(params), _leaves(master))])


def init_state(params: PyTree, tx: optax.GradientTransformation, mesh, config: DDPConfig,
               *, frozen: Frozen = None, fsdp=None, rng=None,
               model_state: PyTree = None) -> TrainState:
  """Places params on the mesh and builds the optimizer state for `config`'s strategy.

  The caller's arrays are copied, never donated.

  Args:
    params: the model params (a pytree of arrays).
    tx: any optax `GradientTransformation`. It sees the param tree with frozen and
      non-float leaves replaced by None (masks given as pytrees may keep any value there).
    mesh: a mesh with a "data" axis (and a "replica" axis for
      `num_distributed_optimizer_instances > 1`, an "expert" axis for expert parallelism).
      jaxdp runs its step manual over "replica", "expert" and "data" and leaves every
      other axis (e.g. "model") to the compiler. Params placed with a `NamedSharding` on
      this mesh keep their sharding over the other axes (tensor-parallel weights, e.g.
      `P(None, "model")`), in `params`, master params and optimizer state alike. Params
      sharded `P("expert", ...)` are expert params: dense params are data parallel over
      "expert" too, expert params get buffers of their own reduced over the
      expert-data-parallel group ("replica" and "data") only, and `loss_fn` sees this
      rank's experts (the model exchanges tokens over "expert" itself).
    config: the `DDPConfig`.
    frozen: params to leave untrained: a boolean pytree (True = frozen) or a function
      `(path, leaf) -> bool`. They get no grads, no optimizer state, no collective.
    fsdp: `optim_grads_params` only: its `FSDPConfig` (units); None for the default.
    rng: a key (`jax.random.key(seed)`, raw `PRNGKey` data or an int seed): each step
      derives its keys from it, the step counter and the device's data shard, and
      `loss_fn` gets them as `rng=` (dropout; see `make_train_step`). None: no key.
    model_state: mutable non-trainable model state (BatchNorm running statistics: Linen's
      `variables["batch_stats"]`, `jaxdp.nnx_model_state(model)`), a pytree of arrays kept
      replicated: `loss_fn` gets it as `model_state=` and returns the updated one.

  Returns:
    A `TrainState` for `make_train_step(loss_fn, tx, mesh, config)`.

  Raises:
    ValueError: the mesh has no "data" axis, params have no trainable float leaf,
      `frozen` does not match params, a param is placed over a data axis or on another
      mesh, or (sharded strategies) an expert param's experts per rank do not divide by
      the "data" axis size.
    NotImplementedError: tensor- or expert-parallel params under `optim_grads_params`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> state = jaxdp.init_state({"w": jnp.ones((4, 2))}, optax.sgd(0.1), mesh, jaxdp.DDPConfig())
    >>> int(state.step), state.layout.num_buckets
    (0, 1)
  """
  _check_mesh(mesh, config)
  model_specs = model_specs_of(params, mesh)
  if _fsdp_branch(config, fsdp):
    if any(any(dims) for dims in model_specs):
      path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(params)[0][
          next(i for i, dims in enumerate(model_specs) if any(dims))][0])
      raise NotImplementedError(
          f"params{path} is sharded over a non-data mesh axis (tensor or expert parallel): "
          "optim_grads_params does not keep such shardings yet; use 'optim' (or no_shard), "
          "or place the params replicated")
    from jaxdp._src import fsdp as fsdp_lib  # noqa: PLC0415 - fsdp imports this module
    return loop.with_extras(
        fsdp_lib.init_state(params, tx, mesh, config, frozen=frozen, fsdp=fsdp), mesh, rng,
        model_state)
  layout = layout_for(params, mesh, config, frozen, model_specs)
  sharded, trainable = _sharded(config), layout.trainable
  if sharded:
    _check_expert_rows(layout, mesh)
    # the optimizer sees padded leaves: refuse tx that would be silently different
    distributed_optimizer.check_exact(tx, layout)
  gather_in_step = sharded and config.overlap_param_gather

  def build(params):
    leaves = _leaves(params)
    master = [(_padded(x, layout, i) if sharded else x).astype(_master_dtype(x.dtype))
              if t and _keeps_master(config, x.dtype) else None
              for i, (t, x) in enumerate(zip(trainable, leaves))]
    model = [None if (t and gather_in_step) else x for t, x in zip(trainable, leaves)]
    state = TrainState(jnp.zeros((), jnp.int32), _tree(layout, model), _tree(layout, master),
                       None, layout, config, tuple(mesh.shape.items()), model_specs)
    opt_state = tx.init(_opt_params(layout, state.params, state.master))
    return dataclasses.replace(state, opt_state=opt_state)

  placed = [NamedSharding(mesh, _pspec(dims)) for dims in model_specs]
  params = _tree(layout, [jax.device_put(x, s, may_alias=False)
                          for x, s in zip(jax.tree.leaves(params), placed)])
  specs = _state_specs(jax.eval_shape(build, params))

  def build_placed(params):
    # Placed the way the step places its output state (not by out_shardings, whose specs
    # an Auto mesh would not normalise as the step's do): step 2 reuses step 1's program.
    return jax.tree.map(lambda x, s: _constrain(x, mesh, s), build(params), specs)

  return loop.with_extras(jax.jit(build_placed)(params), mesh, rng, model_state)


def _check_expert_rows(layout: Layout, mesh):
  """Sharded strategies split each rank's experts over "data": they must divide evenly."""
  for buf in layout.buffers:
    for p in buf.params if buf.expert else ():
      if p.rows != p.shape[0]:
        raise ValueError(
            f"params{p.path}: {p.shape[0]} experts per expert-parallel rank do not divide "
            f"over the {mesh.shape[DATA]} devices of the {DATA!r} axis, which the sharded "
            "optimizer splits them over; use a number of experts that is a multiple of "
            f"{mesh.shape[EXPERT] * mesh.shape[DATA]} (expert x data axis sizes), or "
            "data_parallel_sharding_strategy='no_shard'")


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

  def gather(i, m):
    mesh = m.sharding.mesh
    m = jax.device_put(m, NamedSharding(mesh, P()))
    x = _unpadded(m, layout, i).astype(layout.dtypes[i])
    dims = _model_spec(state, i, x.ndim)
    return jax.device_put(x, NamedSharding(mesh, _pspec(dims))) if any(dims) else x

  leaves = [x if x is not None else gather(i, m)
            for i, (x, m) in enumerate(zip(_leaves(state.params), _leaves(state.master)))]
  return _tree(layout, leaves)


# ----------------------------------------------------------------------------- step

def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, mesh,
                    config: DDPConfig, *, grad_accum_steps: int = 1, fsdp=None,
                    has_aux: bool = False):
  """Builds the jitted train step of `config`'s strategy.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar`, the mean loss over the batch it gets.
      What the state carries adds arguments and outputs (`jaxdp._src.loop`): with
      `init_state(..., rng=)` it is called with `rng=` (a typed key: the state's key
      folded with the step counter, the device's data shard and the micro-batch index:
      other dropout masks every step and on every shard, the same ones in a resumed run);
      with `init_state(..., model_state=)` with `model_state=`, and it returns
      `(loss, new_model_state)`. The new model state is averaged over the data axes after
      each micro-batch where it differs across devices (Flax's `pmean(batch_stats)`; a
      model that syncs it itself, such as SyncBatchNorm, is left as it computed it; torch
      DDP broadcasts rank 0's buffers instead, keeping one shard's statistics: the mean
      keeps all of them). Integer leaves take the first shard's value.
    tx: the optax transformation `init_state` was given. Its update runs in the global view
      with the mesh's Explicit axes made automatic, so shape-dependent transformations
      (`optax.contrib.muon`) run on sharded leaves as on an Auto mesh.
    mesh: the mesh `init_state` was given.
    config: the `DDPConfig` `init_state` was given.
    grad_accum_steps: micro-batches per step; gradients are communicated once per step
      (every micro-batch under `optim_grads`, which keeps only its shard).
    fsdp: `optim_grads_params` only: the `FSDPConfig` given to `init_state`.
    has_aux: `loss_fn` returns `(loss, aux)` (`(loss, (aux, new_model_state))` with model
      state); every leaf of `aux` is averaged over the micro-batches and the data axes
      (a per-shard mean becomes the global mean; non-float leaves in float32) and returned
      as `metrics["aux"]`. Per-example outputs belong in `make_eval_step(per_example=True)`.

  Returns:
    `train_step(state, batch) -> (state, metrics)`: a `jax.jit` function that donates
    `state` (`.lower`, `.trace` are the jitted function's), wrapped in host-side checks.
    `batch` is a pytree of global arrays whose leading dim (the same for every leaf,
    divisible by data-parallel size × `grad_accum_steps`) is split over the data axes.
    `metrics` holds the global mean `loss` and the global `grad_norm` (before any
    clipping), and `aux` with `has_aux`. With `config.check_for_nan_in_grad` the state is not donated, each step
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
  _check_mesh(mesh, config)
  if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) \
      or grad_accum_steps < 1:
    raise ValueError(f"grad_accum_steps={grad_accum_steps!r}: must be an integer >= 1")
  if _fsdp_branch(config, fsdp):
    from jaxdp._src import fsdp as fsdp_lib  # noqa: PLC0415
    return fsdp_lib.make_train_step(loss_fn, tx, mesh, config,
                                    grad_accum_steps=grad_accum_steps, fsdp=fsdp,
                                    has_aux=has_aux)
  axes = _data_axes(mesh)
  dp = _dp(mesh)
  strategy = config.data_parallel_sharding_strategy
  sharded = _sharded(config)
  scatter_each_microbatch = strategy in ("optim_grads", "optim_grads_params")
  gather_in_step = sharded and config.overlap_param_gather
  batch_spec = P(axes)

  def reduce_axes(buf) -> tuple[str, ...]:
    """A buffer's data-parallel group: expert buffers skip the axis their params split over."""
    return tuple(a for a in axes if not (buf.expert and a == EXPERT))

  def local_grads(params, master, batch, key, model_state, layout: Layout, own_axes):
    """Per device: the reduced grad of every trainable param, the local mean loss, the aux
    and the new model state (see `loop`).

    `own_axes[i]`: the data axes leaf `i` is itself sharded over ("expert" for experts).
    """
    key = loop.device_key(key, collectives.data_index(axes))
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
    full = [collectives.make_varying(x, [a for a in axes if a not in own_axes[i]]) if t else x
            for i, (t, x) in enumerate(zip(trainable, full))]

    buckets = [(buf, b) for buf in layout.buffers for b in buf.buckets]
    hooks = [collectives.grad_ready_hook(b, grad_dtype=buf.grad_dtype, dp=dp, scatter=sharded,
                                         axes=reduce_axes(buf),
                                         average=config.average_in_collective)
             for buf, b in buckets]
    sinks = [collectives.sink_for(b, buf.grad_dtype, sharded,
                                  [a for a in axes if a not in reduce_axes(buf)])
             for buf, b in buckets]

    def scaled_loss(leaves, mb, j, ms):
      # Each micro-batch's loss is divided by k (Megatron's schedule does the same), so
      # the k accumulated grads sum to the grad of the mean loss over the k× batch.
      loss, extra = loop.call_loss(loss_fn, has_aux, _tree(layout, leaves), mb,
                                   loop.micro_key(key, j), ms)
      return loss / grad_accum_steps, extra

    def hooked_loss(sinks, accs, mb, j, ms):
      leaves = list(full)
      for (_, b), hook, sink, acc in zip(buckets, hooks, sinks, accs):
        out = hook([leaves[p.index] for p in b.params], sink, acc)
        for p, x in zip(b.params, out):
          leaves[p.index] = x
      return scaled_loss(leaves, mb, j, ms)

    def local_accum(mb, j, ms):
      """Local (unreduced) grads of one micro-batch, ravelled into bucket buffers."""
      def loss_of_trainable(tleaves):
        leaves = list(full)
        for p, x in zip(layout.params, tleaves):
          leaves[p.index] = x
        return scaled_loss(leaves, mb, j, ms)
      (loss, extra), g = jax.value_and_grad(loss_of_trainable, has_aux=True)(
          [full[p.index] for p in layout.params])
      g = dict(zip((p.index for p in layout.params), g))
      return loss, extra, [bucket_ravel([g[p.index] for p in b.params], b, layout.dp,
                                        buf.grad_dtype) for buf, b in buckets]

    k = grad_accum_steps
    micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
    zeros = [jnp.zeros_like(s) for s in sinks]
    acc_zero = [jnp.zeros((b.shard_size * layout.dp,), buf.grad_dtype) for buf, b in buckets]
    acc_zero = [collectives.make_varying(a, axes) for a in acc_zero]
    last = jax.tree.map(lambda x: x[-1], micro)
    loss_zero = collectives.make_varying(jnp.zeros((), jnp.float32), axes)  # a scan carry
    sync = lambda ms: collectives.sync_model_state(ms, axes)  # noqa: E731
    # aux of the first k-1 micro-batches (scan outputs), and of the last one
    first_aux = None
    if scatter_each_microbatch:
      def body(carry, xs):
        loss_sum, red_sum, ms = carry
        mb, j = xs
        (loss, (aux, ms)), red = jax.value_and_grad(hooked_loss, has_aux=True)(
            sinks, acc_zero, mb, j, ms)
        return (loss_sum + loss, [a + r for a, r in zip(red_sum, red)], sync(ms)), aux
      init = (loss_zero, zeros, model_state)
      if k > 1:  # last_aux None: first_aux holds every micro-batch's
        (loss, reduced, model_state), first_aux = jax.lax.scan(body, init,
                                                               (micro, jnp.arange(k)))
        last_aux = None
      else:
        (loss, reduced, model_state), last_aux = body(init, (last, 0))
    else:
      loss, accs = loss_zero, acc_zero
      if k > 1:
        def body(carry, xs):
          loss_sum, acc, ms = carry
          mb, j = xs
          l, (aux, ms), g = local_accum(mb, j, ms)
          return (loss_sum + l, [a + x for a, x in zip(acc, g)], sync(ms)), aux
        first = jax.tree.map(lambda x: x[:-1], micro)
        (loss, accs, model_state), first_aux = jax.lax.scan(
            body, (loss, accs, model_state), (first, jnp.arange(k - 1)))
      (l, (last_aux, model_state)), reduced = jax.value_and_grad(hooked_loss, has_aux=True)(
          sinks, accs, last, k - 1, model_state)
      model_state = sync(model_state)
      loss = loss + l
    aux = collectives.mean_over(loop.mean_micro(first_aux, last_aux, k), axes)
    # The metrics: global mean loss and grad norm. The norm² of the reduced buckets (zero
    # padding) rides in the loss's psum, each bucket's divided by the number of devices
    # that hold the same copy of it (those it was psum'd over). DDP with dense buckets
    # only: every device holds the whole reduced buckets already.
    def copies(buf):
      return math.prod(mesh.shape[a] for a in reduce_axes(buf)) // (
          layout.dp if sharded else 1)
    sq = sum(jnp.sum(jnp.square(r.astype(jnp.float32))) / copies(buf)
             for (buf, _), r in zip(buckets, reduced))
    if sharded or any(buf.expert for buf in layout.buffers):
      loss, sq = collectives.sum_over(jnp.stack([loss, sq]), axes)
      loss = loss / dp
    else:
      loss, sq = jax.lax.pmean(loss, axes), sq * dp
    grad_norm = jnp.sqrt(sq)

    grads: list[Any] = [None] * len(trainable)
    for (_, b), red in zip(buckets, reduced):
      parts = shard_unravel(red, b, layout.dp) if sharded else bucket_unravel(red, b, layout.dp)
      for p, g in zip(b.params, parts):
        grads[p.index] = g
    return _tree(layout, grads), loss, grad_norm, aux, model_state

  def step(state: TrainState, batch):
    layout = state.layout
    _check_state(state, mesh, config)
    _check_batch(batch, dp * grad_accum_steps)
    batch = jax.tree.map(lambda x: _constrain(x, mesh, batch_spec), batch)
    # shard_map specs name the manual (data) axes only; the others stay automatic.
    param_dims, master_dims = _leaf_specs(state)
    manual = lambda dims: [None if d is None else _manual(d, axes) for d in dims]
    model_dims = [_model_spec(state, i, len(shape)) for i, shape in enumerate(layout.shapes)]
    grad_specs = [_manual(_with_data(d, axes, layout.shard_axes[i]) if sharded else d, axes)
                  if t else None for i, (t, d) in enumerate(zip(layout.trainable, model_dims))]
    own = tuple(_own_axes(d, axes) for d in model_dims)
    extras = loop.extra_specs(state)
    grads, loss, grad_norm, aux, model_state = jax.shard_map(
        functools.partial(local_grads, layout=layout, own_axes=own), mesh=mesh,
        in_specs=(_tree(layout, manual(param_dims)), _tree(layout, manual(master_dims)),
                  batch_spec, extras["rng"], extras["model_state"]),
        out_specs=(_tree(layout, grad_specs), P(), P(), P(), extras["model_state"]),
        axis_names=set(axes))(state.params, state.master, batch,
                              loop.step_key(state.rng, state.step), state.model_state)

    opt_params = _opt_params(layout, state.params, state.master)
    updates, opt_state = loop.tx_update(tx, grads, state.opt_state, opt_params, mesh)
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
      params = _gather_params(master, layout, mesh, params, state)
    new_state = dataclasses.replace(state, step=state.step + 1, params=_tree(layout, params),
                                    master=_tree(layout, master), opt_state=opt_state,
                                    model_state=model_state)
    return finish_step(new_state, _state_specs(new_state), mesh, config, loss, grad_norm,
                       grads, aux if has_aux else None)

  return jit_step(step, mesh, config, compiler_options(mesh.devices.flat[0].platform))


def finish_step(new_state: TrainState, specs: TrainState, mesh, config: DDPConfig, loss,
                grad_norm, grads, aux=None):
  """The end of every strategy's step: the new state placed as `specs` say (as
  `init_state` placed it), the metrics (`aux` under "aux" when the step has one), and with
  the NaN check on one "finite" flag per grad leaf (read on the host by
  `checks.TrainStep`)."""
  new_state = jax.tree.map(lambda x, s: _constrain(x, mesh, s), new_state, specs)
  metrics = {"loss": loss, "grad_norm": grad_norm}
  if aux is not None:
    metrics["aux"] = aux
  if config.check_for_nan_in_grad:
    return new_state, metrics, checks.finite_leaves(grads)
  return new_state, metrics


def jit_step(step, mesh, config: DDPConfig, options) -> checks.TrainStep:
  """`step` jitted with `options`, the state donated, wrapped in the host-side checks.

  With the NaN check on, the state is not donated: a step that fails the check leaves the
  caller's state valid and unchanged (at the cost of holding two states during the step).
  """
  donate = () if config.check_for_nan_in_grad else 0
  return checks.TrainStep(jax.jit(step, donate_argnums=donate, compiler_options=options),
                          mesh, config)


def _gather_params(master, layout: Layout, mesh, params, state: TrainState):
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
  axes = _data_axes(mesh)
  master_dims = _leaf_specs(state)[1]
  specs = [_manual(d, axes) if m is not None else None for m, d in zip(master, master_dims)]
  out_specs = [_manual(_model_spec(state, i, len(layout.shapes[i])), axes)
               if m is not None else None for i, m in enumerate(master)]
  gathered = jax.shard_map(gather, mesh=mesh, in_specs=(specs,), out_specs=out_specs,
                           axis_names=set(axes))(master)
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
