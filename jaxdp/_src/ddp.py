"""The bucketed step (`no_shard`, `optim`, `optim_grads`): forward, backward with bucket
reductions, optimizer update.

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
   masks are exact), or, with the fused update (`TrainState.fused`), each bucket (its
   shard) as one flat array (see `distributed_optimizer`): `no_shard` sees its params
   raveled into the buckets and unravels the new ones.
3. Sharded strategies gather the updated params per bucket, either at the start of the
   next step's forward (`overlap_param_gather`) or right after the update.

Scanned layers (`DDPConfig(stacked=...)`, sharded strategies): a stack's leaves are one
bucket, sharded on a dim of a layer, and the loss runs through `fsdp_program.run_loss`, which
turns each scan over them into one `custom_vjp` (`scanned_units`): the forward loop gathers a
layer per iteration, the backward loop reduce-scatters a layer per iteration into the stack
bucket's sink, so neither the gathered stack nor its whole gradient is built at once outside
the loops (GSPMD's ZeRO-1 reduce-scatters in its backward loop the same way).

Step 1 is a sequence of named phases (`start_param_sync`, `register_grad_ready_hooks`,
`forward_backward`, `grad_metrics`, `finish_grad_sync`), composed by `local_grads`.
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
from jax.sharding import PartitionSpec as P

from jaxdp._src import checks, collectives, fsdp_program, loop
from jaxdp._src.buffer import bucket_unravel, shard_unravel
from jaxdp._src.compiler import compiler_options
from jaxdp._src.config import DDPConfig
from jaxdp._src.distributed_optimizer import (
  check_exact,
  check_expert_rows,
  check_model_rows,
  fused_master,
  flat_master_specs,
  gather_master,
  gather_params,
  grad_blocks,
  layer_spec,
  layout_own_specs,
  master_blocks,
  pad_leaf,
  per_leaf_state,
  unpad_view,
  unravel_flat,
  use_fused,
)
from jaxdp._src.layout import (
  Frozen,
  alone_size,
  Layout,
  default_bucket_size,
  float_elements,
  layer_bucket,
  make_layout,
  master_dtype,
  model_shard_dims,
)
from jaxdp._src.mesh import (
  DATA,
  EXPERT,
  ModelSpec,
  constrain,
  data_axes,
  dp_size,
  experts_of,
  manual_spec,
  model_specs_of,
  own_axes,
  pspec,
  run_manual,
  runs_auto,
  view_dims,
  with_data,
)
from jaxdp._src.state import (
  TrainState,
  init_source,
  bucket_names,
  extra_specs,
  leaf_specs,
  leaves_of,
  model_spec,
  opt_params_of,
  state_specs,
  tree_of,
)

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


# ----------------------------------------------------------------------------- helpers


def _sharded(config: DDPConfig) -> bool:
  return config.use_distributed_optimizer


def _keeps_master(config: DDPConfig, dtype) -> bool:
  return _sharded(config) or master_dtype(dtype) != np.dtype(dtype)


# ----------------------------------------------------------------------------- layout


def layout_for(
  params: PyTree,
  mesh,
  config: DDPConfig,
  frozen: Frozen = None,
  model_specs: tuple[ModelSpec, ...] = (),
) -> Layout:
  """The layout a train step uses for `params` on `mesh` under `config`.

  `model_specs`: the caller's own sharding of each leaf (`model_specs_of`): expert params
  (sharded over "expert") get buffers of their own, sharded over "data" on their leading
  dim, and a leaf sharded over any other axis (tensor parallel) is sharded over "data" on a
  dim those axes leave whole where it has one (`model_shard_dims`, as FSDP does), so that
  its gathers and reduce-scatters move each device's own slice (`own_specs`); one that
  `DDPConfig(stacked=)` names, on a dim of a layer, reduced per layer inside the scan.
  """
  treedef = jax.tree.structure(params)
  experts = leading = None
  shard_dims: dict[str, int] = {}
  if model_specs:
    is_expert = experts_of(model_specs)
    experts = jax.tree.unflatten(treedef, is_expert)
    keyed = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [jax.tree_util.keystr(keys) for keys, _ in keyed]
    shapes = [tuple(x.shape) for _, x in keyed]
    tp = [tuple(() if e else axes for axes in dims) for dims, e in zip(model_specs, is_expert)]
    # a leaf split over another axis on its layer axis is not scanned layer by layer
    layered = {
      path
      for path, shape, dims in zip(paths, shapes, tp)
      if config.stack_of(path) is not None and len(shape) >= 2 and not dims[0]
    }
    found = model_shard_dims(paths, shapes, tp, mesh.shape[DATA], layered.__contains__)
    shard_dims = {path: dim + (path in layered) for path, dim in found.items()}
    leading = jax.tree.unflatten(
      treedef,
      [e or (path in shard_dims and path not in layered) for path, e in zip(paths, is_expert)],
    )
  strategy = config.data_parallel_sharding_strategy
  if config.overlap_grad_reduce:
    bucket_size = config.bucket_size or default_bucket_size(
      dp_size(mesh), strategy, float_elements(params)
    )
  else:
    bucket_size = sys.maxsize  # one bucket per buffer, reduced after backward
  layout = make_layout(
    params,
    dp=mesh.shape[DATA],
    bucket_size=bucket_size,
    grad_dtype=config.grad_dtype,
    frozen=frozen,
    experts=experts,
    leading=leading,
    expert_parallel=mesh.shape.get(EXPERT, 1),
    scanned=config.stack_of if config.stacked else None,
    shard_dims=shard_dims,
    alone_over=alone_size(strategy, bucket_size, config.bucket_size),
  )
  if not layout.buffers:
    raise ValueError(
      "params have no trainable floating-point leaf (all are frozen or integer): there "
      "is nothing to train; pass float params, or unfreeze some"
    )
  stacks = {b.stack for buf in layout.buffers for b in buf.buckets}
  for prefix in config.stacked:
    if prefix not in stacks:
      raise ValueError(
        f"DDPConfig(stacked=...) names params{prefix}, but no trainable param of two or "
        f"more dims is under it (params: {', '.join(layout.paths[:4])}"
        f"{' ..' if len(layout.paths) > 4 else ''}); name the subtree whose leaves carry the "
        "layer axis the loss scans over, e.g. stacked=['blocks']"
      )
  return layout


# ----------------------------------------------------------------------------- state


def init_state(
  params: PyTree,
  tx: optax.GradientTransformation,
  mesh,
  config: DDPConfig,
  *,
  frozen: Frozen = None,
) -> TrainState:
  """`jaxdp.init_state` for `no_shard`, `optim` and `optim_grads`; `params` may be a function
  of no arguments that returns them (`init_source`)."""
  source = init_source(params)
  params = source.abstract
  model_specs = model_specs_of(params, mesh)
  layout = layout_for(params, mesh, config, frozen, model_specs)
  sharded, trainable = _sharded(config), layout.trainable
  if sharded:
    check_expert_rows(layout, mesh)
    check_model_rows(layout, model_specs, mesh, [i for i, t in enumerate(trainable) if t])
    # the optimizer sees padded leaves: refuse tx that would be silently different
    check_exact(tx, layout)
  fused = use_fused(tx, layout, config, model_specs)
  gather_in_step = sharded and config.overlap_param_gather

  def build(params):
    leaves = leaves_of(params, layout)
    master = [
      (pad_leaf(x, layout, i) if sharded else x).astype(master_dtype(x.dtype))
      if t and _keeps_master(config, x.dtype)
      else None
      for i, (t, x) in enumerate(zip(trainable, leaves))
    ]
    model = [None if (t and gather_in_step) else x for t, x in zip(trainable, leaves)]
    state = TrainState(
      jnp.zeros((), jnp.int32),
      tree_of(layout, model),
      fused_master(leaves, layout) if fused and sharded else tree_of(layout, master),
      None,
      layout,
      config,
      tuple(mesh.shape.items()),
      model_specs,
      fused=fused,
    )
    return state

  def opt_params(state):  # the tree `tx` sees
    if fused:  # no_shard keeps every param in `params`, and fuses them for the optimizer
      return state.master if sharded else fused_master(leaves_of(state.params, layout), layout)
    return opt_params_of(layout, state.params, state.master)

  # each leaf enters sharded over "data" where dp divides a dim (the params stay whole only
  # where the state keeps them whole): no device receives or computes a whole sharded leaf
  views = [
    pspec(view_dims(shape, dims, mesh.shape[DATA], layout.shard_axes[i]) if sharded else dims)
    for i, (shape, dims) in enumerate(zip(layout.shapes, model_specs))
  ]
  # Placed the way the step places its output state (not by out_shardings, whose specs an
  # Auto mesh would not normalise as the step's do): step 2 reuses step 1's program.
  return source.run(build, opt_params, tx, mesh, layout, views, state_specs)


def whole_params(state: TrainState, mesh, sharded: bool = False) -> PyTree:
  """Traced `get_params`: every leaf in its own shape and dtype, fresh, over its model
  sharding, and with `sharded` over "data" too (`unpad_view`)."""
  state = per_leaf_state(state, mesh)
  layout = state.layout

  def whole(i, x, m):
    dims = model_spec(state, i, len(layout.shapes[i]))
    if x is None:  # gathered inside the next step: read it from `master` here
      x = unpad_view(m, layout.shapes[i], layout.shard_axes[i], mesh, dims, sharded)
      return jnp.copy(x.astype(layout.dtypes[i]))
    view = view_dims(layout.shapes[i], dims, mesh.shape[DATA], layout.shard_axes[i])
    return constrain(jnp.copy(x), mesh, pspec(view if sharded else dims))

  return tree_of(
    layout,
    [
      whole(i, x, m)
      for i, (x, m) in enumerate(
        zip(leaves_of(state.params, layout), leaves_of(state.master, layout))
      )
    ],
  )


# ----------------------------------------------------------------------------- step phases
#
# What one device does inside the step's `shard_map`, in order, each phase a function (the
# names follow Megatron's DDP and DistributedOptimizer):
#
#   start_param_sync        optim* with overlap_param_gather: all-gather the params from
#                           their master rows; every trainable param made varying
#   register_grad_ready_hooks   one hook and one sink per bucket
#   forward_backward        the micro-batches: local accumulation (`no_sync`) or a
#                           reduction per micro-batch (optim_grads), the hooks reducing
#                           each bucket as its grads complete (`start_grad_sync`)
#   finish_grad_sync        the reduced buckets back into per-param grads
#   grad_metrics            the global mean loss and grad norm, in one small collective


@dataclasses.dataclass(frozen=True)
class _Plan:
  """What `make_train_step` fixes for every step: the strategy's choices and the mesh."""

  axes: tuple[str, ...]
  """The data axes the step runs manual over (`DATA` last)."""
  axis_sizes: tuple[tuple[str, int], ...]
  dp: int
  sharded: bool
  """optim, optim_grads: grads reduce-scattered, master rows sharded."""
  scatter_each_microbatch: bool
  """optim_grads: every micro-batch is reduce-scattered (no local accumulation)."""
  gather_in_step: bool
  """optim* with overlap_param_gather: the params are gathered at the start of the step."""
  grad_accum_steps: int
  average: bool
  has_aux: bool = False
  """`loss_fn` returns `(loss, aux)` (see `loop`)."""
  fused: bool = False
  """The state keeps flat buckets (`TrainState.fused`): the grads stay the reduced buckets
  (shards)."""
  in_scan: bool = False
  """The layout has stack buckets (`DDPConfig(stacked=...)`) and nothing is accumulated
  before a micro-batch's reduction (one micro-batch, or `optim_grads`): each scan over their
  params runs as one `custom_vjp` (`scanned_units`) whose backward reduce-scatters every
  layer in its iteration; with `gather_in_step` its forward gathers every layer in its
  iteration too."""
  own: tuple[tuple[int, Any], ...] = ()
  """`(leaf, its caller's spec)` of the tensor-parallel leaves whose gathers and reductions
  move this device's own slice (`own_specs`)."""

  @property
  def own_of(self) -> dict[int, Any]:
    return dict(self.own)

  def reduce_axes(self, buf) -> tuple[str, ...]:
    """A buffer's data-parallel group: expert buffers skip the axis their params split over."""
    return tuple(a for a in self.axes if not (buf.expert and a == EXPERT))


