"""Where every gradient lives: per-dtype buffers cut into buckets, from shapes alone.

This is Megatron's `param_layout.py` in static Python data. Params are grouped into one
flat buffer per (param dtype, grad dtype) key, laid out in reverse tree order (backprop
order, so the last layers' bucket fills first) and cut into buckets of at least
`bucket_size` elements without splitting a param.

A bucket is stored *shard-major*: its buffer is `dp` equal shards, and shard `d` holds rows
`[d * r, (d + 1) * r)` of every param in the bucket, where `r = rows / dp` and `rows` is the
size of the param's *shard dim* padded to a multiple of `dp`. The shard dim is the leading
one, unless another dim needs less padding (a stacked `(layers, d, 4d)` weight with fewer
layers than devices is sharded on `d`). A `psum_scatter(tiled=True)` of the bucket
therefore hands device `d` the same 1/dp of every param, so a sharded optimizer sees an
ordinary param tree (each leaf padded on its shard dim and sharded on it) and every optax
transformation (masks, global norms) stays exact. Each shard is padded at its end so that
the bucket is a multiple of `lcm(dp, 128)` elements (Megatron's bucket-end padding).

Nothing here is traced: layouts are frozen, hashable dataclasses of ints and tuples that can
be static arguments of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Collection, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
Frozen = PyTree | Callable[[str, Any], bool] | None
Units = Mapping[str, str] | Callable[[str], str] | None
Stacked = Collection[str] | Callable[[str], bool] | None


DDP_BUCKET_SIZE = 25 * 2**20 // 4
"""`no_shard`'s default bucket in elements: PyTorch DDP's 25 MiB (`bucket_cap_mb`) of fp32."""
DDP_MIN_BUCKETS = 16
"""A `no_shard` model that fits one default bucket is split into this many."""
DDP_SMALLEST_BUCKET = 16_384
"""The smallest default `no_shard` bucket, in elements (64 KiB of fp32)."""


def default_bucket_size(dp: int, strategy: str = "optim", elements: int | None = None) -> int:
  """The bucket size in elements that `DDPConfig(bucket_size=None)` means under `strategy`.

  XLA has no views into a buffer: a bucket's grads are concatenated into a copy before its
  collective (Megatron's grads are views of the buffer and pay nothing), so a bucket's size
  is transient memory in the backward. docs/design.md ("Default bucket sizes") gives the
  measurements behind each rule.

  * `no_shard` (DDP): `DDP_BUCKET_SIZE`, PyTorch DDP's 25 MiB of fp32 grads, since the copy
    is whole-size and alive at the backward's peak. A model that fits one such bucket
    (`elements`: its floating-point elements) gets `DDP_MIN_BUCKETS` buckets (of at least
    `DDP_SMALLEST_BUCKET`), so that its reduction starts inside the backward.
  * the sharded strategies: `max(16_000_000, 1_000_000 * dp)` (Megatron's rule with 16M in
    place of its 40M, so that a large embedding fills a bucket alone and its ravel is a
    bitcast; the `dp` term keeps each device's shard >= 1M elements).

  Examples:
    >>> default_bucket_size(8, "no_shard"), default_bucket_size(8), default_bucket_size(64)
    (6553600, 16000000, 64000000)
    >>> default_bucket_size(8, "no_shard", elements=834_304)  # GPT small: 16 buckets
    52144
  """
  if strategy != "no_shard":
    return max(16_000_000, 1_000_000 * dp)
  if elements is None or elements > DDP_BUCKET_SIZE:
    return DDP_BUCKET_SIZE
  return max(DDP_SMALLEST_BUCKET, -(-elements // DDP_MIN_BUCKETS))


def alone_size(strategy: str, bucket_size: int, configured: int | None = None) -> int | None:
  """`make_layout`'s `alone_over` under `strategy`: with `no_shard`'s default buckets of
  `DDP_BUCKET_SIZE` (no `configured` `DDPConfig.bucket_size`), a param larger than a bucket
  is reduced in a bucket of its own. It would overflow the bucket anyway; in one with other
  params it is copied into their concatenation, a copy as large as the param alive beside
  its grad (a large embedding's, docs/design.md "Default bucket sizes"), alone its ravel is
  a bitcast. None elsewhere: a small model's 16 buckets and the sharded strategies' keep
  their params together.

  Examples:
    >>> alone_size("no_shard", DDP_BUCKET_SIZE), alone_size("no_shard", 52_144)
    (6553600, None)
    >>> alone_size("optim", 16_000_000), alone_size("no_shard", DDP_BUCKET_SIZE, 2**20)
    (None, None)
  """
  if strategy == "no_shard" and configured is None and bucket_size == DDP_BUCKET_SIZE:
    return bucket_size
  return None


def float_elements(params) -> int:
  """The number of floating-point elements of a param tree (what `default_bucket_size`
  divides among a small model's DDP buckets)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(params) if _is_float(x.dtype))


def round_up(n: int, k: int) -> int:
  """`n` rounded up to a multiple of `k` (Megatron's `pad_to_divisor`).

  Examples:
    >>> round_up(10, 8), round_up(16, 8), round_up(0, 8)
    (16, 16, 0)
  """
  # ceil(n / k) * k in integer arithmetic
  return -(-n // k) * k


def master_dtype(dtype) -> np.dtype:
  """The dtype of the optimizer's copy of a param of `dtype`: fp32, or wider.

  Examples:
    >>> master_dtype(jnp.bfloat16), master_dtype(np.float64)
    (dtype('float32'), dtype('float64'))
  """
  return np.dtype(jnp.promote_types(dtype, jnp.float32))


# [Note: shard-major buckets]
# A bucket of `dp * shard_size` elements is `dp` shards of `shard_size` elements one after
# the other, and shard `d` is what device `d` owns: block `d` of every param of the bucket,
# in bucket order, each block starting at its `ParamSpec.offset` inside the shard. A param's
# block `d` is rows `[d * rows / dp, (d + 1) * rows / dp)` of its shard dim
# (`ParamSpec.axis`, see [Note: shard dim]) with every other dim whole, flattened row-major
# (`ParamSpec.local_shape`). Hence:
# * `rows` is the shard dim padded with zero rows to a multiple of dp (of `dp * outer`, so
#   that each block splits `outer` ways again): every device gets the same number of rows
#   of every param, and a param's blocks sit at the same offset in every shard;
# * `ParamSpec.shard_size(dp)` is one block's elements, and `Bucket.shard_size` their sum
#   rounded up to a multiple of `lcm(dp, 128) // dp`, so that the bucket is a multiple of
#   `lcm(dp, 128)` elements; the zeros after the last block of a shard are the bucket's tail;
# * element `j` of param `p`'s block `d` sits at
#   `bucket.offset + d * bucket.shard_size + p.offset + j` of its buffer.
# In this order a tiled `psum_scatter` of the flat bucket hands device `d` its blocks and a
# tiled `all_gather` rebuilds the bucket, with no reshuffle, and the sharded optimizer sees
# each leaf as an ordinary array padded on its shard dim and split over "data" on it.
# `buffer.bucket_ravel` / `bucket_unravel` move whole params into and out of this order,
# `shard_ravel` / `shard_unravel` one device's blocks. (A stacked FSDP bucket describes one
# layer of its params: `ParamSpec.layers`.)
#
# [Note: shard dim]
# Each param is split over "data" on one dim, its *shard dim*, and padded there only. It is
# the dim whose padding to a multiple of dp is the smallest fraction of its size, the
# leading one on ties (`shard_axis`): each device then holds `ceil(n / dp)` rows, 1/dp of
# the leaf plus at most one row, and a small leading dim (a `(2, d, ffn)` gate, 4 layers on
# 8 devices) is not padded to dp where another dim pads less. Dims that other mesh axes
# split (tensor or expert parallel) are passed over where the leaf has another, so that
# "data" splits each device's own slice. `make_layout` picks the dim for a size bucket's
# params; FSDP passes its own in `shard_dims` (`unit_shard_dims`). The choice is recorded
# in `ParamSpec.axis` (of a layer for stacked params) and `Leaf.shard_axis` (of the whole
# leaf), which everything downstream (collectives, views, checkpoints, the ledger) reads.
@dataclasses.dataclass(frozen=True)
class ParamSpec:
  """One param's place in its bucket (Megatron's `param_index_map` entry).

  Examples:
    >>> import jax.numpy as jnp, jaxdp
    >>> params = {"w": jnp.zeros((300, 4)), "b": jnp.zeros(3)}
    >>> layout = jaxdp.layout.make_layout(params, dp=8, bucket_size=2000)
    >>> w = layout.buffers[0].buckets[0].params[0]  # 300 rows pad to 304 = 8 x 38
    >>> w.path, w.index, w.rows, w.offset, w.shard_size(8), w.padded_shape
    ("['w']", 1, 304, 0, 152, (304, 4))
  """

  path: str
  """`jax.tree_util.keystr` of the leaf."""
  index: int
  """Position of the leaf in `jax.tree.leaves(params)`."""
  shape: tuple[int, ...]
  rows: int
  """The shard dim's size (1 for a scalar) padded up to a multiple of dp (of `dp * outer`
  with `make_layout(outer=)`)."""
  offset: int
  """Start of this param's rows inside every shard of its bucket."""
  layers: int = 0
  """Stacked (scanned-over-layers) param: the size of its leading layer axis, and `shape`,
  `rows` and `offset` describe one layer; 0 for an ordinary param."""
  axis: int = 0
  """The shard dim: `rows` is its size padded to a multiple of dp (a scalar has dim 0 of
  size 1)."""

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def padded_shape(self) -> tuple[int, ...]:
    """The param as the sharded optimizer sees it: its shard dim padded to `rows`."""
    return _with_dim(self.shape or (1,), self.axis, self.rows)

  def local_shape(self, dp: int) -> tuple[int, ...]:
    """One device's block of the padded param: `rows / dp` of its shard dim."""
    return _with_dim(self.shape or (1,), self.axis, self.rows // dp)

  def shard_size(self, dp: int) -> int:
    """Elements of this param in one shard."""
    return math.prod(self.local_shape(dp))


def _with_dim(shape: tuple[int, ...], axis: int, n: int) -> tuple[int, ...]:
  return (*shape[:axis], n, *shape[axis + 1 :])


def shard_axis(shape: tuple[int, ...], dp: int, taken: Collection[int] = ()) -> int:
  """The dim to shard a param over dp devices: the one that needs the least padding to a
  multiple of dp, the leading one on ties (0 for a scalar); of the dims not in `taken`
  (split over another mesh axis) where there is one.

  Examples:
    >>> shard_axis((50257, 768), 8), shard_axis((4, 768, 3072), 8), shard_axis((300, 4), 8)
    (1, 1, 0)
    >>> shard_axis((64, 8), 4, taken={0}), shard_axis((64,), 4, taken={0})
    (1, 0)
  """
  # See [Note: shard dim]. The padding as a fraction of the dim, so that a dim dp divides
  # costs 1 and a dim of size 0 is never picked; `taken` dims only when every dim is taken.
  padded = [round_up(n, dp) / n if n else math.inf for n in shape]
  free = [k for k in range(len(shape)) if k not in taken] or list(range(len(shape)))
  return min(free, key=lambda k: (padded[k], k)) if shape else 0


def model_shard_dims(
  paths: Sequence[str],
  shapes: Sequence[tuple[int, ...]],
  model_dims: Sequence[tuple[tuple[str, ...], ...]],
  dp: int,
  layered: Callable[[str], bool] = lambda path: False,
) -> dict[str, int]:
  """The shard dim of every leaf its caller split over other mesh axes (tensor parallel):
  one those axes leave whole where the leaf has one (`shard_axis(taken=)`), so that each
  device's block over "data" is a slice of its own block over the other axes, and a gather
  or a reduce-scatter over "data" alone moves that slice and nothing of the rest.

  Args:
    paths, shapes: each leaf's `jax.tree_util.keystr` and shape, in tree order.
    model_dims: per leaf, per dim, the mesh axes other than the data axes it is split over.
    dp: the data axis size.
    layered: the leaves whose leading dim is a layer axis: their dim is one of a layer
      (the layer axis dropped), as `make_layout(stacked=)` takes it.

  Returns:
    `{path: dim}` of every leaf split over some axis, `make_layout`'s `shard_dims`.

  Examples:
    >>> model_shard_dims(["['w1']", "['w2']", "['b']"], [(8, 64), (64, 8), (64,)],
    ...                  [((), ("model",)), (("model",), ()), (("model",),)], 4)
    {"['w1']": 0, "['w2']": 1, "['b']": 0}
    >>> model_shard_dims(["['w']"], [(2, 64, 8)], [((), ("model",), ())], 4, lambda p: True)
    {"['w']": 1}
  """
  every = unit_shard_dims(paths, shapes, model_dims, dp, layered)
  return {path: every[path] for path, dims in zip(paths, model_dims) if any(dims)}


def unit_shard_dims(
  paths: Sequence[str],
  shapes: Sequence[tuple[int, ...]],
  model_dims: Sequence[tuple[tuple[str, ...], ...]],
  dp: int,
  layered: Callable[[str], bool] = lambda path: False,
  leading: Collection[str] = (),
  columns: Collection[str] = (),
) -> dict[str, int]:
  """The shard dim of every leaf of an FSDP layout (`make_layout(units=, shard_dims=)`):
  the dim ZeRO picks (`shard_axis`: the one that pads least, the leading one on ties) of
  those the caller's other mesh axes leave whole (`model_shard_dims`), so that a device
  holds at most one row of padding per leaf, on that dim. A Gemma `(2, d, ffn)` gating
  weight on 8 devices is sharded on `d`, not padded 2 -> 8 on its leading dim (4 x its
  size). Per layer for `layered` leaves (their layer axis dropped); the leading dim,
  whatever its padding, for the `leading` paths (a param FSDP gathers by row blocks,
  `FSDPConfig(chunks=)`: a block is rows of its leading dim); dim 1 for the `columns`
  paths (a table looked up by rows, `FSDPConfig(lookups=)`: each device holds every row's
  columns).

  Args:
    paths, shapes, model_dims, dp, layered: as `model_shard_dims` takes them; `model_dims`
      may be `()` (no leaf split over another axis).
    leading: paths pinned to their leading dim (of a layer).
    columns: paths pinned to their dim 1.

  Returns:
    `{path: dim}` of every leaf.

  Examples:
    >>> unit_shard_dims(["['gate']", "['embed']", "['norm']"], [(2, 64, 256), (50, 16), (64,)],
    ...                 (), 8)
    {"['gate']": 1, "['embed']": 1, "['norm']": 0}
    >>> unit_shard_dims(["['embed']"], [(50, 16)], (), 8, leading={"['embed']"})
    {"['embed']": 0}
  """
  model_dims = model_dims or [()] * len(paths)
  out = {}
  for path, shape, dims in zip(paths, shapes, model_dims):
    lead = 1 if layered(path) else 0
    if path in columns:
      out[path] = 1
      continue
    if path in leading:
      out[path] = 0
      continue
    # `dims` counts the layer axis and the shard dim is of a layer: shift by `lead`, and
    # ignore a split layer axis
    taken = {d - lead for d, axes in enumerate(dims) if axes and d >= lead}
    out[path] = shard_axis(tuple(shape[lead:]), dp, taken)
  return out


@dataclasses.dataclass(frozen=True)
class Bucket:
  """A run of params reduced by one collective.

  Examples:
    >>> import jax.numpy as jnp, jaxdp
    >>> params = {"w": jnp.zeros((300, 4)), "b": jnp.zeros(3)}
    >>> layout = jaxdp.layout.make_layout(params, dp=8, bucket_size=2000)
    >>> (bucket,) = layout.buffers[0].buckets  # 8 shards of 160, 77 of them padding
    >>> [p.path for p in bucket.params], bucket.numel, bucket.shard_size
    (["['w']", "['b']"], 1203, 160)
  """

  index: int
  params: tuple[ParamSpec, ...]
  offset: int
  """Start of the bucket in its buffer."""
  shard_size: int
  """Elements per shard, padding included; the bucket holds `dp * shard_size`."""
  unit: str | None = None
  """The FSDP unit this bucket holds (layouts made with `units=`); None for size buckets."""
  stack: str | None = None
  """The stack its params belong to (`make_layout(scanned=...)`): whole stacked leaves
  sharded on a dim of a layer, gathered and reduced one layer at a time inside the scan over
  them; None for other buckets."""

  @property
  def numel(self) -> int:
    """Elements of real params (no padding)."""
    return sum(p.size for p in self.params)


@dataclasses.dataclass(frozen=True)
class BufferLayout:
  """One flat buffer: all params with one (param dtype, grad dtype) key.

  Examples:
    >>> import jax.numpy as jnp, jaxdp
    >>> params = {"w": jnp.zeros((300, 4)), "b": jnp.zeros(3)}
    >>> layout = jaxdp.layout.make_layout(params, dp=8, bucket_size=2000)
    >>> (buf,) = layout.buffers
    >>> buf.name, buf.param_dtype, buf.grad_dtype, buf.size, buf.numel
    ('float32', dtype('float32'), dtype('float32'), 1280, 1203)
  """

  name: str
  param_dtype: np.dtype
  grad_dtype: np.dtype
  buckets: tuple[Bucket, ...]
  size: int
  """Elements, padding included."""
  expert: bool = False
  """Expert (MoE) params (layouts made with `experts=`): reduced over the expert-data-parallel
  group only, and each `ParamSpec` describes one expert-parallel rank's slice of its param
  (leading dim divided by `expert_parallel`)."""

  @property
  def params(self) -> tuple[ParamSpec, ...]:
    return tuple(p for b in self.buckets for p in b.params)

  @property
  def numel(self) -> int:
    return sum(b.numel for b in self.buckets)


@dataclasses.dataclass(frozen=True)
class Leaf:
  """What a layout knows of one leaf of the param tree, trainable or not.

  Examples:
    >>> import jax.numpy as jnp, jaxdp
    >>> params = {"w": jnp.zeros((300, 4)), "step": jnp.zeros((), jnp.int32)}
    >>> step, w = jaxdp.layout.make_layout(params, dp=8, bucket_size=2000).leaves
    >>> w.index, w.path, w.shape, w.trainable, w.shard_axis
    (1, "['w']", (300, 4), True, 0)
    >>> step.dtype, step.trainable, step.unit, step.layers
    (dtype('int32'), False, None, 0)
  """

  index: int
  """Position of the leaf in `jax.tree.leaves(params)`."""
  path: str
  """`jax.tree_util.keystr` of the leaf."""
  shape: tuple[int, ...]
  """The whole leaf's shape (its layer axis leading if stacked)."""
  dtype: np.dtype
  trainable: bool
  """Has a gradient buffer: floating point and not frozen."""
  shard_axis: int
  """The dim of the whole leaf a sharded strategy shards and pads (`ParamSpec.axis`; for a
  stacked leaf, whose layers lead, that of a layer + 1; for a leaf without a gradient
  buffer the leading dim, of a layer if stacked, unless `make_layout(shard_dims=)` gives
  one)."""
  unit: str | None = None
  """Its unit name (layouts made with `units=`), else None."""
  layers: int = 0
  """Its leading layer axis size when stacked (`make_layout(stacked=)`), else 0."""
  expert: bool = False
  """An expert param (`make_layout(experts=)`): in a buffer of expert params, described
  there as one expert-parallel rank's slice."""
  grad_dtype: np.dtype | None = None
  """The dtype its grads are reduced in (its buffer's); None without a gradient buffer."""


@dataclasses.dataclass(frozen=True)
class Layout:
  """Buffers and buckets of a param tree for a data-parallel size `dp`.

  Examples:
    >>> import jax.numpy as jnp, jaxdp
    >>> params = {"w": jnp.zeros((300, 4)), "b": jnp.zeros(3)}
    >>> layout = jaxdp.layout.make_layout(params, dp=8, bucket_size=2000)
    >>> layout.paths, layout.shapes, layout.num_buckets, layout.trainable
    (("['b']", "['w']"), ((3,), (300, 4)), 1, (True, True))
    >>> [(leaf.path, leaf.shape) for leaf in layout.leaves]
    [("['b']", (3,)), ("['w']", (300, 4))]
  """

  treedef: jax.tree_util.PyTreeDef
  leaves: tuple[Leaf, ...]
  """Every leaf of the param tree, in tree order."""
  dp: int
  bucket_size: int
  buffers: tuple[BufferLayout, ...]
  shard_dims: tuple[tuple[str, int], ...] = ()
  """`(path, dim)` of every leaf `make_layout(shard_dims=)` gave its shard dim, sorted."""
  outer: int = 1
  """Outer shards of each device's block (`make_layout(outer=)`): rows are padded to a
  multiple of `dp * outer`."""

  # The per-leaf tuples below are read off `leaves`, for callers that want one fact of
  # every leaf at once.

  @functools.cached_property
  def shapes(self) -> tuple[tuple[int, ...], ...]:
    """Shape of every leaf, in tree order."""
    return tuple(leaf.shape for leaf in self.leaves)

  @functools.cached_property
  def dtypes(self) -> tuple[np.dtype, ...]:
    return tuple(leaf.dtype for leaf in self.leaves)

  @functools.cached_property
  def paths(self) -> tuple[str, ...]:
    return tuple(leaf.path for leaf in self.leaves)

  @functools.cached_property
  def static(self) -> tuple[int, ...]:
    """Leaves with no gradient buffer (frozen or not floating point), in tree order."""
    return tuple(leaf.index for leaf in self.leaves if not leaf.trainable)

  @functools.cached_property
  def trainable(self) -> tuple[bool, ...]:
    """Per leaf in tree order: does it have a gradient buffer."""
    return tuple(leaf.trainable for leaf in self.leaves)

  @property
  def units(self) -> tuple[str, ...] | None:
    """Per leaf in tree order: its unit name (layouts made with `units=`), else None."""
    if not self.leaves or self.leaves[0].unit is None:  # every leaf has a unit, or none
      return None
    return tuple(leaf.unit for leaf in self.leaves)

  @property
  def layers(self) -> tuple[int, ...] | None:
    """Per leaf in tree order: its leading layer axis size when stacked, else 0 (layouts
    made with `units=`, which `stacked=` needs), else None."""
    if self.units is None:
      return None
    return tuple(leaf.layers for leaf in self.leaves)

  @functools.cached_property
  def shard_axes(self) -> tuple[int, ...]:
    """Per leaf in tree order: `Leaf.shard_axis`."""
    return tuple(leaf.shard_axis for leaf in self.leaves)

  @property
  def stacked(self) -> bool:
    """Whether some leaf is stacked (a bucket then describes one layer of its unit)."""
    return any(leaf.layers for leaf in self.leaves)

  @property
  def params(self) -> tuple[ParamSpec, ...]:
    """Every param with a gradient buffer, in buffer and bucket order."""
    return tuple(p for buf in self.buffers for p in buf.params)

  @property
  def num_buckets(self) -> int:
    return sum(len(b.buckets) for b in self.buffers)

  def summary(self) -> str:
    """A table of buffers and buckets: params, elements, padding.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxdp
      >>> params = {"w": jnp.zeros((300, 4)), "b": jnp.zeros((3,))}
      >>> print(jaxdp.layout.make_layout(params, dp=8, bucket_size=2000).summary())
      dp=8, bucket_size=2,000 elements; 1 buffer, 1 bucket, 1,203 param elements
      buffer float32: 1,280 elements (77 padding)
        bucket 0: [0, 1,280)  2 params, 1,203 elements, 77 padding  ['w'] .. ['b']
      >>> print(jaxdp.layout.make_layout({"stack": jnp.zeros((4, 64, 8))}, dp=8).summary())
      dp=8, bucket_size=16,000,000 elements; 1 buffer, 1 bucket, 2,048 param elements
      buffer float32: 2,048 elements (0 padding)
        bucket 0: [0, 2,048)  1 param, 2,048 elements, 0 padding  ['stack'] .. ['stack']
      1 param sharded on a dim that pads less than the leading one: ['stack'] dim 1
    """
    n = sum(b.numel for b in self.buffers)
    lines = [
      f"dp={self.dp}, bucket_size={self.bucket_size:,} elements; "
      f"{len(self.buffers)} buffer{'s' * (len(self.buffers) != 1)}, "
      f"{self.num_buckets} bucket{'s' * (self.num_buckets != 1)}, {n:,} param elements"
    ]
    static = [leaf.path for leaf in self.leaves if not leaf.trainable]
    if static:
      lines.append(
        f"{len(static)} leaves without gradient buffer (frozen or not float): "
        + ", ".join(static[:4])
        + (" .." if len(static) > 4 else "")
      )
    for buf in self.buffers:
      lines.append(f"buffer {buf.name}: {buf.size:,} elements ({buf.size - buf.numel:,} padding)")
      for b in buf.buckets:
        size = b.shard_size * self.dp
        lines.append(
          f"  bucket {b.index}: [{b.offset:,}, {b.offset + size:,})  {len(b.params)} "
          f"param{'s' * (len(b.params) != 1)}, {b.numel:,} elements, "
          f"{size - b.numel:,} padding  {b.params[0].path} .. {b.params[-1].path}"
          + (f"  unit {b.unit}" if b.unit is not None else "")
          + (f"  stack {b.stack}, reduced per layer" if b.stack is not None else "")
          + (f" (per layer, x{b.params[0].layers})" if b.params[0].layers else "")
        )
    moved = [
      f"{p.path} dim {p.axis}"
      for buf in self.buffers
      for b in buf.buckets
      if b.stack is None
      for p in b.params
      if p.axis and not p.layers
    ]
    if moved:
      lines.append(
        f"{len(moved)} param{'s' * (len(moved) != 1)} sharded on a dim that pads "
        "less than the leading one: " + ", ".join(moved[:4]) + (" .." if len(moved) > 4 else "")
      )
    return "\n".join(lines)


def sharded_shape(layout: Layout, i: int) -> tuple[tuple[int, ...], int]:
  """Leaf `i` as a sharded strategy stores it, and the axis its rows are padded on.

  The leaf's shard dim (`Leaf.shard_axis`: the dim that needs the least padding, the
  leading one on ties; for a stacked leaf, whose layers lead, a dim of a layer) is padded
  up to a multiple of dp; a scalar is stored `(rows,)`.
  """
  leaf = layout.leaves[i]
  shape, axis = leaf.shape or (1,), leaf.shard_axis
  # `Leaf.shard_axis` counts a stacked leaf's layer axis: this is the whole leaf as stored
  rows = round_up(shape[axis], layout.dp * layout.outer)
  return (*shape[:axis], rows, *shape[axis + 1 :]), axis


def outer_bucket(bucket: Bucket, dp: int, outer: int) -> Bucket:
  """One device's shard of `bucket` as a bucket of its own, to be split `outer` ways (a
  layout made with `outer=`): each param's block (`local_shape(dp)`, its layers leading if
  stacked) is a param whose rows (`rows / dp`, a multiple of `outer`) are split again, so
  that a reduce-scatter of it over the outer axis hands each device `1 / (dp * outer)` of
  every param's rows, contiguous on its shard dim, and an all-gather rebuilds the block.

  Examples:
    >>> import jax.numpy as jnp
    >>> params = {"w": jnp.zeros((10, 3)), "s": jnp.zeros((2, 6, 5))}
    >>> layout = make_layout(params, dp=4, units=lambda p: p, stacked={"['s']"}, outer=2)
    >>> [(p.path, p.rows) for p in layout.params]  # rows padded to multiples of 4 x 2
    [("['w']", 16), ("['s']", 8)]
    >>> w, s = [outer_bucket(b, 4, 2).params[0] for b in layout.buffers[0].buckets]
    >>> (w.shape, w.axis, w.rows, w.local_shape(2)), (s.shape, s.axis, s.local_shape(2))
    (((4, 3), 0, 4, (2, 3)), ((2, 2, 5), 1, (2, 1, 5)))
  """
  # Each param's block on one device (`local_shape(dp)`, the layer axis kept in front) becomes
  # a param whose rows are the block's `rows / dp`; rows were padded to a multiple of
  # `dp * outer`, so these split `outer` ways without more padding. Offsets restart at 0 and
  # there is no tail: one device's shard, laid out shard-major for the `outer` devices (see
  # [Note: shard-major buckets]).
  specs, offset = [], 0
  for p in bucket.params:
    lead = (p.layers,) if p.layers else ()
    spec = ParamSpec(
      p.path, p.index, (*lead, *p.local_shape(dp)), p.rows // dp, offset, 0, p.axis + len(lead)
    )
    specs.append(spec)
    offset += spec.shard_size(outer)
  return Bucket(bucket.index, tuple(specs), 0, offset, bucket.unit, bucket.stack)


def layer_bucket(bucket: Bucket, dp: int) -> Bucket:
  """One layer of a stack's bucket (`Bucket.stack`): each param's `ParamSpec` of one layer
  (its shape without the layer axis, its shard dim one lower), laid out one after the other:
  what one reduce-scatter inside the scan's backward reduces.

  Examples:
    >>> import jax.numpy as jnp, jaxdp
    >>> params = {"blocks": {"w": jnp.zeros((4, 12, 20))}, "head": jnp.zeros((12, 3))}
    >>> layout = make_layout(params, dp=8, scanned=lambda p: "blocks" if "blocks" in p else None)
    >>> (b,) = [b for b in layout.buffers[0].buckets if b.stack]
    >>> w = b.params[0]  # sharded on 20 (padded to 24), not on the 4 layers
    >>> w.shape, w.axis, w.local_shape(8), layer_bucket(b, 8).params[0].local_shape(8)
    ((4, 12, 20), 2, (4, 12, 3), (12, 3))
  """
  # Drop the layer axis of each (scanned) param and pack one layer's blocks back to back from
  # offset 0, with no tail: the operand of one layer's reduce-scatter inside the scan.
  specs, offset = [], 0
  for p in bucket.params:
    spec = dataclasses.replace(p, shape=p.shape[1:], axis=p.axis - 1, offset=offset)
    specs.append(spec)
    offset += spec.shard_size(dp)
  return Bucket(bucket.index, tuple(specs), 0, offset, bucket.unit, bucket.stack)


def _is_float(dtype) -> bool:
  return jax.numpy.issubdtype(dtype, jax.numpy.floating)  # bf16 is no np.floating


_ONE_LEAF = jax.tree.structure(0)


def is_function(x) -> bool:
  """Is `x` a function rather than a pytree? What `init_state`'s `params` (an init
  function or the params) and a mask (`frozen=`: a function of `(path, leaf)` or a
  boolean pytree) may each be.

  A function is a `functools.partial` (`jax.tree_util.Partial` too), or a callable that
  JAX sees as a single leaf: a `def` or `lambda`, a bound method, a jitted function, an
  object of a class that is not a registered pytree node. A pytree node never is,
  callable or not: an `eqx.Module` (whose `__call__` is the model's forward), a dict, a
  Flax `struct` dataclass. So jaxdp never calls a params tree, as `jax.grad` and optax
  never do.

  Examples:
    >>> import functools, jax.numpy as jnp
    >>> is_function(lambda: {"w": jnp.ones(2)}), is_function(functools.partial(max, 1))
    (True, True)
    >>> is_function({"w": jnp.ones(2)}), is_function(jnp.ones(2))
    (False, False)
  """
  if isinstance(x, functools.partial):
    return True
  return callable(x) and jax.tree.structure(x) == _ONE_LEAF


def _frozen_mask(
  params: PyTree, frozen: Frozen, paths: list[str], name: str = "frozen"
) -> list[bool]:
  leaves = jax.tree.leaves(params)
  if frozen is None:
    return [False] * len(leaves)
  if is_function(frozen):  # a boolean pytree may be callable (an eqx.Module): never called
    return [bool(frozen(path, leaf)) for path, leaf in zip(paths, leaves)]
  try:
    # a prefix of params: one bool covers the whole subtree under it
    mask = jax.tree.leaves(jax.tree.broadcast(frozen, params))
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"{name}: must be a boolean pytree with the structure of params (or a prefix of "
      f"it), or a function (path, leaf) -> bool; got {jax.tree.structure(frozen)} for "
      f"params {jax.tree.structure(params)}"
    ) from e
  return [bool(m) for m in mask]


def _expert_shapes(
  experts: list[bool], ep: int, paths: list[str], shapes: list[tuple[int, ...]]
) -> list[tuple[int, ...]]:
  """Each leaf's shape on one expert-parallel rank: expert params' leading dim / `ep`."""
  if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
    raise ValueError(f"expert_parallel={ep!r}: must be a positive integer (the expert axis size)")
  out = []
  for path, shape, is_expert in zip(paths, shapes, experts):
    if is_expert and (not shape or shape[0] % ep):
      raise ValueError(
        f"experts: params{path} has shape {shape}, whose leading (expert) dim does not "
        f"divide over the {ep} expert-parallel ranks; give expert params a leading dim of "
        f"experts that is a multiple of expert_parallel={ep}"
      )
    out.append((shape[0] // ep, *shape[1:]) if is_expert else shape)
  return out


def _unit_names(units: Units, paths: list[str]) -> list[str] | None:
  if units is None:
    return None
  if callable(units):
    names = [units(path) for path in paths]
  else:
    missing = [path for path in paths if path not in units]
    if missing:
      raise ValueError(
        f"units: no unit for params{missing[0]}; map every leaf path "
        "(jax.tree_util.keystr) to a unit name, or pass a function"
      )
    names = [units[path] for path in paths]
  for path, name in zip(paths, names):
    if not isinstance(name, str):
      raise ValueError(f"units: params{path} has unit {name!r}; unit names must be str")
  return names


def _layer_counts(
  stacked: Stacked, paths: list[str], shapes: list[tuple[int, ...]], unit_of: list[str] | None
) -> list[int] | None:
  if stacked is None:
    return None
  if unit_of is None:
    raise ValueError(
      "stacked: needs units= (a stacked param belongs to a unit of one layer); pass units as well"
    )
  is_stacked = stacked if callable(stacked) else set(stacked).__contains__
  layers = []
  for path, shape in zip(paths, shapes):
    if not is_stacked(path):
      layers.append(0)
    elif not shape:
      raise ValueError(
        f"stacked: params{path} is a scalar, it has no leading layer axis; "
        "stack only params of shape (layers, ...)"
      )
    else:
      layers.append(shape[0])
  # Every leaf of a unit must have the same layer count (0: not stacked), since a unit's
  # bucket describes one layer of each of its params.
  per_unit: dict[str, set[int]] = {}
  for name, n in zip(unit_of, layers):
    per_unit.setdefault(name, set()).add(n)
  for name, counts in per_unit.items():
    if len(counts) > 1:
      found = ", ".join(
        f"params{p} {'has ' + str(n) + ' layers' if n else 'is not stacked'}"
        for p, u, n in zip(paths, unit_of, layers)
        if u == name
      )
      raise ValueError(
        f"unit {name!r} mixes params with different layer axes ({found}); a "
        "unit is one layer: give stacked params a unit of their own"
      )
  return layers


def make_layout(
  params: PyTree,
  dp: int,
  bucket_size: int | None = None,
  *,
  grad_dtype=None,
  frozen: Frozen = None,
  units: Units = None,
  stacked: Stacked = None,
  experts: Frozen = None,
  expert_parallel: int = 1,
  leading: Frozen = None,
  scanned: Callable[[str], str | None] | None = None,
  shard_dims: Mapping[str, int] | None = None,
  outer: int = 1,
  alone_over: int | None = None,
) -> Layout:
  """Computes the buffers and buckets of a param tree, from shapes and dtypes alone.

  Args:
    params: a pytree of arrays or `jax.ShapeDtypeStruct`s.
    dp: number of data-parallel shards every bucket divides into.
    bucket_size: elements after which a bucket closes (a param is never split);
      None: the sharded strategies' default `max(16_000_000, 1_000_000 * dp)` (`DDPConfig`
      gives `no_shard` smaller ones; see `default_bucket_size`).
      Ignored with `units`.
    grad_dtype: dtype gradients are reduced in (e.g. `jnp.float32` for fp32 main grads);
      None: each param's own dtype.
    frozen: params that get no gradient buffer: a boolean pytree (True = frozen) with
      the structure of params, or `fn(path: str, leaf) -> bool`. Leaves that are not
      floating point are always left out.
    units: FSDP units instead of size buckets: `{path: unit name}` for every leaf, or
      `fn(path: str) -> unit name` (paths are `jax.tree_util.keystr` of the leaf). Each
      bucket is then one unit's params of one buffer, units in backprop order.
    stacked: params that carry a leading layer axis (scanned layers), as a set of paths
      or `fn(path: str) -> bool`; needs `units`. Their `ParamSpec` describes one layer
      (`layers` = the axis size), so a bucket is one layer of its unit.
    experts: expert (MoE) params, like `frozen`: a boolean pytree or
      `fn(path, leaf) -> bool`. They go into buffers of their own (`BufferLayout.expert`,
      named `expert/<dtype>`), which are reduced over the expert-data-parallel group only
      (Megatron's `expert_parallel_bucket_groups`).
    expert_parallel: size of the expert axis that expert params' leading dim is sharded
      over; their `ParamSpec`s describe one rank's slice (`shape[0] // expert_parallel`).
    leading: params whose shard dim is their leading one whatever its padding, like
      `frozen` (jaxdp passes the weights a caller sharded for tensor parallelism). Every
      other param of a size-bucket layout is sharded on the dim `shard_axis` picks; with
      `units`, and for expert and stacked params, the shard dim is the leading one (of a
      layer) unless `shard_dims` gives one (FSDP gives every leaf its own:
      `unit_shard_dims`).
    scanned: size-bucket layouts only: `fn(path) -> stack name or None`, the stack of
      params whose leading dim is a layer axis that one scan iterates over (the bucketed
      strategies' `DDPConfig(stacked=...)`; params of fewer than two dims, expert and
      `leading` ones are left out). Each is sharded on the dim of a layer that
      `shard_axis` picks (+ 1), never on the layers, so that one layer's reduced gradient
      is a slice of every device's block; a stack's params of one buffer are one bucket
      (`Bucket.stack`) whatever `bucket_size`, reduced one layer at a time.
    shard_dims: `{path: dim}`: the shard dim of these params (of a layer if stacked),
      whatever its padding (FSDP gives a tensor-parallel leaf a dim the other mesh axes do
      not split, `shard_axis(..., taken=)`); kept in `Layout.shard_dims`.
    outer: rows are padded to a multiple of `dp * outer`, so that each device's block
      splits `outer` ways again (`outer_bucket`: FSDP's optimizer sharded across the
      "replica" axis as well, `outer_dp_sharding_strategy="optim"`).
    alone_over: size-bucket layouts: a param of more elements than this gets a bucket of
      its own, the params before it closing theirs short of `bucket_size` (a bucket of one
      param is raveled without a copy; `no_shard`'s default buckets, `alone_size`).

  Returns:
    A static `Layout`.

  Raises:
    ValueError: dp or bucket_size not positive, `frozen` does not match params, a leaf
      has no unit, a unit mixes stacked and unstacked params, or an expert param's leading
      dim does not divide by `expert_parallel`.

  Examples:
    >>> import jax.numpy as jnp, jaxdp
    >>> params = {"a": jnp.zeros((1000,)), "b": jnp.zeros((10, 10), jnp.bfloat16)}
    >>> layout = jaxdp.layout.make_layout(params, dp=8, grad_dtype=jnp.float32)
    >>> [buf.name for buf in layout.buffers]
    ['bfloat16/float32', 'float32']
    >>> layout.buffers[1].size  # 1000 elements padded to a multiple of lcm(8, 128)
    1024

    One bucket per unit, a stacked unit described per layer:

    >>> params = {"blocks": {"w": jnp.zeros((4, 16, 3))}, "head": jnp.zeros((3, 2))}
    >>> layout = jaxdp.layout.make_layout(params, dp=8, units=lambda path: path[2:6],
    ...                            stacked={"['blocks']['w']"})
    >>> [(b.unit, b.params[0].layers, b.params[0].shape) for b in layout.buffers[0].buckets]
    [('head', 0, (3, 2)), ('bloc', 4, (16, 3))]

    Expert params (8 experts over 2 expert-parallel ranks) in a buffer of their own:

    >>> params = {"router": jnp.zeros((4, 8)), "w": jnp.zeros((8, 4, 16))}
    >>> layout = jaxdp.layout.make_layout(params, dp=4, experts=lambda path, _: path == "['w']",
    ...                            expert_parallel=2)
    >>> [(buf.name, buf.expert, buf.params[0].shape) for buf in layout.buffers]
    [('expert/float32', True, (4, 4, 16)), ('float32', False, (4, 8))]
  """
  if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
    raise ValueError(f"dp={dp!r}: must be a positive integer (the data axis size)")
  if isinstance(outer, bool) or not isinstance(outer, int) or outer < 1:
    raise ValueError(f"outer={outer!r}: must be a positive integer (the replica axis size)")
  if bucket_size is None:
    bucket_size = default_bucket_size(dp)
  if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
    raise ValueError(
      f"bucket_size={bucket_size!r}: must be a positive number of elements, "
      "or None for the default (`default_bucket_size`)"
    )
  keyed, treedef = jax.tree_util.tree_flatten_with_path(params)
  paths = [jax.tree_util.keystr(k) for k, _ in keyed]
  shapes = [tuple(int(d) for d in leaf.shape) for _, leaf in keyed]
  dtypes = [np.dtype(leaf.dtype) for _, leaf in keyed]
  frozen_leaves = _frozen_mask(params, frozen, paths)
  expert_leaves = _frozen_mask(params, experts, paths, "experts")
  leading_leaves = _frozen_mask(params, leading, paths, "leading")
  # A scanned stack (ZeRO's `DDPConfig(stacked=)`): only params of two dims or more, neither
  # expert nor `leading`, of a size-bucket layout belong to one; None for every other param.
  stack_of = [
    scanned(path) if scanned and len(shape) >= 2 and units is None and not (e or lead) else None
    for path, shape, e, lead in zip(paths, shapes, expert_leaves, leading_leaves)
  ]
  # An expert param is laid out as one expert-parallel rank's slice (its leading dim / ep):
  # what that rank holds and its expert-data-parallel group reduces.
  local_shapes = _expert_shapes(expert_leaves, expert_parallel, paths, shapes)
  unit_of = _unit_names(units, paths)
  layers = _layer_counts(stacked, paths, shapes, unit_of)
  given = dict(shard_dims or {})

  # The trainable leaves by buffer key, each list in reverse tree order: the backward produces
  # the last layers' grads first, so the first bucket is the first whose grads are complete.
  # Frozen and non-float leaves get no buffer; they are only recorded in `static`.
  by_key: dict[tuple[np.dtype, np.dtype, bool], list[int]] = {}
  static = set()
  for i in reversed(range(len(keyed))):  # backprop order
    if frozen_leaves[i] or not _is_float(dtypes[i]):
      static.add(i)
      continue
    gdtype = np.dtype(grad_dtype) if grad_dtype is not None else dtypes[i]
    by_key.setdefault((dtypes[i], gdtype, expert_leaves[i]), []).append(i)

  # See [Note: shard-major buckets].
  align = math.lcm(dp, 128) // dp  # shard-size multiple that makes a bucket lcm(dp, 128)
  buffers = []
  # One buffer per key, in name order: first cut its leaves into groups, a bucket each, then
  # lay each group out shard-major.
  for (pdtype, gdtype, expert), leaves in sorted(
    by_key.items(), key=lambda kv: _buffer_name(*kv[0])
  ):
    groups: list[list[int]] = []
    # FSDP: one group per unit, the units in the order of their first leaf in backprop order;
    # `bucket_size` plays no part.
    if unit_of is not None:
      by_unit: dict[str, list[int]] = {}
      for i in leaves:
        by_unit.setdefault(unit_of[i], []).append(i)
      groups = list(by_unit.values())
    else:
      # Size buckets: add leaves until the group holds `bucket_size` elements or more, so that a
      # bucket may overshoot by one param but never splits one. The params of one scanned stack
      # form a group of their own whatever its size (it is reduced layer by layer inside the
      # scan). With `alone_over`, a larger param closes the open group and starts its own (its
      # ravel is then a bitcast); `alone_size` sets `alone_over` to `bucket_size`, so the size
      # check closes that group right after it.
      group, count = [], 0
      for i in leaves:
        n = math.prod(local_shapes[i])
        alone = alone_over is not None and n > alone_over and stack_of[i] is None
        if group and (stack_of[i] != stack_of[group[0]] or alone):
          groups.append(group)
          group, count = [], 0
        group.append(i)
        count += n
        if count >= bucket_size and stack_of[i] is None:
          groups.append(group)
          group, count = [], 0
      if group:
        groups.append(group)
    # Lay each group out (see [Note: shard-major buckets]): `shard` counts the elements of one
    # shard (each param's block starts at its value), `offset` those of the buffer (each
    # bucket starts at its value).
    buckets, offset = [], 0
    for b, group in enumerate(groups):
      specs, shard = [], 0
      for i in group:
        # A stacked FSDP param is described per layer: `shape` without its layer axis, `n` the
        # number of layers (`ParamSpec.layers`).
        n = layers[i] if layers else 0
        shape = local_shapes[i][1:] if n else local_shapes[i]
        # The shard dim (see [Note: shard dim]): picked here for a size bucket's ordinary params;
        # dim 0 by default for units, expert params (whose leading dim is the experts) and
        # `leading` ones; for a scanned param a dim of a layer, never the layer axis, so that one
        # layer's grads are a slice of every device's block; `shard_dims` overrides all of these.
        free = unit_of is None and not (expert_leaves[i] or leading_leaves[i])
        axis = shard_axis(shape, dp) if free else 0
        if stack_of[i] is not None:
          axis = 1 + shard_axis(shape[1:], dp)
        axis = given.get(paths[i], axis)
        # a scalar is one row
        rows = round_up(shape[axis] if shape else 1, dp * outer)
        spec = ParamSpec(paths[i], i, shape, rows, shard, n, axis)
        specs.append(spec)
        shard += spec.shard_size(dp)
      # the bucket's tail: zeros after the last block of every shard
      shard = round_up(shard, align)
      unit = unit_of[group[0]] if unit_of is not None else None
      buckets.append(Bucket(b, tuple(specs), offset, shard, unit, stack_of[group[0]]))
      offset += shard * dp
    buffers.append(
      BufferLayout(
        _buffer_name(pdtype, gdtype, expert), pdtype, gdtype, tuple(buckets), offset, expert
      )
    )
  # a leaf's shard dim: its buffer's where it has one, else the leading dim (of a layer)
  # unless `shard_dims` gives one. `ParamSpec.axis` of a stacked FSDP param is of a layer;
  # `Leaf.shard_axis` counts the layer axis, hence the + 1.
  axis_of = {p.index: p.axis + (1 if p.layers else 0) for buf in buffers for p in buf.params}
  buffer_of = {p.index: buf for buf in buffers for p in buf.params}
  leaves = []
  for i, (path, shape, dtype) in enumerate(zip(paths, shapes, dtypes)):
    layer_count = layers[i] if layers else 0
    leaf = Leaf(
      index=i,
      path=path,
      shape=shape,
      dtype=dtype,
      trainable=i not in static,
      shard_axis=axis_of.get(i, (1 if layer_count else 0) + given.get(path, 0)),
      unit=unit_of[i] if unit_of is not None else None,
      layers=layer_count,
      expert=i in buffer_of and buffer_of[i].expert,
      grad_dtype=buffer_of[i].grad_dtype if i in buffer_of else None,
    )
    leaves.append(leaf)
  return Layout(
    treedef, tuple(leaves), dp, bucket_size, tuple(buffers), tuple(sorted(given.items())), outer
  )


def _buffer_name(param_dtype: np.dtype, grad_dtype: np.dtype, expert: bool = False) -> str:
  name = param_dtype.name if param_dtype == grad_dtype else f"{param_dtype.name}/{grad_dtype.name}"
  return f"expert/{name}" if expert else name
