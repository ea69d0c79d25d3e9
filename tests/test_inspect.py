"""jaxdp.inspect and the deviceless GPU compile, on small shard_map programs.

The programs are a hand-written backward pass through 4 tanh layers, each
layer's weight gradient reduced as soon as it is computed (one bucket per
layer): the shape of jaxdp's bucketed backward. Expected bytes are computed
here from the shapes, never by the code under test. The GPU cases compile for 8
H100s without a GPU and are skipped when jax-cuda12-plugin is not installed.
"""

import doctest
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdp._src import aot, compiler, hlo
from jaxdp._src import inspect as ji

N = 8  # devices on the "data" axis
D = 256  # layer width: each bucket is a (D, D) weight gradient
ROWS = 32  # batch rows per device
LAYERS = 4

GPU_REASON = aot.gpu_compile_unavailable()
needs_gpu_compile = pytest.mark.skipif(
  GPU_REASON is not None, reason=f"no deviceless GPU compile: {GPU_REASON}"
)

ITEMSIZE = {jnp.float32: 4, jnp.bfloat16: 2}

REDUCERS = {
  "all-reduce": lambda g: jax.lax.psum(g, "data"),
  "reduce-scatter": lambda g: jax.lax.psum_scatter(g, "data", tiled=True),
  "all-gather": lambda g: jax.lax.all_gather(g, "data", tiled=True),
}


def backward_like(mesh, kind):
  """4 layers of forward, then backward issuing one collective per layer."""
  reduce = REDUCERS[kind]

  def body(x, ws):
    hs = [x]
    for w in ws:
      hs.append(jnp.tanh(hs[-1] @ w))
    g = jnp.ones_like(hs[-1])
    buckets = []
    for i in reversed(range(len(ws))):
      g = g * (1 - hs[i + 1] ** 2)
      buckets.append(reduce(hs[i].T @ g))  # layer i's bucket is ready
      if i:
        g = g @ ws[i].T
    return buckets

  out = P("data") if kind == "reduce-scatter" else P()
  return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=out, check_vma=False)


def abstract_args(mesh, dtype=jnp.float32):
  x = jax.ShapeDtypeStruct((N * ROWS, D), dtype, sharding=NamedSharding(mesh, P("data")))
  w = jax.ShapeDtypeStruct((D, D), dtype, sharding=NamedSharding(mesh, P()))
  return x, [w] * LAYERS


def bucket_bytes(dtype=jnp.float32):
  return D * D * ITEMSIZE[dtype]