def start_param_sync(params, master, layout: Layout, plan: _Plan, own_axes) -> list[Any]:
  """The params the forward sees (tree order): gathered from the master rows when the step
  gathers them, each trainable one varying over the data axes it is not itself sharded
  over (`own_axes[i]`, e.g. "expert"), so that `jax.grad` leaves the reduction to the hooks."""
  full = leaves_of(params, layout)
  if plan.gather_in_step:
    full = gather_master(master, layout, full, plan.fused, stacks=not plan.in_scan, own=plan.own_of)
  return [
    collectives.make_varying(x, [a for a in plan.axes if a not in own_axes[i]]) if t else x
    for i, (t, x) in enumerate(zip(layout.trainable, full))
  ]


def register_grad_ready_hooks(layout: Layout, plan: _Plan):
  """`(buckets, hooks, sinks)`: per bucket, its grad-ready hook and the zero sink whose
  cotangent receives its reduced grads (a tuple of per-param ones for a bucket that holds a
  tensor-parallel leaf of `plan.own`, reduced per param: `collectives.grad_ready_hook_each`)."""
  buckets = [(buf, b) for buf in layout.buffers for b in buf.buckets]
  own = plan.own_of
  hooks = []
  for buf, b in buckets:
    kwargs = dict(
      dp=plan.dp, scatter=plan.sharded, axes=plan.reduce_axes(buf), average=plan.average
    )
    if collectives.holds_own(b, own):
      hooks.append(
        collectives.grad_ready_hook_each(b, grad_dtype=buf.grad_dtype, own=own, **kwargs)
      )
    else:
      hooks.append(collectives.grad_ready_hook(b, grad_dtype=buf.grad_dtype, **kwargs))
  sinks = [
    collectives.sink_for(
      b,
      buf.grad_dtype,
      plan.sharded,
      [a for a in plan.axes if a not in plan.reduce_axes(buf)],
      own,
    )
    for buf, b in buckets
  ]
  return buckets, hooks, sinks


