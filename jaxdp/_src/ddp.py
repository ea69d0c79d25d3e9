"""The bucketed step (`no_shard`, `optim`, `optim_grads`): forward, backward with bucket
reductions, optimizer update.

One step (Megatron's DDP + DistributedOptimizer timeline):

1. Inside `jax.shard_map` over the data axes: params are made varying (each device
   differentiates its own copy), the grad-ready hook of every bucket is applied to that
   bucket's params, and `jax.grad` runs the backward. Each hook reduces its bucket as soon
   as the bucket's grads exist: `psum` for `no_shard`, `psum_scatter` for the sharded
   strategies. With `grad_accum_steps=k`, k-1 micro-batches accumulate local grads and the
   last one carries them into the hooks (Megatron's `no_sync`); `optim_grads` reduces
   every micro-batch and keeps only its shard (on a mesh with "replica", within the other
   data axes, the summed shards all-reduced across "replica" once per step).
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

from jaxdp._src import checks, collectives, fsdp_program, fsdp_unit, loop
from jaxdp._src import step as step_lib
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
from jaxdp._src.offload import update_offloaded
from jaxdp._src.mesh import (
  DATA,
  EXPERT,
  REPLICA,
  ModelSpec,
  constrain,
  data_axes,
  dp_size,
  experts_of,
  manual_spec,
  model_specs_of,
  own_axes,
  pspec,
  runs_auto,
  view_dims,
  with_data,
)
from jaxdp._src.state import (
  TrainState,
  check_offload,
  init_source,
  bucket_names,
  extra_specs,
  leaf_specs,
  leaves_of,
  model_spec,
  opt_params_of,
  state_specs,
  to_device,
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
        f"more dims is under it (params: {', '.join(leaf.path for leaf in layout.leaves[:4])}"
        f"{' ..' if len(layout.leaves) > 4 else ''}); name the subtree whose leaves carry the "
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
  sharded = _sharded(config)
  if sharded:
    check_expert_rows(layout, mesh)
    trainable = [leaf.index for leaf in layout.leaves if leaf.trainable]
    check_model_rows(layout, model_specs, mesh, trainable)
    # the optimizer sees padded leaves: refuse tx that would be silently different
    check_exact(tx, layout)
  fused = use_fused(tx, layout, config, model_specs)
  # the state's fields that do not depend on the values: `build` fills in the others
  blank = TrainState(
    None, None, None, None, layout, config, tuple(mesh.shape.items()), model_specs, fused=fused
  )

  def build(params):
    layout, config = blank.layout, blank.config
    sharded, leaves = config.use_distributed_optimizer, leaves_of(params, layout)
    master = [
      (pad_leaf(x, layout, leaf.index) if sharded else x).astype(master_dtype(x.dtype))
      if leaf.trainable and _keeps_master(config, x.dtype)
      else None
      for leaf, x in zip(layout.leaves, leaves)
    ]
    # optim* with overlap_param_gather: trainable params are gathered inside the next step
    gather_in_step = sharded and config.overlap_param_gather
    model = [
      None if (leaf.trainable and gather_in_step) else x for leaf, x in zip(layout.leaves, leaves)
    ]
    return dataclasses.replace(
      blank,
      step=jnp.zeros((), jnp.int32),
      params=tree_of(layout, model),
      master=fused_master(leaves, layout) if blank.fused and sharded else tree_of(layout, master),
    )

  def opt_params(state):  # the tree `tx` sees
    if fused:  # no_shard keeps every param in `params`, and fuses them for the optimizer
      return state.master if sharded else fused_master(leaves_of(state.params, layout), layout)
    return opt_params_of(layout, state.params, state.master)

  # each leaf enters sharded over "data" where dp divides a dim (the params stay whole only
  # where the state keeps them whole): no device receives or computes a whole sharded leaf
  views = [
    pspec(view_dims(leaf.shape, dims, mesh.shape[DATA], leaf.shard_axis) if sharded else dims)
    for leaf, dims in zip(layout.leaves, model_specs)
  ]
  # Placed the way the step places its output state (not by out_shardings, whose specs an
  # Auto mesh would not normalise as the step's do): step 2 reuses step 1's program.
  check_offload(mesh, config)
  return source.run(build, opt_params, tx, mesh, layout, views, state_specs)


def whole_params(state: TrainState, mesh, sharded: bool = False) -> PyTree:
  """Traced `get_params`: every leaf in its own shape and dtype, fresh, over its model
  sharding, and with `sharded` over "data" too (`unpad_view`)."""
  state = per_leaf_state(state, mesh)
  layout = state.layout

  def whole(leaf, x, m):
    dims = model_spec(state, leaf.index, len(leaf.shape))
    if x is None:  # gathered inside the next step: read it from `master` here
      x = unpad_view(m, leaf.shape, leaf.shard_axis, mesh, dims, sharded)
      return jnp.copy(x.astype(leaf.dtype))
    view = view_dims(leaf.shape, dims, mesh.shape[DATA], leaf.shard_axis)
    return constrain(jnp.copy(x), mesh, pspec(view if sharded else dims))

  return tree_of(
    layout,
    [
      whole(leaf, x, m)
      for leaf, x, m in zip(
        layout.leaves, leaves_of(state.params, layout), leaves_of(state.master, layout)
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
  per_token: bool = False
  """`loss_fn` returns `(loss_sum, token_count)` (see [Note: per-token loss] in step.py)."""
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
  outer_once: bool = False
  """`optim_grads` with k > 1 on a mesh with "replica": each micro-batch reduces over the
  other data axes, and the summed shards are all-reduced across "replica" once per step
  (See [Note: the sum across "replica" once per step] in collectives.py)."""

  @property
  def own_of(self) -> dict[int, Any]:
    return dict(self.own)

  def reduce_axes(self, buf) -> tuple[str, ...]:
    """A buffer's data-parallel group: expert buffers skip the axis their params split over."""
    return tuple(a for a in self.axes if not (buf.expert and a == EXPERT))

  def micro_axes(self, buf) -> tuple[str, ...]:
    """The axes one micro-batch's reduction of a buffer runs over: its group, less
    "replica" where the step sums across it once (`outer_once`)."""
    return tuple(a for a in self.reduce_axes(buf) if not (self.outer_once and a == REPLICA))