def expected_operand_and_result(kind, dtype=jnp.float32):
  b = bucket_bytes(dtype)
  return {
    "all-reduce": (b, b),
    "reduce-scatter": (b, b // N),
    "all-gather": (b, b * N),
  }[kind]


def expected_ring(kind, dtype=jnp.float32):
  b = bucket_bytes(dtype)
  return {
    "all-reduce": 2 * (N - 1) / N * b,
    "reduce-scatter": (N - 1) / N * b,
    "all-gather": (N - 1) / N * (b * N),  # of the gathered buffer
  }[kind]


@pytest.fixture(scope="module")
def cpu_mesh():
  return jax.make_mesh((N,), ("data",))


@pytest.fixture(scope="module")
def gpu_mesh():
  return aot.gpu_mesh((N,), ("data",))


def check_buckets(s, kind, dtype=jnp.float32):
  """4 separate collectives of the kind, each with the bucket's exact bytes."""
  assert [c.kind for c in s.collectives] == [kind] * LAYERS
  operand, result = expected_operand_and_result(kind, dtype)
  name = {jnp.float32: "f32", jnp.bfloat16: "bf16"}[dtype]
  for c in s.collectives:
    assert c.dtypes == (name,)
    assert c.operand_shapes == (f"{name}[{D},{D}]",)
    assert (c.operand_bytes, c.result_bytes) == (operand, result)
    assert c.group_size == N
    assert c.replica_groups == (tuple(range(N)),)
    assert c.trip_count == 1
    assert c.ring_bytes == pytest.approx(expected_ring(kind, dtype))
  volume = s.comm_bytes()
  assert volume[kind]["count"] == LAYERS
  assert volume[kind]["operand_bytes"] == LAYERS * operand
  assert volume[kind]["ring_bytes"] == pytest.approx(LAYERS * expected_ring(kind, dtype))
  assert volume["total"]["ring_bytes"] == volume[kind]["ring_bytes"]


# ----------------------------------------------------------------------------
# Options


def test_compiler_options():
  assert compiler.compiler_options("cpu") == {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}
  gpu = compiler.compiler_options("cuda")
  for kind in ("all_reduce", "reduce_scatter", "all_gather"):
    assert gpu[f"xla_gpu_{kind}_combine_threshold_bytes"] == 0
  assert gpu["xla_gpu_enable_latency_hiding_scheduler"] is True
  assert compiler.compiler_options("gpu") == gpu
  assert compiler.compiler_options("tpu") == {}  # not verified there: XLA's defaults


def test_target_config_is_package_data():
  text = aot.h100_target_config()
  assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in text
  assert "cuda_compute_capability { major: 9 }" in text


# ----------------------------------------------------------------------------
# CPU


def test_cpu_all_reduce_buckets_stay_separate_only_with_options(cpu_mesh):
  f = jax.jit(backward_like(cpu_mesh, "all-reduce"))
  args = abstract_args(cpu_mesh)
  kept = ji.schedule(f, *args, compiler_options=compiler.compiler_options("cpu"))
  check_buckets(kept, "all-reduce")
  assert not any(c.is_async for c in kept.collectives)  # CPU: all synchronous
  assert all(c.exposed for c in kept.collectives)

  merged = ji.schedule(f, *args)  # XLA's cpu-all-reduce-combiner runs
  (c,) = merged.collectives
  assert c.kind == "all-reduce"
  assert c.operand_shapes == (f"f32[{D},{D}]",) * LAYERS  # one tuple all-reduce
  assert c.operand_bytes == c.result_bytes == LAYERS * bucket_bytes()


@pytest.mark.parametrize("kind", ["reduce-scatter", "all-gather"])
def test_cpu_has_no_reduce_scatter_or_all_gather_combiner(cpu_mesh, kind):
  # XLA:CPU 0.10.2 has no combiner for these: they stay separate without options.
  f = jax.jit(backward_like(cpu_mesh, kind))
  check_buckets(ji.schedule(f, *abstract_args(cpu_mesh)), kind)


def test_schedule_accepts_every_form(cpu_mesh):
  f = backward_like(cpu_mesh, "all-reduce")
  args = abstract_args(cpu_mesh)
  opts = compiler.compiler_options("cpu")
  lowered = jax.jit(f).lower(*args)
  compiled = lowered.compile(compiler_options=opts)
  forms = [
    ji.schedule(compiled),
    ji.schedule(compiled.as_text()),
    ji.schedule(lowered, compiler_options=opts),
    ji.schedule(f, *args, compiler_options=opts),  # not jitted
    ji.schedule(jax.jit(f, compiler_options=opts), *args),
  ]
  assert all(s.collectives == forms[0].collectives for s in forms)
  assert ji.schedule(forms[0]) is forms[0]
  with pytest.raises(ValueError, match="ENTRY"):
    ji.schedule(lowered.as_text())  # StableHLO, not HLO
  with pytest.raises(TypeError):
    ji.schedule(42)


def test_cpu_loop_collectives_count_trip_times(cpu_mesh):
  def body(h, ws):
    def layer(h, w):
      h = jnp.tanh(h @ w)
      return h, jax.lax.psum(h.T @ h, "data")

    return jax.lax.scan(layer, h, ws)[1]

  f = jax.shard_map(body, mesh=cpu_mesh, in_specs=(P("data"), P()), out_specs=P(), check_vma=False)
  x, _ = abstract_args(cpu_mesh)
  ws = jax.ShapeDtypeStruct((3, D, D), jnp.float32, sharding=NamedSharding(cpu_mesh, P()))
  s = ji.schedule(f, x, ws)
  (c,) = s.collectives
  assert c.trip_count == 3
  assert c.computation != s.ops[0].computation  # inside the while body
  assert s.comm_bytes()["all-reduce"]["count"] == 3
  assert s.comm_bytes()["all-reduce"]["operand_bytes"] == 3 * bucket_bytes()


def test_cpu_permute_all_to_all_and_subgroups():
  mesh = jax.make_mesh((4, 2), ("data", "model"))

  def body(x):
    a = jax.lax.all_to_all(x, "data", 0, 0, tiled=True)
    b = jax.lax.ppermute(x, "model", [(0, 1), (1, 0)])
    c = jax.lax.psum(x, "data")
    return a, b, c

  f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P(), check_vma=False)
  x = jax.ShapeDtypeStruct((4 * 64, D), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  s = ji.schedule(f, x)
  by_kind = {c.kind: c for c in s.collectives}
  assert set(by_kind) == {"all-to-all", "collective-permute", "all-reduce"}
  shard = 64 * D * 4
  a2a = by_kind["all-to-all"]
  assert a2a.operand_bytes == a2a.result_bytes == shard  # tuple form on CPU
  assert a2a.group_size == 4
  assert a2a.ring_bytes == pytest.approx(3 / 4 * shard)
  perm = by_kind["collective-permute"]
  assert perm.source_target_pairs == (
    (0, 1),
    (1, 0),
    (2, 3),
    (3, 2),
    (4, 5),
    (5, 4),
    (6, 7),
    (7, 6),
  )
  assert perm.ring_bytes == shard
  ar = by_kind["all-reduce"]
  assert ar.replica_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
  assert ar.ring_bytes == pytest.approx(2 * 3 / 4 * shard)


def test_replica_groups_in_shardy_mesh_form():
  # jit-inserted (not shard_map) reductions print their groups as mesh axes.
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
  w = jax.ShapeDtypeStruct((32, 16), jnp.float32, sharding=NamedSharding(mesh, P("model")))
  compiled = (
    jax.jit(lambda x, w: (x @ w).sum(0), out_shardings=NamedSharding(mesh, P()))
    .lower(x, w)
    .compile()
  )
  assert "replica_groups=mesh[" in compiled.as_text()
  groups = {c.replica_groups for c in ji.schedule(compiled).collectives}
  assert groups == {
    ((0, 1), (2, 3), (4, 5), (6, 7)),  # over "model"
    ((0, 2, 4, 6), (1, 3, 5, 7)),
  }  # over "data" (mesh form)


def test_mesh_groups_with_device_ids():
  """Shardy's form on a mesh whose devices are not 0..n-1 row-major: `device_ids=(...)`
  (iota or a list) lays them out before the groups are read (read as every device before)."""
  attrs = ", replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}, x=1"
  assert hlo.parse_mesh_groups(attrs) == (4, ((0, 1, 2, 3), (4, 5, 6, 7)))
  listed = ", replica_groups=mesh['a'=4,'b'=2], device_ids=(0,4,1,5,2,6,3,7) {'b'}"
  assert hlo.parse_mesh_groups(listed) == (2, ((0, 4), (1, 5), (2, 6), (3, 7)))


def test_replica_groups_iota_form():
  # XLA's compact form; not produced by the programs above, parsed all the same.
  attrs = ", replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true"
  assert hlo.parse_replica_groups(attrs) == ((0, 2, 4, 6), (1, 3, 5, 7))
  assert hlo.parse_replica_groups(", replica_groups=[1,8]<=[8]") == (tuple(range(8)),)


def test_hlo_this_parser_cannot_read_stops_it_named():
  """XLA's text changes with XLA: an instruction line the parser cannot read, or replica
  groups in an unknown form, stop it with the construct named, never a schedule or a
  prediction that silently leaves an op out."""
  text = UNSUGARED.replace("%n = f32[1024,16]{1,0} negate(%p)", "%n = f32[1024,16]{1,0} negate %p")
  with pytest.raises(ValueError, match=r"computation 'wrapped' .* '%n = f32\[1024,16\]"):
    ji.schedule(text)
  # an unsugared start's groups are its wrapped collective's (read as every device before)
  halves = UNSUGARED.replace(
    "replica_groups={{0,1,2,3,4,5,6,7}}", "replica_groups={{0,1,2,3},{4,5,6,7}}"
  )
  (c,) = ji.schedule(halves).collectives
  assert c.group_size == 4 and c.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
  text = UNSUGARED.replace("replica_groups={{0,1,2,3,4,5,6,7}}", "replica_groups=<all 8>")
  with pytest.raises(ValueError, match=r"start's replica groups are in a form .*<all 8>"):
    ji.schedule(text)


UNSUGARED = """HloModule m, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped (p: f32[1024,16]) -> f32[128,16] {
  %p = f32[1024,16]{1,0} parameter(0)
  %n = f32[1024,16]{1,0} negate(%p)
  ROOT %rs = f32[128,16]{1,0} reduce-scatter(%n), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[1024,16], w: f32[16,16]) -> (f32[128,16], f32[1024,16]) {
  %x = f32[1024,16]{1,0} parameter(0)
  %w = f32[16,16]{1,0} parameter(1)
  %start = ((f32[1024,16]{1,0}), f32[128,16]{1,0}) async-start(%x), calls=%wrapped
  %d = f32[1024,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %done = f32[128,16]{1,0} async-done(%start)
  ROOT %t = (f32[128,16]{1,0}, f32[1024,16]{1,0}) tuple(%done, %d)
}
"""


def test_unsugared_async_start():
  # XLA prints `reduce-scatter-start` only when the async computation is the
  # collective alone; with more in it, `async-start(...), calls=%wrapped`.
  # Round-trip through XLA's own parser and printer to get the real text.
  hlo = pytest.importorskip("jaxlib._hlo")
  text = hlo.hlo_module_from_text(UNSUGARED).to_string()
  assert "async-start(%x), calls=%wrapped" in text
  (c,) = ji.schedule(text).collectives
  assert (c.kind, c.opcode, c.done_name) == ("reduce-scatter", "async-start", "done")
  assert (c.operand_bytes, c.result_bytes) == (1024 * 16 * 4, 128 * 16 * 4)
  assert c.is_async and c.overlapped_gemms == ("d",)


def test_ring_bytes_formula():
  assert ji.ring_bytes("all-reduce", 1000, 8) == 2 * 7 / 8 * 1000
  assert ji.ring_bytes("reduce-scatter", 1000, 8) == 7 / 8 * 1000
  assert ji.ring_bytes("all-gather", 1000, 8) == 7 / 8 * 1000
  assert ji.ring_bytes("all-reduce", 1000, 1) == 0
  with pytest.raises(ValueError):
    ji.ring_bytes("broadcast", 1, 2)


def test_report_and_plain_data(cpu_mesh):
  f = jax.jit(
    backward_like(cpu_mesh, "all-reduce"), compiler_options=compiler.compiler_options("cpu")
  )
  s = ji.schedule(f, *abstract_args(cpu_mesh))
  text = ji.report(s)
  assert f"{LAYERS} collectives (0 async" in text
  assert text.count("EXPOSED (sync)") == LAYERS
  assert "2(N-1)/N*B" in text
  rows = s.records()
  assert [r["operand_bytes"] for r in rows] == [bucket_bytes()] * LAYERS
  assert all(r["exposed"] for r in rows)
  lanes = {row["lane"] for row in s.timeline()}
  assert lanes == {"compute", "comm"}


def test_memory_stats_fields():
  m = ji.memory_stats(lambda x: x * 2, jnp.zeros((256,), jnp.float32))
  assert (m.argument_bytes, m.output_bytes) == (1024, 1024)
  assert m.peak_bytes == (m.argument_bytes + m.output_bytes + m.temp_bytes - m.alias_bytes)


def test_gpu_unavailable_is_reported_not_raised_at_import():
  # Without the plugin the GPU path explains itself; importing jaxdp still works.
  code = (
    "import sys\n"
    "sys.modules['jax_cuda12_plugin'] = None\n"
    "sys.modules['jax_plugins.xla_cuda12'] = None\n"
    "from jaxdp._src import aot\n"
    "print(aot.gpu_compile_unavailable())\n"
    "try:\n"
    "    aot.gpu_mesh()\n"
    "except RuntimeError as e:\n"
    "    print('RuntimeError:', e)\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    check=True,
    env={"JAX_PLATFORMS": "cpu", "PATH": "", "PYTHONPATH": "."},
  ).stdout
  assert "jax-cuda12-plugin" in out and "jaxdp[aot]" in out
  assert "RuntimeError: gpu_topology:" in out


GPU_EXAMPLES = ("predict_step",)  # inspect's examples that compile for the GPU target


def run_doctests(module, gpu: bool):
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  for test in doctest.DocTestFinder().find(module):
    if test.name.endswith(GPU_EXAMPLES) == gpu:
      runner.run(test)
  return doctest.TestResults(runner.failures, runner.tries)


def test_doctests_inspect():
  result = run_doctests(ji, gpu=False)
  assert result.attempted > 0 and result.failed == 0


@needs_gpu_compile
def test_doctests_inspect_gpu():
  result = run_doctests(ji, gpu=True)
  assert result.attempted > 0 and result.failed == 0


# ----------------------------------------------------------------------------
# GPU (deviceless H100 target)


@needs_gpu_compile
@pytest.mark.parametrize("kind", ["all-reduce", "reduce-scatter", "all-gather"])
def test_gpu_buckets_overlap_backward_gemms(gpu_mesh, kind):
  dtype = jnp.bfloat16 if kind != "all-reduce" else jnp.float32
  compiled = aot.compile_for_gpu(backward_like(gpu_mesh, kind), *abstract_args(gpu_mesh, dtype))
  s = ji.schedule(compiled)
  assert s.is_scheduled and s.num_partitions == N
  check_buckets(s, kind, dtype)
  assert all(c.opcode == f"{kind}-start" and c.done_name for c in s.collectives)
  # Every bucket but the last one issued runs under a backward GEMM; the last has nothing
  # left to hide behind: its done follows its start (COST_MODEL_OPTIONS keep the pair XLA
  # would make synchronous).
  *hidden, last = sorted(s.collectives, key=lambda c: c.start_index)
  for c in hidden:
    assert c.is_async and c.overlaps_gemm, ji.report(s)
    assert c.done_index > c.start_index + 1
  assert last.exposed and last.done_index == last.start_index + 1
  assert ji.report(s).count("EXPOSED") == 1


@needs_gpu_compile
def test_gpu_cublas_gemms_count_as_gemms(gpu_mesh):
  compiled = aot.compile_for_gpu(
    backward_like(gpu_mesh, "all-reduce"),
    *abstract_args(gpu_mesh),
    compiler_options={"xla_gpu_enable_triton_gemm": False},
  )
  assert 'custom_call_target="__cublas$lt$matmul"' in compiled.as_text()
  s = ji.schedule(compiled)
  *hidden, _ = sorted(s.collectives, key=lambda c: c.start_index)
  for c in hidden:
    assert c.overlapped_gemms and all(g.startswith("custom-call") for g in c.overlapped_gemms)


@needs_gpu_compile
def test_gpu_default_combiner_merges_buckets(gpu_mesh):
  # Without jaxdp's options (XLA's 30 MiB default thresholds) the 4 buckets
  # become one all-reduce after the last GEMM: nothing overlaps.
  f = jax.jit(backward_like(gpu_mesh, "all-reduce"))
  s = ji.schedule(f.lower(*abstract_args(gpu_mesh)).compile())
  (c,) = s.collectives
  assert c.kind == "all-reduce" and c.operand_bytes == LAYERS * bucket_bytes()
  assert c.exposed
  gemms = [op.index for op in s.ops if op.category == "gemm"]
  assert c.start_index > max(gemms)


@needs_gpu_compile
def test_gpu_loop_body_collectives(gpu_mesh):
  def body(h, ws):
    def layer(h, w):
      h = jnp.tanh(h @ w)
      return h, jax.lax.psum(h.T @ h, "data")

    return jax.lax.scan(layer, h, ws)[1]

  f = jax.shard_map(body, mesh=gpu_mesh, in_specs=(P("data"), P()), out_specs=P(), check_vma=False)
  x, _ = abstract_args(gpu_mesh)
  ws = jax.ShapeDtypeStruct((3, D, D), jnp.float32, sharding=NamedSharding(gpu_mesh, P()))
  s = ji.schedule(aot.compile_for_gpu(f, x, ws))
  (c,) = s.collectives
  assert c.opcode == "all-reduce-start" and c.trip_count == 3
  assert c.computation != s.ops[0].computation
  assert s.comm_bytes()["all-reduce"]["operand_bytes"] == 3 * bucket_bytes()


@needs_gpu_compile
def test_gpu_memory_stats(gpu_mesh):
  args = abstract_args(gpu_mesh)
  m = ji.memory_stats(aot.compile_for_gpu(backward_like(gpu_mesh, "all-reduce"), *args))
  assert m.argument_bytes == (ROWS * D + LAYERS * D * D) * 4
  # Outputs: 4 buckets plus XLA's tuple index table (one pointer per output).
  assert 0 <= m.output_bytes - LAYERS * bucket_bytes() <= 8 * LAYERS
  assert m.temp_bytes > 0 and m.alias_bytes == 0
  # XLA's peak: every argument and output live at once, and at most all its temps besides
  # (jaxlib 0.10's XLA counts all of them; 0.12's the temps live at the peak).
  assert m.argument_bytes + m.output_bytes < m.peak_bytes
  assert m.peak_bytes <= m.argument_bytes + m.output_bytes + m.temp_bytes


@needs_gpu_compile
def test_compile_for_gpu_refuses_cpu_arguments(cpu_mesh):
  with pytest.raises(ValueError, match="GPU mesh"):
    aot.compile_for_gpu(lambda x: x * 2, abstract_args(cpu_mesh)[0])
  with pytest.raises(ValueError, match="not GPU"):
    aot.compile_for_gpu(lambda x: x * 2, jax.ShapeDtypeStruct((4,), jnp.float32))


@needs_gpu_compile
def test_abstract_like_retargets_shardings(cpu_mesh, gpu_mesh):
  x = jax.device_put(jnp.zeros((N * 4, 4)), NamedSharding(cpu_mesh, P("data")))
  (ax,) = aot.abstract_like((x,), gpu_mesh)
  assert ax.sharding.spec == P("data") and ax.sharding.mesh == gpu_mesh
  assert {d.platform for d in ax.sharding.device_set} == {"gpu"}


@needs_gpu_compile
def test_doctests_aot():
  result = doctest.testmod(aot, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0


def test_schedule_reads_hlo_before_optimization(cpu_mesh):
  # XLA:CPU promotes bf16 collectives to f32; the HLO before optimization (no "%"
  # before names, no computation signatures) still says what the program asked for.
  lowered = jax.jit(backward_like(cpu_mesh, "all-gather")).lower(
    *abstract_args(cpu_mesh, jnp.bfloat16)
  )
  s = ji.schedule(lowered.as_text(dialect="hlo"))
  assert not s.is_scheduled
  check_buckets(s, "all-gather", jnp.bfloat16)
  assert all(op.name and "%" not in op.name for op in s.ops)