def forward_backward(
  loss_fn: LossFn,
  full: list[Any],
  batch,
  layout: Layout,
  plan: _Plan,
  buckets,
  hooks,
  sinks,
  key=None,
  model_state=None,
  blocks=None,
):
  """`(local loss, reduced buckets, aux, model state)` of the step's micro-batches.

  Each micro-batch's loss is divided by k (Megatron's schedule does the same), so the k
  accumulated grads sum to the grad of the mean loss over the k× batch. `optim_grads`
  reduces every micro-batch through the hooks and sums the shards; the others accumulate
  the local grads of the first k-1 (`no_sync`) and carry them into the hooks with the last.
  `loss_fn` is called through `loop.call_loss`: micro-batch `j` gets `fold_in(key, j)` and
  the model state the one before it left (synced over the data axes); the aux is the mean
  over the micro-batches (None without `has_aux`).
  """
  k = plan.grad_accum_steps
  sync = lambda ms: collectives.sync_model_state(ms, plan.axes)
  units = scanned_units(layout, plan) if plan.in_scan else []

  def scaled_loss(leaves, mb, j, ms, scanned=None):
    call = lambda tree, a: loop.call_loss(loss_fn, plan.has_aux, tree, *a)
    args = (mb, loop.micro_key(key, j), ms)
    if scanned:
      values = {**dict(enumerate(leaves)), **scanned}
      avals = [jax.ShapeDtypeStruct(s, d) for s, d in zip(layout.shapes, layout.dtypes)]
      # prefetch=0: each loop iteration gathers its own layer. ZeRO keeps every gathered
      # layer for the backward (reshard=False), so a layer gathered ahead would hide nothing
      # XLA does not already overlap within the layer, and add a layer to the peak.
      loss, extra = fsdp_program.run_loss(
        call, layout.treedef, avals, values, units, args, plan.axes, reshard=False, prefetch=0
      )
    else:
      loss, extra = call(tree_of(layout, leaves), args)
    return loss / k, extra

  def hooked_loss(sinks, accs, mb, j, ms):
    """The loss with every bucket's params passed through its hook: its grad w.r.t. the
    sinks is the reduced buckets (plus `accs`). A stack bucket's sink is split into its
    params' blocks, which the scans' backward loops reduce into (`scanned_units`)."""
    leaves, scanned = list(full), {}
    for (_, b), hook, sink, acc in zip(buckets, hooks, sinks, accs):
      if plan.in_scan and b.stack is not None:  # (master block or whole param, sink block)
        sunk = sink if isinstance(sink, tuple) else shard_unravel(sink, b, layout.dp)
        for p, block in zip(b.params, sunk):
          scanned[p.index] = (blocks[p.index] if plan.gather_in_step else leaves[p.index], block)
        continue
      out = hook([leaves[p.index] for p in b.params], sink, acc)
      for p, x in zip(b.params, out):
        leaves[p.index] = x
    return scaled_loss(leaves, mb, j, ms, scanned)

  def local_accum(mb, j, ms):
    """Local (unreduced) grads of one micro-batch, ravelled into bucket buffers."""

    def loss_of_trainable(tleaves):
      leaves = list(full)
      for p, x in zip(layout.params, tleaves):
        leaves[p.index] = x
      return scaled_loss(leaves, mb, j, ms)

    (loss, extra), g = jax.value_and_grad(loss_of_trainable, has_aux=True)(
      [full[p.index] for p in layout.params]
    )
    g = dict(zip((p.index for p in layout.params), g))
    return (
      loss,
      extra,
      [
        collectives.ravel_local([g[p.index] for p in b.params], b, buf.grad_dtype, plan.own_of)
        for buf, b in buckets
      ],
    )

  micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
  zeros = jax.tree.map(jnp.zeros_like, sinks)
  acc_zero = [collectives.acc_for(b, buf.grad_dtype, plan.own_of) for buf, b in buckets]
  acc_zero = collectives.make_varying(acc_zero, plan.axes)
  last = jax.tree.map(lambda x: x[-1], micro)
  loss_zero = collectives.make_varying(jnp.zeros((), jnp.float32), plan.axes)  # a scan carry
  if plan.scatter_each_microbatch:

    def body(carry, xs):
      loss_sum, red_sum, ms = carry
      mb, j = xs
      (loss, (aux, ms)), red = jax.value_and_grad(hooked_loss, has_aux=True)(
        sinks, acc_zero, mb, j, ms
      )
      return (loss_sum + loss, jax.tree.map(jnp.add, red_sum, red), sync(ms)), aux

    init = (loss_zero, zeros, model_state)
    if k > 1:  # the aux of every micro-batch, stacked
      (loss, reduced, model_state), auxs = jax.lax.scan(body, init, (micro, jnp.arange(k)))
      return loss, reduced, loop.mean_micro(auxs, None, k), model_state
    (loss, reduced, model_state), aux = body(init, (last, 0))
    return loss, reduced, loop.mean_micro(None, aux, 1), model_state
  loss, accs, first_aux = loss_zero, acc_zero, None
  if k > 1:

    def body(carry, xs):
      loss_sum, acc, ms = carry
      mb, j = xs
      mb_loss, (aux, ms), g = local_accum(mb, j, ms)
      return (loss_sum + mb_loss, jax.tree.map(jnp.add, acc, g), sync(ms)), aux

    first = jax.tree.map(lambda x: x[:-1], micro)
    (loss, accs, model_state), first_aux = jax.lax.scan(
      body, (loss, accs, model_state), (first, jnp.arange(k - 1))
    )
  (mb_loss, (aux, model_state)), reduced = jax.value_and_grad(hooked_loss, has_aux=True)(
    sinks, accs, last, k - 1, model_state
  )
  return loss + mb_loss, reduced, loop.mean_micro(first_aux, aux, k), sync(model_state)