def start_param_sync(params, master, layout: Layout, plan: _Plan, own_axes) -> list[Any]:
  """The params the forward sees (tree order): gathered from the master rows when the step
  gathers them, each trainable one varying over the data axes it is not itself sharded
  over (`own_axes[i]`, e.g. "expert"), so that `jax.grad` leaves the reduction to the hooks."""
  full = leaves_of(params, layout)
  # With `gather_in_step` the trainable leaves of `params` are None: the step starts from the
  # master rows. Under `in_scan` the stack buckets are left out (`stacks=False`): their
  # layers are gathered one per iteration inside the scan instead (`scanned_units`).
  if plan.gather_in_step:
    full = gather_master(master, layout, full, plan.fused, stacks=not plan.in_scan, own=plan.own_of)
  # See [Note: varying values] in collectives.py. An expert leaf already varies over
  # "expert" (each rank holds other experts), so only the remaining data axes are added.
  return [
    collectives.make_varying(x, [a for a in plan.axes if a not in own_axes[leaf.index]])
    if leaf.trainable
    else x
    for leaf, x in zip(layout.leaves, full)
  ]


@dataclasses.dataclass(frozen=True)
class GradSync:
  """Every bucket's grad-ready hook and the zero sink whose cotangent receives its reduced
  grads (`register_grad_ready_hooks`), in the order of `buckets`."""

  buckets: list[tuple[Any, Any]]
  """`(buffer, bucket)` of every bucket, buffer by buffer."""
  hooks: list[Callable]
  sinks: list[Any]
  """A bucket's sink: one array (its reduced buffer, or this device's shard of it), or a
  tuple of per-param ones for a bucket that holds a tensor-parallel leaf of `plan.own`,
  reduced per param (`collectives.grad_ready_hook_each`)."""
  blocks: dict[int, Any]
  """Scanned layers whose forward gathers them in the step (`plan.in_scan` with
  `gather_in_step`): leaf -> this device's master block (`master_blocks`); else empty."""


