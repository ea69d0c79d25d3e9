"""FSDP (`optim_grads_params`, ZeRO-3): params, grads and optimizer state sharded 1/dp.

A *unit* (Megatron-FSDP's unit module, torch FSDP2's `fully_shard` module) is a group of
params gathered by one collective. Its params are laid out like a bucket (`make_layout` with
`units=`: shard-major, per dtype), so that device `d` holds rows `[d r, (d+1) r)` of every
param of the unit, at rest, in three places of the `TrainState`:

* `master`: the optimizer's fp32 copy of each trainable param's rows, `(rows, ...)` sharded
  over "data" on dim 0 (`(layers, rows, ...)` on dim 1 for a stacked param);
* `opt_state`: built on `master`, sharded like it;
* `params`: frozen params' rows in their own dtype, sharded the same way; trainable leaves
  are None; integer leaves stay whole and replicated.

The fused update (`distributed_optimizer`'s, `TrainState.fused`): the layout is one bucket
per (unit, buffer), so where `use_fused` allows it `master` is one flat array per unit
bucket (`{"<buffer>/bucket<i>": (dp * shard_size,)}` sharded over "data") and `opt_state`
the optax state of that tree. A unit's all-gather then reads its flat master shard (cast to
the param dtype, no concatenation first), its reduce-scatter's output is the flat grad
shard (no slicing into leaves), and one `tx.update` runs on the flat tree: a global-norm
clip sums one partial norm per unit bucket instead of one per leaf. Stacked units (a
`(layers, rows, ...)` master gathered one layer per scan iteration) keep the per-leaf
update, and so does every state with one (`use_fused`); frozen params keep their own form
in `params`. Readers see the per-leaf form through `per_leaf_state`.

One step: `fsdp_program.run_loss` traces the loss with whole params and runs it unit by
unit, each unrolled unit (and each scan over a stacked unit, one layer per iteration) one
`custom_vjp`: the forward all-gathers the unit's shard in the param dtype where the unit is
first used (one all-gather per unit and dtype, `collectives.unit_collectives`; with
`FSDPConfig(param_dtype=)` the fp32 shard is cast to it before the collective, and the loss
receives every float param in it: torch FSDP2's `MixedPrecisionPolicy`), keeps what
`jax.vjp` of the unit keeps less what is computed from the params alone; the backward
all-gathers the unit again (`reshard_after_forward`, the default), runs the unit's vjp and
reduce-scatters its grads in the grad dtype (one reduce-scatter; fp32 with
`grad_reduce_in_fp32`) straight into the shard the optimizer updates, before the backward of
the unit before it starts. `FSDPConfig(prefetch=k)` bounds how far ahead a gather may start,
by data dependencies. Frozen params are gathered but get no grad, no collective and no
optimizer state. The user's `jax.checkpoint` decides which activations are saved.

Units (which params) are `units.py`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxdp._src import checks, collectives, fsdp_program, loop
from jaxdp._src.buffer import pad_rows
from jaxdp._src.compiler import GPU_PLATFORMS, compiler_options as base_compiler_options
from jaxdp._src.config import DDPConfig, FSDPConfig
from jaxdp._src.distributed_optimizer import (
  check_exact,
  fused_master,
  grad_blocks,
  per_leaf_state,
  unpad_view,
  use_fused,
)
from jaxdp._src.layout import Frozen, Layout, ParamSpec, make_layout, master_dtype, sharded_shape
from jaxdp._src.mesh import DATA, constrain, data_axes, dp_size, model_specs_of, pspec, view_dims
from jaxdp._src.state import (
  FLAT_SPEC,
  TrainState,
  init_source,
  bucket_names,
  extra_specs,
  is_flat_leaf,
  leaves_of,
  opt_params_of,
  tree_of,
)
from jaxdp._src.units import (
  assign_units,
  chunked_leaves,
  compute_dtype,
  param_specs,
  units_of,
)

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


def layout_for(
  params: PyTree, mesh, config: DDPConfig, fsdp: FSDPConfig, frozen: Frozen = None
) -> Layout:
  """The FSDP layout: one bucket per (unit, buffer) over the trainable params."""
  units, stacked = assign_units(params, fsdp)
  layout = make_layout(
    params,
    dp=mesh.shape[DATA],
    grad_dtype=jnp.float32 if config.grad_reduce_in_fp32 else None,
    frozen=frozen,
    units=units,
    stacked=stacked,
  )
  if not layout.buffers:
    raise ValueError(
      "params have no trainable floating-point leaf (all are frozen or integer): there "
      "is nothing to train; pass float params, or unfreeze some"
    )
  return layout


def _shard_dim(spec: ParamSpec) -> int:
  return 1 if spec.layers else 0


def _pad(x, spec: ParamSpec):
  return jax.vmap(lambda y: pad_rows(y, spec))(x) if spec.layers else pad_rows(x, spec)


def _spec(ndim: int, dim: int | None) -> P:
  """Full-length spec sharding `dim` over "data" (None: replicated)."""
  return P(*[DATA if d == dim else None for d in range(ndim)]) if ndim else P()


# ----------------------------------------------------------------------------- state


def state_specs(state: TrainState) -> TrainState:
  """The PartitionSpec of every leaf of an FSDP state (a tree like `state`)."""
  layout = state.layout
  specs = param_specs(layout)
  params = [
    None if x is None else _spec(x.ndim, _shard_dim(specs[i]) if i in specs else None)
    for i, x in enumerate(leaves_of(state.params))
  ]
  if state.fused:
    flat = {name: (b.shard_size * layout.dp,) for name, _, b in bucket_names(layout)}
    return dataclasses.replace(
      state,
      step=P(),
      params=tree_of(layout, params),
      master={name: FLAT_SPEC for name in flat},
      opt_state=jax.tree_util.tree_map_with_path(
        lambda path, x: FLAT_SPEC if is_flat_leaf(path, x, flat) else _spec(x.ndim, None),
        state.opt_state,
      ),
      **extra_specs(state),
    )
  master = [
    None if m is None else _spec(m.ndim, _shard_dim(specs[i]))
    for i, m in enumerate(leaves_of(state.master))
  ]
  by_shape = {}
  for i, m in enumerate(leaves_of(state.master)):
    if m is not None:
      by_shape.setdefault(tuple(m.shape), _shard_dim(specs[i]))
  return dataclasses.replace(
    state,
    step=P(),
    params=tree_of(layout, params),
    master=tree_of(layout, master),
    opt_state=jax.tree.map(lambda x: _spec(x.ndim, by_shape.get(tuple(x.shape))), state.opt_state),
    **extra_specs(state),
  )


def init_state(
  params: PyTree,
  tx: optax.GradientTransformation,
  mesh,
  config: DDPConfig,
  *,
  frozen: Frozen = None,
  fsdp: FSDPConfig | None = None,
) -> TrainState:
  """`jaxdp.init_state` for `optim_grads_params`: every float param sharded by unit;
  `params` may be a function of no arguments that returns them (`init_source`)."""
  fsdp = fsdp or FSDPConfig()
  source = init_source(params)
  params = source.abstract
  model_specs = model_specs_of(params, mesh)
  if any(any(dims) for dims in model_specs):
    path = jax.tree_util.keystr(
      jax.tree_util.tree_flatten_with_path(params)[0][
        next(i for i, dims in enumerate(model_specs) if any(dims))
      ][0]
    )
    raise NotImplementedError(
      f"params{path} is sharded over a non-data mesh axis (tensor or expert parallel): "
      "optim_grads_params does not keep such shardings yet; use 'optim' (or no_shard), "
      "or place the params replicated"
    )
  layout = layout_for(params, mesh, config, fsdp, frozen)
  check_exact(tx, layout)  # the optimizer sees padded leaves: refuse a tx that would differ
  specs, trainable = param_specs(layout), layout.trainable
  fused = use_fused(tx, layout, config, chunked=bool(chunked_leaves(layout, fsdp)))

  def build(params):
    leaves = leaves_of(params)
    if fused:  # one flat array per unit bucket
      master = fused_master(leaves, layout)
    else:
      master = tree_of(
        layout,
        [
          _pad(x, specs[i]).astype(master_dtype(x.dtype)) if trainable[i] else None
          for i, x in enumerate(leaves)
        ],
      )
    stored = [
      None if trainable[i] else _pad(x, specs[i]) if i in specs else x for i, x in enumerate(leaves)
    ]
    state = TrainState(
      jnp.zeros((), jnp.int32),
      tree_of(layout, stored),
      master,
      None,
      layout,
      config,
      tuple(mesh.shape.items()),
      fused=fused,
    )
    opt_params = master if fused else opt_params_of(layout, state.params, state.master)
    return dataclasses.replace(state, opt_state=tx.init(opt_params))

  # each leaf enters sharded over "data" where dp divides a dim: no device receives or
  # computes a whole leaf
  views = [
    pspec(view_dims(shape, (), mesh.shape[DATA], sharded_shape(layout, i)[1]))
    for i, shape in enumerate(layout.shapes)
  ]
  out_specs = state_specs(jax.eval_shape(build, params))
  return source.run(build, mesh, layout, views, out_specs)


def whole_params(state: TrainState, mesh, sharded: bool = False) -> PyTree:
  """Traced `get_params`: every leaf in its own shape and dtype, fresh, replicated, or with
  `sharded` over "data" on a dim that dp divides (`unpad_view`)."""
  state = per_leaf_state(state, mesh)
  layout = state.layout
  specs = param_specs(layout)

  def whole(i, x, m):
    shape = layout.shapes[i]
    if m is not None or i in specs:  # stored padded and sharded
      x = unpad_view(
        m if m is not None else x, shape, sharded_shape(layout, i)[1], mesh, (), sharded
      )
      return jnp.copy(x.astype(layout.dtypes[i]))
    view = view_dims(shape, (), mesh.shape[DATA]) if sharded else ()
    return constrain(jnp.copy(x.astype(layout.dtypes[i])), mesh, pspec(view))

  return tree_of(
    layout,
    [
      whole(i, x, m)
      for i, (x, m) in enumerate(zip(leaves_of(state.params), leaves_of(state.master)))
    ],
  )


# ----------------------------------------------------------------------------- step


def call_with_units(
  call: Callable,
  layout: Layout,
  stored: list,
  tmaster: dict,
  units: list,
  fsdp: FSDPConfig,
  axes,
  *args,
):
  """Inside the step: `call(params, *args)` with every unit gathered where the traced program
  uses it and released after (`fsdp_program.run_loss`); `call` may return any pytree."""
  values = dict(enumerate(stored))
  values.update(tmaster)
  # the loss receives every float param in `fsdp.param_dtype` (what the gathers return)
  leaf_avals = [
    jax.ShapeDtypeStruct(s, compute_dtype(d, fsdp.param_dtype))
    for s, d in zip(layout.shapes, layout.dtypes)
  ]
  return fsdp_program.run_loss(
    lambda tree, a: call(tree, *a),
    layout.treedef,
    leaf_avals,
    values,
    units,
    args,
    axes,
    reshard=fsdp.reshard_after_forward,
    prefetch=fsdp.prefetch,
  )


def flat_keys(layout: Layout) -> dict[str, int]:
  """A fused state's bucket name -> the key its flat master shard has among the leaves'
  values in `run_loss` (`UnitIO.shards`): -1 - its number, apart from the leaf indices."""
  return {name: -1 - n for n, (name, _, _) in enumerate(bucket_names(layout))}


def unit_values(master, layout: Layout, fused: bool) -> dict:
  """Inside the step: this device's master shards as `call_with_units` takes them: leaf
  index -> rows, or (`fused`) `flat_keys` -> flat shard."""
  if fused:
    keys = flat_keys(layout)
    return {keys[name]: m for name, m in master.items()}
  return {i: m for i, m in enumerate(leaves_of(master)) if m is not None}


def unit_collectives(
  layout: Layout,
  mesh,
  config: DDPConfig,
  fsdp: FSDPConfig | None = None,
  fused: bool = False,
  *,
  chunks: bool = True,
) -> list[fsdp_program.UnitIO]:
  """Inside the step: each unit's gather (forward all-gather, in `fsdp.param_dtype`) and
  scatter (backward reduce-scatter), as `fsdp_program.run_loss` takes them; the leaves
  `fsdp.chunks` names are gathered by row blocks where the loss uses them (`chunks=False`:
  none, for code that gathers units whole outside `run_loss`); `fused`: on the flat master
  shards of a fused state (`collectives.unit_collectives_flat`; a fused state has no
  chunks, see `init_state`)."""
  fsdp = fsdp or FSDPConfig()
  units = units_of(layout, fsdp.param_dtype, config.grad_reduce_in_fp32)
  if fused:
    keys = {b: k for (_, _, b), k in zip(bucket_names(layout), flat_keys(layout).values())}
    out = []
    for u in units:
      grad = tuple(
        (b, dtype, master_dtype(layout.dtypes[b.params[0].index]), keys[b]) for b, dtype in u.grad
      )
      out.append(
        fsdp_program.UnitIO(
          name=u.name,
          trainable=u.trainable,
          frozen=u.frozen,
          stacked=bool(u.layers),
          collectives=collectives.unit_collectives_flat(
            u.gather,
            grad,
            dp=dp_size(mesh),
            axes=data_axes(mesh),
            average=config.average_in_collective,
          ),
          shards=tuple(k for *_, k in grad),
        )
      )
    return out
  chunks = chunked_leaves(layout, fsdp) if chunks else {}
  return [
    fsdp_program.UnitIO(
      name=u.name,
      trainable=u.trainable,
      frozen=u.frozen,
      stacked=bool(u.layers),
      collectives=collectives.unit_collectives(
        u.gather,
        u.grad,
        {i: master_dtype(layout.dtypes[i]) for i in u.trainable},
        dp=dp_size(mesh),
        axes=data_axes(mesh),
        average=config.average_in_collective,
        chunked=[i for i in u.leaves if i in chunks],
      ),
      chunks={i: chunks[i] for i in u.leaves if i in chunks},
    )
    for u in units
  ]


def make_grad_fn(
  loss_fn: LossFn,
  mesh,
  config: DDPConfig,
  *,
  grad_accum_steps: int = 1,
  fsdp: FSDPConfig | None = None,
  has_aux: bool = False,
):
  """`grad_fn(state, batch) -> (grads, loss, grad_norm, aux, model_state)`: what an FSDP step
  hands the optimizer.

  `grads` is a tree like `state.master`: each trainable param's reduced (mean over the
  global batch) gradient, padded like the master and sharded over "data" like it, so every
  device holds 1/dp of it; `loss` is the global mean and `grad_norm` the global norm of
  `grads`, both from one scalar all-reduce; `aux` (None without `has_aux`) and the new
  `model_state` (None when the state holds none) are as `jaxdp.make_train_step` describes.
  Traceable; `make_train_step` calls it inside its jitted step.
  """
  fsdp = fsdp or FSDPConfig()
  axes, dp, k = data_axes(mesh), dp_size(mesh), grad_accum_steps

  def local_grads(master, params, batch, key, model_state, layout: Layout, fused: bool):
    """Per device: this device's rows of every trainable param's grad (a fused state: its
    flat shard of every unit bucket), the loss, the aux and the new model state."""
    key = loop.device_key(key, collectives.data_index(axes))
    stored, trainable = leaves_of(params), layout.trainable
    # Row-block gathers happen inside run_loss only (not in the gathered-once accumulation).
    units = unit_collectives(
      layout, mesh, config, fsdp, fused, chunks=k == 1 or fsdp.reshard_after_backward
    )

    def loss_of(tmaster, mb, j, ms):
      loss, extra = call_with_units(
        lambda tree, mb, key, ms: loop.call_loss(loss_fn, has_aux, tree, mb, key, ms),
        layout,
        stored,
        tmaster,
        units,
        fsdp,
        axes,
        mb,
        loop.micro_key(key, j),
        ms,
      )
      return loss / k, extra

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)
    sync = lambda ms: collectives.sync_model_state(ms, axes)
    tmaster = unit_values(master, layout, fused)
    if k == 1:
      (loss, (aux, model_state)), grads = grad_fn(tmaster, batch, 0, model_state)
      model_state, aux = sync(model_state), loop.mean_micro(None, aux, 1)
    elif not fsdp.reshard_after_backward:  # one gather and one reduce-scatter per step
      micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
      values = dict(enumerate(stored))
      values.update(tmaster)
      full = {**values, **fsdp_program.gather_units(units, values)}

      whole_keys = [i for i, t in enumerate(trainable) if t]

      def micro_loss(ftrain, mb, j, ms):
        leaves = [ftrain.get(i, full[i]) for i in range(len(trainable))]
        loss, extra = loop.call_loss(
          loss_fn, has_aux, tree_of(layout, leaves), mb, loop.micro_key(key, j), ms
        )
        return loss / k, extra

      def body(carry, xs):
        loss_sum, grad_sum, ms = carry
        (loss, (aux, ms)), g = jax.value_and_grad(micro_loss, has_aux=True)(
          {i: full[i] for i in whole_keys}, *xs, ms
        )
        grad_sum = jax.tree.map(lambda a, x: a + x.astype(jnp.float32), grad_sum, g)
        return (loss_sum + loss, grad_sum, sync(ms)), aux

      zero = (
        collectives.make_varying(jnp.zeros((), jnp.float32), axes),
        collectives.make_varying(
          {i: jnp.zeros(full[i].shape, jnp.float32) for i in whole_keys}, axes
        ),
        model_state,
      )
      (loss, whole, model_state), auxs = jax.lax.scan(body, zero, (micro, jnp.arange(k)))
      aux = loop.mean_micro(auxs, None, k)
      grads = fsdp_program.scatter_units(units, whole)
    else:  # every micro-batch gathers and reduce-scatters; the shards add up
      micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)

      def body(carry, xs):
        loss_sum, grad_sum, ms = carry
        (loss, (aux, ms)), grads = grad_fn(tmaster, *xs, ms)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads), sync(ms)), aux

      zero = (
        collectives.make_varying(jnp.zeros((), jnp.float32), axes),
        jax.tree.map(jnp.zeros_like, tmaster),
        model_state,
      )
      (loss, grads, model_state), auxs = jax.lax.scan(body, zero, (micro, jnp.arange(k)))
      aux = loop.mean_micro(auxs, None, k)
    aux = collectives.average_aux(aux, axes)
    # The global mean loss and grad norm in one collective: every device holds a distinct
    # 1/dp of each reduced grad (zero padding) and the replicas hold the same shards, so the
    # norm² of the local shards summed over all devices counts each element `replicas` times.
    replicas = dp // mesh.shape[DATA]
    sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads.values())
    if replicas > 1:
      sq = collectives.make_varying(sq, [a for a in axes if a != DATA])
    loss, sq = collectives.sum_over(jnp.stack([loss, sq]), axes)
    if fused:
      out = {name: grads[key] for name, key in flat_keys(layout).items()}
    else:
      out = tree_of(layout, [grads.get(i) for i in range(len(trainable))])
    return (
      out,
      loss / dp,
      jnp.sqrt(sq / replicas),
      aux,
      model_state,
    )

  def grad_fn(state: TrainState, batch):
    specs = state_specs(state)
    batch_spec = P(axes)
    batch = jax.tree.map(lambda x: constrain(x, mesh, batch_spec), batch)
    return jax.shard_map(
      functools.partial(local_grads, layout=state.layout, fused=state.fused),
      mesh=mesh,
      in_specs=(specs.master, specs.params, batch_spec, specs.rng, specs.model_state),
      out_specs=(specs.master, P(), P(), P(), specs.model_state),
      axis_names=set(axes),
    )(state.master, state.params, batch, loop.step_key(state.rng, state.step), state.model_state)

  return grad_fn


def make_train_step(
  loss_fn: LossFn,
  tx: optax.GradientTransformation,
  mesh,
  config: DDPConfig,
  *,
  grad_accum_steps: int = 1,
  fsdp: FSDPConfig | None = None,
  has_aux: bool = False,
):
  """`jaxdp.make_train_step` for `optim_grads_params`, after its argument checks (see the
  module docstring)."""
  fsdp = fsdp or FSDPConfig()
  k = grad_accum_steps
  grad_fn = make_grad_fn(loss_fn, mesh, config, grad_accum_steps=k, fsdp=fsdp, has_aux=has_aux)

  def step(state: TrainState, batch):
    layout = state.layout
    _check_state(state, mesh, config, fsdp)
    checks.check_batch(batch, dp_size(mesh) * k)
    grads, loss, grad_norm, aux, model_state = grad_fn(state, batch)
    # fused: one update on the flat unit buckets (see the module docstring)
    opt_params = state.master if state.fused else opt_params_of(layout, state.params, state.master)
    updates, opt_state = loop.tx_update(tx, grads, state.opt_state, opt_params, mesh)
    master = optax.apply_updates(opt_params, updates)
    new_state = dataclasses.replace(
      state, step=state.step + 1, master=master, opt_state=opt_state, model_state=model_state
    )
    return checks.finish_step(
      new_state,
      state_specs(new_state),
      mesh,
      config,
      loss,
      grad_norm,
      grad_blocks(grads, layout) if state.fused and config.check_for_nan_in_grad else grads,
      aux if has_aux else None,
    )

  return checks.jit_step(
    step, mesh, config, compiler_options(mesh.devices.flat[0].platform, fsdp.prefetch)
  )


def compiler_options(platform: str, prefetch: int = 1) -> dict[str, Any]:
  """jaxdp's options (buckets stay separate collectives), plus, on GPU, the collective
  pipeliner, which starts a scanned layer's all-gathers one iteration ahead, with
  `FSDPConfig(prefetch=2)` or more (one more layer gathered at the peak; inside a layer the
  per-param gathers already overlap the compute of the params before them)."""
  options = base_compiler_options(platform)
  if platform in GPU_PLATFORMS:
    options.update(
      xla_gpu_enable_pipelined_all_gather=prefetch > 1, xla_gpu_enable_pipelined_reduce_scatter=True
    )
  return options


def _check_state(state, mesh, config: DDPConfig, fsdp: FSDPConfig):
  checks.check_state(state, mesh, config)
  layout = state.layout
  abstract = jax.tree.unflatten(
    layout.treedef, [jax.ShapeDtypeStruct(s, d) for s, d in zip(layout.shapes, layout.dtypes)]
  )
  units, stacked = assign_units(abstract, fsdp)
  if (
    layout.units is None
    or tuple(units[p] for p in layout.paths) != layout.units
    or tuple(bool(n) for n in layout.layers) != tuple(p in stacked for p in layout.paths)
  ):
    raise ValueError(
      f"the state's units were made by another FSDPConfig than this step's {fsdp}; pass "
      "the same fsdp= to init_state and make_train_step"
    )