def scanned_units(layout: Layout, plan: _Plan) -> list[fsdp_program.UnitIO]:
  """One stacked `fsdp_program.UnitIO` per stack's bucket (`Bucket.stack`), for `run_loss`
  to run each scan over the stack as one `custom_vjp` whose loops gather and reduce-scatter
  one layer per iteration: the ZeRO-1 form of FSDP's scanned unit, which keeps its forward's
  layers for the backward (`FSDPConfig(reshard_after_forward=False)`).

  A param's value (`run_loss`'s `values[i]`) is a pair: this device's master block, whose
  layer the forward loop all-gathers in its iteration (`gather_in_step`; one all-gather per
  param), or the whole param, whose layer it reads; and the sink block, to which the
  backward hands the layer's reduced gradient (one reduce-scatter per layer for the whole
  bucket; the sink's cotangent, the layers stacked, is this device's block of the reduced
  grad). The first gets no cotangent.
  """
  units = []
  other = [a for a in plan.axes if a != DATA]
  own = {i: layer_spec(spec) for i, spec in plan.own}  # a layer's, as the loops see it
  for buf in layout.buffers:
    for b in buf.buckets:
      if b.stack is None:
        continue
      layer = layer_bucket(b, layout.dp)

      def gather(t, f, layer=layer, dtype=buf.param_dtype, casts=None, apart=()):
        if not plan.gather_in_step:
          return {p.index: t[p.index][0] for p in layer.params}
        casts = casts or {}
        return {
          p.index: collectives.make_varying(
            collectives.all_gather_rows(
              t[p.index][0], p, casts.get(p.index, dtype), own=own.get(p.index)
            ),
            other,
          )
          for p in layer.params
        }

      def scatter(cts, b=b, buf=buf, apart=()):
        blocks = collectives.reduce_scatter_layer(
          cts,
          b,
          buf.grad_dtype,
          own,
          dp=plan.dp,
          axes=plan.reduce_axes(buf),
          average=plan.average,
        )
        return {p.index: (None, g) for p, g in zip(b.params, blocks)}

      trainable = tuple(sorted(p.index for p in b.params))
      units.append(
        fsdp_program.UnitIO(
          name=b.stack,
          trainable=trainable,
          frozen=(),
          stacked=True,
          collectives=collectives.UnitCollectives(
            gather=gather, scatter=scatter, gather_each=gather
          ),
        )
      )
  return units


