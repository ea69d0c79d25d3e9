"""HFSDP: FSDP with Megatron-FSDP's `outer_dp_sharding_strategy="optim"` on a
`("replica", "data")` mesh.

The compute params are sharded over "data" (1/D, replicated over "replica", as HSDP); the
fp32 master and the optimizer state are sharded over both axes (1/(R·D)). Every run trains a
tiny model and compares with plain `jax.grad` + optax on one device; the collectives and
their replica groups are read from the compiled program (`tests/test_meshes.py`'s helpers:
on the 8 CPU devices of a `(2, 4)` mesh, device `(r, d)` has id `4 * r + d`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp.inspect import measured_bytes, memory_ledger, memory_report
from tests.test_meshes import STEPS, as_sets, collectives, groups, mlp, reference
from tests.tolerances import AdamBound, rtol_sum

R, D = 2, 4
HFSDP = jaxdp.DDPConfig(
  data_parallel_sharding_strategy="optim_grads_params",
  num_distributed_optimizer_instances=R,
  outer_dp_sharding_strategy="optim",
)
TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
AUTO = (jax.sharding.AxisType.Auto,) * 2


def stacked_mlp():
  """Three tanh layers of width 6 stacked on a leading layer axis (the loss scans over
  them) and a head: 6 rows pad to 8 = R·D on every leaf."""
  rng = np.random.default_rng(1)
  params = {
    "blocks": {
      "w": 0.4 * rng.standard_normal((3, 6, 6)).astype(np.float32),
      "b": 0.1 * rng.standard_normal((3, 6)).astype(np.float32),
    },
    "head": 0.5 * rng.standard_normal((6, 3)).astype(np.float32),
  }

  def loss_fn(p, b):
    layer = lambda h, l: (jnp.tanh(h @ l["w"] + l["b"]), None)
    h, _ = jax.lax.scan(layer, b["x"], p["blocks"])
    return jnp.mean((h @ p["head"] - b["y"]) ** 2)

  batch = {
    "x": rng.standard_normal((16, 6)).astype(np.float32),
    "y": rng.standard_normal((16, 3)).astype(np.float32),
  }
  return params, loss_fn, batch


CASES = {  # name: (model, FSDPConfig, grad_accum_steps, axis types)
  "unrolled": (mlp, jaxdp.FSDPConfig(), 1, None),
  "unrolled-auto": (mlp, jaxdp.FSDPConfig(), 1, AUTO),
  "stacked": (stacked_mlp, jaxdp.FSDPConfig(stacked=["blocks"]), 1, None),
  "accum": (mlp, jaxdp.FSDPConfig(), 2, None),
  "accum-gathered": (mlp, jaxdp.FSDPConfig(reshard_after_backward=False), 2, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hfsdp_equals_single_device(case):
  model, fsdp, k, axis_types = CASES[case]
  params, loss_fn, batch = model()
  kw = {} if axis_types is None else {"axis_types": axis_types}
  mesh = jax.make_mesh((R, D), ("replica", "data"), **kw)
  state = jaxdp.init_state(params, TX, mesh, HFSDP, fsdp=fsdp)
  step = jaxdp.make_train_step(loss_fn, TX, mesh, HFSDP, fsdp=fsdp, grad_accum_steps=k)
  for i in range(STEPS):
    state, metrics = step(state, batch)
    if i == 0:
      first = metrics
  if axis_types is None:  # Auto meshes trim the output specs (P("data") != P("data", None))
    assert step._cache_size() == 1  # the state a step returns is placed like init_state's
  # Both losses average 16 x 3 squared errors (and the micro-batches' means average to the
  # global one), so each gradient element sums 48 terms in another order: tests/tolerances.py.
  bound = AdamBound(1e-2, 16 * 3, params, clip=1.0)
  bound.check(jaxdp.get_params(state), reference(params, loss_fn, batch, TX, bound))
  # The grad norm counts each element once: after the reduce-scatter across "replica" every
  # device holds a distinct 1/(R·D) of it (counted R times it would be off by sqrt(2)). A
  # norm sums squares: rtol_sum of the 48 terms of each gradient and of the params' count.
  grads = jax.grad(loss_fn)(params, batch)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  np.testing.assert_allclose(
    float(first["grad_norm"]),
    float(optax.tree.norm(grads)),
    rtol=rtol_sum(16 * 3) + rtol_sum(n_params),
  )
  np.testing.assert_allclose(
    float(first["loss"]), float(loss_fn(params, batch)), rtol=rtol_sum(16 * 3)
  )


def rows(n):
  """A dim of n padded to a multiple of R·D = 8."""
  return -(-n // (R * D)) * (R * D)


def test_hfsdp_collectives_and_bytes_per_device():
  """Per step: one reduce-scatter per unit over "data" groups in the backward, then one per
  unit bucket over "replica" groups (not an all-reduce), then one all-gather per unit
  bucket over "replica" groups after the update; per device the optimizer state and the
  master are 1/(R·D) of the padded params, the compute params 1/D."""
  params, loss_fn, batch = mlp()  # units l0 (w 6x10, b 10) and l1 (w 10x3, b 3)
  mesh = jax.make_mesh((R, D), ("replica", "data"))
  tx = optax.adamw(1e-2)
  state = jaxdp.init_state(params, tx, mesh, HFSDP)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, HFSDP)
  assert not state.fused  # each leaf's block is split across "replica": a per-leaf update

  # Each device's block of a unit (fp32 elements): rows padded to 8, 1/D of them.
  padded = {"l0": rows(6) * 10 + rows(10), "l1": rows(10) * 3 + rows(3)}  # 80 + 16, 48 + 8
  block = {u: 4 * n // D for u, n in padded.items()}  # bytes: 96, 56
  data, replica = as_sets(groups(mesh, "data")), as_sets(groups(mesh, "replica"))
  everyone = as_sets((tuple(range(R * D)),))
  ops = collectives(step, state, batch)
  kinds = [
    (kind, n, "data" if g == data else "replica" if g == replica else g) for kind, n, g in ops
  ]
  scatters = [(n, g) for kind, n, g in kinds if kind == "reduce-scatter"]
  # The backward's reduce-scatters over "data" move whole unit buckets (the bucket layout's
  # 128-element alignment included: lcm(D, 128)); then one per unit across "replica".
  assert sorted(g for _, g in scatters) == ["data", "data", "replica", "replica"]
  # each unit's "replica" scatter reduces what its "data" scatter made: the k-th comes after
  # k of those (the units' order between them is the scheduler's)
  for k, at in enumerate(i for i, (_, g) in enumerate(scatters) if g == "replica"):
    assert sum(g == "data" for _, g in scatters[:at]) >= k + 1, scatters
  assert sorted(n for n, g in scatters if g == "replica") == sorted(block.values())
  gathers = [(n, g) for kind, n, g in kinds if kind == "all-gather"]
  # across "replica": the updated 1/(R·D) of each unit bucket, in the param dtype (fp32)
  assert sorted(n for n, g in gathers if g == "replica") == sorted(b // R for b in block.values())
  assert {g for _, g in gathers} == {"data", "replica"}
  # no all-reduce over "replica" (HSDP's): only the loss and norm scalars over all devices
  assert [(kind, g) for kind, _, g in ops if kind == "all-reduce"] == [("all-reduce", everyone)]
  # across "replica": a unit's reduce-scatter, its update, then its gather; the k-th gather
  # comes after k of the scatters (how the units interleave is the scheduler's)
  order = [kind for kind, _, g in kinds if g == "replica"]
  assert sorted(order) == ["all-gather"] * 2 + ["reduce-scatter"] * 2
  for k, at in enumerate(i for i, kind in enumerate(order) if kind == "all-gather"):
    assert order[:at].count("reduce-scatter") >= k + 1, order

  for leaf in jax.tree.leaves(state.opt_state[0].mu) + jax.tree.leaves(state.master):
    assert leaf.shape[0] % (R * D) == 0 and leaf.sharding.spec[0] == ("data", "replica")
    assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // (R * D)
  for leaf in jax.tree.leaves(state.params):
    assert leaf.shape[0] % (R * D) == 0 and leaf.sharding.spec[0] == "data"
    assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // D
  # Bytes per device, from the padded sizes: the master and Adam's two moments 1/(R·D) (and
  # Adam's int32 count), the compute params 1/D.
  elements = sum(padded.values())
  want = {"params": 4 * elements // D, "master": 4 * elements // (R * D)}
  want["opt_state"] = 2 * want["master"] + 4
  assert {k: v for k, v in measured_bytes(state).items() if k != "step"} == want
  assert memory_ledger(params, tx, D, HFSDP).state == want
  # measured on a (replica, data) mesh of its own
  report = memory_report(jax.tree.map(jnp.asarray, params), tx, D, HFSDP)
  assert all(r["predicted"] == r["measured"] for r in report if r["measured"] is not None)
  assert {r["kind"] for r in report if r["measured"] is not None} >= set(want)


def test_hfsdp_state_readers_and_checkpoints_across_strategies(tmp_path):
  """`get_params` (whole and sharded), `get_opt_state`, `make_eval_step` and
  `abstract_state` read an HFSDP state; its checkpoint restores into plain FSDP on one
  "data" axis of 8 and back, bit for bit, and the restored state steps as the original.
  One param is bf16, so its fp32 master is stored apart from it; one (5 x 4) is padded on
  its rows, and its sharded views are over "data" on its columns."""
  params, loss_fn, batch = mlp()
  params["l1"]["w"] = params["l1"]["w"].astype(jnp.bfloat16)
  params["extra"] = np.linspace(-1, 1, 20, dtype=np.float32).reshape(5, 4)

  def loss(p, b):
    p = jax.tree.map(lambda x: x.astype(jnp.float32), p)
    return loss_fn(p, b) + 1e-2 * jnp.sum(p["extra"] ** 2)

  mesh = jax.make_mesh((R, D), ("replica", "data"))
  tx = optax.adamw(1e-2)
  state = jaxdp.init_state(params, tx, mesh, HFSDP)
  step = jaxdp.make_train_step(loss, tx, mesh, HFSDP)
  state, _ = step(state, batch)

  whole = jaxdp.get_params(state)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), whole) == jax.tree.map(
    lambda x: (x.shape, x.dtype), params
  )
  view = jaxdp.get_params(state, sharded=True)
  assert view["extra"].sharding.spec == jax.P(None, "data")
  for a, b in zip(jax.tree.leaves(view), jax.tree.leaves(whole)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # the compute params are the master cast to the param dtype, rows in place
  compute = jax.tree.map(lambda x: np.asarray(x), state.params)
  master = jax.tree.map(lambda x: np.asarray(x), state.master)
  for c, m in zip(jax.tree.leaves(compute), jax.tree.leaves(master)):
    np.testing.assert_array_equal(c, m.astype(c.dtype))
  mu = jaxdp.get_opt_state(state)[0].mu
  assert jax.tree.map(np.shape, mu) == jax.tree.map(np.shape, params)
  mu_view = jaxdp.get_opt_state(state, sharded=True)[0].mu
  assert mu_view["extra"].sharding.spec == jax.P(None, "data")
  for a, b in zip(jax.tree.leaves(mu_view), jax.tree.leaves(mu)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  evaluate = jaxdp.make_eval_step(lambda p, b: {"loss": loss(p, b)}, mesh, HFSDP)
  np.testing.assert_allclose(
    float(evaluate(state, batch)["loss"]), float(loss(whole, batch)), rtol=rtol_sum(16 * 3)
  )
  abstract = jaxdp.abstract_state(params, tx, mesh, HFSDP)
  assert jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), abstract) == jax.tree.map(
    lambda x: (x.shape, x.dtype, x.sharding), state
  )

  mgr = jaxdp.CheckpointManager(tmp_path / "hfsdp")
  mgr.save(1, state)
  mgr.wait_until_finished()
  fsdp_config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
  mesh8 = jax.make_mesh((R * D,), ("data",))
  plain = mgr.restore(jaxdp.init_state(params, tx, mesh8, fsdp_config))
  for a, b in zip(jax.tree.leaves(jaxdp.get_params(plain)), jax.tree.leaves(whole)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(
    jax.tree.leaves(jaxdp.get_opt_state(plain)), jax.tree.leaves(jaxdp.get_opt_state(state))
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  back_mgr = jaxdp.CheckpointManager(tmp_path / "fsdp")
  back_mgr.save(1, plain)
  back_mgr.wait_until_finished()
  back = back_mgr.restore(jaxdp.init_state(params, tx, mesh, HFSDP))
  # 8 rows is a multiple of 8 under both: the padding is the same, so an abstract target
  # takes it too
  again = back_mgr.restore(jaxdp.abstract_state(params, tx, mesh, HFSDP))
  for restored in (back, again):
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
      assert a.sharding == b.sharding
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(step(back, batch)[0]), jax.tree.leaves(step(state, batch)[0])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hfsdp_bad_input_is_refused_before_compiling():
  params, _, _ = mlp()
  base = dict(data_parallel_sharding_strategy="optim_grads_params")
  with pytest.raises(
    ValueError, match=r"needs data_parallel_sharding_strategy='optim_grads_params'"
  ):
    jaxdp.DDPConfig(
      data_parallel_sharding_strategy="optim",
      num_distributed_optimizer_instances=2,
      outer_dp_sharding_strategy="optim",
    )
  with pytest.raises(ValueError, match=r"set num_distributed_optimizer_instances"):
    jaxdp.DDPConfig(**base, outer_dp_sharding_strategy="optim")
  with pytest.raises(ValueError, match=r"use 'no_shard' .* or 'optim'"):
    jaxdp.DDPConfig(**base, outer_dp_sharding_strategy="optim_grads")
  # a mesh without "replica"
  with pytest.raises(ValueError, match=r"use a mesh with axes \('replica', 'data'\)"):
    jaxdp.init_state(params, optax.sgd(0.1), jax.make_mesh((8,), ("data",)), HFSDP)
  mesh = jax.make_mesh((R, D), ("replica", "data"))
  with pytest.raises(ValueError, match=r"fused_update=True: outer_dp_sharding_strategy='optim'"):
    fused = jaxdp.DDPConfig(
      **base,
      num_distributed_optimizer_instances=R,
      outer_dp_sharding_strategy="optim",
      fused_update=True,
    )
    jaxdp.init_state(params, optax.sgd(0.1), mesh, fused)
  with pytest.raises(NotImplementedError, match=r"chunks=.*outer_dp_sharding_strategy='no_shard'"):
    jaxdp.init_state(
      params, optax.sgd(0.1), mesh, HFSDP, fsdp=jaxdp.FSDPConfig(chunks={("l0", "w"): 2})
    )
  tp = jax.make_mesh((R, D // 2, 2), ("replica", "data", "model"))
  placed = dict(params)
  placed["l0"] = {
    "w": jax.device_put(params["l0"]["w"], jax.NamedSharding(tp, jax.P(None, "model"))),
    "b": params["l0"]["b"],
  }
  with pytest.raises(
    NotImplementedError, match=r"tensor or expert parallel.*place the params replicated"
  ):
    jaxdp.init_state(placed, optax.sgd(0.1), tp, HFSDP)


def test_hfsdp_frozen_params_and_average_in_collective():
  """A frozen param is gathered over "data" and gets no grad, no master and no collective
  across "replica"; `average_in_collective` divides by R·D inside the reduce-scatter over
  "data", and the one across "replica" sums: one SGD step is the single-device one."""
  params, loss_fn, batch = mlp()
  mesh = jax.make_mesh((R, D), ("replica", "data"))
  config = jaxdp.DDPConfig(
    data_parallel_sharding_strategy="optim_grads_params",
    num_distributed_optimizer_instances=R,
    outer_dp_sharding_strategy="optim",
    average_in_collective=True,
  )
  frozen = {"l0": {"w": True, "b": False}, "l1": {"w": False, "b": False}}
  tx = optax.sgd(1.0)
  state = jaxdp.init_state(params, tx, mesh, config, frozen=frozen)
  assert state.master["l0"]["w"] is None
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  ops = collectives(step, state, batch)
  replica = as_sets(groups(mesh, "replica"))
  assert len([kind for kind, _, g in ops if g == replica and kind == "reduce-scatter"]) == 2
  state, _ = step(state, batch)
  got, grads = jaxdp.get_params(state), jax.grad(loss_fn)(params, batch)
  np.testing.assert_array_equal(np.asarray(got["l0"]["w"]), params["l0"]["w"])
  # SGD at lr 1: p - g. A gradient element sums 48 terms in another order, so it moves by
  # up to sqrt(48) * rtol_sum(48) of its leaf's largest gradient (tests/tolerances.py); the
  # subtraction rounds once more in each program, by eps32 / 2 of |p - g|.
  for path in (("l0", "b"), ("l1", "w"), ("l1", "b")):
    g, p = grads[path[0]][path[1]], params[path[0]][path[1]]
    atol = np.sqrt(48) * rtol_sum(48) * float(jnp.max(jnp.abs(g)))
    atol += 2**-23 * float(np.max(np.abs(p - g)))
    np.testing.assert_allclose(got[path[0]][path[1]], p - g, rtol=0, atol=atol, err_msg=str(path))
