"""Every collective jaxdp issues, and the grad-ready hook that issues them.

The only module that calls `jax.lax` collectives (Megatron's `start_grad_sync` /
`start_param_sync`). It runs inside `jax.shard_map` over the data axes. Everything else
asks it to "reduce this bucket" or "gather this bucket".
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable, Collection, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxdp._src import jaxprs
from jaxdp._src.buffer import (
  bucket_ravel,
  bucket_unravel,
  pad_rows,
  shard_ravel,
  shard_unravel,
  unpad_rows,
)
from jaxdp._src.layout import Bucket, Layout, ParamSpec, layer_bucket
from jaxdp._src.mesh import DATA, EXPERT, REPLICA


# [Note: varying values]
# Inside `jax.shard_map` every value's type says which manual mesh axes it varies over
# (https://docs.jax.dev/en/latest/notebooks/shard_map.html, "efficient transposition").
# `jax.grad` of a loss that reads a value replicated over "data" sums its cotangent over
# "data" for us: a psum per param at the end of the backward, none of it in buckets, and
# none of it overlapped. So every trainable param enters the loss marked varying
# (`make_varying`, a no-op in the compiled program) and the grad-ready hooks issue the
# reductions themselves. Scan carries and sums that meet varying values (a loss
# accumulator, zero grads) are marked varying too, or their types would not match.
#
# [Note: the sum across "replica" once per step]
# HSDP (a sharded strategy on a ("replica", "data") mesh) with `grad_accum_steps=k` would
# cross the slow network between replicas k times a step if every micro-batch's
# reduce-scatter summed over "replica" too. A sum is linear, so each micro-batch reduces
# over the data axes but "replica" (the 1/dp of the mean included: `Reduction.dp` counts
# the replicas), the step adds up the k shards, which differ across "replica", and one
# all-reduce of the sum across "replica" ends the step (`all_reduce_outer`): Megatron-FSDP's
# `sync_model_each_microbatch=False`, FSDP2's `set_requires_all_reduce(False)` until the
# last micro-batch. The shard in flight is typed varying over "replica" ([Note: varying
# values]) until that all-reduce.
#
# [Note: the sink]
# A hook cannot return a value of another shape or dtype from the backward than its input
# had in the forward: a param's cotangent is the param's shape. The reduced bucket (fp32
# main grads, a 1/dp shard, one flat buffer) therefore leaves through a second argument,
# the *sink*: a zero array of the reduced buffer's shape that the loss takes and ignores
# (`sink_for`), whose cotangent the hook's backward sets to the reduced buffer while the
# params get zeros. Differentiating w.r.t. the sinks gives the reduced grads, each as soon
# as its bucket's cotangents exist. Megatron's `register_grad_ready` + `start_grad_sync`
# do the same with a backward hook and a side buffer.


def varying_axes(x) -> frozenset:
  """The mesh axes a value inside `jax.shard_map` varies over (empty outside one)."""
  return jaxprs.varying(jax.typeof(x))


def make_varying(tree, axes: Sequence[str]):
  """Marks replicated values as varying over `axes`, so that `jax.grad` does not psum them;
  axes a value already varies over are left as they are."""

  def one(x):
    missing = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(one, tree)


def manual_over(spec, f: Callable) -> Callable:
  """`f` manual over the mesh axes `spec` (a PartitionSpec) names too, on this device's
  block of each of them; `f` itself for None. Inside the step's `shard_map` the compiler
  first gathers an operand whole over the automatic axes before a collective over a manual
  one: a tensor-parallel leaf's gather over `DATA` would start with one over "model". Its
  collectives run so instead (`own` in this module: leaf -> its caller's spec), each on the
  device's own slice."""
  if spec is None:
    return f
  names = {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
  return jax.shard_map(f, in_specs=spec, out_specs=spec, axis_names=names)


def sum_over(x, axes: Sequence[str]):
  """Sum of a per-device scalar over `axes` (for metrics and norms)."""
  return jax.lax.psum(x, tuple(axes))


def mean_over(x, axes: Sequence[str]):
  """Mean of a per-device scalar over `axes` (for metrics)."""
  return jax.lax.pmean(x, tuple(axes))


def data_index(axes: Sequence[str]) -> jax.Array:
  """This device's index among the data-parallel shards of the batch (row-major over `axes`,
  as the batch is split by `P(axes)`)."""
  index = jnp.zeros((), jnp.int32)
  for a in axes:
    index = index * jax.lax.axis_size(a) + jax.lax.axis_index(a)
  return index


def _vary(x, axes: Sequence[str]):
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def average_aux(tree, axes: Sequence[str]):
  """The mean of every leaf over `axes` (aux metrics), in float32 for non-float leaves."""

  def mean(x):
    x = x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)
    return jax.lax.pmean(_vary(x, axes), tuple(axes))

  return jax.tree.map(mean, tree)


def sync_model_state(tree, axes: Sequence[str]):
  """Mutable model state made equal on every device: a float leaf that differs across
  `axes` (each device updated it from its own shard) is averaged over the axes it varies
  over; a non-float leaf that differs takes the first shard's value (torch DDP's buffer
  broadcast); a leaf that is already the same everywhere (the model reduced it itself, e.g.
  SyncBatchNorm's `pmean`, or left it alone) is kept as it is."""

  def sync(x):
    varying = tuple(a for a in axes if a in jax.typeof(x).manual_axis_type.varying)
    if not varying:
      return x
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return jax.lax.pmean(x, varying)
    first = data_index(varying) == 0
    y = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
    return jax.lax.psum(jnp.where(first, y, jnp.zeros_like(y)), varying).astype(x.dtype)

  return jax.tree.map(sync, tree)


# [Note: a table computed by rows]
# An FSDP param read by rows where it is used (a vocabulary table: `h @ out.T`, `embed[ids]`)
# can stay sharded: each device computes with its own rows and the *activations* move
# instead of the param (Megatron's vocab-parallel layers, over the data axis). The product's
# rows of every device's activations are computed where that device's block of the table
# is, then exchanged (`exchange_batch`); a lookup's rows are found where they are and summed
# into their device (`scatter_batch`). The param's gradient is this device's rows summed
# over every device's batch: what the reduce-scatter of every device's whole gradient gives,
# reduced already (`UnitCollectives.table_rows` scales it as `reduce_bucket` does).


def gather_batch(x: jax.Array, axis: int) -> jax.Array:
  """Every device's `x` over `DATA`, stacked along `axis` in device order (tiled)."""
  return jax.lax.all_gather(x, DATA, axis=axis, tiled=True, to="varying")


def scatter_batch(x: jax.Array, axis: int) -> jax.Array:
  """`x` summed over `DATA`, this device's part of `axis` (the inverse of `gather_batch`'s
  stacking: a `psum_scatter`, tiled)."""
  return jax.lax.psum_scatter(x, DATA, scatter_dimension=axis, tiled=True)


def exchange_batch(x: jax.Array, axis: int) -> jax.Array:
  """`x` cut into `DATA`-size parts along `axis`, part d sent to device d, the parts
  received stacked along `axis` in device order (an `all_to_all`, tiled, on one dim: no
  transpose inside the collective)."""
  return jax.lax.all_to_all(x, DATA, axis, axis, tiled=True)


def all_gather_bucket(
  local: Sequence[jax.Array], bucket: Bucket, dp: int, to: str = "varying"
) -> list[jax.Array]:
  """All-gathers a bucket from every device's row blocks: one collective per bucket.

  Args:
    local: this device's block (`ParamSpec.local_shape`) of each param in the bucket.
    bucket: the bucket.
    dp: size of the data axis.
    to: "varying" to feed a forward pass, "invarying" to return replicated params.

  Returns:
    The bucket's params in their full shapes.
  """
  shard = shard_ravel(local, bucket)
  full = jax.lax.all_gather(shard, DATA, tiled=True, to=to)
  return bucket_unravel(full, bucket, dp)


def holds_own(bucket: Bucket, own: Collection[int]) -> bool:
  """Does `bucket` hold an `own` leaf (a tensor-parallel leaf, whose ravel into the bucket
  would gather it whole over its other axes first), so that it is reduced per param?"""
  return any(p.index in own for p in bucket.params)


def per_param(bucket: Bucket, own: Collection[int]) -> bool:
  """Is `bucket` gathered and reduced one collective per param, no ravel: a stack's
  (`Bucket.stack`: no copy of the stacked layers), or one that `holds_own`?"""
  return bucket.stack is not None or holds_own(bucket, own)


def all_gather_params(
  masters: Sequence[Any],
  layout: Layout,
  out: Sequence[Any],
  stacks: bool = True,
  own: Mapping[int, Any] | None = None,
) -> list[Any]:
  """All-gathers every bucket of `layout` from each device's rows: one collective per bucket
  (Megatron's `start_param_sync`; per param in a `per_param` bucket), the params replicated
  ("invarying").

  Args:
    masters: per leaf in tree order, this device's rows of each trainable param (any float
      dtype: each bucket casts them to its param dtype).
    layout: the layout whose buckets to gather.
    out: per leaf, what to return for the leaves no bucket holds.
    stacks: False leaves the params of the stacks' buckets (`Bucket.stack`) as `out` has
      them (a step that gathers them layer by layer inside the scan).
    own: leaf -> its caller's spec over other mesh axes, for tensor-parallel leaves whose
      shard dim those axes leave whole: each gathers its own slice (`manual_over`).

  Returns:
    `out` with every bucket's params in their full shapes, in their param dtype.
  """
  own = own or {}
  shards = [
    [masters[p.index] for p in b.params]  # gathered per param, never ravelled
    if per_param(b, own)
    else shard_ravel([masters[p.index] for p in b.params], b, buf.param_dtype)
    for buf in layout.buffers
    for b in buf.buckets
  ]
  return all_gather_shards(shards, layout, out, stacks, own)


def all_gather_shards(
  shards: Sequence[Any],
  layout: Layout,
  out: Sequence[Any],
  stacks: bool = True,
  own: Mapping[int, Any] | None = None,
) -> list[Any]:
  """`all_gather_params` from each device's shard of every bucket (buffer and bucket order,
  any float dtype), as a fused state keeps its master; a `per_param` bucket's shard may also
  be given as its params' blocks (`ParamSpec.local_shape`), each gathered on its own."""
  own = own or {}
  out = list(out)
  buckets = [(buf, b) for buf in layout.buffers for b in buf.buckets]
  for (buf, b), shard in zip(buckets, shards):
    if b.stack is not None and not stacks:
      continue
    if per_param(b, own):
      blocks = shard if isinstance(shard, list) else shard_unravel(shard, b, layout.dp)
      for p, x in zip(b.params, blocks):
        out[p.index] = all_gather_rows(x, p, buf.param_dtype, "invarying", own.get(p.index))
      continue
    full = jax.lax.all_gather(shard.astype(buf.param_dtype), DATA, tiled=True, to="invarying")
    for p, x in zip(b.params, bucket_unravel(full, b, layout.dp)):
      out[p.index] = x
  return out


def all_gather_rows(
  block: jax.Array, spec: ParamSpec, dtype, to: str = "varying", own=None
) -> jax.Array:
  """One param whole over `DATA` from every device's block (`spec.local_shape`): one
  all-gather on its shard dim (`spec.axis`) in `dtype`, no ravel; its padding rows cut off.
  `own`: the param's spec over other mesh axes (`manual_over`): the device's own slice."""
  gather = lambda x: jax.lax.all_gather(x, DATA, axis=spec.axis, tiled=True, to=to)
  return unpad_rows(manual_over(own, gather)(block.astype(dtype)), spec)


@dataclasses.dataclass(frozen=True)
class Reduction:
  """How a gradient is summed over the data-parallel axes, whatever it is summed in: a
  ravelled bucket, one param, one layer. Static Python data, built once where the keywords
  `dp`, `axes` and `average` enter this module and handed down as they are.

  Examples:
    >>> r = Reduction(dp=8, axes=["data"], average=False)
    >>> r.axes, float(r.before_sum(jnp.float32(8.0))), float(r.after_sum(jnp.float32(1.0)))
    (('data',), 1.0, 1.0)
  """

  dp: int
  """Data-parallel size (replicas included): the mean over the devices divides by it."""
  axes: tuple[str, ...]
  """The mesh axes the sum runs over (`DATA` last)."""
  average: bool
  """Divide by `dp` after the sum (Megatron's `average_in_collective`) instead of scaling each
  device's part by `1/dp` before it."""

  def __post_init__(self):
    object.__setattr__(self, "axes", tuple(self.axes))

  def before_sum(self, x: jax.Array) -> jax.Array:
    """`x` scaled by `1/dp` unless the mean is taken after the sum (`average`)."""
    return x if self.average else x * jnp.asarray(1.0 / self.dp, x.dtype)

  def after_sum(self, x: jax.Array) -> jax.Array:
    """The sum divided by `dp` where `average` takes the mean after it."""
    return x / jnp.asarray(self.dp, x.dtype) if self.average else x

  def without(self, axis: str) -> Reduction:
    """The same reduction over `axes` less `axis` (an expert param's: its group leaves out
    `EXPERT`)."""
    return dataclasses.replace(self, axes=tuple(a for a in self.axes if a != axis))


def _scatter_rows(ct: jax.Array, axis: int, reduction: Reduction, own=None) -> jax.Array:
  """A padded cotangent reduce-scattered on its dim `axis` (`reduce_bucket` with `scatter`,
  which scatters dim 0), manual over the axes of `own` too (`manual_over`)."""

  def reduce(ct):
    if axis:
      ct = jnp.moveaxis(ct, axis, 0)
    g = reduce_bucket(ct, reduction, scatter=True)
    return jnp.moveaxis(g, 0, axis) if axis else g

  return manual_over(own, reduce)(ct)


def reduce_rows(
  ct: jax.Array, spec: ParamSpec, grad_dtype, reduction: Reduction, scatter: bool, own=None
):
  """One param's whole cotangent reduced on its own, no ravel, in `grad_dtype`: with
  `scatter` reduce-scattered on its shard dim, this device's block (`spec.local_shape`);
  else all-reduced whole. `own`: its spec over other mesh axes, each device reducing its own
  slice (`manual_over`)."""
  ct = ct.astype(grad_dtype)
  if scatter:
    return _scatter_rows(pad_rows(ct, spec), spec.axis, reduction, own)
  return manual_over(own, lambda x: reduce_bucket(x, reduction, scatter=False))(ct)


def reduce_scatter_layer(
  cts, bucket: Bucket, grad_dtype, own=None, *, dp: int, axes: Sequence[str], average: bool
):
  """One layer of a stack's bucket (`Bucket.stack`) reduced inside the scan's backward: the
  whole cotangents of the layer's params (`cts`, leaf index -> cotangent; a missing one
  counts as zeros) raveled into one buffer in `grad_dtype` and reduce-scattered
  (`_scatter_bucket`; `dp`, `axes`, `average` as `Reduction` takes them): one collective per
  layer; where the bucket holds an `own` leaf (leaf -> its spec of one layer over other
  mesh axes: tensor parallel) one per param, each on the device's own slice (`reduce_rows`).
  Returns this device's block of each param's layer (`layer_bucket`'s `local_shape`), in
  `bucket.params` order."""
  own = own or {}
  reduction = Reduction(dp, axes, average)
  shards = jax.lax.axis_size(DATA)
  layer = layer_bucket(bucket, shards)
  if holds_own(layer, own):
    return [
      reduce_rows(
        _whole_ct(cts, p, grad_dtype), p, grad_dtype, reduction, scatter=True, own=own.get(p.index)
      )
      for p in layer.params
    ]
  return shard_unravel(_scatter_bucket(cts, layer, grad_dtype, reduction), layer, shards)


def reduce_bucket(flat: jax.Array, reduction: Reduction, scatter: bool) -> jax.Array:
  """Reduces one ravelled bucket over the data-parallel axes (`reduction.axes`): one
  collective (two with a replica axis).

  DDP: `psum` over the axes, every device gets the whole bucket. Distributed optimizer
  (`scatter`): `psum_scatter(tiled=True)` over `DATA`, device `d` gets shard `d`, then `psum`
  over the other axes. Either pre-scaled by `1/dp` and summed, or (`average`) averaged.
  """
  flat = reduction.before_sum(flat)
  if scatter:
    out = jax.lax.psum_scatter(flat, DATA, tiled=True)
    other = tuple(a for a in reduction.axes if a != DATA)
    if other:
      out = jax.lax.psum(out, other)
  else:
    out = jax.lax.psum(flat, reduction.axes)
  return reduction.after_sum(out)


def grad_ready_hook(
  bucket: Bucket, *, grad_dtype, dp: int, scatter: bool, axes: Sequence[str], average: bool
):
  """The backward hook of one bucket (Megatron's `register_grad_ready` + `start_grad_sync`).

  Returns `hook(leaves, sink, acc) -> leaves`, the identity in the forward. Its backward
  rule ravels the bucket's cotangents into one buffer of `grad_dtype`, adds `acc` (grads
  accumulated over earlier micro-batches, or zeros) and reduces it with `reduce_bucket`.
  The reduced buffer leaves as the cotangent of `sink`, so it may have another dtype or
  size than the params (fp32 main grads, a 1/dp shard); the params get zero cotangents.
  The reduction depends only on this bucket's grads, so XLA can run it while the rest of
  backward computes.

  Args:
    bucket: the bucket this hook reduces.
    grad_dtype: dtype of the reduction.
    dp: data-parallel size (replicas included), for the mean.
    scatter: reduce-scatter (each device keeps its shard) instead of all-reduce.
    axes: the data-parallel mesh axes the bucket is summed over (`DATA` last).
    average: divide by `dp` after the sum instead of scaling by `1/dp` before it.
  """
  reduction = Reduction(dp, axes, average)

  def bwd(acc, cts):  # See [Note: the sink]
    flat = bucket_ravel(cts, bucket, jax.lax.axis_size(DATA), grad_dtype) + acc
    return (
      jax.tree.map(jnp.zeros_like, cts),
      reduce_bucket(flat, reduction, scatter),
      jnp.zeros_like(acc),
    )

  return _sink_hook(bwd)


def grad_ready_hook_each(
  bucket: Bucket,
  *,
  grad_dtype,
  own: Mapping[int, Any],
  dp: int,
  scatter: bool,
  axes: Sequence[str],
  average: bool,
):
  """`grad_ready_hook` of a `per_param` bucket that holds an `own` leaf (leaf -> its caller's
  spec over other mesh axes, tensor parallel): each param's grads reduced on their own
  (`reduce_rows`), no ravel, a tensor-parallel one on this device's own slice. Its sink and
  `acc` are tuples (`sink_for(own=)`, `acc_for`): per param its reduced grad (its block with
  `scatter`, else whole), and its whole local grad accumulated in `grad_dtype`. The other
  arguments are `grad_ready_hook`'s."""
  reduce = functools.partial(
    reduce_rows, grad_dtype=grad_dtype, reduction=Reduction(dp, axes, average), scatter=scatter
  )

  def bwd(acc, cts):
    reduced = tuple(
      reduce(ct.astype(grad_dtype) + a, p, own=own.get(p.index))
      for p, ct, a in zip(bucket.params, cts, acc)
    )
    return jax.tree.map(jnp.zeros_like, cts), reduced, jax.tree.map(jnp.zeros_like, acc)

  return _sink_hook(bwd)


def _sink_hook(bwd):
  """`hook(leaves, sink, acc) -> leaves`, the identity on `leaves`, whose backward is
  `bwd(acc, cts) -> (leaves' cotangents, sink's, acc's)`: the grad-ready hooks' shape, the
  reduced grads leaving through the cotangent of `sink`."""

  @jax.custom_vjp
  def hook(leaves, sink, acc):
    del sink, acc
    return leaves

  def fwd(leaves, sink, acc):
    del sink
    return leaves, acc

  hook.defvjp(fwd, bwd)
  return hook


def sink_for(bucket: Bucket, grad_dtype, scatter: bool, varying: Sequence[str] = (), own=()) -> Any:
  """The zero input whose cotangent receives the bucket's reduced grads: one flat array, or
  for a bucket that holds an `own` leaf (`grad_ready_hook_each`) a tuple, per param its
  block (`scatter`) or its whole shape.

  `varying`: the data axes the bucket is not reduced over (an expert bucket differs across
  "expert"); with `scatter` the shard also differs across `DATA`.
  """
  shards = jax.lax.axis_size(DATA)
  axes = (*varying, DATA) if scatter else tuple(varying)
  vary = lambda x: jax.lax.pcast(x, axes, to="varying") if axes else x
  if holds_own(bucket, own):
    return tuple(
      vary(jnp.zeros(p.local_shape(shards) if scatter else p.shape, grad_dtype))
      for p in bucket.params
    )
  return vary(jnp.zeros((bucket.shard_size * (1 if scatter else shards),), grad_dtype))


def acc_for(bucket: Bucket, grad_dtype, own=()) -> Any:
  """The zero local grads of a bucket that a step accumulates over micro-batches (a
  `no_sync` accumulator): the raveled bucket, or per param its whole grad for a bucket that
  holds an `own` leaf (`grad_ready_hook_each`); varying over every data axis."""
  if holds_own(bucket, own):
    return tuple(jnp.zeros(p.shape, grad_dtype) for p in bucket.params)
  return jnp.zeros((bucket.shard_size * jax.lax.axis_size(DATA),), grad_dtype)


def ravel_local(grads: Sequence[jax.Array], bucket: Bucket, grad_dtype, own=()) -> Any:
  """A micro-batch's local grads of a bucket (`bucket.params` order, whole) in the form of
  `acc_for`: raveled, or cast one by one."""
  if holds_own(bucket, own):
    return tuple(g.astype(grad_dtype) for g in grads)
  return bucket_ravel(grads, bucket, jax.lax.axis_size(DATA), grad_dtype)


def _whole_ct(cts, p: ParamSpec, grad_dtype) -> jax.Array:
  """Leaf `p.index`'s whole cotangent in `cts`, zeros if it has none."""
  ct = cts.get(p.index)
  return jnp.zeros(p.shape, grad_dtype) if ct is None else ct


def _scatter_bucket(cts, bucket: Bucket, grad_dtype, reduction: Reduction):
  """One grad bucket of an FSDP unit reduce-scattered: its leaves' whole cotangents (`cts`,
  leaf index -> cotangent; a missing one counts as zeros) raveled in `grad_dtype`, and this
  device's flat shard of their reduced sum."""
  flat = bucket_ravel(
    [_whole_ct(cts, p, grad_dtype) for p in bucket.params],
    bucket,
    jax.lax.axis_size(DATA),
    grad_dtype,
  )
  return reduce_bucket(flat, reduction, scatter=True)


class UnitCollectives(NamedTuple):
  """One FSDP unit's collectives as plain functions (`unit_collectives` says what each
  takes and returns); FSDP's program calls them inside each unit's `custom_vjp`. The row
  gathers are None where the unit gathers no leaf by row blocks; `scatter_each` is None
  where a scanned layer reduce-scatters with `scatter`."""

  gather: Callable  # (trainable shards, frozen shards) -> {leaf: whole param}
  scatter: Callable  # {leaf: whole cotangent} -> {leaf: shard grad}
  gather_each: Callable  # as gather, one all-gather per param (inside a scan)
  gather_rows: Callable | None = None  # (leaf, rows [lo, hi) of its shard) -> every device's
  scatter_rows: Callable | None = None  # (leaf, ct of gather_rows' output) -> reduced rows
  scatter_each: Callable | None = None  # as scatter, one reduce-scatter per param (in a scan)
  table_rows: Callable | None = None  # (leaf, its rows' grad over every batch) -> reduced rows


# A unit's collectives are the methods of a frozen record of what they share (its buckets,
# dtypes, reduction), handed to FSDP's program as bound methods in a `UnitCollectives`:
# `_UnitOfBlocks` for a per-leaf state, `_UnitOfFlatShards` for a fused one. `eq=False`
# keeps them hashed by identity, as the functions they are handed out as.


@dataclasses.dataclass(frozen=True, eq=False)
class _UnitOfBlocks:
  """One FSDP unit whose trainable params arrive as per-leaf row blocks: what its
  collectives share (`unit_collectives` gives each field's meaning). The methods named as
  `UnitCollectives`' fields are its functions; the others are their shared steps."""

  gather_buckets: Sequence[tuple[Bucket, Any]]  # (bucket, param dtype)
  grad_buckets: Sequence[tuple[Bucket, Any]]  # (bucket, grad dtype)
  cotangent_dtypes: Mapping[int, Any]  # leaf -> dtype of its trainable block
  reduction: Reduction  # over the reduce axes; an expert leaf's: `reduction_of`
  other: tuple[str, ...]  # the data axes besides `DATA`, which a gathered param varies over
  own: Mapping[int, Any] = dataclasses.field(default_factory=dict)  # leaf -> tensor-parallel spec
  experts: frozenset[int] = frozenset()

  @functools.cached_property
  def specs(self) -> dict[int, ParamSpec]:
    return {p.index: p for b, _ in self.gather_buckets for p in b.params}

  @functools.cached_property
  def dtypes(self) -> dict[int, Any]:  # leaf -> the dtype it is gathered in
    return {p.index: dtype for b, dtype in self.gather_buckets for p in b.params}

  @functools.cached_property
  def grad_dtypes(self) -> dict[int, Any]:  # leaf -> the dtype it is reduced in
    return {p.index: dtype for b, dtype in self.grad_buckets for p in b.params}

  def reduction_of(self, leaf: int) -> Reduction:
    """The reduction of `leaf`'s grads: an expert param's (split over `EXPERT`, a rank's
    experts on each device) over the expert-data-parallel group, the axes less `EXPERT`."""
    return self.reduction.without(EXPERT) if leaf in self.experts else self.reduction

  def varying(self, x: jax.Array) -> jax.Array:
    """A gathered param, made varying over the other data axes (it is the same across them)."""
    return make_varying(x, self.other) if self.other else x

  def whole(self, bucket: Bucket, apart: Collection[int]) -> bool:
    """Is `bucket` moved by one collective: no `own` leaf, no `apart` leaf in it?"""
    return not any(p.index in self.own or p.index in apart for p in bucket.params)

  def gather_rows(self, leaf: int, rows: jax.Array, dtype=None) -> jax.Array:
    axis = self.specs[leaf].axis
    gather = lambda r: jax.lax.all_gather(r, DATA, axis=axis, tiled=True, to="varying")
    return self.varying(
      manual_over(self.own.get(leaf), gather)(rows.astype(dtype or self.dtypes[leaf]))
    )

  def scatter_rows(self, leaf: int, ct: jax.Array) -> jax.Array:
    ct = ct.astype(self.grad_dtypes[leaf])
    g = _scatter_rows(ct, self.specs[leaf].axis, self.reduction_of(leaf), self.own.get(leaf))
    return g.astype(self.cotangent_dtypes[leaf])

  def table_rows(self, leaf: int, grad: jax.Array) -> jax.Array:
    # Scaled as `reduce_bucket` scales, with no collective: the rows are summed already.
    g = grad.astype(self.grad_dtypes[leaf])
    return self.reduction.after_sum(self.reduction.before_sum(g)).astype(
      self.cotangent_dtypes[leaf]
    )

  def gather_each_of(self, local, buckets, casts, apart) -> dict:
    """The params of `buckets` but `apart`, from their blocks in `local`: one all-gather
    per param, no ravel."""
    return {
      p.index: unpad_rows(self.gather_rows(p.index, local[p.index], casts.get(p.index)), p)
      for b, _ in buckets
      for p in b.params
      if p.index not in apart
    }

  def scatter_each_of(self, cts, buckets, apart) -> dict:
    """The grads of `buckets`' params but `apart`: one reduce-scatter per param, no ravel."""
    return {
      p.index: self.scatter_rows(p.index, pad_rows(_whole_ct(cts, p, self.grad_dtypes[p.index]), p))
      for b, _ in buckets
      for p in b.params
      if p.index not in apart
    }

  def gather(self, trainable, frozen, casts=None, apart=frozenset()) -> dict:
    local, casts = {**trainable, **frozen}, casts or {}
    shards = jax.lax.axis_size(DATA)
    out = {}
    for b, dtype in self.gather_buckets:
      moved = {casts.get(p.index, dtype) for p in b.params}
      if not self.whole(b, apart) or len(moved) > 1:
        out.update(self.gather_each_of(local, [(b, dtype)], casts, apart))
        continue
      (dtype,) = moved  # every param of the bucket cast to one dtype: gathered in it
      full = all_gather_bucket([local[p.index].astype(dtype) for p in b.params], b, shards)
      for p, x in zip(b.params, full):
        out[p.index] = self.varying(x)
    return out

  def scatter(self, cts, apart=frozenset()) -> dict:
    shards = jax.lax.axis_size(DATA)
    grads = {}
    for b, grad_dtype in self.grad_buckets:
      if not self.whole(b, apart):
        grads.update(self.scatter_each_of(cts, [(b, grad_dtype)], apart))
        continue
      # A bucket holds expert params only or none: its first leaf's reduction is all of theirs.
      shard = _scatter_bucket(cts, b, grad_dtype, self.reduction_of(b.params[0].index))
      for p, g in zip(b.params, shard_unravel(shard, b, shards)):
        grads[p.index] = g.astype(self.cotangent_dtypes[p.index])
    return grads

  def gather_each(self, trainable, frozen, casts=None, apart=frozenset()) -> dict:
    return self.gather_each_of({**trainable, **frozen}, self.gather_buckets, casts or {}, apart)

  def scatter_each(self, cts, apart=frozenset()) -> dict:
    return self.scatter_each_of(cts, self.grad_buckets, apart)


def unit_collectives(
  gather_buckets: Sequence[tuple[Bucket, Any]],
  grad_buckets: Sequence[tuple[Bucket, Any]],
  cotangent_dtypes: Mapping[int, Any],
  *,
  dp: int,
  axes: Sequence[str],
  average: bool,
  own: Mapping[int, Any] | None = None,
  reduce_axes: Sequence[str] | None = None,
  experts: Collection[int] = (),
) -> UnitCollectives:
  """The gather and the reduce-scatter of one FSDP unit (FSDP's pre-forward and post-backward
  collectives), as plain functions; FSDP's program calls them inside each unit's
  `custom_vjp` (the gather in its forward and again in its backward, the reduce-scatter at
  the end of its backward).

  Returns a `UnitCollectives`:

  * `gather(trainable, frozen, casts=None, apart=()) -> full`: `trainable` and `frozen` map
    leaf indices to this device's row blocks `(rows / dp, ...)` of the unit's params
    (`trainable` in the optimizer's dtype, e.g. fp32 masters); `full` maps every leaf of the
    unit to its whole param. Per gather bucket (one per param dtype): cast the blocks to the
    param dtype, ravel them into one shard, `all_gather` it: one collective. `casts` maps a
    leaf to the dtype it moves in instead (the loss casts it to that before every use); a
    bucket whose leaves do not all move in one dtype is gathered one collective per param.
  * `scatter(cts, apart=()) -> grads`: `cts` maps the unit's trainable leaves to their
    whole-param cotangents; per grad bucket, ravel them in the grad dtype and
    `reduce_bucket(scatter=True)` them: one reduce-scatter, whose shard (cast to
    `cotangent_dtypes`) is this device's block of each leaf's reduced gradient. A missing
    cotangent counts as zeros.
  * `gather_each(trainable, frozen, casts=None, apart=()) -> full`: as `gather`, one
    `all_gather` per param (on its shard dim, no ravel): a scanned layer's params arrive one
    by one, so each param's gather overlaps the compute of the ones before it inside the
    loop iteration.
  * `gather_rows(leaf, rows, dtype=None) -> gathered`: `rows` is a slice `[lo, hi)` of this
    device's block of a leaf gathered by row blocks (`FSDPConfig(chunks=)`); `gathered`
    stacks every device's slice, in the param dtype (or `dtype`: the loss casts the param
    before using it, and the cast moves): rows `d * rows/dp + [lo, hi)` of the padded param
    for d = 0..dp-1.
  * `scatter_rows(leaf, ct) -> grad`: the inverse collective of `gather_rows` for the
    cotangent of `gathered`: reduce-scattered in the grad dtype, this device's `[lo, hi)`
    rows of the reduced gradient, in the `cotangent_dtypes` dtype.
  * `scatter_each(cts, apart=()) -> grads`: as `scatter`, one reduce-scatter per param (on
    its shard dim, no ravel): inside a scanned layer's backward, where the ravel would be a
    copy of the layer's whole-size grads alive next to them (the program's memory peak).
  * `table_rows(leaf, grad) -> grad`: a table's rows computed where they are (see [Note: a
    table computed by rows]): `grad`, this device's rows' gradient summed over every
    device's batch, scaled as the reduce-scatter scales, in the `cotangent_dtypes` dtype.

  The `apart` leaves (gathered by row blocks, or tables computed by rows: never whole) are
  left out of `gather`, `scatter`, `gather_each` and `scatter_each`; the other params of a
  bucket that holds one are gathered and reduce-scattered one collective per param, and so
  are those of a bucket that holds one of the `own` leaves (a tensor-parallel leaf, split
  over another mesh axis on a dim other than its shard dim: its own all-gather over `DATA`
  keeps that split, a ravel into the bucket would not).

  Args:
    gather_buckets: `(bucket, param dtype)` over all the unit's float params.
    grad_buckets: `(bucket, grad dtype)` over the unit's trainable params.
    cotangent_dtypes: leaf index -> dtype of the `trainable` block it receives.
    dp: data-parallel size (for averaging; replicas included).
    axes: the data-parallel mesh axes (`DATA` last).
    average: average inside the collective instead of pre-scaling.
    own: leaf -> the PartitionSpec over other mesh axes its caller split it over (of one
      layer for a stacked unit), for leaves whose shard dim those axes leave whole: each of
      their gathers and reduce-scatters runs in a `shard_map` manual over those axes too,
      on this device's own slice. (Inside the step's `shard_map` the compiler first gathers
      an operand whole over the automatic axes before a collective over a manual one: a
      tensor-parallel block would be gathered over "model" first.)
    reduce_axes: the axes the reduce-scatters sum over (`DATA` last); None: `axes`.
      Without "replica", the sum over it is left to `reduce_scatter_outer` (HFSDP) or to
      `all_reduce_outer` once per step (HSDP with grad accumulation).
    experts: expert params (split over `EXPERT`, a manual axis: each device holds its
      rank's experts): their grads are reduced over `axes` less `EXPERT`, the
      expert-data-parallel group. A bucket holds expert params only or none.
  """
  axes = tuple(axes)
  unit = _UnitOfBlocks(
    gather_buckets=tuple(gather_buckets),
    grad_buckets=tuple(grad_buckets),
    cotangent_dtypes=cotangent_dtypes,
    reduction=Reduction(dp, axes if reduce_axes is None else reduce_axes, average),
    other=tuple(a for a in axes if a != DATA),
    own=own or {},
    experts=frozenset(experts),
  )
  return UnitCollectives(
    gather=unit.gather,
    scatter=unit.scatter,
    gather_each=unit.gather_each,
    gather_rows=unit.gather_rows,
    scatter_rows=unit.scatter_rows,
    scatter_each=unit.scatter_each,
    table_rows=unit.table_rows,
  )


def reduce_scatter_outer(blocks: Sequence[jax.Array], bucket: Bucket, grad_dtype) -> list:
  """HFSDP's reduce-scatter across "replica" (Megatron-FSDP's outer-DP gradient
  reduce-scatter, `outer_dp_sharding_strategy="optim"`): this device's blocks of one
  bucket's grads, already reduce-scattered over `DATA`, raveled in `grad_dtype` as
  `bucket` lays them out (`layout.outer_bucket`) and summed over `REPLICA` with one
  `psum_scatter`. Returns this device's `1 / replicas` of each block (`local_shape` of
  `bucket`'s specs), in the blocks' dtype."""
  replicas = jax.lax.axis_size(REPLICA)
  flat = bucket_ravel(blocks, bucket, replicas, grad_dtype)
  shard = jax.lax.psum_scatter(flat, REPLICA, tiled=True)
  return [g.astype(x.dtype) for g, x in zip(shard_unravel(shard, bucket, replicas), blocks)]


def all_reduce_outer(blocks: Sequence[jax.Array], grad_dtype) -> list:
  """HSDP's sum across "replica" once per step (Megatron-FSDP's outer-DP all-reduce at the
  last micro-batch, `sync_model_each_microbatch=False`): this device's blocks of one
  bucket's grads (or its one flat shard), which every micro-batch reduced over the other
  data axes and the step summed, raveled in `grad_dtype` (the dtype the micro-batches'
  reductions moved) and all-reduced over `REPLICA` with one collective. Returns the blocks
  in their own shapes and dtypes, the same on every replica. See [Note: the sum across
  "replica" once per step]."""
  flat = jnp.concatenate([x.astype(grad_dtype).reshape(-1) for x in blocks])
  total = jax.lax.psum(flat, REPLICA)
  ends = list(itertools.accumulate(x.size for x in blocks))
  parts = jnp.split(total, ends[:-1])
  return [g.reshape(x.shape).astype(x.dtype) for g, x in zip(parts, blocks)]


def all_gather_outer(shards: Sequence[jax.Array], bucket: Bucket, dtype) -> list:
  """The inverse of `reduce_scatter_outer` for the updated params: this device's
  `1 / replicas` of each param's block of `bucket` (`layout.outer_bucket`), cast to the
  param `dtype`, all-gathered across `REPLICA` with one collective. Returns every block
  (`bucket`'s param shapes) in `dtype`, the same on every replica ("invarying")."""
  full = jax.lax.all_gather(shard_ravel(shards, bucket, dtype), REPLICA, tiled=True, to="invarying")
  return bucket_unravel(full, bucket, jax.lax.axis_size(REPLICA))


def _same_params(a: Bucket, b: Bucket) -> bool:
  """Do buckets `a` and `b` hold the same params at the same offsets (a gather bucket that
  is exactly a grad bucket, whose flat shard it can gather as it is)?"""
  where = lambda bucket: [(p.index, p.offset) for p in bucket.params]
  return a.shard_size == b.shard_size and where(a) == where(b)


@dataclasses.dataclass(frozen=True, eq=False)
class _UnitOfFlatShards:
  """One FSDP unit of a fused state, whose trainable params arrive as one flat shard per
  grad bucket: what its collectives share (`unit_collectives_flat` gives each field's
  meaning). `gather`, `scatter` and `gather_each` are its `UnitCollectives` functions."""

  gather_buckets: Sequence[tuple[Bucket, Any]]  # (bucket, param dtype)
  grad_buckets: Sequence[tuple[Bucket, Any, Any, Any]]  # (bucket, grad, master dtype, key)
  reduction: Reduction
  other: tuple[str, ...]  # the data axes besides `DATA`, which a gathered param varies over

  def blocks(self, trainable) -> dict:
    """Leaf -> its block, sliced out of the flat shards `trainable` (grad bucket key ->)."""
    shards = jax.lax.axis_size(DATA)
    out = {}
    for b, _, _, key in self.grad_buckets:
      out.update((p.index, x) for p, x in zip(b.params, shard_unravel(trainable[key], b, shards)))
    return out

  def gather_each_of(self, local, frozen, casts, buckets) -> dict:
    """The params of `buckets` from their blocks (`local`, `frozen`): one all-gather per
    param, as a per-leaf state's unit gathers them."""
    per_leaf = _UnitOfBlocks(
      gather_buckets=tuple(buckets),
      grad_buckets=(),  # a gather reduces nothing
      cotangent_dtypes={},
      reduction=self.reduction,
      other=self.other,
    )
    return per_leaf.gather_each(local, frozen, casts)

  def gather(self, trainable, frozen, casts=None, apart=frozenset()) -> dict:
    shards = jax.lax.axis_size(DATA)
    local, casts = None, casts or {}  # the blocks, sliced out only where a bucket needs them
    out = {}
    for b, dtype in self.gather_buckets:
      moved = {casts.get(p.index, dtype) for p in b.params}
      if len(moved) > 1:  # some params cast, others not: one all-gather per param
        local = local if local is not None else {**self.blocks(trainable), **frozen}
        out.update(self.gather_each_of(local, {}, casts, [(b, dtype)]))
        continue
      (dtype,) = moved
      flat = next((key for g, _, _, key in self.grad_buckets if _same_params(g, b)), None)
      if flat is not None:
        shard = trainable[flat].astype(dtype)
      else:
        local = local if local is not None else {**self.blocks(trainable), **frozen}
        shard = shard_ravel([local[p.index] for p in b.params], b, dtype)
      full = jax.lax.all_gather(shard, DATA, tiled=True, to="varying")
      for p, x in zip(b.params, bucket_unravel(full, b, shards)):
        out[p.index] = make_varying(x, self.other) if self.other else x
    return out

  def scatter(self, cts, apart=frozenset()) -> dict:
    return {
      key: _scatter_bucket(cts, b, grad_dtype, self.reduction).astype(dtype)
      for b, grad_dtype, dtype, key in self.grad_buckets
    }

  def gather_each(self, trainable, frozen, casts=None, apart=frozenset()) -> dict:
    return self.gather_each_of(self.blocks(trainable), frozen, casts, self.gather_buckets)


def unit_collectives_flat(
  gather_buckets: Sequence[tuple[Bucket, Any]],
  grad_buckets: Sequence[tuple[Bucket, Any, Any, Any]],
  *,
  dp: int,
  axes: Sequence[str],
  average: bool,
  reduce_axes: Sequence[str] | None = None,
) -> UnitCollectives:
  """`unit_collectives` for a fused FSDP state, whose master is one flat shard per grad
  bucket (`distributed_optimizer.fused_master`): the gather reads the flat shards and the
  reduce-scatter's shard is returned as it is, no slicing into leaves.

  Returns `gather`, `scatter` and `gather_each` as `unit_collectives` does, except that
  `trainable` and the grads map each grad bucket's key to this device's flat shard
  `(shard_size,)` in its master dtype. A gather bucket that holds exactly the params of a
  grad bucket (a unit without frozen params of its dtype) all-gathers that flat shard cast
  to the param dtype, with no copy before the collective; one that also holds frozen
  params ravels the blocks of both (`shard_unravel` of the flat shard).

  Args:
    gather_buckets: `(bucket, param dtype)` over all the unit's float params.
    grad_buckets: `(bucket, grad dtype, master dtype, key)` over the unit's trainable
      params (the reduce-scatter runs in the grad dtype; its shard is returned in the master
      dtype under `key`).
    dp, axes, average, reduce_axes: as in `unit_collectives`.
  """
  unit = _UnitOfFlatShards(
    gather_buckets=tuple(gather_buckets),
    grad_buckets=tuple(grad_buckets),
    reduction=Reduction(dp, axes if reduce_axes is None else reduce_axes, average),
    other=tuple(a for a in axes if a != DATA),
  )
  return UnitCollectives(gather=unit.gather, scatter=unit.scatter, gather_each=unit.gather_each)
