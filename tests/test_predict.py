"""jaxdp.inspect.predict_step: the step time XLA's cost model gives a compiled GPU program.

The structure of a prediction is checked, never its numbers: loops count their trips, no
collective is exposed for longer than it runs, the timeline holds the compiled program's own
instructions on two streams that never run two things at once, and step time is compute plus
exposed communication. Programs are compiled for 8 H100s without a GPU (skipped without
jax-cuda12-plugin): small `shard_map` programs, jaxdp's step and a plain `jax.jit` one.
"""

import collections

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdp
from jaxdp import inspect

N = 8  # devices on the "data" axis
D = 256  # layer width
ROWS = 32  # batch rows per device
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
GPU_REASON = inspect.gpu_compile_unavailable()
pytestmark = pytest.mark.skipif(
  GPU_REASON is not None, reason=f"no deviceless GPU compile: {GPU_REASON}"
)


@pytest.fixture(scope="module")
def mesh():
  return inspect.gpu_mesh((N,), ("data",))


def scanned(mesh, layers):
  """`layers` tanh layers under `lax.scan`, each reducing its activations' Gram matrix."""

  def body(h, ws):
    def layer(h, w):
      h = jnp.tanh(h @ w)
      return h, jax.lax.psum(h.T @ h, "data")

    return jax.lax.scan(layer, h, ws)[1]

  f = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P(), check_vma=False)
  x = jax.ShapeDtypeStruct((N * ROWS, D), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  ws = jax.ShapeDtypeStruct((layers, D, D), jnp.float32, sharding=NamedSharding(mesh, P()))
  return inspect.compile_for_gpu(f, x, ws)


def mlp_params():
  return [{"w": jax.ShapeDtypeStruct((D, D), jnp.float32)} for _ in range(3)]


def mlp_loss(params, batch):
  x = batch["x"]
  for layer in params:
    x = jnp.tanh(x @ layer["w"])
  return jnp.mean((x - batch["y"]) ** 2)


def mlp_batch():
  return {k: jax.ShapeDtypeStruct((N * ROWS, D), jnp.float32) for k in ("x", "y")}


def jaxdp_step(strategy):
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, bucket_size=D * D)
  return inspect.compile_train_step(
    mlp_loss, optax.adamw(1e-3), N, config, mlp_params(), mlp_batch()
  )


def jit_step(mesh):
  """The data-parallel step a JAX user writes: params replicated, batch sharded."""
  tx = optax.adamw(1e-3)

  def step(params, opt_state, batch):
    grads = jax.grad(mlp_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), mlp_params())
  opt_state = jax.eval_shape(tx.init, params)
  replicated = lambda t: inspect.abstract_like(t, mesh)
  batch = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P("data"))),
    mlp_batch(),
  )
  return inspect.compile_for_gpu(jax.jit(step), replicated(params), replicated(opt_state), batch)


def check_invariants(p):
  """What holds for every prediction, whatever the estimates."""
  tol = 1e-6 * max(p.step_us, 1.0)  # float sums of up to thousands of microsecond terms
  assert set(p.comm_us) == set(p.exposed_us)
  for kind in p.comm_us:
    assert 0.0 <= p.exposed_us[kind] <= p.comm_us[kind] + tol, kind
  assert p.comm_us["total"] == pytest.approx(sum(us for k, us in p.comm_us.items() if k != "total"))
  assert p.step_us == pytest.approx(p.compute_us + p.exposed_us["total"])
  assert 0.0 <= p.hidden_fraction <= 1.0
  for lane in ("compute", "comm"):  # one stream each: nothing runs beside itself
    spans = [(i.start_us, i.end_us) for i in p.timeline if i.lane == lane]
    assert all(a <= b for a, b in spans)
    assert all(b0 <= a1 + tol for (_, b0), (a1, _) in zip(spans, spans[1:])), lane
  for i in p.timeline:
    assert 0.0 <= i.exposed_us <= i.end_us - i.start_us + tol
    assert (i.lane == "comm") == (i.kind in KINDS)
    assert i.end_us <= p.step_us + tol