def finish_grad_sync(reduced, layout: Layout, plan: _Plan, buckets) -> PyTree:
  """The reduced buckets as a grad tree: whole grads (`no_shard`), or this device's rows of
  each (the sharded strategies); None for leaves that are not trained. A fused state's
  grads are the reduced shards themselves, `{bucket name: shard}`."""
  if plan.fused:
    return {name: red for (name, _, _), red in zip(bucket_names(layout), reduced)}
  grads: list[Any] = [None] * len(layout.trainable)
  for (_, b), red in zip(buckets, reduced):
    if isinstance(red, tuple):  # reduced per param (`grad_ready_hook_each`)
      parts = red
    elif plan.sharded:
      parts = shard_unravel(red, b, layout.dp)
    else:
      parts = bucket_unravel(red, b, layout.dp)
    for p, g in zip(b.params, parts):
      grads[p.index] = g
  return tree_of(layout, grads)


def grad_metrics(loss, reduced, layout: Layout, plan: _Plan, buckets):
  """`(loss, grad_norm)`: the global mean loss and the global norm of the reduced grads.

  The norm² of the reduced buckets (zero padding) rides in the loss's psum, each bucket's
  divided by the number of devices that hold the same copy of it (those it was psum'd
  over). DDP with dense buckets only: every device holds the whole reduced buckets already.
  """
  sizes = dict(plan.axis_sizes)

  def copies(buf):
    return math.prod(sizes[a] for a in plan.reduce_axes(buf)) // (layout.dp if plan.sharded else 1)

  sq = sum(
    jnp.sum(jnp.square(x.astype(jnp.float32))) / copies(buf)
    for (buf, _), r in zip(buckets, reduced)
    for x in jax.tree.leaves(r)
  )
  if plan.sharded or any(buf.expert for buf in layout.buffers):
    loss, sq = collectives.sum_over(jnp.stack([loss, sq]), plan.axes)
    loss = loss / plan.dp
  else:
    loss, sq = collectives.mean_over(loss, plan.axes), sq * plan.dp
  return loss, jnp.sqrt(sq)