def register_grad_ready_hooks(layout: Layout, plan: _Plan, master) -> GradSync:
  """One hook and one sink per bucket (see `GradSync`)."""
  buckets = [(buf, b) for buf in layout.buffers for b in buf.buckets]
  own = plan.own_of
  hooks = []
  for buf, b in buckets:
    kwargs = dict(dp=plan.dp, scatter=plan.sharded, axes=plan.micro_axes(buf), average=plan.average)
    if collectives.holds_own(b, own):
      hooks.append(
        collectives.grad_ready_hook_each(b, grad_dtype=buf.grad_dtype, own=own, **kwargs)
      )
    else:
      hooks.append(collectives.grad_ready_hook(b, grad_dtype=buf.grad_dtype, **kwargs))
  # See [Note: the sink] in collectives.py. A sink is the reduced buffer's shape: whole
  # under no_shard, this device's shard when sharded (varying over "data"). An expert
  # bucket is not reduced over "expert", so its sink varies over that axis as well, and
  # under `outer_once` every sink varies over "replica" until the step's sum across it.
  sinks = [
    collectives.sink_for(
      b,
      buf.grad_dtype,
      plan.sharded,
      [a for a in plan.axes if a not in plan.micro_axes(buf)],
      own,
    )
    for buf, b in buckets
  ]
  blocks = master_blocks(master, layout, plan.fused) if plan.in_scan and plan.gather_in_step else {}
  return GradSync(buckets, hooks, sinks, blocks)


@dataclasses.dataclass(frozen=True)
class Backward:
  """What `forward_backward` returns."""

  loss: jax.Array
  """This device's loss: the sum of its micro-batches' losses, each divided by k."""
  reduced: list[Any]
  """Every bucket's reduced grads, in `GradSync.buckets`' order, as its sink holds them."""
  aux: PyTree
  """The mean over the micro-batches (None without `has_aux`)."""
  model_state: PyTree


