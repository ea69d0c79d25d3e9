"""Tensor-parallel params (`P(None, "model")`, `P("model", None)`) on a (data=4, model=2) mesh,
with Explicit axes (`jax.make_mesh`'s default) and with Auto axes: every strategy keeps each
leaf's placement over "model", shards the optimizer state over both axes, and trains like
the single-device program."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxdp
from tests.tolerances import AdamBound, rtol_sum

STEPS = 3
TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
# Megatron's column- then row-parallel MLP: w1's columns and b1 over "model", w2's rows.
SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
AXES = {"explicit": (AxisType.Explicit,) * 2, "auto": (AxisType.Auto,) * 2}


def problem():
  rng = np.random.default_rng(0)
  params = {
    "w1": 0.3 * rng.standard_normal((8, 64)).astype(np.float32),
    "b1": 0.1 * rng.standard_normal(64).astype(np.float32),
    "w2": 0.3 * rng.standard_normal((64, 8)).astype(np.float32),
    "b2": np.zeros(8, np.float32),
  }

  def loss_fn(p, b):  # written as for one device: no sharding annotations
    return jnp.mean((forward(p, b) - b["y"]) ** 2)

  batch = {
    "x": rng.standard_normal((16, 8)).astype(np.float32),
    "y": rng.standard_normal((16, 8)).astype(np.float32),
  }
  return params, loss_fn, batch


def reference(params, loss_fn, batch, bound):
  """Plain jax.grad + optax on one device; each step's gradients go to `bound`."""
  opt_state = TX.init(params)
  for _ in range(STEPS):
    grads = jax.grad(loss_fn)(params, batch)
    bound.add(grads)
    updates, opt_state = TX.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


def placed(params, mesh):
  return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}


@pytest.mark.parametrize("axes", list(AXES))
@pytest.mark.parametrize(
  "strategy,overlap",
  [("no_shard", True), ("optim", True), ("optim", False), ("optim_grads", True)],
)
def test_ddp_and_zero_keep_tensor_parallel_placements(strategy, overlap, axes):
  params, loss_fn, batch = problem()
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=AXES[axes])
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, overlap_param_gather=overlap)
  state = jaxdp.init_state(placed(params, mesh), TX, mesh, config)
  step = jaxdp.make_train_step(loss_fn, TX, mesh, config)
  for _ in range(STEPS):
    state, _ = step(state, batch)
  assert step._cache_size() == 1  # the state a step returns is placed like init_state's
  # The loss averages 16 x 8 squared errors (tests/tolerances.py has the argument).
  bound = AdamBound(1e-2, 16 * 8, params, clip=1.0)
  want = reference(params, loss_fn, batch, bound)
  got = jaxdp.get_params(state)
  bound.check(got, want)
  for k in params:  # every leaf keeps the caller's placement over "model"
    assert full_spec(got[k].sharding.spec, got[k].ndim) == full_spec(SPECS[k], got[k].ndim)
  adam = state.opt_state[1][0]
  # Each device's block of w1 (8, 64) and w2 (64, 8): no_shard splits "model" only; the
  # sharded strategies add the rows over "data" (w2's rows over both).
  if strategy == "no_shard":
    shards = {"w1": (8, 32), "w2": (32, 8)}
  else:
    shards = {"w1": (2, 32), "w2": (8, 8)}
    for k, dims in (("w1", ("data", "model")), ("w2", (("data", "model"), None))):
      assert full_spec(state.master[k].sharding.spec, 2) == dims
  for k, shard in shards.items():
    for moment in (adam.mu[k], adam.nu[k]):
      assert moment.addressable_shards[0].data.shape == shard, (k, moment.sharding.spec)
  if strategy == "optim" and overlap:  # the eval step runs on the same placements
    out = jaxdp.make_eval_step(forward, mesh, config, per_example=True)(state, batch)
    host = jax.device_get(got)
    # float32 rounding of sums of 8 and 64 products: rtol_sum of the terms' magnitudes.
    h = np.tanh(batch["x"] @ host["w1"] + host["b1"])
    magnitude = np.abs(h) @ np.abs(host["w2"]) + np.abs(host["b2"])
    tol = rtol_sum(8 + 64) * (1 + magnitude)
    assert np.all(np.abs(np.asarray(out) - forward(host, batch)) <= tol)


def forward(p, b):
  return jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def full_spec(spec, ndim):
  """A spec as one entry per dim (`P("model")` of a 2-D leaf is `("model", None)`)."""
  return tuple(spec) + (None,) * (ndim - len(spec))
