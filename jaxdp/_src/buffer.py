"""Turning a `Layout` into arrays: ravel params into flat buffers and back.

The only module that knows how a bucket's bytes are arranged (shard-major, see
`layout.py`). Every function works on plain arrays and is traceable.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from jaxdp._src.layout import Bucket, Layout, ParamSpec

PyTree = Any


def pad_dim(x: jax.Array, shape: tuple[int, ...], axis: int, rows: int) -> jax.Array:
  """`x` (of `shape`) with zeros appended to dim `axis` up to `rows` (a scalar becomes
  `(rows,)`)."""
  x = x.reshape(shape or (1,))
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, rows - x.shape[axis])
  # no pad op where the dim needs none
  return jnp.pad(x, pad) if rows > x.shape[axis] else x


def unpad_dim(x: jax.Array, shape: tuple[int, ...], axis: int) -> jax.Array:
  """Inverse of `pad_dim`: `x` cut back to `shape` on dim `axis`."""
  return jax.lax.slice_in_dim(x, 0, (shape or (1,))[axis], axis=axis).reshape(shape)


def pad_rows(x: jax.Array, spec: ParamSpec) -> jax.Array:
  """A param in its padded shape: its shard dim padded to `spec.rows`."""
  return pad_dim(x, spec.shape, spec.axis, spec.rows)


def unpad_rows(x: jax.Array, spec: ParamSpec) -> jax.Array:
  """Inverse of `pad_rows`."""
  return unpad_dim(x, spec.shape, spec.axis)


# See [Note: shard-major buckets] in layout.py. `_split` cuts a padded param into its dp
# blocks, one per row: the shard dim becomes `(dp, rows / dp)`, the dp axis moves first and
# the rest is flattened row-major, so row `d` is device `d`'s block in the order
# `ParamSpec.local_shape` gives it. `_merge` undoes these steps one by one.
def _split(padded: jax.Array, spec: ParamSpec, dp: int) -> jax.Array:
  """`(dp, shard elements)`: row `d` is block `d` of the shard dim, flattened."""
  a, shape = spec.axis, padded.shape
  blocks = padded.reshape(*shape[:a], dp, shape[a] // dp, *shape[a + 1 :])
  return jnp.moveaxis(blocks, a, 0).reshape(dp, -1)


def _merge(rows: jax.Array, spec: ParamSpec, dp: int) -> jax.Array:
  """Inverse of `_split`: the padded param from its `dp` blocks."""
  blocks = rows.reshape(dp, *spec.local_shape(dp))
  return jnp.moveaxis(blocks, 0, spec.axis).reshape(spec.padded_shape)


def bucket_ravel(leaves: Sequence[jax.Array], bucket: Bucket, dp: int, dtype=None) -> jax.Array:
  """The bucket's params as one 1-D buffer of `dp * bucket.shard_size` elements.

  `leaves` are the bucket's params in `bucket.params` order, full shapes.
  """
  dtype = dtype or leaves[0].dtype
  # Each param as `(dp, its block size)`; side by side, in bucket order, row `d` is shard `d`
  # with every block at its `ParamSpec.offset`. The zero columns are the tail up to
  # `bucket.shard_size`; flattened row by row, this is the shard-major bucket.
  cols = [_split(pad_rows(x.astype(dtype), p), p, dp) for x, p in zip(leaves, bucket.params)]
  used = sum(c.shape[1] for c in cols)
  cols.append(jnp.zeros((dp, bucket.shard_size - used), dtype))
  return jnp.concatenate(cols, axis=1).reshape(-1)


def bucket_unravel(flat: jax.Array, bucket: Bucket, dp: int) -> list[jax.Array]:
  """Inverse of `bucket_ravel`: the bucket's params in their full shapes."""
  # row `d` is shard `d`: a param's blocks are the columns `[p.offset, p.offset + n)`
  shards = flat.reshape(dp, bucket.shard_size)
  out = []
  for p in bucket.params:
    n = p.shard_size(dp)
    out.append(unpad_rows(_merge(shards[:, p.offset : p.offset + n], p, dp), p))
  return out


def shard_ravel(local: Sequence[jax.Array], bucket: Bucket, dtype=None) -> jax.Array:
  """One device's shard of the bucket from its blocks (`ParamSpec.local_shape`)."""
  dtype = dtype or local[0].dtype
  # one row of `bucket_ravel`'s `(dp, shard_size)` array: this device's blocks, then the tail
  parts = [x.astype(dtype).reshape(-1) for x in local]
  used = sum(x.shape[0] for x in parts)
  parts.append(jnp.zeros((bucket.shard_size - used,), dtype))
  return jnp.concatenate(parts)