@dataclasses.dataclass(frozen=True)
class _MicroLoss:
  """One device's loss of one micro-batch, as the step differentiates it: `loss_fn` through
  `loop.call_loss`, divided by k, with its scanned layers run by `fsdp_program.run_loss`
  (`scanned_units`)."""

  loss_fn: LossFn
  layout: Layout
  plan: _Plan
  key: Any
  """This device's key data for the step (None without one)."""
  units: list

  def __call__(self, leaves, micro_batch, number, model_state, scanned=None):
    plan = self.plan
    call = lambda tree, args: loop.call_loss(
      self.loss_fn, plan.has_aux, tree, *args, per_token=plan.per_token
    )
    args = (micro_batch, loop.micro_key(self.key, number), model_state)
    if scanned:
      values = {**dict(enumerate(leaves)), **scanned}
      avals = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in self.layout.leaves]
      # prefetch=0: each loop iteration gathers its own layer. ZeRO keeps every gathered
      # layer for the backward (reshard=False), so a layer gathered ahead would hide nothing
      # XLA does not already overlap within the layer, and add a layer to the peak.
      loss, extra = fsdp_program.run_loss(
        call,
        self.layout.treedef,
        avals,
        values,
        self.units,
        args,
        plan.axes,
        reshard=False,
        prefetch=0,
      )
    else:
      loss, extra = call(tree_of(self.layout, leaves), args)
    return loss / plan.grad_accum_steps, extra

  def hooked(self, sinks, accs, full, sync: GradSync, micro_batch, number, model_state):
    """The loss with every bucket's params passed through its hook: its grad w.r.t. the
    sinks is the reduced buckets (plus `accs`). A stack bucket's sink is split into its
    params' blocks, which the scans' backward loops reduce into (`scanned_units`)."""
    # The flow, per bucket (See [Note: the sink] in collectives.py): the hook is the identity
    # on the bucket's params in the forward and takes two more arguments, `sink` (the
    # argument `jax.value_and_grad` differentiates, see `forward_backward`) and `acc` (the
    # bucket's local grads of the earlier micro-batches, raveled, or zeros). In the backward
    # the hook ravels the params' cotangents, adds `acc`, reduces the sum and returns it as
    # the sink's cotangent. So the gradient w.r.t. `sinks` is the list of reduced buckets,
    # and the params' own cotangents are zeros nobody reads.
    leaves, scanned = list(full), {}
    for (_, b), hook, sink, acc in zip(sync.buckets, sync.hooks, sinks, accs):
      if self.plan.in_scan and b.stack is not None:  # (master block or whole param, sink block)
        # A stack bucket gets no hook: the scan's backward loop reduce-scatters each layer
        # into its param's block of the sink (`scanned_units`), and `run_loss` reads the
        # pairs from `scanned`. Nothing is accumulated before it (`_Plan.in_scan`), so
        # `acc` is not needed here.
        sunk = sink if isinstance(sink, tuple) else shard_unravel(sink, b, self.layout.dp)
        for p, block in zip(b.params, sunk):
          value = sync.blocks[p.index] if self.plan.gather_in_step else leaves[p.index]
          scanned[p.index] = (value, block)
        continue
      out = hook([leaves[p.index] for p in b.params], sink, acc)
      for p, x in zip(b.params, out):
        leaves[p.index] = x
    return self(leaves, micro_batch, number, model_state, scanned)

  def of_trainable(self, trained, full, micro_batch, number, model_state):
    """The loss with `trained` (the trainable leaves, in `Layout.params` order, the ones
    differentiated) in place of theirs in `full`."""
    leaves = list(full)
    for p, x in zip(self.layout.params, trained):
      leaves[p.index] = x
    return self(leaves, micro_batch, number, model_state)

  def local(self, full, sync: GradSync, micro_batch, number, model_state):
    """One micro-batch's local (unreduced) grads, ravelled into bucket buffers."""
    layout = self.layout
    (loss, extra), grads = jax.value_and_grad(self.of_trainable, has_aux=True)(
      [full[p.index] for p in layout.params], full, micro_batch, number, model_state
    )
    grads = dict(zip((p.index for p in layout.params), grads))
    own = self.plan.own_of
    return (loss, extra), [
      collectives.ravel_local([grads[p.index] for p in b.params], b, buf.grad_dtype, own)
      for buf, b in sync.buckets
    ]


