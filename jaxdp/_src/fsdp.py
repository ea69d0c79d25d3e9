"""FSDP (`optim_grads_params`, ZeRO-3): params, grads and optimizer state sharded 1/dp.

A *unit* (Megatron-FSDP's unit module, torch FSDP2's `fully_shard` module) is a group of
params gathered by one collective. Its params are laid out like a bucket (`make_layout` with
`units=`: shard-major, per dtype), so that device `d` holds rows `[d r, (d+1) r)` of every
param of the unit, at rest, in three places of the `TrainState`:

* `master`: the optimizer's fp32 copy of each trainable param's rows, padded and sharded
  over "data" on its shard dim (`layout_for`: the dim that pads least, as ZeRO's; of a
  layer for a stacked param, `(layers, ...)`);
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

Tensor-parallel params (a leaf the caller placed `P(None, "model")`): each keeps that
placement in every field of the state, and jaxdp adds "data" on a dim the other axes do
not split where the leaf has one (`layout_for`), so that its unit's all-gather and
reduce-scatter run on this device's own "model" slice, manual over both axes
(`collectives.unit_collectives(own=)`): they move 1/tp of the leaf over "data" alone. A
leaf split over another axis on every dim (a column-parallel bias) is sharded on that dim
too and gathered whole over the other axes by the compiler first. The loss sees whole
params over "data" with the caller's split over the rest, and the compiler runs the
tensor-parallel arithmetic (on a mesh with Explicit axes, under `mesh.run_manual`).

HFSDP (`DDPConfig(outer_dp_sharding_strategy="optim")` on a `("replica", "data")` mesh,
`Layout.outer` = replicas): rows pad to a multiple of replicas x dp; `params` also holds each
trainable param's compute rows (1/dp of them, in its own dtype, over "data" alone), which
the units gather; `master` and `opt_state` are sharded over ("data", "replica") on the
shard dim. The backward's reduce-scatters sum over "data" alone; once per step each unit
bucket's grads are reduce-scattered across "replica" (`scatter_outer`), and after the
update the master is all-gathered back across it into the compute rows (`gather_outer`).
docs/design.md, "HFSDP", says why.

HSDP (`num_distributed_optimizer_instances=R` on a `("replica", "data")` mesh, FSDP's
state replicated across "replica") with `grad_accum_steps` > 1: each micro-batch's
reduce-scatters sum over "data" alone and the step all-reduces the summed shards across
"replica" once (`FSDPStep._all_reduce_outer`), as HFSDP does with its reduce-scatter.

Expert params (MoE, a leaf placed `P("expert", ...)` on its leading, expert dim, on a mesh
with an "expert" axis): dense params are FSDP as on any mesh (sharded over "data",
replicated over "expert", their reduce-scatter over "data" followed by an all-reduce of
the shard over "expert"); an expert param keeps its "expert" split and is sharded over
"data" as well, on a dim the expert dim leaves whole (`layout_for`: `P("expert", "data",
None)` for a `(experts, d, h)` weight), in `master`, `opt_state` and `params` alike, so a
device holds `1 / (ep * data)` of it. Its `ParamSpec`s describe one expert-parallel rank's
slice (`make_layout(experts=)`, buffers of their own, as under ZeRO), and since "expert" is
one of the step's manual axes, its unit's all-gather and reduce-scatter are the plain ones
of that slice over "data", the expert-data-parallel group; the grads are never reduced over
"expert" (`collectives.unit_collectives(experts=)`), and the loss receives the rank's
experts, as under `optim`. Why not split the rank's experts themselves over "data", as
ZeRO's expert buckets do: that needs `experts / ep` to divide over "data" (or padding
inside each rank's slice, which no whole-array view, `get_params` or checkpoint, could
cut), while another dim pads at its end like any leaf, and the gather still returns whole
experts. An expert param with no other dim is split on its experts (they must divide). A
frozen expert param, one under `FSDPConfig(stacked=...)` (whose leading dim is the layer
axis) or gathered by row blocks (`chunks=`) is refused by `init_state`.

Units (which params) are `units.py`'s.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxdp._src import checks, collectives, fsdp_program, fsdp_unit, loop
from jaxdp._src import step as step_lib
from jaxdp._src.buffer import pad_dim
from jaxdp._src.compiler import (
  GPU_PLATFORMS,
  REDUCE_SCATTER_PIPELINER,
  first_known,
)
from jaxdp._src.compiler import compiler_options as base_compiler_options
from jaxdp._src.config import DDPConfig, FSDPConfig
from jaxdp._src.distributed_optimizer import (
  check_exact,
  check_expert_rows,
  check_model_rows,
  fused_master,
  grad_blocks,
  own_specs,
  per_leaf_state,
  unpad_view,
  use_fused,
)
from jaxdp._src.layout import (
  Frozen,
  Layout,
  ParamSpec,
  make_layout,
  master_dtype,
  outer_bucket,
  unit_shard_dims,
)
from jaxdp._src.offload import update_offloaded
from jaxdp._src.mesh import (
  DATA,
  EXPERT,
  REPLICA,
  ModelSpec,
  constrain,
  constrain_auto,
  data_axes,
  data_axes_in,
  dp_size,
  experts_of,
  manual_spec,
  model_specs_of,
  pspec,
  run_manual,
  runs_auto,
  view_dims,
  with_data,
)
from jaxdp._src.state import (
  FLAT_SPEC,
  TrainState,
  check_offload,
  init_source,
  bucket_names,
  extra_specs,
  is_flat_leaf,
  leaves_of,
  model_spec,
  opt_params_of,
  opt_state_specs,
  to_device,
  tree_of,
)
from jaxdp._src.units import (
  assign_units,
  chunked_leaves,
  chunked_paths,
  compute_dtype,
  lookup_paths,
  param_specs,
  units_of,
)

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


def layout_for(
  params: PyTree,
  mesh_shape: Mapping[str, int],
  config: DDPConfig,
  fsdp: FSDPConfig,
  frozen: Frozen = None,
  model_specs: tuple[ModelSpec, ...] = (),
) -> Layout:
  """The FSDP layout on a mesh of `mesh_shape` (`mesh.shape`: axis name -> size): one
  bucket per (unit, buffer) over the trainable params. Each float leaf is sharded over
  "data" on the dim that pads least (`layout.unit_shard_dims`, ZeRO's rule: a Gemma
  `(2, d, ffn)` weight on `d`), per layer for a stacked leaf, on its leading dim where
  `FSDPConfig(chunks=)` gathers it by row blocks. A leaf the caller sharded over other
  mesh axes (`model_specs`: tensor parallel) takes a dim those axes do not split where it
  has one (`shard_axis(taken=)`), so that each device's block keeps the caller's split and
  its all-gather over "data" needs nothing of the other axes. Expert params (sharded over
  "expert") get buffers of their own, each `ParamSpec` one expert-parallel rank's slice,
  sharded over "data" on a dim other than the expert dim the same way (see the module
  docstring)."""
  units, stacked = assign_units(params, fsdp)
  keyed, treedef = jax.tree_util.tree_flatten_with_path(params)
  for (keys, x), dims in zip(keyed, model_specs):
    path = jax.tree_util.keystr(keys)
    if path in stacked and any(EXPERT in axes for axes in dims):
      raise ValueError(
        f"params{path} is an expert param ({pspec(dims)}) under FSDPConfig(stacked=...), "
        "whose leaves lead with their layer axis, while an expert param leads with its "
        "expert dim; leave the subtree that holds it out of stacked (unrolled layers)"
      )
  floating = [jnp.issubdtype(x.dtype, jnp.floating) for _, x in keyed]  # the sharded leaves
  named = lookup_paths([jax.tree_util.keystr(keys) for keys, _ in keyed], fsdp)
  for keys, x in keyed:
    path = jax.tree_util.keystr(keys)
    if path in named and (x.ndim < 2 or path in stacked):
      raise ValueError(
        f"FSDPConfig(lookups=...) names params{path} of shape {tuple(x.shape)}"
        f"{' (stacked)' if path in stacked else ''}: a lookup table is one param with rows "
        "and columns (2 dims or more), sharded by its columns; leave it out of lookups="
      )
  paths = [jax.tree_util.keystr(keys) for (keys, _), f in zip(keyed, floating) if f]
  shard_dims = unit_shard_dims(
    paths,
    [tuple(x.shape) for (_, x), f in zip(keyed, floating) if f],
    [dims for dims, f in zip(model_specs, floating) if f],
    mesh_shape[DATA] * config.outer_shards,  # HFSDP pads to replicas x dp
    stacked.__contains__,  # a stacked leaf's dims of one layer
    chunked_paths(paths, fsdp),
    lookup_paths(paths, fsdp),
  )
  layout = make_layout(
    params,
    dp=mesh_shape[DATA],
    grad_dtype=config.grad_dtype,
    frozen=frozen,
    units=units,
    stacked=stacked,
    shard_dims=shard_dims,
    outer=config.outer_shards,
    experts=jax.tree.unflatten(treedef, experts_of(model_specs)) if model_specs else None,
    expert_parallel=mesh_shape.get(EXPERT, 1),
  )
  if not layout.buffers:
    raise ValueError(
      "params have no trainable floating-point leaf (all are frozen or integer): there "
      "is nothing to train; pass float params, or unfreeze some"
    )
  return layout


def _pad(x, spec: ParamSpec):
  """A whole leaf padded on its shard dim (an expert leaf's spec is of one rank's slice; its
  shard dim is the same in the whole leaf)."""
  # A stacked leaf's spec is of one layer (`spec.axis` counts in a layer's dims): pad each
  # layer under `vmap` over the leading layer axis.
  pad = lambda y: pad_dim(y, y.shape, spec.axis, spec.rows)
  return jax.vmap(pad)(x) if spec.layers else pad(x)


# ----------------------------------------------------------------------------- state


def leaf_dims(state: TrainState) -> tuple[list[ModelSpec | None], list[ModelSpec | None]]:
  """`(params, master)`: each leaf's full spec as a `ModelSpec` (None where the leaf is): a
  unit's leaf sharded over "data" on its shard dim (`Layout.shard_axes`) and over the axes
  the caller split it over, an integer leaf over the latter alone; master all None in a
  fused state (flat). HFSDP (`Layout.outer`): the master over "data" and then "replica"
  on its shard dim, the compute params in `params` over "data" alone."""
  layout = state.layout
  manual = data_axes_in(dict(state.mesh_shape))
  specs = param_specs(layout)
  own = [model_spec(state, leaf.index, len(leaf.shape)) for leaf in layout.leaves]
  sharded = lambda leaf, outer=False: with_data(own[leaf.index], manual, leaf.shard_axis, outer)
  params = [
    None if x is None else sharded(leaf) if leaf.index in specs else own[leaf.index]
    for leaf, x in zip(layout.leaves, leaves_of(state.params, layout))
  ]
  if state.fused:
    return params, [None] * len(layout.leaves)
  outer = layout.outer > 1
  return params, [
    None if m is None else sharded(leaf, outer)
    for leaf, m in zip(layout.leaves, leaves_of(state.master, layout))
  ]


def state_specs(state: TrainState) -> TrainState:
  """The PartitionSpec of every leaf of an FSDP state (a tree like `state`)."""
  layout = state.layout
  param_dims, master_dims = leaf_dims(state)
  params = [None if d is None else pspec(d) for d in param_dims]
  if state.fused:
    flat = {named.name: (named.bucket.shard_size * layout.dp,) for named in bucket_names(layout)}
    return dataclasses.replace(
      state,
      step=P(),
      params=tree_of(layout, params),
      master={name: FLAT_SPEC for name in flat},
      opt_state=jax.tree_util.tree_map_with_path(
        lambda path, x: FLAT_SPEC if is_flat_leaf(path, x, flat) else pspec(((),) * x.ndim),
        state.opt_state,
      ),
      **extra_specs(state),
    )
  return dataclasses.replace(
    state,
    step=P(),
    params=tree_of(layout, params),
    master=tree_of(layout, [None if d is None else pspec(d) for d in master_dims]),
    opt_state=opt_state_specs(state, master_dims),
    **extra_specs(state),
  )


def manual_specs(state: TrainState) -> tuple[PyTree, PyTree]:
  """`(params, master)` as a `shard_map` over the data axes takes them (`mesh.manual_spec`:
  the other axes are left to the compiler)."""
  layout = state.layout
  axes = data_axes_in(dict(state.mesh_shape))
  param_dims, master_dims = leaf_dims(state)
  params = tree_of(layout, [None if d is None else manual_spec(d, axes) for d in param_dims])
  if state.fused:
    return params, {named.name: manual_spec(((DATA,),), axes) for named in bucket_names(layout)}
  return params, tree_of(layout, [None if d is None else manual_spec(d, axes) for d in master_dims])


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
  layout = layout_for(params, mesh.shape, config, fsdp, frozen, model_specs)
  specs = param_specs(layout)
  _check_model_specs(layout, model_specs, fsdp)
  _check_outer(layout, model_specs, fsdp)
  check_expert_rows(layout, mesh)
  check_model_rows(layout, model_specs, mesh, specs)
  check_exact(tx, layout)  # the optimizer sees padded leaves: refuse a tx that would differ
  chunked = bool(chunked_leaves(layout, fsdp))
  fused = use_fused(tx, layout, config, model_specs, chunked=chunked)
  # the state's fields that do not depend on the values: `build` fills in the others
  blank = TrainState(
    None,
    None,
    None,
    None,
    layout,
    config,
    tuple(mesh.shape.items()),
    model_specs,
    fused=fused,
    fsdp=fsdp,
  )

  # [Note: HFSDP compute rows]
  # Under HFSDP (`layout.outer` > 1) a trainable param is held twice: its compute rows in
  # `params` (1/dp of the padded leaf, over "data" alone, in the param's own dtype), which
  # the units all-gather over "data" as FSDP gathers its master, and its master in `master`
  # (1/(dp * replicas), over "data" then "replica", in the master dtype), which the optimizer
  # updates. The rows are padded to a multiple of dp * replicas, so that each device's
  # block over "data" splits `replicas` ways again: the master is a slice of the compute
  # rows. A step differentiates w.r.t. the rows, reduce-scatters across "replica" once
  # (`scatter_outer`), updates the master and all-gathers it back into the rows
  # (`gather_outer`). docs/design.md, "HFSDP", gives the why.
  def rows(leaf, x):
    """`x`, the value of `leaf`, padded; HFSDP: placed over "data" on its shard dim first
    (the compute rows), from where the master's placement over ("data", "replica") is a
    slice."""
    x = _pad(x, specs[leaf.index])
    if layout.outer == 1:
      return x
    return constrain_auto(x, mesh, pspec(with_data(((),) * x.ndim, (), leaf.shard_axis)))

  def build(params):
    leaves, outer = leaves_of(params, blank.layout), blank.layout.outer > 1
    if blank.fused:  # one flat array per unit bucket
      master = fused_master(leaves, blank.layout)
    else:
      master = [
        rows(leaf, x).astype(master_dtype(x.dtype)) if leaf.trainable else None
        for leaf, x in zip(blank.layout.leaves, leaves)
      ]
      master = tree_of(blank.layout, master)
    # HFSDP (`layout.outer`): the trainable params' compute rows too, in their own dtype
    # ([Note: HFSDP compute rows]); otherwise a trainable leaf's `params` entry is None, a
    # frozen float leaf keeps its padded rows and an integer leaf (no spec) stays whole
    stored = [
      None if leaf.trainable and not outer else rows(leaf, x) if leaf.index in specs else x
      for leaf, x in zip(blank.layout.leaves, leaves)
    ]
    stored = tree_of(blank.layout, stored)
    return dataclasses.replace(blank, step=jnp.zeros((), jnp.int32), params=stored, master=master)

  def opt_params(state):  # the tree `tx` sees
    return state.master if fused else opt_params_of(layout, state.params, state.master)

  # each leaf enters sharded over "data" where dp divides a dim (and over the caller's own
  # axes): no device receives or computes a whole leaf
  views = [
    pspec(view_dims(leaf.shape, dims, mesh.shape[DATA], leaf.shard_axis))
    for leaf, dims in zip(layout.leaves, model_specs)
  ]
  check_offload(mesh, config)
  return source.run(build, opt_params, tx, mesh, layout, views, state_specs)


def _check_model_specs(layout: Layout, model_specs, fsdp: FSDPConfig):
  """Raises for a caller's sharding FSDP cannot keep: of a frozen expert param, over the
  layer axis of a stacked leaf, or of a leaf gathered by row blocks."""
  chunked = chunked_leaves(layout, fsdp)
  for leaf, dims in zip(layout.leaves, model_specs):
    path, spec = leaf.path, pspec(dims)
    if any(EXPERT in axes for axes in dims) and not leaf.trainable:
      raise ValueError(
        f"params{path} is an expert param ({spec}) that is frozen (or not float): "
        "optim_grads_params shards only trainable expert params; train it, or use 'optim' "
        "(which keeps frozen params whole) for this model"
      )
    if leaf.layers and dims[0]:
      raise ValueError(
        f"params{path} is sharded {spec}: over its layer axis, which "
        "FSDPConfig(stacked=...) scans and gathers one layer at a time; split a dim of a "
        f"layer instead (e.g. P(None, {', '.join(repr(a) for a in dims[0])}))"
      )
    if any(dims) and leaf.index in chunked:
      raise ValueError(
        f"FSDPConfig(chunks=...) names params{path}, which is sharded {spec}: a param "
        "gathered by row blocks must be replicated over the other mesh axes; leave it "
        "out of chunks, or place it replicated"
      )


def _check_outer(layout: Layout, model_specs, fsdp: FSDPConfig):
  """Raises for what HFSDP (`outer_dp_sharding_strategy="optim"`) does not run: params the
  caller sharded over other mesh axes, params gathered by row blocks."""
  if layout.outer == 1:
    return
  for leaf, dims in zip(layout.leaves, model_specs):
    if any(dims):
      raise NotImplementedError(
        f"params{leaf.path} is sharded {pspec(dims)} over another mesh axis (tensor or expert parallel): "
        "outer_dp_sharding_strategy='optim' keeps params replicated over the other axes; "
        "place the params replicated, or use outer_dp_sharding_strategy='no_shard'"
      )
  chunked = chunked_leaves(layout, fsdp)
  if chunked:
    raise NotImplementedError(
      f"FSDPConfig(chunks={dict(fsdp.chunks)}) with outer_dp_sharding_strategy='optim': "
      "row-block gathers are not built for HFSDP; leave chunks out, or use "
      "outer_dp_sharding_strategy='no_shard'"
    )


def whole_params(state: TrainState, mesh, sharded: bool = False) -> PyTree:
  """Traced `get_params`: every leaf in its own shape and dtype, fresh, replicated, or with
  `sharded` over "data" on a dim that dp divides (`unpad_view`)."""
  state = per_leaf_state(state, mesh)
  layout = state.layout
  specs = param_specs(layout)

  def whole(leaf, x, m):
    shape, dims = leaf.shape, model_spec(state, leaf.index, len(leaf.shape))
    if m is not None or leaf.index in specs:  # stored padded and sharded
      # HFSDP: the compute rows (over "data" alone), the master's cast to the param dtype
      x = unpad_view(x if x is not None else m, shape, leaf.shard_axis, mesh, dims, sharded)
      return jnp.copy(x.astype(leaf.dtype))
    view = view_dims(shape, dims, mesh.shape[DATA]) if sharded else dims
    return constrain(jnp.copy(x.astype(leaf.dtype)), mesh, pspec(view))

  return tree_of(
    layout,
    [
      whole(leaf, x, m)
      for leaf, x, m in zip(
        layout.leaves, leaves_of(state.params, layout), leaves_of(state.master, layout)
      )
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
  # One dict of every leaf's value, as `run_loss` takes them: the state's `params` leaves by
  # index (frozen rows, whole integer leaves, None for trainable ones), with the shards the
  # units gather from laid over them (`unit_values`: by leaf index, or by `FlatKey`)
  values = dict(enumerate(stored))
  values.update(tmaster)
  # the loss receives every float param in `fsdp.param_dtype` (what the gathers return),
  # an expert param as this rank's experts (its `ParamSpec`'s shape)
  local = {p.index: p.shape for buf in layout.buffers if buf.expert for p in buf.params}
  leaf_avals = [
    jax.ShapeDtypeStruct(
      local.get(leaf.index, leaf.shape), compute_dtype(leaf.dtype, fsdp.param_dtype)
    )
    for leaf in layout.leaves
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
    keep_last=not fsdp.reshard_last_layer,
    prefetch=fsdp.prefetch,
    tables=fsdp.vocab_parallel,
  )


@dataclasses.dataclass(frozen=True)
class FlatKey:
  """The key of a fused state's flat master shard among the values `run_loss` takes
  (`UnitIO.shards`), which leaf indices (ints) key otherwise: a type of its own, so that a
  bucket is never taken for a leaf."""

  number: int
  """The bucket's position in `bucket_names`."""
  name: str
  """The bucket's name: its key in the fused state's `master`."""

  # JAX sorts a dict's keys when it flattens it, and `run_loss`'s dicts hold these beside
  # leaf indices, so they must compare with ints: a FlatKey sorts before every leaf index,
  # the later buckets first. That order is the order of a program's arguments.
  # Only `<` and `>` are defined: they are what sorting needs. Against an int they answer
  # without looking at the int's value; against anything else they return NotImplemented,
  # so Python tries the other operand and raises TypeError if that fails too. Equality and
  # hashing are the dataclass's (by `number` and `name`), so a key finds its dict entry.
  def _rank(self) -> tuple[int, int]:
    return (0, -self.number)

  def __lt__(self, other):
    if isinstance(other, FlatKey):
      return self._rank() < other._rank()
    return True if isinstance(other, int) else NotImplemented

  def __gt__(self, other):
    if isinstance(other, FlatKey):
      return self._rank() > other._rank()
    return False if isinstance(other, int) else NotImplemented