def shard_unravel(shard: jax.Array, bucket: Bucket, dp: int) -> list[jax.Array]:
  """Inverse of `shard_ravel`: the device's block of every param in the bucket."""
  out = []
  for p in bucket.params:
    n = p.shard_size(dp)
    out.append(shard[p.offset : p.offset + n].reshape(p.local_shape(dp)))
  return out


def bucket_leaves(tree_leaves: Sequence[Any], bucket: Bucket) -> list[Any]:
  """Picks the bucket's params out of `jax.tree.leaves(params)`."""
  return [tree_leaves[p.index] for p in bucket.params]


def ravel(params: PyTree, layout: Layout) -> dict[str, jax.Array]:
  """Flattens the params that have a gradient buffer into one 1-D array per buffer.

  Args:
    params: a pytree with the structure the layout was made from.
    layout: from `make_layout`.

  Returns:
    `{buffer name: 1-D array}` in each buffer's param dtype, padding zeroed.

  Examples:
    >>> import jax.numpy as jnp, jaxdp
    >>> params = {"w": jnp.arange(6.0).reshape(3, 2), "n": jnp.array(7)}
    >>> layout = jaxdp.layout.make_layout(params, dp=2)
    >>> {k: v.shape for k, v in jaxdp.layout.ravel(params, layout).items()}
    {'float32': (128,)}
  """
  leaves = _check_structure(params, layout)
  return {
    buf.name: jnp.concatenate(
      [bucket_ravel(bucket_leaves(leaves, b), b, layout.dp, buf.param_dtype) for b in buf.buckets]
    )
    for buf in layout.buffers
  }


def unravel(flat: dict[str, jax.Array], layout: Layout, like: PyTree | None = None) -> PyTree:
  """Inverse of `ravel`; the round trip is bitwise.

  Args:
    flat: `{buffer name: 1-D array}` as returned by `ravel`.
    layout: the layout `flat` was made with.
    like: a params tree to take the leaves without a gradient buffer from (frozen or
      integer leaves); if None they come back as None.

  Returns:
    The param tree.

  Examples:
    >>> import jax.numpy as jnp, jaxdp
    >>> params = {"w": jnp.arange(6.0).reshape(3, 2), "n": jnp.array(7)}
    >>> layout = jaxdp.layout.make_layout(params, dp=2)
    >>> jaxdp.layout.unravel(jaxdp.layout.ravel(params, layout), layout, like=params)["w"]
    Array([[0., 1.],
           [2., 3.],
           [4., 5.]], dtype=float32)
  """
  out: list[Any] = [None] * len(layout.leaves)
  _refuse_stacked(layout)
  if like is not None:
    for i, x in enumerate(_check_structure(like, layout)):
      out[i] = x
  for buf in layout.buffers:
    if buf.name not in flat or flat[buf.name].shape != (buf.size,):
      got = flat[buf.name].shape if buf.name in flat else "nothing"
      raise ValueError(f"unravel: buffer {buf.name!r} must have shape ({buf.size},), got {got}")
    for b in buf.buckets:
      size = b.shard_size * layout.dp
      # a buffer is its buckets one after the other (`Bucket.offset`)
      chunk = flat[buf.name][b.offset : b.offset + size]
      for p, x in zip(b.params, bucket_unravel(chunk, b, layout.dp)):
        out[p.index] = x
  return jax.tree.unflatten(layout.treedef, out)


def _refuse_stacked(layout: Layout):
  # A stacked param's `ParamSpec` describes one layer while its leaf has a layer axis in
  # front, so the whole-leaf ravel here would not match it.
  if layout.stacked:
    raise ValueError(
      "the layout has stacked params (a bucket is one layer of its unit); "
      "ravel/unravel take layouts of ordinary params: make one without "
      "stacked="
    )


def _check_structure(params: PyTree, layout: Layout) -> list[Any]:
  _refuse_stacked(layout)
  leaves, treedef = jax.tree.flatten(params)
  if treedef != layout.treedef:
    raise ValueError(
      f"params have structure {treedef}, but the layout was made for "
      f"{layout.treedef}; make the layout from these params"
    )
  for leaf, x in zip(layout.leaves, leaves):
    if tuple(x.shape) != leaf.shape:
      raise ValueError(
        f"params{leaf.path}: shape {tuple(x.shape)}, but the layout has {leaf.shape}"
      )
  return leaves
