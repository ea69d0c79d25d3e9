"""Layout, ravel and unravel, checked against numbers worked out by hand in this file."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp._src.ddp import layout_for
from jaxdp._src.ledger import memory_ledger


def test_buckets_offsets_and_padding_by_hand():
  # Tree order is b1, w1, w2; backprop order is the reverse: w2, w1, b1.
  params = {"w1": jnp.zeros((300, 4)), "b1": jnp.zeros((3,)), "w2": jnp.zeros((4, 5))}
  layout = jaxdp.layout.make_layout(params, dp=8, bucket_size=1000)
  (buf,) = layout.buffers
  assert buf.name == "float32"
  # w2 (20 elements) keeps bucket 0 open; w1 brings it to 1220 >= 1000 and closes it.
  b0, b1 = buf.buckets
  assert [p.path for p in b0.params] == ["['w2']", "['w1']"]
  assert [p.path for p in b1.params] == ["['b1']"]
  # Each param is sharded on the dim that pads least to a multiple of dp. w2 (4, 5): dim 0
  # would double (4 -> 8), dim 1 grows 5 -> 8, so 8 columns of 4 (4 per shard); w1
  # (300, 4): 300 -> 304 rows of 4 (152 per shard); b1: 3 -> 8 rows of 1 (1 per shard).
  assert [p.axis for p in b0.params + b1.params] == [1, 0, 0]
  assert [p.rows for p in b0.params + b1.params] == [8, 304, 8]
  assert [p.shard_size(8) for p in b0.params + b1.params] == [4, 152, 1]
  assert [p.offset for p in b0.params] == [0, 4]
  assert layout.shard_axes == (0, 0, 1)  # tree order b1, w1, w2
  # Shards padded so that a bucket is a multiple of lcm(8, 128) = 128: 156 -> 160, 1 -> 16.
  assert (b0.offset, b0.shard_size, b1.offset, b1.shard_size) == (0, 160, 1280, 16)
  assert buf.size == 1280 + 128
  assert buf.numel == 1223
  assert layout.num_buckets == 2 and layout.static == ()


def test_shard_dim_is_the_one_that_pads_least():
  dp = 8
  params = {
    "stacked": jnp.zeros((4, 24, 5)),  # 4 layers < 8 devices: shard the 24 rows
    "emb": jnp.zeros((50, 16)),  # 50 -> 56 rows vs 16 columns: no padding
    "w": jnp.zeros((12, 100)),  # 12 -> 16 (33%) vs 100 -> 104 (4%)
    "tie": jnp.zeros((16, 8)),  # both divide: the leading dim
    "odd": jnp.zeros((3, 5)),  # 3 -> 8 vs 5 -> 8: dim 1 pads less
    "scalar": jnp.zeros(()),
  }
  layout = jaxdp.layout.make_layout(params, dp=dp)
  axes = {p.path: (p.axis, p.rows, p.local_shape(dp)) for p in layout.params}
  assert axes == {
    "['stacked']": (1, 24, (4, 3, 5)),
    "['emb']": (1, 16, (50, 2)),
    "['w']": (1, 104, (12, 13)),
    "['tie']": (0, 16, (2, 8)),
    "['odd']": (1, 8, (3, 1)),
    "['scalar']": (0, 8, (1,)),
  }
  # `leading` pins the leading dim (jaxdp passes tensor-parallel weights); so do FSDP units.
  pinned = jaxdp.layout.make_layout(params, dp=dp, leading=lambda path, leaf: path != "['w']")
  assert {p.path: p.axis for p in pinned.params if p.axis} == {"['w']": 1}
  units = jaxdp.layout.make_layout(params, dp=dp, units=lambda path: "all")
  assert all(p.axis == 0 for p in units.params)


def test_dtype_buffers_and_odd_dp():
  params = {"x": jnp.zeros((10,)), "y": jnp.zeros((2, 2), jnp.bfloat16)}
  layout = jaxdp.layout.make_layout(params, dp=3, grad_dtype=jnp.float32)
  assert [b.name for b in layout.buffers] == ["bfloat16/float32", "float32"]
  bf16, f32 = layout.buffers
  assert bf16.param_dtype == jnp.bfloat16 and bf16.grad_dtype == jnp.float32
  # lcm(3, 128) = 384: every bucket is 384 elements, 128 per shard.
  assert [b.buckets[0].shard_size for b in layout.buffers] == [128, 128]
  assert bf16.size == f32.size == 384
  assert f32.buckets[0].params[0].rows == 12  # 10 -> 12
  assert bf16.buckets[0].params[0].rows == 3  # 2 -> 3


def test_default_bucket_size_is_16m_sharded_and_pytorch_ddps_for_no_shard():
  """make_layout and the sharded strategies default to max(16M, 1M * dp) elements (Megatron's
  rule with 16M for its 40M: a 40M bucket's ravel copy put ZeRO-1 on models/gpt.py above GSPMD
  ZeRO-1); DDP (no_shard) to PyTorch DDP's 25 MiB of fp32, because XLA copies a bucket before
  its all-reduce, and a model that fits one such bucket to 16 buckets, so that its all-reduces
  start inside the backward (docs/design.md, "Default bucket sizes", says what was measured)."""
  params = {"w": jnp.zeros((4,))}
  assert jaxdp.layout.make_layout(params, dp=8).bucket_size == 16_000_000
  assert jaxdp.layout.make_layout(params, dp=64).bucket_size == 64_000_000
  mesh = jax.make_mesh((8,), ("data",))
  tx = optax.sgd(0.1)
  sizes = {
    s: jaxdp.init_state(
      params, tx, mesh, jaxdp.DDPConfig(data_parallel_sharding_strategy=s)
    ).layout.bucket_size
    for s in ("no_shard", "optim", "optim_grads")
  }
  # A DDP model that fits one 25 MiB bucket is cut into 16 (buckets of >= 16,384 elements).
  assert sizes == {"no_shard": 16_384, "optim": 16_000_000, "optim_grads": 16_000_000}
  big = {"w": jnp.zeros((4096, 2048)), "b": jnp.zeros((2048,))}  # 8.4M elements: > 25 MiB
  small = {f"w{i}": jnp.zeros((100, 1001)) for i in range(10)}  # 1M: 16 buckets of 62,563
  ddp = jaxdp.DDPConfig(data_parallel_sharding_strategy="no_shard")
  for p, size, buckets in ((big, 25 * 2**20 // 4, 2), (small, 62_563, 10)):
    layout = jaxdp.init_state(p, tx, mesh, ddp).layout
    assert (layout.bucket_size, layout.num_buckets) == (size, buckets)
    # the ledger counts the same buckets' end padding
    assert memory_ledger(p, tx, 8, ddp).grads == layout.buffers[0].size * 4


def test_no_shard_default_buckets_give_a_param_larger_than_one_a_bucket_of_its_own():
  """Under no_shard's default 25 MiB buckets a param larger than a bucket does not join the
  params before it (backprop order: w, norm, then the table, 6.55M + 8K elements): alone, its
  ravel is a bitcast, not a concatenation as large as it. Explicit bucket sizes, a small
  model's 16 buckets and the sharded strategies keep Megatron's rule (close a bucket once
  it reaches the size), and the ledger counts the same buckets."""
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  big = 25 * 2**20 // 4  # DDP_BUCKET_SIZE
  params = {"embed": sds(big // 1024 + 8, 1024), "norm": sds(1024), "w": sds(1024, 1024)}
  mesh = jax.make_mesh((8,), ("data",))
  paths = lambda layout: [[p.path for p in b.params] for b in layout.buffers[0].buckets]
  for strategy, bucket_size, want in (
    ("no_shard", None, [["['w']", "['norm']"], ["['embed']"]]),
    ("no_shard", big, [["['w']", "['norm']", "['embed']"]]),
    ("optim", None, [["['w']", "['norm']", "['embed']"]]),
  ):
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, bucket_size=bucket_size)
    layout = layout_for(params, mesh, config)
    assert paths(layout) == want, (strategy, bucket_size)
    assert memory_ledger(params, None, 8, config).grads == layout.buffers[0].size * 4


def test_a_param_is_never_split_and_every_bucket_reaches_bucket_size():
  params = {f"p{i:02d}": jnp.zeros((n,)) for i, n in enumerate([7, 300, 64, 1, 999, 5, 130])}
  layout = jaxdp.layout.make_layout(params, dp=4, bucket_size=250)
  buckets = layout.buffers[0].buckets
  sizes = [[p.size for p in b.params] for b in buckets]
  # Backprop order: 130, 5, 999 | 1, 64, 300 | 7
  assert sizes == [[130, 5, 999], [1, 64, 300], [7]]
  assert all(sum(s) >= 250 for s in sizes[:-1])


def test_frozen_and_integer_leaves_get_no_buffer():
  params = {"emb": jnp.zeros((8, 4)), "frozen": jnp.zeros((4, 4)), "step": jnp.zeros((), jnp.int32)}
  by_tree = jaxdp.layout.make_layout(
    params, dp=2, frozen={"emb": False, "frozen": True, "step": False}
  )
  by_fn = jaxdp.layout.make_layout(params, dp=2, frozen=lambda path, leaf: "frozen" in path)
  for layout in (by_tree, by_fn):
    assert [p.path for p in layout.params] == ["['emb']"]
    assert layout.static == (1, 2)  # tree order: emb, frozen, step
  with pytest.raises(ValueError, match="frozen"):
    jaxdp.layout.make_layout(params, dp=2, frozen={"emb": True})


def test_shapes_alone_give_the_same_layout():
  params = {"a": jnp.zeros((33, 3), jnp.bfloat16), "b": jnp.zeros((5,))}
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  assert jaxdp.layout.make_layout(shapes, dp=8, bucket_size=64) == jaxdp.layout.make_layout(
    params, dp=8, bucket_size=64
  )
  hash(jaxdp.layout.make_layout(shapes, dp=8))  # static: usable as a jit static argument


def _random_tree(dtypes):
  rng = np.random.default_rng(0)
  shapes = [(), (1,), (7,), (3, 5), (13, 1, 3), (129,)]
  return {
    f"{np.dtype(d).name}_{i}": jnp.asarray(rng.normal(size=s), d)
    for d in dtypes
    for i, s in enumerate(shapes)
  }


@pytest.mark.parametrize("dp", [1, 3, 8])
def test_round_trip_is_bitwise(dp):
  params = _random_tree([jnp.float32, jnp.bfloat16, jnp.float16])
  params["count"] = jnp.arange(3, dtype=jnp.int32)
  layout = jaxdp.layout.make_layout(params, dp=dp, bucket_size=40)
  flat = jaxdp.layout.ravel(params, layout)
  assert {k: v.dtype for k, v in flat.items()} == {
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "float32": jnp.float32,
  }
  back = jaxdp.layout.unravel(flat, layout, like=params)
  for k in params:
    a, b = np.asarray(params[k]), np.asarray(back[k])
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes(), k


def test_ravel_places_each_shard_rows_where_the_layout_says():
  dp = 4
  params = {"a": jnp.arange(10.0 * 3).reshape(10, 3), "b": jnp.arange(6.0) + 100}
  layout = jaxdp.layout.make_layout(params, dp=dp)
  flat = np.asarray(jaxdp.layout.ravel(params, layout)["float32"])
  (bucket,) = layout.buffers[0].buckets
  for p in bucket.params:
    full = np.asarray(params[p.path[2:-2]]).reshape(p.shape[0], -1)
    padded = np.zeros((p.rows, full.shape[1]), np.float32)
    padded[: p.shape[0]] = full
    r = p.rows // dp
    n = r * full.shape[1]
    for d in range(dp):
      start = bucket.offset + d * bucket.shard_size + p.offset
      np.testing.assert_array_equal(flat[start : start + n], padded[d * r : (d + 1) * r].ravel())
  # Everything that is not a param is zero padding.
  assert np.count_nonzero(flat) == 10 * 3 + 6 - 1  # a[0, 0] is 0.0


def test_ravel_places_column_blocks_of_a_param_sharded_on_dim_1():
  dp = 4
  params = {"s": jnp.arange(2.0 * 6 * 3).reshape(2, 6, 3) + 1}  # 2 layers < 4: dim 1
  layout = jaxdp.layout.make_layout(params, dp=dp)
  (p,) = layout.params
  assert (p.axis, p.rows) == (1, 8)  # 6 -> 8 rows per layer, 2 per shard
  (bucket,) = layout.buffers[0].buckets
  flat = np.asarray(jaxdp.layout.ravel(params, layout)["float32"])
  padded = np.zeros((2, 8, 3), np.float32)
  padded[:, :6] = np.asarray(params["s"])
  for d in range(dp):
    start = bucket.offset + d * bucket.shard_size + p.offset
    np.testing.assert_array_equal(
      flat[start : start + 2 * 2 * 3], padded[:, 2 * d : 2 * d + 2].ravel()
    )


def test_bad_arguments():
  with pytest.raises(ValueError, match="bucket_size"):
    jaxdp.layout.make_layout({"w": jnp.zeros(3)}, dp=2, bucket_size=0)
  with pytest.raises(ValueError, match="dp"):
    jaxdp.layout.make_layout({"w": jnp.zeros(3)}, dp=0)
  layout = jaxdp.layout.make_layout({"w": jnp.zeros(3)}, dp=2)
  with pytest.raises(ValueError, match="structure"):
    jaxdp.layout.ravel({"v": jnp.zeros(3)}, layout)
  with pytest.raises(ValueError, match=r"\['w'\]: shape"):
    jaxdp.layout.ravel({"w": jnp.zeros(4)}, layout)
  assert math.lcm(2, 128) == jaxdp.layout.ravel({"w": jnp.zeros(3)}, layout)["float32"].size
