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

from jaxdp._src import checks, collectives, loop
from jaxdp._src.buffer import bucket_ravel, bucket_unravel, shard_unravel
from jaxdp._src.compiler import compiler_options
from jaxdp._src.config import DDPConfig
from jaxdp._src.distributed_optimizer import (check_exact, check_expert_rows, gather_params,
                                               pad_leaf, unpad_leaf)
from jaxdp._src.layout import Frozen, Layout, default_bucket_size, make_layout, master_dtype
from jaxdp._src.mesh import (DATA, EXPERT, ModelSpec, constrain, data_axes, dp_size, experts_of,
                             manual_spec, model_specs_of, own_axes, pspec, with_data)
from jaxdp._src.state import (TrainState, extra_specs, leaf_specs, leaves_of, model_spec,
                              opt_params_of, state_specs, tree_of)

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


# ----------------------------------------------------------------------------- helpers

def _sharded(config: DDPConfig) -> bool:
  return config.data_parallel_sharding_strategy != "no_shard"


def _keeps_master(config: DDPConfig, dtype) -> bool:
  return _sharded(config) or master_dtype(dtype) != np.dtype(dtype)


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
    experts = jax.tree.unflatten(treedef, experts_of(model_specs))
    leading = jax.tree.unflatten(treedef, [any(dims) for dims in model_specs])
  if config.overlap_grad_reduce:
    bucket_size = config.bucket_size or default_bucket_size(dp_size(mesh))
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


# ----------------------------------------------------------------------------- state

def init_state(params: PyTree, tx: optax.GradientTransformation, mesh, config: DDPConfig,
               *, frozen: Frozen = None) -> TrainState:
  """`jaxdp.init_state` for `no_shard`, `optim` and `optim_grads`."""
  checks.check_mesh(mesh, config)
  model_specs = model_specs_of(params, mesh)
  layout = layout_for(params, mesh, config, frozen, model_specs)
  sharded, trainable = _sharded(config), layout.trainable
  if sharded:
    check_expert_rows(layout, mesh)
    # the optimizer sees padded leaves: refuse tx that would be silently different
    check_exact(tx, layout)
  gather_in_step = sharded and config.overlap_param_gather

  def build(params):
    leaves = leaves_of(params)
    master = [(pad_leaf(x, layout, i) if sharded else x).astype(master_dtype(x.dtype))
              if t and _keeps_master(config, x.dtype) else None
              for i, (t, x) in enumerate(zip(trainable, leaves))]
    model = [None if (t and gather_in_step) else x for t, x in zip(trainable, leaves)]
    state = TrainState(jnp.zeros((), jnp.int32), tree_of(layout, model), tree_of(layout, master),
                       None, layout, config, tuple(mesh.shape.items()), model_specs)
    opt_state = tx.init(opt_params_of(layout, state.params, state.master))
    return dataclasses.replace(state, opt_state=opt_state)

  placed = [NamedSharding(mesh, pspec(dims)) for dims in model_specs]
  params = tree_of(layout, [jax.device_put(x, s, may_alias=False)
                          for x, s in zip(jax.tree.leaves(params), placed)])
  specs = state_specs(jax.eval_shape(build, params))

  def build_placed(params):
    # Placed the way the step places its output state (not by out_shardings, whose specs
    # an Auto mesh would not normalise as the step's do): step 2 reuses step 1's program.
    return jax.tree.map(lambda x, s: constrain(x, mesh, s), build(params), specs)

  return jax.jit(build_placed)(params)


def get_params(state: TrainState) -> PyTree:
  """`jaxdp.get_params` for `no_shard`, `optim` and `optim_grads`."""
  layout = state.layout
  if not (_sharded(state.config) and state.config.overlap_param_gather):
    return state.params

  def gather(i, m):
    mesh = m.sharding.mesh
    m = jax.device_put(m, NamedSharding(mesh, P()))
    x = unpad_leaf(m, layout, i).astype(layout.dtypes[i])
    dims = model_spec(state, i, x.ndim)
    return jax.device_put(x, NamedSharding(mesh, pspec(dims))) if any(dims) else x

  leaves = [x if x is not None else gather(i, m)
            for i, (x, m) in enumerate(zip(leaves_of(state.params), leaves_of(state.master)))]
  return tree_of(layout, leaves)