def local_grads(
  loss_fn: LossFn, plan: _Plan, params, master, batch, key, model_state, layout: Layout, own_axes
):
  """Per device, inside the step's `shard_map`: the reduced grad of every trainable param
  (`finish_grad_sync`), the global mean loss and the global grad norm, the aux averaged
  over the data axes and the new model state (see `loop`).

  `key`: the step's key data (None without one), folded here with this device's shard.
  `own_axes[i]`: the data axes leaf `i` is itself sharded over ("expert" for experts).
  """
  key = loop.device_key(key, collectives.data_index(plan.axes))
  full = start_param_sync(params, master, layout, plan, own_axes)
  buckets, hooks, sinks = register_grad_ready_hooks(layout, plan)
  blocks = master_blocks(master, layout, plan.fused) if plan.in_scan and plan.gather_in_step else {}
  loss, reduced, aux, model_state = forward_backward(
    loss_fn, full, batch, layout, plan, buckets, hooks, sinks, key, model_state, blocks
  )
  loss, grad_norm = grad_metrics(loss, reduced, layout, plan, buckets)
  return (
    finish_grad_sync(reduced, layout, plan, buckets),
    loss,
    grad_norm,
    collectives.average_aux(aux, plan.axes),
    model_state,
  )


# ----------------------------------------------------------------------------- step