def flat_keys(layout: Layout) -> dict[str, FlatKey]:
  """A fused state's bucket name -> the key its flat master shard has among the leaves'
  values in `run_loss` (`UnitIO.shards`)."""
  return {
    named.name: FlatKey(number, named.name) for number, named in enumerate(bucket_names(layout))
  }


def unit_values(master, layout: Layout, fused: bool, params=None) -> dict:
  """Inside the step: this device's master shards as `call_with_units` takes them: leaf
  index -> rows, or (`fused`) `FlatKey` -> flat shard. HFSDP (`layout.outer`): the
  trainable leaves' compute rows in `params` (a tree like the state's), which the units
  gather (the master holds 1/replicas of them)."""
  if layout.outer > 1:
    stored = leaves_of(params, layout)
    return {leaf.index: stored[leaf.index] for leaf in layout.leaves if leaf.trainable}
  if fused:
    keys = flat_keys(layout)
    return {keys[name]: m for name, m in master.items()}
  return {i: m for i, m in enumerate(leaves_of(master, layout)) if m is not None}


def unit_collectives(
  layout: Layout,
  mesh,
  config: DDPConfig,
  fsdp: FSDPConfig | None = None,
  fused: bool = False,
  *,
  chunks: bool = True,
  model_specs: tuple[ModelSpec, ...] = (),
  outer_once: bool = False,
) -> list[fsdp_unit.UnitIO]:
  """Inside the step: each unit's gather (forward all-gather, in `fsdp.param_dtype`) and
  scatter (backward reduce-scatter), as `fsdp_program.run_loss` takes them; the leaves
  `fsdp.chunks` names are gathered by row blocks where the loss uses them (`chunks=False`:
  none, for code that gathers units whole outside `run_loss`); `fused`: on the flat master
  shards of a fused state (`collectives.unit_collectives_flat`; a fused state has no
  chunks, see `init_state`). A leaf the caller sharded over other mesh axes
  (`model_specs`) on dims other than its shard dim is gathered and reduce-scattered one
  collective per param, manual over those axes too (`collectives.unit_collectives(own=)`).
  `outer_once`: the reduce-scatters leave "replica" out, summed across once per step
  (`all_reduce_outer`), as HFSDP's are (`scatter_outer`)."""
  fsdp = fsdp or FSDPConfig()
  units = units_of(layout, fsdp.param_dtype, config.grad_dtype is not None)
  # HFSDP, or HSDP with grad accumulation: summed over "replica" once per step, after the
  # micro-batches (`scatter_outer`, `all_reduce_outer`)
  outer = layout.outer > 1 or outer_once
  reduce_axes = tuple(a for a in data_axes(mesh) if a != REPLICA) if outer else None
  grad_dtypes = lambda u: {p.index: jnp.dtype(dtype) for b, dtype in u.grad for p in b.params}
  if fused:
    keys = {
      named.bucket: key for named, key in zip(bucket_names(layout), flat_keys(layout).values())
    }
    out = []
    for u in units:
      grad = tuple(
        (b, dtype, master_dtype(layout.leaves[b.params[0].index].dtype), keys[b])
        for b, dtype in u.grad
      )
      out.append(
        fsdp_unit.UnitIO(
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
            reduce_axes=reduce_axes,
          ),
          shards=tuple(k for *_, k in grad),
          grad_dtypes=grad_dtypes(u),
        )
      )
    return out
  chunks_ok = chunks
  chunks = chunked_leaves(layout, fsdp) if chunks else {}
  named = lookup_paths([leaf.path for leaf in layout.leaves], fsdp)
  lookups = {leaf.index for leaf in layout.leaves if leaf.path in named}
  # Tensor parallel, sharded over "data" on a dim of its own: per param, manual over its
  # automatic axes (an expert param's "expert" is one of the step's manual axes already);
  # a stacked unit's collectives see one layer
  specs = param_specs(layout)
  layers = [dims[1:] if leaf.layers else dims for leaf, dims in zip(layout.leaves, model_specs)]
  own = own_specs(layers, {i: s.axis for i, s in specs.items()}, data_axes(mesh))
  # A table computed by rows sums its gradient over "data" alone, from params the loss sees
  # whole over the other axes (`FSDPConfig.vocab_parallel`).
  tables = data_axes(mesh) == (DATA,) and not any(map(any, model_specs)) and layout.outer == 1
  return [
    fsdp_unit.UnitIO(
      name=u.name,
      trainable=u.trainable,
      frozen=u.frozen,
      stacked=bool(u.layers),
      collectives=collectives.unit_collectives(
        u.gather,
        u.grad,
        {i: master_dtype(layout.leaves[i].dtype) for i in u.trainable},
        dp=dp_size(mesh),
        axes=data_axes(mesh),
        average=config.average_in_collective,
        own=own,
        reduce_axes=reduce_axes,
        experts=[i for i, e in enumerate(experts_of(model_specs)) if e],
      )._replace(**({} if tables and chunks_ok else {"table_rows": None})),
      chunks={i: chunks[i] for i in u.leaves if i in chunks},
      grad_dtypes=grad_dtypes(u),
      shard_dims={i: layout.leaves[i].shard_axis for i in u.leaves},
      lookups=frozenset(i for i in u.leaves if i in lookups),
    )
    for u in units
  ]