# ----------------------------------------------------------------------------- step

def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, mesh,
                    config: DDPConfig, *, grad_accum_steps: int = 1,
                    has_aux: bool = False) -> checks.TrainStep:
  """`jaxdp.make_train_step` for `no_shard`, `optim` and `optim_grads`, after its argument
  checks (see the module docstring)."""
  axes = data_axes(mesh)
  dp = dp_size(mesh)
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
    full = leaves_of(params)
    if gather_in_step:
      full = collectives.all_gather_params(leaves_of(master), layout, full)
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
      loss, extra = loop.call_loss(loss_fn, has_aux, tree_of(layout, leaves), mb,
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
    # The aux of the micro-batches: of the first k-1 (scan outputs) and of the last one.
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
    aux = collectives.average_aux(loop.mean_micro(first_aux, last_aux, k), axes)
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
      loss, sq = collectives.mean_over(loss, axes), sq * dp
    grad_norm = jnp.sqrt(sq)

    grads: list[Any] = [None] * len(trainable)
    for (_, b), red in zip(buckets, reduced):
      parts = shard_unravel(red, b, layout.dp) if sharded else bucket_unravel(red, b, layout.dp)
      for p, g in zip(b.params, parts):
        grads[p.index] = g
    return tree_of(layout, grads), loss, grad_norm, aux, model_state

  def step(state: TrainState, batch):
    layout = state.layout
    checks.check_state(state, mesh, config)
    checks.check_batch(batch, dp * grad_accum_steps)
    batch = jax.tree.map(lambda x: constrain(x, mesh, batch_spec), batch)
    # shard_map specs name the manual (data) axes only; the others stay automatic.
    param_dims, master_dims = leaf_specs(state)
    manual = lambda dims: [None if d is None else manual_spec(d, axes) for d in dims]
    model_dims = [model_spec(state, i, len(shape)) for i, shape in enumerate(layout.shapes)]
    grad_specs = [manual_spec(with_data(d, axes, layout.shard_axes[i]) if sharded else d, axes)
                  if t else None for i, (t, d) in enumerate(zip(layout.trainable, model_dims))]
    own = tuple(own_axes(d, axes) for d in model_dims)
    extras = extra_specs(state)
    grads, loss, grad_norm, aux, model_state = jax.shard_map(
        functools.partial(local_grads, layout=layout, own_axes=own), mesh=mesh,
        in_specs=(tree_of(layout, manual(param_dims)), tree_of(layout, manual(master_dims)),
                  batch_spec, extras["rng"], extras["model_state"]),
        out_specs=(tree_of(layout, grad_specs), P(), P(), P(), extras["model_state"]),
        axis_names=set(axes))(state.params, state.master, batch,
                              loop.step_key(state.rng, state.step), state.model_state)

    opt_params = opt_params_of(layout, state.params, state.master)
    updates, opt_state = loop.tx_update(tx, grads, state.opt_state, opt_params, mesh)
    new = leaves_of(optax.apply_updates(opt_params, updates))

    params, master = leaves_of(state.params), leaves_of(state.master)
    for i, t in enumerate(layout.trainable):
      if not t:
        continue
      if master[i] is not None:
        master[i] = new[i]
      if params[i] is not None and not sharded:
        params[i] = new[i].astype(layout.dtypes[i])
    if sharded and not config.overlap_param_gather:
      params = gather_params(master, layout, mesh, params, state)
    new_state = dataclasses.replace(state, step=state.step + 1, params=tree_of(layout, params),
                                    master=tree_of(layout, master), opt_state=opt_state,
                                    model_state=model_state)
    return checks.finish_step(new_state, state_specs(new_state), mesh, config, loss, grad_norm,
                              grads, aux if has_aux else None)

  return checks.jit_step(step, mesh, config, compiler_options(mesh.devices.flat[0].platform))


