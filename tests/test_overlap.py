"""jaxdp's real train step: bucket collectives overlap backward, bytes match the ring formulas.

Overlap is read off the GPT train step compiled for 8 H100s without a GPU
(`jaxdp.inspect.compile_train_step`; skipped without jax-cuda12-plugin). Each program is
compiled once per test run. Communication volume is read off the CPU compile of an MLP
whose leading dims do not divide dp, against the formulas of docs/design.md computed here from
the param count (never by the code under test): the program may move more than the
formula only by the padding (rows padded to a multiple of dp, bucket ends to 128
elements).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxdp
from jaxdp.inspect import compile_train_step, gpu_compile_unavailable, memory_report
from jaxdp.inspect import report, ring_formula, schedule
from models.gpt import GPT, GPTConfig, gpt_loss
from models.mlp import MLP, mlp_loss

N = 8
GPU_REASON = gpu_compile_unavailable()
_skip_without_gpu_compile = pytest.mark.skipif(
  GPU_REASON is not None, reason=f"no deviceless GPU compile: {GPU_REASON}"
)


def needs_gpu_compile(test):
  """Skipped without the GPU target; run on one xdist worker, which compiles each GPT
  program once (`gpu_step` is cached per process)."""
  return pytest.mark.slow(_skip_without_gpu_compile(pytest.mark.xdist_group("h100_gpt")(test)))


METRIC_BYTES = 64
"""Collectives this small carry the step's metrics (loss, norms), not buckets."""


def tx():
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


# ----------------------------------------------------------------------------- GPU: overlap

GPT_CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=4, d_model=64)


@functools.cache
def gpt():
  params, loss_fn = jaxdp.nnx_split(GPT(GPT_CONFIG, rngs=nnx.Rngs(0)), gpt_loss)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  tokens = jax.ShapeDtypeStruct((2 * N, GPT_CONFIG.block_size), jnp.int32)
  return params, loss_fn, {"x": tokens, "y": tokens}


def gpt_config(strategy, overlap, default_buckets=False):
  params, _, _ = gpt()
  psi = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  return jaxdp.DDPConfig(
    data_parallel_sharding_strategy=strategy,
    bucket_size=None if default_buckets else psi // 5,
    overlap_grad_reduce=overlap,
  )


@functools.cache
def gpu_step(strategy, overlap=True, default_buckets=False):
  """The GPT train step for 8 H100s: (schedule, layout)."""
  params, loss_fn, batch = gpt()
  config = gpt_config(strategy, overlap, default_buckets)
  compiled = compile_train_step(loss_fn, tx(), N, config, params, batch)
  mesh = jax.make_mesh((N,), ("data",))
  state = jax.eval_shape(lambda p: jaxdp.init_state(p, tx(), mesh, config), params)
  return schedule(compiled), state.layout


def bucket_collectives(s, kind, bucket_bytes):
  """The collectives of `kind` whose operand is one of the buckets, in issue order."""
  found = [c for c in s.collectives if c.kind == kind and c.operand_bytes in bucket_bytes]
  return sorted(found, key=lambda c: c.start_index)


def grad_bucket_bytes(layout):
  return {
    b.shard_size * layout.dp * buf.grad_dtype.itemsize
    for buf in layout.buffers
    for b in buf.buckets
  }


def gemm_indices(s):
  return [op.index for op in s.ops if op.category == "gemm"]


def check_overlapped(s, layout, kind):
  reductions = bucket_collectives(s, kind, grad_bucket_bytes(layout))
  assert len(reductions) == layout.num_buckets >= 4, report(s)
  # All but the last one issued (the embedding's bucket, complete only when the backward
  # is) run under a backward GEMM.
  for c in reductions[:-1]:
    assert c.is_async and c.overlaps_gemm, report(s)


def check_after_backward(s, layout, kind):
  assert layout.num_buckets == len(layout.buffers) == 1
  (reduction,) = bucket_collectives(s, kind, grad_bucket_bytes(layout))
  assert reduction.start_index > max(gemm_indices(s)), report(s)
  assert not reduction.overlaps_gemm