@dataclasses.dataclass(frozen=True)
class _UnitLoss:
  """One device's loss of one micro-batch, divided by k: `loss_fn` through
  `loop.call_loss`, with every unit gathered where the traced program uses it
  (`call_with_units`), or (`whole`) on params gathered once for the step."""

  step: FSDPStep
  layout: Layout
  stored: list
  """The state's `params` leaves (frozen params' rows; None for trainable ones)."""
  units: list
  key: Any
  """This device's key data for the step (None without one)."""

  def _call(self, tree, micro_batch, key, model_state):
    step = self.step
    return loop.call_loss(
      step.loss_fn, step.has_aux, tree, micro_batch, key, model_state, per_token=step.per_token
    )

  def __call__(self, tmaster, micro_batch, number, model_state):
    loss, extra = call_with_units(
      self._call,
      self.layout,
      self.stored,
      tmaster,
      self.units,
      self.step.fsdp,
      data_axes(self.step.mesh),
      micro_batch,
      loop.micro_key(self.key, number),
      model_state,
    )
    return loss / self.step.grad_accum_steps, extra

  def whole(self, full, trained, micro_batch, number, model_state):
    """The loss on `full` (every leaf gathered whole), with `trained` (the trainable ones,
    differentiated) in place."""
    leaves = [trained.get(leaf.index, full[leaf.index]) for leaf in self.layout.leaves]
    tree = tree_of(self.layout, leaves)
    loss, extra = self._call(tree, micro_batch, loop.micro_key(self.key, number), model_state)
    return loss / self.step.grad_accum_steps, extra


