"""Expert params that are also tensor parallel: an MoE expert weight `(E, d, h)` placed
`P("expert", None, "model")` on a `("data", "expert", "model")` mesh (Megatron's expert
tensor parallelism), and the same model expert parallel alone on `("data", "expert")`.

Every strategy trains it like the single-device program; each expert leaf keeps both of the
caller's axes at rest and in the views, and every collective over "data" moves this
device's "model" slice of its rank's experts, never the slice gathered whole over "model"
(`distributed_optimizer.own_specs`, which ZeRO and FSDP share)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdp
from tests.test_meshes import reference
from tests.tolerances import AdamBound, rtol_sum

STEPS = 3
E, D, H, N = 8, 8, 16, 16  # experts, model width, expert width, tokens
TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
MESHES = {
  "expert": ((4, 2), ("data", "expert")),
  "expert+model": ((2, 2, 2), ("data", "expert", "model")),
}
# Megatron's expert MLP split over "model": w_in on its output columns, w_out on its rows
SPECS = {
  "expert": {"dense": P(), "w_in": P("expert"), "w_out": P("expert")},
  "expert+model": {
    "dense": P(None, "model"),
    "w_in": P("expert", None, "model"),
    "w_out": P("expert", "model", None),
  },
}


def problem():
  rng = np.random.default_rng(0)
  params = {
    "dense": 0.3 * rng.standard_normal((D, D)).astype(np.float32),
    "w_in": 0.3 * rng.standard_normal((E, D, H)).astype(np.float32),
    "w_out": 0.3 * rng.standard_normal((E, H, D)).astype(np.float32),
  }
  batch = {
    "x": rng.standard_normal((N, D)).astype(np.float32),
    "y": rng.standard_normal((N, D)).astype(np.float32),
    "expert": (np.arange(N) * 3 % E).astype(np.int32),  # a fixed routing, every expert used
  }
  return params, batch


def make_loss(expert_axis):
  """A dense layer, then each token through the one expert its routing names. With
  `expert_axis` the loss of one expert-parallel rank, which holds E / ep experts: tokens go
  to their experts' ranks and back by an all-to-all each way (GShard's dispatch and
  combine); without it, one device's."""

  def loss_fn(p, b):
    x = jnp.tanh(b["x"] @ p["dense"])
    expert_in = jnp.broadcast_to(x, (E, *x.shape))  # [E, n, d]
    if expert_axis:  # [E / ep, ep * n, d]: my experts, everyone's tokens
      expert_in = jax.lax.all_to_all(expert_in, expert_axis, 0, 1, tiled=True)
    h = jnp.tanh(jnp.einsum("end,edh->enh", expert_in, p["w_in"]))
    out = jnp.einsum("enh,ehd->end", h, p["w_out"])
    if expert_axis:  # every expert's output for my tokens, [E, n, d]
      out = jax.lax.all_to_all(out, expert_axis, 1, 0, tiled=True)
    y = jnp.einsum("ne,end->nd", jax.nn.one_hot(b["expert"], E, dtype=out.dtype), out)
    return jnp.mean((y - b["y"]) ** 2)

  return loss_fn


def full_spec(spec, ndim):
  """A spec as one entry per dim, a 1-tuple entry as its one axis name."""
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  return tuple(e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in entries)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_expert_params_split_over_model_train_like_one_device(strategy, mesh_name):
  params, batch = problem()
  mesh = jax.make_mesh(*MESHES[mesh_name])
  model = "model" in mesh.axis_names
  specs = SPECS[mesh_name]
  on = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state = jaxdp.init_state(on, TX, mesh, config)
  step = jaxdp.make_train_step(make_loss("expert"), TX, mesh, config)
  if model:
    # Over "data" (devices 4 apart) only the expert leaves move, one collective per leaf on
    # this device's "model" slice of its rank's 4 experts: 4 x 8 x 16 / 2 floats. Gathered
    # whole over "model" first they would be twice that, and a ravel into one bucket four
    # times (the dense leaf is reduced over ("expert", "data"), a group of its own).
    slice_bytes = 4 * (E // 2) * D * H // 2
    data = ((0, 4), (1, 5), (2, 6), (3, 7))
    ops = jaxdp.inspect.schedule(step.lower(state, batch).compile()).collectives
    moved = [max(c.operand_bytes, c.result_bytes) for c in ops if c.replica_groups == data]
    assert slice_bytes in moved and max(moved) == slice_bytes, ops
  for _ in range(STEPS):
    state, _ = step(state, batch)
  assert step._cache_size() == 1  # the state a step returns is placed like init_state's
  # The loss averages 16 x 8 squared errors (tests/tolerances.py has the argument).
  bound = AdamBound(1e-2, N * D, params, clip=1.0)
  want = reference(params, make_loss(None), batch, TX, bound, steps=STEPS)
  got = jaxdp.get_params(state)
  bound.check(got, want)
  for k in params:  # every leaf keeps the caller's placement
    assert full_spec(got[k].sharding.spec, got[k].ndim) == full_spec(specs[k], got[k].ndim)
  # the grad-norm metric counts each element once: a dense one is on every expert rank, an
  # expert one on one, each split over "model". A norm sums squares: rtol_sum of the 16 x 8
  # terms of each gradient and of the params' count.
  _, metrics = step(jaxdp.init_state(on, TX, mesh, config), batch)
  np.testing.assert_allclose(
    float(metrics["grad_norm"]),
    float(optax.tree.norm(jax.grad(make_loss(None))(params, batch))),
    rtol=rtol_sum(N * D) + rtol_sum(sum(x.size for x in params.values())),
  )

  # The views: each moment placed as its param, over the caller's axes and, sharded, over
  # "data" on a dim they leave whole: 1 / 8 of every expert leaf per device.
  params_view = jaxdp.get_params(state, sharded=True)
  whole, view = jaxdp.get_opt_state(state)[1][0], jaxdp.get_opt_state(state, sharded=True)[1][0]
  # (over "expert" alone both take "data" on dim 1, which 4 divides)
  if model:
    want_view = {"w_in": ("expert", "data", "model"), "w_out": ("expert", "model", "data")}
  else:
    want_view = {"w_in": ("expert", "data", None), "w_out": ("expert", "data", None)}
  for k, dims in want_view.items():
    assert full_spec(params_view[k].sharding.spec, 3) == dims
    for name in ("mu", "nu"):
      x = getattr(view, name)[k]
      assert full_spec(x.sharding.spec, 3) == dims, (name, k, x.sharding.spec)
      assert x.addressable_shards[0].data.size == x.size // 8, (name, k)
      np.testing.assert_array_equal(np.asarray(x), np.asarray(getattr(whole, name)[k]))