@needs_gpu_compile
def test_ddp_bucket_all_reduces_overlap_backward_gemms():
  s, layout = gpu_step("no_shard", True)
  check_overlapped(s, layout, "all-reduce")


@needs_gpu_compile
def test_ddp_default_buckets_of_a_model_that_fits_one_overlap_backward_gemms():
  """This GPT (0.2M params) fits one 25 MiB bucket, where its all-reduce could start only
  after the backward; by default DDP cuts such a model into buckets of 16,384 elements (a
  16th of it, at least that), of whole params, and all but the last two issued run under a
  backward GEMM: the embedding's and the first block's last params', both complete only when
  the backward is."""
  s, layout = gpu_step("no_shard", True, default_buckets=True)
  psi = sum(math.prod(x.shape) for x in jax.tree.leaves(gpt()[0]))
  assert layout.bucket_size == max(16_384, -(-psi // 16)) == 16_384
  reductions = bucket_collectives(s, "all-reduce", grad_bucket_bytes(layout))
  assert len(reductions) == layout.num_buckets >= 10, report(s)
  for c in reductions[:-2]:
    assert c.is_async and c.overlaps_gemm, report(s)


@needs_gpu_compile
def test_ddp_without_overlap_reduces_once_after_backward():
  s, layout = gpu_step("no_shard", False)
  check_after_backward(s, layout, "all-reduce")


@needs_gpu_compile
def test_distributed_optimizer_reduce_scatters_overlap_backward_gemms():
  s, layout = gpu_step("optim", True)
  check_overlapped(s, layout, "reduce-scatter")
  # overlap_param_gather: the params are gathered bucket by bucket at the start of the
  # step, each gather under the forward of the layers before it. The first two gathered
  # (the bucket holding the embeddings, first in backprop order, and the one holding block
  # 0's attention, last) are both needed before the first GEMM, with only the embedding lookup
  # before them: nothing of the forward can hide them. Every later one runs under GEMMs.
  gathers = sorted(
    (c for c in s.collectives if c.kind == "all-gather"), key=lambda c: c.start_index
  )
  assert len(gathers) == layout.num_buckets
  for c in gathers[2:]:
    assert c.is_async and c.overlaps_gemm, report(s)
  assert sum(c.overlaps_gemm for c in gathers) >= len(gathers) // 2, report(s)


@needs_gpu_compile
def test_distributed_optimizer_without_overlap_reduces_once_after_backward():
  s, layout = gpu_step("optim", False)
  check_after_backward(s, layout, "reduce-scatter")


@needs_gpu_compile
def test_scanned_distributed_optimizer_gathers_and_reduces_each_layer_in_the_loops():
  """`optim` on the scanned GPT with `DDPConfig(stacked=["blocks"])`: each layer's params
  are all-gathered in the forward loop's iteration (one per param) and its grads
  reduce-scattered in the backward loop's (one per layer), each overlapping that loop's
  compute; outside the loops only the other bucket's gather and reduce-scatter (the last)."""
  params, loss_fn = jaxdp.nnx_split(
    GPT(dataclasses.replace(GPT_CONFIG, scan_layers=True), rngs=nnx.Rngs(0)), gpt_loss
  )
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  _, _, batch = gpt()
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim", stacked=["blocks"])
  s = schedule(compile_train_step(loss_fn, tx(), N, config, params, batch))
  n_blocks = len(jax.tree.leaves(params["blocks"]))
  looped = [c for c in s.collectives if c.trip_count == GPT_CONFIG.n_layer]
  gathers = [c for c in looped if c.kind == "all-gather"]
  (scatter,) = [c for c in looped if c.kind == "reduce-scatter"]
  assert len(gathers) == n_blocks, report(s)
  for c in gathers + [scatter]:
    assert c.is_async and c.overlaps_compute, report(s)
  once = [c for c in s.collectives if c.trip_count == 1 and c.operand_bytes > METRIC_BYTES]
  assert sorted(c.kind for c in once) == ["all-gather", "reduce-scatter"], report(s)


@needs_gpu_compile
def test_fsdp_all_gathers_overlap_compute():
  s, layout = gpu_step("optim_grads_params", True)
  gathers = sorted(
    (c for c in s.collectives if c.kind == "all-gather"), key=lambda c: c.start_index
  )
  units = {b.unit for buf in layout.buffers for b in buf.buckets}
  assert len(units) == GPT_CONFIG.n_layer + 3  # blocks, wte, wpe, ln_f
  assert len(gathers) >= len(units)
  # Prefetch: every unit's gather but the first runs while earlier units compute.
  for c in gathers[1:]:
    assert c.is_async and c.overlaps_compute, report(s)
  assert sum(c.overlaps_gemm for c in gathers) >= GPT_CONFIG.n_layer, report(s)
  scatters = [
    c for c in s.collectives if c.kind == "reduce-scatter" and c.operand_bytes > METRIC_BYTES
  ]
  assert len(scatters) == len(units)  # the tied wte: once, the sum of its two uses
  assert sum(c.overlaps_gemm for c in scatters) >= GPT_CONFIG.n_layer - 1, report(s)


@needs_gpu_compile
def test_fsdp_holds_one_gathered_bucket_per_unit_and_one_grad_bucket_in_flight():
  """Notebook 03's model at half width: 4 bf16 layers 512 wide (one unit bucket each: 0.5
  MiB gathered, 1 MiB of f32 gradients), batch 64, Adam. Two things kept FSDP's peak above
  ZeRO-1's (which holds every param whole) on this model unless jaxdp orders them:

  * the forward's gather would outlive the forward: `x @ w + b`'s residual is cheap, XLA
    moves its computation into the backward's fusions, which read `b` from the forward's
    gathered bucket (so the gathered params pass a barrier in the forward);
  * a unit's f32 gradients would be copied into their bucket while the later unit's
    reduce-scatter is still in flight, two gradient buckets alive (so they wait for it).

  docs/design.md ("FSDP's two orderings") gives the peaks with and without each. Structurally: no unit's gradient bucket is assembled while another unit's
  reduce-scatter is in flight, and each reduce-scatter but the last still runs under a
  backward matmul."""
  width = 512
  params, loss_fn = jaxdp.nnx_split(
    MLP(width, width, width, n_layers=4, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16), mlp_loss
  )
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  x = jax.ShapeDtypeStruct((64, width), jnp.bfloat16)
  peak, compiled = {}, {}
  for strategy in ("optim", "optim_grads_params"):
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, bucket_size=width * width)
    compiled[strategy] = compile_train_step(
      loss_fn, optax.adamw(1e-3), N, config, params, {"x": x, "y": x}
    )
    peak[strategy] = jaxdp.inspect.memory_stats(compiled[strategy]).peak_bytes
  assert peak["optim_grads_params"] < peak["optim"], peak
  s = schedule(compiled["optim_grads_params"])
  scatters = sorted(
    (c for c in s.collectives if c.kind == "reduce-scatter" and c.operand_bytes > METRIC_BYTES),
    key=lambda c: c.start_index,
  )
  assert len(scatters) == 4, report(s)
  for c in scatters:  # no gradient bucket is assembled (concatenated) during a reduce-scatter
    assembled = [op.name for op in s.ops[c.start_index : c.done_index] if "concatenate" in op.name]
    assert not assembled, (c.name, assembled)
  assert all(c.is_async and c.overlaps_gemm for c in scatters[:-1]), report(s)


@needs_gpu_compile
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_sharded_steps_reduce_norms_in_at_most_two_small_all_reduces(strategy):
  # optax's clip_by_global_norm on grads sharded over "data" sums one partial norm per
  # leaf (one scalar all-reduce each in the SPMD program, ~50 on this GPT); the GPU
  # compile merges them into one, and the step's metrics (loss, grad norm) take one more.
  s, _ = gpu_step(strategy, True)
  small = [c for c in s.collectives if c.kind == "all-reduce" and c.operand_bytes <= METRIC_BYTES]
  assert 1 <= len(small) <= 2, report(s)


# ----------------------------------------------------------------------------- CPU: bytes

MLP_SIZES = (12, 100, 5)  # rows 12, 100, 5 pad to 16, 104, 8 on 8 devices
MLP_LAYERS = 4


def mlp(dtype):
  din, dh, dout = MLP_SIZES
  model = MLP(din, dh, dout, n_layers=MLP_LAYERS, rngs=nnx.Rngs(0), param_dtype=dtype)
  params, loss_fn = jaxdp.nnx_split(model, mlp_loss)
  batch = {"x": jnp.ones((2 * N, din), dtype), "y": jnp.zeros((2 * N, dout), dtype)}
  return params, loss_fn, batch


def psi_bounds(params):
  """(Ψ, Ψ with every leading dim padded to a multiple of N) of a param tree."""
  psi = sum(x.size for x in jax.tree.leaves(params))
  padded = sum(-(-x.shape[0] // N) * N * math.prod(x.shape[1:]) for x in jax.tree.leaves(params))
  return psi, padded


@functools.cache
def cpu_comm(strategy, dtype):
  params, loss_fn, batch = mlp(dtype)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, bucket_size=3000)
  mesh = jax.make_mesh((N,), ("data",))
  state = jaxdp.init_state(params, tx(), mesh, config)
  step = jaxdp.make_train_step(loss_fn, tx(), mesh, config)
  if dtype == jnp.float32:
    s = schedule(step, state, batch)  # the CPU program, compiled with jaxdp's options
  else:  # XLA:CPU promotes bf16 collectives to f32: read what jaxdp asked for
    s = schedule(step.lower(state, batch).as_text(dialect="hlo"))
  volume = {}
  for c in s.collectives:
    if c.operand_bytes > METRIC_BYTES:
      volume[c.kind] = volume.get(c.kind, 0.0) + c.ring_bytes * c.trip_count
  return volume, params, state, s


def within_padding(measured, psi, padded, n_collectives, bytes_per_element, factor):
  """`factor · bytes · Ψ` <= measured <= the same of the padded Ψ (+ 127 per bucket)."""
  low = factor * bytes_per_element * psi
  high = factor * bytes_per_element * (padded + 127 * n_collectives)
  return low <= measured <= high


@pytest.mark.parametrize(
  "strategy,dtype",
  [
    ("no_shard", jnp.float32),
    ("optim", jnp.float32),
    ("optim_grads", jnp.float32),
    ("optim", jnp.bfloat16),
  ],
)
def test_bytes_per_step_match_the_ring_formula(strategy, dtype):
  volume, params, state, s = cpu_comm(strategy, dtype)
  psi, padded = psi_bounds(params)
  ring = (N - 1) / N
  grad_bytes = 4  # grad_reduce_in_fp32
  param_bytes = jnp.dtype(dtype).itemsize
  n = {
    k: sum(c.kind == k and c.operand_bytes > METRIC_BYTES for c in s.collectives)
    for k in ("all-reduce", "reduce-scatter", "all-gather")
  }
  assert n[{"no_shard": "all-reduce"}.get(strategy, "reduce-scatter")] >= 3  # 3+ buckets
  if strategy == "no_shard":
    assert set(volume) == {"all-reduce"}
    # DDP: all-reduce 2(N-1)/N · grad bytes.
    assert within_padding(
      volume["all-reduce"], psi, padded, n["all-reduce"], grad_bytes, 2 * ring
    ), report(s)
  else:
    assert set(volume) == {"reduce-scatter", "all-gather"}
    # ZeRO-1/2: reduce-scatter (N-1)/N · grad bytes + all-gather (N-1)/N · param bytes:
    # with fp32 params the same as DDP.
    assert within_padding(
      volume["reduce-scatter"], psi, padded, n["reduce-scatter"], grad_bytes, ring
    ), report(s)
    assert within_padding(volume["all-gather"], psi, padded, n["all-gather"], param_bytes, ring), (
      report(s)
    )
    if dtype == jnp.float32:
      ddp, _, _, _ = cpu_comm("no_shard", dtype)
      assert sum(volume.values()) == pytest.approx(ddp["all-reduce"], rel=1e-3)
  # jaxdp's own formula (layout padding included) is exact.
  expected = ring_formula(state)
  assert volume.keys() == expected.keys()
  for kind, value in expected.items():
    assert volume[kind] == pytest.approx(value, rel=1e-9), report(s, expected=expected)
  assert "expected" in report(s, expected=expected)


@needs_gpu_compile
def test_fsdp_bytes_per_step_are_one_and_a_half_ddp():
  # Read on the GPU target: XLA:CPU may CSE the backward re-gather (reshard_after_forward)
  # with the forward one (docs/design.md).
  s, layout = gpu_step("optim_grads_params", True)
  params, _, _ = gpt()
  psi = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  volume = {}
  for c in s.collectives:
    if c.operand_bytes > METRIC_BYTES:
      volume[c.kind] = volume.get(c.kind, 0.0) + c.ring_bytes * c.trip_count
  ddp = 2 * (N - 1) / N * 4 * psi
  ring = {k: (N - 1) / N * 4 * math.prod(params[k].shape) for k in ("wte", "wpe")}
  # The GPT's leading dims divide 8: padding is only the bucket ends (128 elements each).
  # Per unit: an all-gather in the forward and again in the backward, and one reduce-scatter
  # (torch FSDP's 1.5 x DDP). The tied wte, used by the embedding and by the logits, is
  # reduce-scattered once (the sum of both uses' gradients) but gathered in the forward of
  # each; a backward gathers only where the grads need the param's value, which wpe's and
  # the embedding's wte grads do not; and the last segment (the logits) keeps its forward
  # gather of wte for its backward, which follows at once (XLA merges the two identical
  # all-gathers): wte is gathered twice, wpe once.
  assert volume["reduce-scatter"] == pytest.approx(ddp / 2, rel=0.01), report(s)
  assert volume["all-gather"] == pytest.approx(ddp - ring["wpe"], rel=0.01), report(s)
  assert sum(volume.values()) == pytest.approx(1.5 * ddp - ring["wpe"], rel=0.01)


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_memory_report_predicted_equals_measured(strategy):
  params, loss_fn, batch = mlp(jnp.bfloat16)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, bucket_size=3000)
  compile_gpu = GPU_REASON is None and strategy == "optim"
  rows = memory_report(
    params, tx(), N, config, loss_fn=loss_fn if compile_gpu else None, batch=batch
  )
  by_kind = {r["kind"]: r for r in rows}
  assert list(by_kind) == ["params", "master", "opt_state", "state", "grads", "gathered", "total"]
  assert all(r["strategy"] == strategy and r["dp"] == N for r in rows)
  for kind in ("params", "master", "opt_state", "state"):
    assert by_kind[kind]["measured"] == by_kind[kind]["predicted"], kind
  psi, _ = psi_bounds(params)
  # bf16 params, fp32 master and Adam moments: 2Ψ + 12Ψ (ZeRO: 12Ψ/N) bytes, + padding.
  master_and_moments = 12 * psi if strategy == "no_shard" else 12 * psi / N
  assert by_kind["master"]["predicted"] + by_kind["opt_state"]["predicted"] == pytest.approx(
    master_and_moments, rel=0.1
  )
  if compile_gpu:
    # What the compiled program takes as arguments (less the batch) is the state.
    assert by_kind["state"]["compiled"] == by_kind["state"]["measured"]
    assert by_kind["total"]["compiled"] >= by_kind["state"]["compiled"]
  else:
    assert by_kind["state"]["compiled"] is None


def test_doctests_ledger():
  import doctest

  from jaxdp._src import ledger

  result = doctest.testmod(ledger, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0