@dataclasses.dataclass(frozen=True)
class FSDPStep:
  """`optim_grads_params` as a `step.StepStrategy` (see the module docstring)."""

  loss_fn: LossFn
  mesh: Any
  config: DDPConfig
  fsdp: FSDPConfig
  grad_accum_steps: int = 1
  has_aux: bool = False
  per_token: bool = False
  """`loss_fn` returns `(loss_sum, token_count)` (see [Note: per-token loss] in step.py)."""

  def check_state(self, state: TrainState) -> None:
    _check_state(state, self.mesh, self.config, self.fsdp)

  def state_specs(self, state: TrainState) -> TrainState:
    return state_specs(state)

  def compiler_options(self) -> dict[str, Any]:
    return compiler_options(self.mesh.devices.flat[0].platform, self.fsdp)

  def in_specs(self, state: TrainState) -> step_lib.StepInputs:
    specs = state_specs(state)
    params, master = manual_specs(state)
    return step_lib.StepInputs(
      params=params,
      master=master,
      batch=P(data_axes(self.mesh)),
      key=specs.rng,
      model_state=specs.model_state,
    )

  def out_specs(self, state: TrainState):
    specs = state_specs(state)
    tokens = P() if self.per_token else None
    out = step_lib.LocalGrads(manual_specs(state)[1], P(), P(), P(), specs.model_state, tokens)
    if not runs_auto(self.mesh, state.model_specs):
      return out, None
    return out, dataclasses.replace(out, grads=specs.master)

  def local_grads(self, state: TrainState, inputs: step_lib.StepInputs) -> step_lib.LocalGrads:
    """Per device: this device's rows of every trainable param's grad (a fused state: its
    flat shard of every unit bucket), the loss, the aux and the new model state."""
    layout, fused, fsdp = state.layout, state.fused, self.fsdp
    axes, dp, k = data_axes(self.mesh), dp_size(self.mesh), self.grad_accum_steps
    key = loop.device_key(inputs.key, collectives.data_index(axes))
    stored = leaves_of(inputs.params, layout)
    outer_once = self._outer_once(layout)
    # Row-block gathers happen inside run_loss only (not in the gathered-once accumulation).
    units = unit_collectives(
      layout,
      self.mesh,
      self.config,
      fsdp,
      fused,
      chunks=k == 1 or fsdp.reshard_after_backward,
      model_specs=state.model_specs,
      outer_once=outer_once,
    )
    unit_loss = _UnitLoss(self, layout, stored, units, key)
    unit_grad = jax.value_and_grad(unit_loss, has_aux=True)
    tmaster = unit_values(inputs.master, layout, fused, inputs.params)
    if layout.outer > 1:
      # HFSDP ([Note: HFSDP compute rows]): the compute rows, differentiated in the master
      # dtype (the reduce-scatter's shard is fp32) and varying over "replica", so that no
      # implicit psum over it runs
      tmaster = collectives.make_varying(
        {i: x.astype(master_dtype(x.dtype)) for i, x in tmaster.items()}, (REPLICA,)
      )
    elif outer_once:  # the shards, like their cotangents, differ across "replica" in the loop
      tmaster = collectives.make_varying(tmaster, (REPLICA,))
    # Three micro-batch modes. k == 1: one pass, the units' own gathers and reduce-scatters
    # (`run_loss`). k > 1 with `reshard_after_backward=False`: every unit is gathered once,
    # outside any custom_vjp, the k micro-batches differentiate the whole params and
    # accumulate whole-size fp32 grads locally (no collective per micro-batch, at the cost
    # of holding the gathered params and whole grads for the step), then one reduce-scatter
    # per unit. Otherwise: each micro-batch runs as k == 1 does and the reduced shards add
    # up; the memory stays FSDP's, and the collectives run k times.
    if k == 1:
      (loss, (aux, model_state)), grads = unit_grad(tmaster, inputs.batch, 0, inputs.model_state)
      model_state = collectives.sync_model_state(model_state, axes)
      aux = loop.mean_micro(None, aux, 1)
    elif not fsdp.reshard_after_backward:  # one gather and one reduce-scatter per step
      micro = step_lib.micro_batches(inputs.batch, k)
      # The same values as `call_with_units`'s, each unit gathered whole here instead
      values = dict(enumerate(stored))
      values.update(tmaster)
      full = {**values, **fsdp_unit.gather_units(units, values)}
      trained = {leaf.index: full[leaf.index] for leaf in layout.leaves if leaf.trainable}
      whole_grad = jax.value_and_grad(functools.partial(unit_loss.whole, full), has_aux=True)
      # fp32 whole-size accumulators, varying: each device sums its own micro-batches' grads
      zeros = {i: jnp.zeros(x.shape, jnp.float32) for i, x in trained.items()}
      each = step_lib.accumulate(
        functools.partial(whole_grad, trained),
        collectives.make_varying(zeros, axes),
        micro,
        inputs.model_state,
        axes,
      )
      loss, model_state = each.loss, each.model_state
      aux = loop.mean_micro(each.auxs, None, k)
      grads = fsdp_unit.scatter_units(units, each.grads)
    else:  # every micro-batch gathers and reduce-scatters; the shards add up
      each = step_lib.accumulate(
        functools.partial(unit_grad, tmaster),
        jax.tree.map(jnp.zeros_like, tmaster),
        step_lib.micro_batches(inputs.batch, k),
        inputs.model_state,
        axes,
      )
      loss, grads, model_state = each.loss, each.grads, each.model_state
      aux = loop.mean_micro(each.auxs, None, k)
      if outer_once:
        grads = self._all_reduce_outer(grads, layout, fused)
    aux, count = loop.take_count(aux, self.per_token)
    aux = collectives.average_aux(aux, axes)
    if layout.outer > 1:  # HFSDP: one reduce-scatter per unit bucket across "replica"
      grads = scatter_outer(grads, layout)
    # The global mean loss and grad norm in one collective: every device holds a distinct
    # 1/dp of each reduced grad (zero padding) and the replicas hold the same shards (HFSDP:
    # distinct ones), so the norm² of the local shards summed over all devices counts each
    # element `replicas` times; an expert param's shards differ across "expert" too (`ep`
    # times fewer replicas).
    replicas = 1 if layout.outer > 1 else dp // self.mesh.shape[DATA]
    ep = self.mesh.shape.get(EXPERT, 1)
    experts = {leaf.index for leaf in layout.leaves if leaf.expert}
    squares = sum(
      jnp.sum(jnp.square(g.astype(jnp.float32))) * (ep if i in experts else 1)
      for i, g in grads.items()
    )
    # `squares` is summed together with the loss, which varies over every data axis: mark it
    # varying over the axes its shards do not ([Note: varying values] in collectives.py)
    if replicas > 1:
      squares = collectives.make_varying(squares, [a for a in axes if a != DATA])
    scalars = step_lib.global_loss_and_norm(loss, squares, axes, dp, replicas, count, k)
    grads = step_lib.divide_by_count(grads, scalars.count)
    if fused:
      grads = {name: grads[key] for name, key in flat_keys(layout).items()}
    else:
      grads = tree_of(layout, [grads.get(leaf.index) for leaf in layout.leaves])
    return step_lib.LocalGrads(
      grads, scalars.loss, scalars.grad_norm, aux, model_state, scalars.tokens
    )

  def _outer_once(self, layout: Layout) -> bool:
    """HSDP (`outer_dp_sharding_strategy="no_shard"`, a "replica" axis) whose micro-batches
    each reduce-scatter (k > 1, `reshard_after_backward`): over the data axes but "replica",
    summed across it once per step (`_all_reduce_outer`). HFSDP sums across it once per
    step already (`scatter_outer`); units kept gathered reduce once per step anyway."""
    replicas = self.mesh.shape.get(REPLICA, 1)
    accumulates = self.grad_accum_steps > 1 and self.fsdp.reshard_after_backward
    return accumulates and replicas > 1 and layout.outer == 1

  def _all_reduce_outer(self, grads: dict, layout: Layout, fused: bool) -> dict:
    """The micro-batches' summed shards (`{leaf: block}`, a fused state's `{FlatKey: flat
    shard}`) all-reduced across "replica": one all-reduce per unit grad bucket, in the dtype
    its reduce-scatters moved (See [Note: the sum across "replica" once per step] in
    collectives.py)."""
    keys = dict(zip((named.bucket for named in bucket_names(layout)), flat_keys(layout).values()))
    out = dict(grads)
    for unit in units_of(layout, self.fsdp.param_dtype, self.config.grad_dtype is not None):
      for b, grad_dtype in unit.grad:
        names = [keys[b]] if fused else [p.index for p in b.params]
        total = collectives.all_reduce_outer([grads[n] for n in names], grad_dtype)
        out.update(zip(names, total))
    return out

  def call_with_params(self, state: TrainState, inputs: step_lib.StepInputs, fn: Callable):
    """Inside the `shard_map`: `fn(params, batch, model_state)` with every unit gathered
    where the traced program uses it (`call_with_units`)."""
    layout, fused = state.layout, state.fused
    return call_with_units(
      fn,
      layout,
      leaves_of(inputs.params, layout),
      unit_values(inputs.master, layout, fused, inputs.params),
      unit_collectives(
        layout, self.mesh, self.config, self.fsdp, fused, model_specs=state.model_specs
      ),
      self.fsdp,
      data_axes(self.mesh),
      inputs.batch,
      inputs.model_state,
    )

  def update(self, tx, state: TrainState, out: step_lib.LocalGrads):
    layout = state.layout
    # fused: one update on the flat unit buckets (see the module docstring)
    opt_params = state.master if state.fused else opt_params_of(layout, state.params, state.master)
    if self.config.optimizer_cpu_offload:  # streamed a piece at a time, back to host memory
      specs = self.state_specs(state)
      param_specs = (
        specs.master if state.fused else opt_params_of(layout, specs.params, specs.master)
      )
      master, opt_state = update_offloaded(
        tx, out.grads, state.opt_state, opt_params, self.mesh, (specs.opt_state, param_specs)
      )
    else:
      updates, opt_state = loop.tx_update(tx, out.grads, state.opt_state, opt_params, self.mesh)
      master = optax.apply_updates(opt_params, updates)
    new_state = dataclasses.replace(state, master=master, opt_state=opt_state)
    if layout.outer > 1:  # HFSDP: the updated params back into the compute rows
      on_device = dataclasses.replace(new_state, master=to_device(new_state.master))
      new_state = dataclasses.replace(new_state, params=gather_outer(on_device, self.mesh))
    # The NaN check names leaves: a fused state's flat shards are cut into per-leaf blocks
    nan_check = state.fused and self.config.check_for_nan_in_grad
    return new_state, grad_blocks(out.grads, layout) if nan_check else out.grads