def check_names(p, compiled):
  """The timeline's intervals are the compiled schedule's kernels and collectives, each as
  many times as it runs, in schedule order within every computation."""
  s = inspect.schedule(compiled)
  kernels = [op for op in s.ops if op.category in ("gemm", "compute")]
  runs = collections.Counter()
  for op in kernels:
    runs[op.name] += op.trip_count
  for c in s.collectives:
    runs[c.name] += c.trip_count
  assert collections.Counter(i.name for i in p.timeline) == runs
  assert set(p.unestimated) <= set(runs)
  for comp in {op.computation for op in kernels}:
    order = [op.name for op in kernels if op.computation == comp]
    seen = [i.name for i in p.timeline if i.lane == "compute" and i.computation == comp]
    trips = len(seen) // max(len(order), 1)
    assert seen == order * trips, comp
  category = {op.name: op.category for op in kernels}
  assert all(i.kind == category[i.name] for i in p.timeline if i.lane == "compute")


def test_loops_count_every_trip(mesh):
  two, four = scanned(mesh, 2), scanned(mesh, 4)
  p2, p4 = inspect.predict_step(two), inspect.predict_step(four)
  for p, compiled in ((p2, two), (p4, four)):
    check_invariants(p)
    check_names(p, compiled)
  assert p4.step_us > p2.step_us and p4.compute_us > p2.compute_us
  assert p4.comm_us["all-reduce"] > p2.comm_us["all-reduce"] > 0
  (body,) = {i.computation for i in p4.timeline if i.lane == "comm"}
  per_trip = [i for i in p4.timeline if i.computation == body]
  assert len(per_trip) == 2 * len([i for i in p2.timeline if i.computation == body])


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_jaxdp_step(strategy):
  compiled = jaxdp_step(strategy)
  p = inspect.predict_step(compiled)
  check_invariants(p)
  check_names(p, compiled)
  kinds = {"no_shard": {"all-reduce"}, "optim_grads_params": {"all-gather", "reduce-scatter"}}
  assert kinds[strategy] <= set(p.comm_us)
  assert all(p.comm_us[k] > 0 for k in kinds[strategy])


def test_plain_jit_step_and_the_options_leave_the_schedule_alone(mesh):
  compiled = jit_step(mesh)
  p = inspect.predict_step(compiled)
  check_invariants(p)
  check_names(p, compiled)
  assert p.comm_us["total"] > 0
  # Without COST_MODEL_OPTIONS the program is the same, in the same order; only the
  # estimates are gone, and predict_step says how to get them.
  bare = inspect.compile_for_gpu(
    jax.jit(lambda x: jnp.tanh(x @ x.T).sum()),
    jax.ShapeDtypeStruct((N * ROWS, D), jnp.float32, sharding=NamedSharding(mesh, P("data"))),
    compiler_options={**inspect.COST_MODEL_OPTIONS, "xla_gpu_collect_cost_model_stats": False},
  )
  with_costs = inspect.compile_for_gpu(
    jax.jit(lambda x: jnp.tanh(x @ x.T).sum()),
    jax.ShapeDtypeStruct((N * ROWS, D), jnp.float32, sharding=NamedSharding(mesh, P("data"))),
  )
  names = lambda c: [(op.name, op.opcode) for op in inspect.schedule(c).ops]
  assert names(bare) == names(with_costs)
  with pytest.raises(ValueError, match="COST_MODEL_OPTIONS"):
    inspect.predict_step(bare)


def test_a_function_is_compiled_with_the_options(mesh):
  x = jax.ShapeDtypeStruct((N * ROWS, D), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  f = jax.shard_map(
    lambda x: jax.lax.psum_scatter(jnp.tanh(x), "data", tiled=True),
    mesh=mesh,
    in_specs=P(),
    out_specs=P("data"),
  )
  p = inspect.predict_step(f, x)  # an async-wrapped reduce-scatter: its estimate is read
  check_invariants(p)
  assert p.comm_us["reduce-scatter"] > 0 and not p.unestimated


def test_cpu_program_is_refused_naming_the_fix():
  with pytest.raises(ValueError, match="no XLA:GPU cost estimates"):
    inspect.predict_step(lambda x: x * 2, jnp.zeros(4))
