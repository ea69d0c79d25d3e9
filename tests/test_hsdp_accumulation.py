"""HSDP with grad accumulation: the micro-batches reduce within "data", and the sum across
"replica" (the slow network between hosts) runs once per step.

On a `(replica=2, data=4)` mesh with `grad_accum_steps=2`, every strategy is compiled and
its collectives read from the optimized program: each collective whose replica groups hold
devices of both replicas runs outside the micro-batch loop (trip count 1), and the bytes it
moves per step are those of the same step without accumulation. Every strategy also trains
the tiny MLP of `tests/test_meshes.py` and is compared with plain `jax.grad` + optax on one
device. On the 8 CPU devices of a `(2, 4)` mesh, device `(r, d)` has id `4 * r + d`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from tests.test_meshes import STEPS, mlp, reference
from tests.tolerances import AdamBound, rtol_sum

R, D, K = 2, 4, 2
TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


def config(strategy, **kw):
  return jaxdp.DDPConfig(
    data_parallel_sharding_strategy=strategy, num_distributed_optimizer_instances=R, **kw
  )


CASES = {  # name: (DDPConfig, FSDPConfig or None)
  "no_shard": (jaxdp.DDPConfig(), None),
  "optim": (config("optim"), None),
  "optim_grads": (config("optim_grads"), None),
  "optim_grads per-leaf": (config("optim_grads", fused_update=False), None),
  "optim_grads average": (config("optim_grads", average_in_collective=True), None),
  "fsdp": (config("optim_grads_params"), jaxdp.FSDPConfig()),
  "fsdp per-leaf": (config("optim_grads_params", fused_update=False), jaxdp.FSDPConfig()),
  "fsdp gathered": (
    config("optim_grads_params"),
    jaxdp.FSDPConfig(reshard_after_backward=False),
  ),
  "hfsdp": (
    config("optim_grads_params", outer_dp_sharding_strategy="optim"),
    jaxdp.FSDPConfig(),
  ),
}


def compiled_step(case, k):
  ddp, fsdp = CASES[case]
  params, loss_fn, batch = mlp()
  mesh = jax.make_mesh((R, D), ("replica", "data"))
  kw = {} if fsdp is None else {"fsdp": fsdp}
  state = jaxdp.init_state(params, TX, mesh, ddp, **kw)
  step = jaxdp.make_train_step(loss_fn, TX, mesh, ddp, grad_accum_steps=k, **kw)
  return jaxdp.inspect.schedule(step.lower(state, batch).compile())


def crossing(schedule):
  """The collectives whose groups hold devices of both replicas (id // D)."""
  return [
    c
    for c in schedule.collectives
    if any(len({device // D for device in g}) > 1 for g in c.replica_groups)
  ]


@pytest.mark.parametrize("case", list(CASES))
def test_collectives_across_replica_run_once_per_step(case):
  accumulated, single = compiled_step(case, K), compiled_step(case, 1)
  across = crossing(accumulated)
  # The micro-batches run in a loop (trip count K): its collectives stay within "data".
  inside = [c for c in accumulated.collectives if c.trip_count == K]
  if case not in ("no_shard", "optim", "fsdp gathered"):  # these reduce once after it
    assert inside and all(c.kind == "reduce-scatter" or c.kind == "all-gather" for c in inside)
  assert all(c.trip_count == 1 for c in across), [(c.kind, c.trip_count) for c in across]
  # ... and the step crosses "replica" as the step without accumulation does: the grads
  # once (an all-reduce of each bucket's shard, HFSDP a reduce-scatter and the params'
  # all-gather, DDP an all-reduce of the whole buckets over every device) and the
  # loss-and-norm scalars, with as many bytes (a per-leaf FSDP state's all-reduce of the
  # summed blocks leaves out the bucket's tail padding: fewer)
  kinds = lambda s: sorted(c.kind for c in crossing(s))
  moved = lambda s: sum(c.operand_bytes for c in crossing(s))
  assert kinds(accumulated) == kinds(single)
  assert moved(accumulated) <= moved(single)
  if case != "fsdp per-leaf":
    assert moved(accumulated) == moved(single)
  grads = [c for c in across if c.operand_bytes > 8]  # not the loss-and-norm scalars
  assert grads and {c.kind for c in grads} <= {"all-reduce", "reduce-scatter", "all-gather"}


@pytest.mark.parametrize("case", list(CASES))
def test_accumulated_step_equals_single_device(case):
  ddp, fsdp = CASES[case]
  params, loss_fn, batch = mlp()
  mesh = jax.make_mesh((R, D), ("replica", "data"))
  kw = {} if fsdp is None else {"fsdp": fsdp}
  state = jaxdp.init_state(params, TX, mesh, ddp, **kw)
  step = jaxdp.make_train_step(loss_fn, TX, mesh, ddp, grad_accum_steps=K, **kw)
  for i in range(STEPS):
    state, metrics = step(state, batch)
    if i == 0:
      first = metrics
  assert step._cache_size() == 1
  # The loss averages 16 x 3 squared errors, each micro-batch's mean divided by K: every
  # gradient element sums the same 48 terms in another order (tests/tolerances.py).
  bound = AdamBound(1e-2, 16 * 3, params, clip=1.0)
  bound.check(jaxdp.get_params(state), reference(params, loss_fn, batch, TX, bound))
  # The grad norm counts each element once though both replicas hold every shard after
  # the sum across them (twice would be off by sqrt(2)); a norm sums squares.
  n_params = sum(x.size for x in jax.tree.leaves(params))
  np.testing.assert_allclose(
    float(first["grad_norm"]),
    float(optax.tree.norm(jax.grad(loss_fn)(params, batch))),
    rtol=rtol_sum(16 * 3) + rtol_sum(n_params),
  )
  np.testing.assert_allclose(
    float(first["loss"]), float(loss_fn(params, batch)), rtol=rtol_sum(16 * 3)
  )


def stacked_mlp():
  """Three tanh layers of width 8 stacked on a leading layer axis (the loss scans over
  them) and a head."""
  rng = np.random.default_rng(1)
  params = {
    "blocks": {
      "w": 0.4 * rng.standard_normal((3, 8, 8)).astype(np.float32),
      "b": 0.1 * rng.standard_normal((3, 8)).astype(np.float32),
    },
    "head": 0.5 * rng.standard_normal((8, 3)).astype(np.float32),
  }

  def loss_fn(p, b):
    layer = lambda h, l: (jnp.tanh(h @ l["w"] + l["b"]), None)
    h, _ = jax.lax.scan(layer, b["x"], p["blocks"])
    return jnp.mean((h @ p["head"] - b["y"]) ** 2)

  batch = {
    "x": rng.standard_normal((16, 8)).astype(np.float32),
    "y": rng.standard_normal((16, 3)).astype(np.float32),
  }
  return params, loss_fn, batch


@pytest.mark.parametrize(
  "ddp, fsdp",
  [
    (config("optim_grads", stacked=("blocks",)), None),
    (config("optim_grads_params"), jaxdp.FSDPConfig(stacked=["blocks"])),
  ],
  ids=["optim_grads", "fsdp"],
)
def test_scanned_layers_reduce_within_data_and_equal_single_device(ddp, fsdp):
  """Scanned layers reduce-scatter one layer per iteration of the scan's backward loop,
  itself inside the micro-batch loop: those stay within "data" too."""
  params, loss_fn, batch = stacked_mlp()
  mesh = jax.make_mesh((R, D), ("replica", "data"))
  kw = {} if fsdp is None else {"fsdp": fsdp}
  state = jaxdp.init_state(params, TX, mesh, ddp, **kw)
  step = jaxdp.make_train_step(loss_fn, TX, mesh, ddp, grad_accum_steps=K, **kw)
  across = crossing(jaxdp.inspect.schedule(step.lower(state, batch).compile()))
  assert across and all(c.trip_count == 1 for c in across)
  for _ in range(STEPS):
    state, _ = step(state, batch)
  bound = AdamBound(1e-2, 16 * 3, params, clip=1.0)
  bound.check(jaxdp.get_params(state), reference(params, loss_fn, batch, TX, bound))


def residual_blocks():
  """Three residual blocks of two matmuls (width 8 -> 16 -> 8) stacked on a leading layer
  axis, a scale before each: the forward first uses `g` and `w1` in a block's first half,
  so their grads are reduce-scattered late (an iteration later), `b1`'s and `w2`'s early."""
  rng = np.random.default_rng(2)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  params = {
    "blocks": {
      "g": np.ones((3, 8), np.float32),
      "w1": 0.3 * normal(3, 8, 16),
      "b1": 0.1 * normal(3, 16),
      "w2": 0.3 * normal(3, 16, 8),
    },
    "head": 0.5 * normal(8, 3),
  }

  def loss_fn(p, b):
    def block(h, l):
      z = jnp.tanh(h * l["g"]) @ l["w1"] + l["b1"]
      return h + jnp.tanh(z) @ l["w2"], None

    h, _ = jax.lax.scan(block, b["x"], p["blocks"])
    return jnp.mean((h @ p["head"] - b["y"]) ** 2)

  return params, loss_fn, {"x": normal(16, 8), "y": normal(16, 3)}


def test_scanned_fsdp_units_on_an_hsdp_mesh_without_accumulation():
  """HSDP's FSDP over three scanned blocks, one micro-batch: a block's early grads are
  reduced across "replica" inside the backward loop, so they vary over "data" alone, and
  the loop's carry must keep that type when the next block's gather orders them (the loop
  runs from three layers on: with two, both are peeled out of it)."""
  ddp, fsdp = config("optim_grads_params"), jaxdp.FSDPConfig(stacked=["blocks"])
  params, loss_fn, batch = residual_blocks()
  mesh = jax.make_mesh((R, D), ("replica", "data"))
  state = jaxdp.init_state(params, TX, mesh, ddp, fsdp=fsdp)
  step = jaxdp.make_train_step(loss_fn, TX, mesh, ddp, fsdp=fsdp)
  for _ in range(STEPS):
    state, _ = step(state, batch)
  bound = AdamBound(1e-2, 16 * 3, params, clip=1.0)
  bound.check(jaxdp.get_params(state), reference(params, loss_fn, batch, TX, bound))


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_sum_across_replica_moves_the_grad_reduce_dtype(strategy):
  """With `grad_reduce_dtype=bf16` the one all-reduce across "replica" moves bf16, as the
  micro-batches' reduce-scatters do (an FSDP state sums their fp32 shards, cast to bf16
  for the collective)."""
  ddp = config(strategy, grad_reduce_dtype=jnp.bfloat16)
  fsdp = jaxdp.FSDPConfig() if strategy == "optim_grads_params" else None
  params, loss_fn, batch = mlp()
  mesh = jax.make_mesh((R, D), ("replica", "data"))
  kw = {} if fsdp is None else {"fsdp": fsdp}
  state = jaxdp.init_state(params, TX, mesh, ddp, **kw)
  step = jaxdp.make_train_step(loss_fn, TX, mesh, ddp, grad_accum_steps=K, **kw)
  # The program as asked for (XLA:CPU runs bf16 collectives in f32 after optimizing)
  schedule = jaxdp.inspect.schedule(step.lower(state, batch).as_text(dialect="hlo"))
  grads = [c for c in crossing(schedule) if c.operand_bytes > 8]
  assert grads and all(c.kind == "all-reduce" and c.dtypes == ("bf16",) for c in grads)