def forward_backward(
  micro_loss: _MicroLoss, full: list[Any], batch, sync: GradSync, model_state=None
) -> Backward:
  """The step's micro-batches on this device (see `Backward`).

  Each micro-batch's loss is divided by k (Megatron's schedule does the same), so the k
  accumulated grads sum to the grad of the mean loss over the k× batch. `optim_grads`
  reduces every micro-batch through the hooks and sums the shards (then across "replica"
  once, `_Plan.outer_once`); the others accumulate
  the local grads of the first k-1 (`no_sync`) and carry them into the hooks with the last.
  Micro-batch `j` gets `fold_in(key, j)` and the model state the one before it left
  (synced over the data axes).
  """
  plan = micro_loss.plan
  k = plan.grad_accum_steps
  micro = step_lib.micro_batches(batch, k)
  last = jax.tree.map(lambda x: x[-1], micro)
  # The zero accumulators, one per bucket in the local (unreduced) form: raveled, or per
  # param for a bucket with a tensor-parallel leaf of `plan.own`. They meet varying grads
  # in the hooks, so they are varying too ([Note: varying values] in collectives.py).
  acc_zero = [collectives.acc_for(b, buf.grad_dtype, plan.own_of) for buf, b in sync.buckets]
  acc_zero = collectives.make_varying(acc_zero, plan.axes)
  # Differentiated w.r.t. its first argument only, the sinks: the grads it returns are the
  # reduced buckets ([Note: the sink] in collectives.py).
  reduced_grad = jax.value_and_grad(micro_loss.hooked, has_aux=True)
  # Three modes: optim_grads reduces every micro-batch (the sinks' cotangents, shards, are
  # summed by `accumulate`); the others keep the first k-1 micro-batches local and hand
  # their sum to the last micro-batch's hooks as `accs`, which reduce it once.
  if plan.scatter_each_microbatch:
    if k == 1:
      (loss, (aux, model_state)), reduced = reduced_grad(
        sync.sinks, acc_zero, full, sync, last, 0, model_state
      )
      model_state = collectives.sync_model_state(model_state, plan.axes)
      return Backward(loss, reduced, loop.mean_micro(None, aux, 1), model_state)
    each = step_lib.accumulate(
      functools.partial(reduced_grad, sync.sinks, acc_zero, full, sync),
      jax.tree.map(jnp.zeros_like, sync.sinks),
      micro,
      model_state,
      plan.axes,
    )
    reduced = each.grads
    if plan.outer_once:  # the shards' sum across "replica", once per step (`_Plan.outer_once`)
      reduced = [
        tuple(collectives.all_reduce_outer(red, buf.grad_dtype))
        if isinstance(red, tuple)  # per param (`grad_ready_hook_each`)
        else collectives.all_reduce_outer([red], buf.grad_dtype)[0]
        for (buf, _), red in zip(sync.buckets, reduced)
      ]
    return Backward(each.loss, reduced, loop.mean_micro(each.auxs, None, k), each.model_state)
  # no_shard and optim: one reduction per step, at the last micro-batch
  loss, accs, first_aux = None, acc_zero, None
  if k > 1:  # Megatron's `no_sync`: the first k-1 micro-batches' grads stay local
    first = step_lib.accumulate(
      functools.partial(micro_loss.local, full, sync),
      acc_zero,
      jax.tree.map(lambda x: x[:-1], micro),
      model_state,
      plan.axes,
    )
    loss, accs, first_aux, model_state = first.loss, first.grads, first.auxs, first.model_state
  (last_loss, (aux, model_state)), reduced = reduced_grad(
    sync.sinks, accs, full, sync, last, k - 1, model_state
  )
  loss = last_loss if loss is None else loss + last_loss
  aux = loop.mean_micro(first_aux, aux, k)
  return Backward(loss, reduced, aux, collectives.sync_model_state(model_state, plan.axes))