def make_grad_fn(
  loss_fn: LossFn,
  mesh,
  config: DDPConfig,
  *,
  grad_accum_steps: int = 1,
  fsdp: FSDPConfig | None = None,
  has_aux: bool = False,
) -> Callable[[TrainState, PyTree], step_lib.LocalGrads]:
  """`grad_fn(state, batch) -> step.LocalGrads`: what an FSDP step hands the optimizer.

  Its `grads` is a tree like `state.master`: each trainable param's reduced (mean over the
  global batch) gradient, padded like the master and sharded over "data" like it, so every
  device holds 1/dp of it; `loss` is the global mean and `grad_norm` the global norm of
  `grads`, both from one scalar all-reduce; `aux` (None without `has_aux`) and the new
  `model_state` (None when the state holds none) are as `jaxdp.make_train_step` describes.
  Traceable; `make_train_step` runs the same inside its jitted step.
  """
  strategy = FSDPStep(loss_fn, mesh, config, fsdp or FSDPConfig(), grad_accum_steps, has_aux)
  return functools.partial(step_lib.run_local_grads, strategy, mesh)


def scatter_outer(grads: dict, layout: Layout) -> dict:
  """Inside the step, HFSDP: `{leaf: this device's block of its grad}` (reduced over
  "data") reduced over "replica" too, one reduce-scatter per unit bucket
  (`collectives.reduce_scatter_outer`): each device's 1/replicas of the block, the
  master's shape."""
  out = {}
  for buf in layout.buffers:
    for b in buf.buckets:
      blocks = [grads[p.index] for p in b.params]
      shards = collectives.reduce_scatter_outer(
        blocks, outer_bucket(b, layout.dp, layout.outer), buf.grad_dtype
      )
      out.update((p.index, g) for p, g in zip(b.params, shards))
  return out