def _update_leaves(tx, grads, state: TrainState, mesh, sharded: bool):
  """The per-leaf update: `(params, master)` leaves (tree order) and the new optax state."""
  layout = state.layout
  opt_params = opt_params_of(layout, state.params, state.master)
  updates, opt_state = loop.tx_update(tx, grads, state.opt_state, opt_params, mesh)
  new = leaves_of(optax.apply_updates(opt_params, updates), layout)
  params, master = leaves_of(state.params, layout), leaves_of(state.master, layout)
  for i, t in enumerate(layout.trainable):
    if not t:
      continue
    if master[i] is not None:
      master[i] = new[i]
    if params[i] is not None and not sharded:
      params[i] = new[i].astype(layout.dtypes[i])
  if sharded and not state.config.overlap_param_gather:
    params = gather_params(master, layout, mesh, params, state)
  return params, master, opt_state


def make_train_step(
  loss_fn: LossFn,
  tx: optax.GradientTransformation,
  mesh,
  config: DDPConfig,
  *,
  grad_accum_steps: int = 1,
  has_aux: bool = False,
) -> checks.TrainStep:
  """`jaxdp.make_train_step` for `no_shard`, `optim` and `optim_grads`, after its argument
  checks (see the module docstring)."""
  axes = data_axes(mesh)
  dp = dp_size(mesh)
  sharded = _sharded(config)
  plan = _Plan(
    axes=axes,
    axis_sizes=tuple(mesh.shape.items()),
    dp=dp,
    sharded=sharded,
    scatter_each_microbatch=config.shards_grads,
    gather_in_step=sharded and config.overlap_param_gather,
    grad_accum_steps=grad_accum_steps,
    average=config.average_in_collective,
    has_aux=has_aux,
  )
  batch_spec = P(axes)

  def step(state: TrainState, batch):
    layout = state.layout
    in_scan = (grad_accum_steps == 1 or plan.scatter_each_microbatch) and any(
      b.stack is not None for buf in layout.buffers for b in buf.buckets
    )
    own = layout_own_specs(layout, state.model_specs, mesh)
    plan_ = dataclasses.replace(plan, fused=state.fused, in_scan=in_scan, own=tuple(own.items()))
    checks.check_state(state, mesh, config)
    checks.check_batch(batch, dp * grad_accum_steps)
    batch = jax.tree.map(lambda x: constrain(x, mesh, batch_spec), batch)
    # shard_map specs name the manual (data) axes only; the others stay automatic.
    param_dims, master_dims = leaf_specs(state)
    manual = lambda dims: [None if d is None else manual_spec(d, axes) for d in dims]
    model_dims = [model_spec(state, i, len(shape)) for i, shape in enumerate(layout.shapes)]
    grad_dims = [
      (with_data(d, axes, layout.shard_axes[i]) if sharded else d) if t else None
      for i, (t, d) in enumerate(zip(layout.trainable, model_dims))
    ]
    own = tuple(own_axes(d, axes) for d in model_dims)
    extras = extra_specs(state)
    master_specs, grad_specs = (
      tree_of(layout, manual(master_dims)),
      tree_of(layout, manual(grad_dims)),
    )
    placed = tree_of(layout, [None if d is None else pspec(d) for d in grad_dims])
    if state.fused and sharded:
      master_specs = grad_specs = placed = flat_master_specs(layout, axes)
    elif state.fused:
      grad_specs = placed = {name: P() for name, _, _ in bucket_names(layout)}
    out_specs = (grad_specs, P(), P(), P(), extras["model_state"])
    grads, loss, grad_norm, aux, model_state = run_manual(
      functools.partial(local_grads, loss_fn, plan_, layout=layout, own_axes=own),
      mesh,
      (
        tree_of(layout, manual(param_dims)),
        master_specs,
        batch_spec,
        extras["rng"],
        extras["model_state"],
      ),
      out_specs,
      (placed, *out_specs[1:]) if runs_auto(mesh, state.model_specs) else None,
    )(state.params, state.master, batch, loop.step_key(state.rng, state.step), state.model_state)

    if state.fused:  # one update per bucket (see `distributed_optimizer`)
      params = leaves_of(state.params, layout)
      flat = state.master if sharded else fused_master(params, layout)
      updates, opt_state = loop.tx_update(tx, grads, state.opt_state, flat, mesh)
      if sharded:
        master = optax.apply_updates(flat, updates)
        if not config.overlap_param_gather:
          params = gather_params(master, layout, mesh, params, state)
      else:  # DDP keeps the params themselves (no master): each leaf + its updates' slice
        master = state.master
        updates = unravel_flat(updates, layout)
        params = [x if u is None else optax.apply_updates(x, u) for x, u in zip(params, updates)]
      checked = grad_blocks(grads, layout) if config.check_for_nan_in_grad else None
    else:
      params, master, opt_state = _update_leaves(tx, grads, state, mesh, sharded)
      master, checked = tree_of(layout, master), grads
    new_state = dataclasses.replace(
      state,
      step=state.step + 1,
      params=tree_of(layout, params),
      master=master,
      opt_state=opt_state,
      model_state=model_state,
    )
    return checks.finish_step(
      new_state,
      state_specs(new_state),
      mesh,
      config,
      loss,
      grad_norm,
      checked,
      aux if has_aux else None,
    )

  return checks.jit_step(step, mesh, config, compiler_options(mesh.devices.flat[0].platform))