def scanned_units(layout: Layout, plan: _Plan) -> list[fsdp_unit.UnitIO]:
  """One stacked `fsdp_unit.UnitIO` per stack's bucket (`Bucket.stack`), for `run_loss`
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
          axes=plan.micro_axes(buf),
          average=plan.average,
        )
        return {p.index: (None, g) for p, g in zip(b.params, blocks)}

      trainable = tuple(sorted(p.index for p in b.params))
      units.append(
        fsdp_unit.UnitIO(
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
    return {named.name: red for named, red in zip(bucket_names(layout), reduced)}
  grads: list[Any] = [None] * len(layout.leaves)
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


def grad_metrics(
  backward: Backward, layout: Layout, plan: _Plan, buckets, count=None
) -> step_lib.GlobalScalars:
  """The global mean loss and the global norm of the reduced grads; with `count` (this
  device's token count of a per-token loss) the loss and norm per token, and the count the
  grads are divided by ([Note: per-token loss] in step.py).

  The norm² of the reduced buckets (zero padding) rides in the loss's psum, each bucket's
  divided by the number of devices that hold the same copy of it (those it was psum'd
  over). DDP with dense buckets only: every device holds the whole reduced buckets already.
  """
  sizes = dict(plan.axis_sizes)

  # How many devices hold the same reduced element: the devices of the buffer's reduction
  # group all hold the whole reduced buffer under no_shard; sharded, each holds a distinct
  # 1/dp of it over "data", so only the group's other axes ("replica", "expert" for a dense
  # buffer) hold copies.
  # Summing every device's norm² over the data axes then counts each element `copies`
  # times; dividing by it first makes the sum the norm² of the grads.
  def copies(buf):
    return math.prod(sizes[a] for a in plan.reduce_axes(buf)) // (layout.dp if plan.sharded else 1)

  squares = sum(
    jnp.sum(jnp.square(x.astype(jnp.float32))) / copies(buf)
    for (buf, _), reduced in zip(buckets, backward.reduced)
    for x in jax.tree.leaves(reduced)
  )
  # Sharded, or with expert buffers (reduced without "expert"), devices hold different
  # grads, so the norm² needs the sum over devices, which rides with the loss's (and with
  # a per-token loss's count: under dense no_shard too, where each device's `squares` is
  # the same 1/dp of the norm², so their sum is the norm²).
  if plan.sharded or count is not None or any(buf.expert for buf in layout.buffers):
    return step_lib.global_loss_and_norm(
      backward.loss, squares, plan.axes, plan.dp, count=count, micro_batches=plan.grad_accum_steps
    )
  # Dense no_shard: every device holds the whole reduced grads, and `copies` is dp for each
  # bucket, so `squares * dp` is the norm² with no collective but the loss's.
  loss = collectives.mean_over(backward.loss, plan.axes)
  return step_lib.GlobalScalars(loss, jnp.sqrt(squares * plan.dp))


def local_grads(
  loss_fn: LossFn, plan: _Plan, inputs: step_lib.StepInputs, layout: Layout, own_axes
) -> step_lib.LocalGrads:
  """Per device, inside the step's `shard_map`: the reduced grad of every trainable param
  (`finish_grad_sync`), the global mean loss and the global grad norm, the aux averaged
  over the data axes and the new model state (see `loop`).

  `inputs.key`: the step's key data (None without one), folded here with this device's
  shard. `own_axes[i]`: the data axes leaf `i` is itself sharded over ("expert" for experts).
  """
  key = loop.device_key(inputs.key, collectives.data_index(plan.axes))
  full = start_param_sync(inputs.params, inputs.master, layout, plan, own_axes)
  sync = register_grad_ready_hooks(layout, plan, inputs.master)
  units = scanned_units(layout, plan) if plan.in_scan else []
  backward = forward_backward(
    _MicroLoss(loss_fn, layout, plan, key, units), full, inputs.batch, sync, inputs.model_state
  )
  aux, count = loop.take_count(backward.aux, plan.per_token)
  scalars = grad_metrics(backward, layout, plan, sync.buckets, count)
  grads = finish_grad_sync(backward.reduced, layout, plan, sync.buckets)
  return step_lib.LocalGrads(
    grads=step_lib.divide_by_count(grads, scalars.count),
    loss=scalars.loss,
    grad_norm=scalars.grad_norm,
    aux=collectives.average_aux(aux, plan.axes),
    model_state=backward.model_state,
    tokens=scalars.tokens,
  )


# ----------------------------------------------------------------------------- step


def _model_dims(state: TrainState) -> list:
  """Each leaf's placement over the caller's mesh axes, as the step sees it (`model_spec`)."""
  return [model_spec(state, leaf.index, len(leaf.shape)) for leaf in state.layout.leaves]


@dataclasses.dataclass(frozen=True)
class BucketedStep:
  """`no_shard`, `optim` and `optim_grads` as a `step.StepStrategy` (see the module
  docstring)."""

  loss_fn: LossFn
  mesh: Any
  config: DDPConfig
  plan: _Plan
  """What the config and mesh fix; `plan_for` adds what the state fixes."""

  def plan_for(self, state: TrainState) -> _Plan:
    layout = state.layout
    stacks = any(b.stack is not None for buf in layout.buffers for b in buf.buckets)
    one_reduction = self.plan.grad_accum_steps == 1 or self.plan.scatter_each_microbatch
    own = layout_own_specs(layout, state.model_specs, self.mesh)
    return dataclasses.replace(
      self.plan, fused=state.fused, in_scan=one_reduction and stacks, own=tuple(own.items())
    )

  def check_state(self, state: TrainState) -> None:
    checks.check_state(state, self.mesh, self.config)

  def state_specs(self, state: TrainState) -> TrainState:
    return state_specs(state)

  def compiler_options(self) -> dict[str, Any]:
    return compiler_options(self.mesh.devices.flat[0].platform)

  def _manual(self, dims):
    """`shard_map` specs (the data axes only) of leaves placed `dims` (None: no leaf)."""
    return [None if d is None else manual_spec(d, self.plan.axes) for d in dims]

  def _grad_dims(self, state: TrainState):
    """Where each reduced grad lands: over "data" on its shard dim when sharded."""
    layout = state.layout
    model_dims = _model_dims(state)
    return [
      (with_data(d, self.plan.axes, leaf.shard_axis) if self.plan.sharded else d)
      if leaf.trainable
      else None
      for leaf, d in zip(layout.leaves, model_dims)
    ]

  def in_specs(self, state: TrainState) -> step_lib.StepInputs:
    layout = state.layout
    param_dims, master_dims = leaf_specs(state)
    extras = extra_specs(state)
    if state.fused and self.plan.sharded:
      master = flat_master_specs(layout, self.plan.axes)
    else:
      master = tree_of(layout, self._manual(master_dims))
    return step_lib.StepInputs(
      params=tree_of(layout, self._manual(param_dims)),
      master=master,
      batch=P(self.plan.axes),
      key=extras["rng"],
      model_state=extras["model_state"],
    )

  def out_specs(self, state: TrainState):
    layout = state.layout
    grad_dims = self._grad_dims(state)
    grads = tree_of(layout, self._manual(grad_dims))
    placed = tree_of(layout, [None if d is None else pspec(d) for d in grad_dims])
    if state.fused and self.plan.sharded:
      grads = placed = flat_master_specs(layout, self.plan.axes)
    elif state.fused:
      grads = placed = {named.name: P() for named in bucket_names(layout)}
    tokens = P() if self.plan.per_token else None
    specs = step_lib.LocalGrads(grads, P(), P(), P(), extra_specs(state)["model_state"], tokens)
    if not runs_auto(self.mesh, state.model_specs):
      return specs, None
    return specs, dataclasses.replace(specs, grads=placed)

  def local_grads(self, state: TrainState, inputs: step_lib.StepInputs) -> step_lib.LocalGrads:
    layout = state.layout
    model_dims = _model_dims(state)
    own = tuple(own_axes(d, self.plan.axes) for d in model_dims)
    return local_grads(self.loss_fn, self.plan_for(state), inputs, layout, own)

  def call_with_params(self, state: TrainState, inputs: step_lib.StepInputs, fn: Callable):
    """Inside the `shard_map`: `fn(params, batch, model_state)` on whole params (gathered
    from their master rows where the step gathers them)."""
    layout = state.layout
    full = leaves_of(inputs.params, layout)
    if self.plan.gather_in_step:
      own = layout_own_specs(layout, state.model_specs, self.mesh)
      full = gather_master(inputs.master, layout, full, state.fused, own=own)
    return fn(tree_of(layout, full), inputs.batch, inputs.model_state)

  # Two updates, by the state's form (`TrainState.fused`): per leaf on the optimizer's tree,
  # or one `tx.update` on the flat bucket tree. Both end the same way for the sharded
  # strategies: the new master rows are all-gathered into the params here, unless the next
  # step gathers them at its start (`overlap_param_gather`, `start_param_sync`).
  def update(self, tx, state: TrainState, out: step_lib.LocalGrads):
    if not state.fused:
      return self._update_leaves(tx, state, out.grads), out.grads
    # The NaN check flags each leaf: it reads the flat shards cut back into per-leaf blocks
    checked = grad_blocks(out.grads, state.layout) if self.config.check_for_nan_in_grad else None
    return self._update_buckets(tx, state, out.grads), checked

  def _apply(self, tx, state: TrainState, grads, opt_params, param_specs):
    """`(new opt_params, new opt_state)`: the optax update applied. Offloaded buckets
    (`DDPConfig.optimizer_cpu_offload`) are streamed through the device a piece at a time
    and stay in host memory (`offload.update_offloaded`)."""
    if self.config.optimizer_cpu_offload:
      specs = (self.state_specs(state).opt_state, param_specs)
      return update_offloaded(tx, grads, state.opt_state, opt_params, self.mesh, specs)
    updates, opt_state = loop.tx_update(tx, grads, state.opt_state, opt_params, self.mesh)
    return optax.apply_updates(opt_params, updates), opt_state

  def _gathered(self, master, layout: Layout, params, state: TrainState):
    """The params gathered from the new master rows right after the update, unless the next
    step gathers them at its start (`overlap_param_gather`, `start_param_sync`)."""
    if self.config.overlap_param_gather:
      return params
    return gather_params(to_device(master), layout, self.mesh, params, state)

  def _update_buckets(self, tx, state: TrainState, grads) -> TrainState:
    """The fused update: one per bucket (see `distributed_optimizer`)."""
    layout = state.layout
    params = leaves_of(state.params, layout)
    if self.plan.sharded:
      specs = self.state_specs(state).master
      master, opt_state = self._apply(tx, state, grads, state.master, specs)
      params = self._gathered(master, layout, params, state)
    else:  # DDP keeps the params themselves (no master): each leaf + its updates' slice
      flat = fused_master(params, layout)
      updates, opt_state = loop.tx_update(tx, grads, state.opt_state, flat, self.mesh)
      master = state.master
      updates = unravel_flat(updates, layout)
      params = [x if u is None else optax.apply_updates(x, u) for x, u in zip(params, updates)]
    return dataclasses.replace(
      state, params=tree_of(layout, params), master=master, opt_state=opt_state
    )

  def _update_leaves(self, tx, state: TrainState, grads) -> TrainState:
    """The per-leaf update of the optimizer's tree (`opt_params_of`): the master rows, or
    under `no_shard` the params themselves where they have no master."""
    layout, sharded = state.layout, self.plan.sharded
    opt_params = opt_params_of(layout, state.params, state.master)
    specs = self.state_specs(state)
    new, opt_state = self._apply(
      tx, state, grads, opt_params, opt_params_of(layout, specs.params, specs.master)
    )
    new = leaves_of(new, layout)
    params, master = leaves_of(state.params, layout), leaves_of(state.master, layout)
    # A trainable leaf's new value goes to its master where it has one; under no_shard the
    # param itself is updated too, cast back to its dtype (sharded, `params` holds the
    # gathered copy, replaced below, or None under `overlap_param_gather`).
    for leaf in layout.leaves:
      if not leaf.trainable:
        continue
      if master[leaf.index] is not None:
        master[leaf.index] = new[leaf.index]
      if params[leaf.index] is not None and not sharded:
        params[leaf.index] = new[leaf.index].astype(leaf.dtype)
    if sharded:
      params = self._gathered(master, layout, params, state)
    return dataclasses.replace(
      state, params=tree_of(layout, params), master=tree_of(layout, master), opt_state=opt_state
    )


def bucketed_step(
  loss_fn: LossFn,
  mesh,
  config: DDPConfig,
  grad_accum_steps: int = 1,
  has_aux: bool = False,
  per_token: bool = False,
) -> BucketedStep:
  """The `step.StepStrategy` of `no_shard`, `optim` and `optim_grads`."""
  sharded = _sharded(config)
  plan = _Plan(
    axes=data_axes(mesh),
    axis_sizes=tuple(mesh.shape.items()),
    dp=dp_size(mesh),
    sharded=sharded,
    scatter_each_microbatch=config.shards_grads,
    gather_in_step=sharded and config.overlap_param_gather,
    grad_accum_steps=grad_accum_steps,
    average=config.average_in_collective,
    has_aux=has_aux,
    per_token=per_token,
    outer_once=config.shards_grads and grad_accum_steps > 1 and mesh.shape.get(REPLICA, 1) > 1,
  )
  return BucketedStep(loss_fn, mesh, config, plan)