def gather_outer(state: TrainState, mesh) -> PyTree:
  """HFSDP after the update: `state.params` with each trainable param's compute rows
  (sharded over "data") all-gathered across "replica" from the master (sharded over both),
  cast to the param dtype: one all-gather per unit bucket (`collectives.all_gather_outer`)."""
  layout = state.layout
  params_spec, master_spec = manual_specs(state)

  # A `shard_map` of its own: the step's `shard_map` ends with `run_local_grads`, and the
  # optax update before this runs in the global view
  def local(master, params):
    blocks, out = leaves_of(master, layout), leaves_of(params, layout)
    for buf in layout.buffers:
      for b in buf.buckets:
        shards = [blocks[p.index] for p in b.params]
        full = collectives.all_gather_outer(
          shards, outer_bucket(b, layout.dp, layout.outer), buf.param_dtype
        )
        for p, x in zip(b.params, full):
          out[p.index] = x
    return tree_of(layout, out)

  return run_manual(local, mesh, (master_spec, params_spec), params_spec)(
    state.master, state.params
  )


def compiler_options(platform: str, fsdp: FSDPConfig | None = None) -> dict[str, Any]:
  """jaxdp's options (buckets stay separate collectives), plus, on GPU, XLA's collective
  pipeliner for the reduce-scatters and, for a step with scanned units
  (`FSDPConfig(stacked=)`), XLA's all-gather combiner: a layer's params, gathered one
  all-gather each one iteration ahead of their use, then move in one collective (one
  latency, not one per param: most of their time across hosts). The unrolled units'
  gathers are one collective each already; their order is kept by data dependencies."""
  fsdp = fsdp or FSDPConfig()
  # prefetch=0: a layer's params gathered in its own iteration, one by one (not combined)
  options = base_compiler_options(platform, scanned=bool(fsdp.stacked) and fsdp.prefetch > 0)
  if platform in GPU_PLATFORMS:
    options.update(first_known(REDUCE_SCATTER_PIPELINER))
  return options


def _check_state(state, mesh, config: DDPConfig, fsdp: FSDPConfig):
  checks.check_state(state, mesh, config, fsdp)
  layout = state.layout
  abstract = jax.tree.unflatten(
    layout.treedef, [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in layout.leaves]
  )
  units, stacked = assign_units(abstract, fsdp)
  if layout.units is None or any(
    leaf.unit != units[leaf.path] or bool(leaf.layers) != (leaf.path in stacked)
    for leaf in layout.leaves
  ):
    raise ValueError(
      f"the state's units were made by another FSDPConfig than this step's {fsdp}; pass "
      "the same fsdp= to init_state and make_train_step"
    )
