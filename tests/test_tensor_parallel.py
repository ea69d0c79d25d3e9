"""Tensor-parallel params (`P(None, "model")`, `P("model", None)`) on a (data=4, model=2) mesh,
with Explicit axes (`jax.make_mesh`'s default) and with Auto axes: every strategy keeps each
leaf's placement over "model", shards the optimizer state over both axes, and trains like
the single-device program."""

from collections import Counter

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
  # sharded strategies add "data" on the dim "model" leaves whole, as FSDP does (w1's rows,
  # w2's columns), so that each device gathers its own "model" slice.
  if strategy == "no_shard":
    shards = {"w1": (8, 32), "w2": (32, 8)}
  else:
    shards = {"w1": (2, 32), "w2": (32, 2)}
    for k, dims in (("w1", ("data", "model")), ("w2", ("model", "data"))):
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


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_opt_state_views_keep_tensor_parallel_placements(strategy):
  """`get_opt_state` places each of Adam's moments as `get_params` places its param: over
  "model" as the caller split it and, with `sharded=True`, over "data" on the dim "model"
  leaves whole, so each device holds 1 / (4 x 2) of a weight's moment, not 1 / 4. The values
  are the whole view's bit for bit."""
  params, loss_fn, batch = problem()
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state = jaxdp.init_state(placed(params, mesh), TX, mesh, config)
  state, _ = jaxdp.make_train_step(loss_fn, TX, mesh, config)(state, batch)
  views = {
    sharded: (jaxdp.get_params(state, sharded=sharded), jaxdp.get_opt_state(state, sharded=sharded))
    for sharded in (False, True)
  }
  # the placements, written out: w1 (8, 64) on its rows over "data", w2 (64, 8) on its
  # columns; b1 (64,) has no dim "model" leaves whole and stays over "model" alone
  want = {
    False: {"w1": (None, "model"), "b1": ("model",), "w2": ("model", None), "b2": (None,)},
    True: {"w1": ("data", "model"), "b1": ("model",), "w2": ("model", "data"), "b2": ("data",)},
  }
  whole = views[False][1][1][0]
  for sharded, (params_view, opt_view) in views.items():
    adam = opt_view[1][0]
    for k in params:
      assert full_spec(params_view[k].sharding.spec, params_view[k].ndim) == want[sharded][k]
      for name in ("mu", "nu"):
        x = getattr(adam, name)[k]
        assert full_spec(x.sharding.spec, x.ndim) == want[sharded][k], (sharded, name, k)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(getattr(whole, name)[k]))
  for k in ("w1", "w2"):  # a weight's moment: 1 / (data x model) of it per device
    for x in (views[True][1][1][0].mu[k], views[True][1][1][0].nu[k]):
      assert x.addressable_shards[0].data.size == x.size // (4 * 2), (k, x.sharding.spec)


def full_spec(spec, ndim):
  """A spec as one entry per dim (`P("model")` of a 2-D leaf is `("model", None)`)."""
  return tuple(spec) + (None,) * (ndim - len(spec))


# ----------------------------------------------------------------------------- FSDP

FSDP = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
LAYERS = 2
# The stacked form: every block's leaves carry a leading layer axis, split within a layer;
# w2 is frozen (a frozen base weight, tensor parallel too).
STACKED_SPECS = {
  "blocks": {"w1": P(None, None, "model"), "b1": P(None, "model"), "w2": P(None, "model", None)},
  "head": P(),
}
STACKED_FROZEN = {"blocks": {"w1": False, "b1": False, "w2": True}, "head": False}


def stacked_problem():
  rng = np.random.default_rng(1)
  params = {
    "blocks": {
      "w1": 0.3 * rng.standard_normal((LAYERS, 8, 64)).astype(np.float32),
      "b1": 0.1 * rng.standard_normal((LAYERS, 64)).astype(np.float32),
      "w2": 0.1 * rng.standard_normal((LAYERS, 64, 8)).astype(np.float32),
    },
    "head": 0.3 * rng.standard_normal((8, 8)).astype(np.float32),
  }

  def loss_fn(p, b):  # residual blocks under lax.scan, written as for one device
    block = lambda h, l: (h + jnp.tanh(h @ l["w1"] + l["b1"]) @ l["w2"], None)
    h, _ = jax.lax.scan(block, b["x"], p["blocks"])
    return jnp.mean((h @ p["head"] - b["y"]) ** 2)

  _, _, batch = problem()
  return params, loss_fn, batch


def frozen_reference(params, loss_fn, batch, frozen, bound):
  """`reference` with frozen leaves left out of the optimizer and kept as they are."""
  keep = lambda t: jax.tree.map(lambda x, f: None if f else x, t, frozen)
  opt_state = TX.init(keep(params))
  for _ in range(STEPS):
    grads = jax.grad(loss_fn)(params, batch)
    bound.add(jax.tree.map(lambda g, f: 0 * g if f else g, grads, frozen))
    updates, opt_state = TX.update(keep(grads), opt_state, keep(params))
    new = optax.apply_updates(keep(params), updates)
    params = jax.tree.map(
      lambda n, p, f: p if f else n, new, params, frozen, is_leaf=lambda x: x is None
    )
  return params


@pytest.mark.parametrize("axes", list(AXES))
@pytest.mark.parametrize("form", ["unrolled", "stacked"])
def test_fsdp_keeps_tensor_parallel_placements(form, axes):
  """FSDP shards, gathers and reduce-scatters over "data" only: each leaf keeps the
  caller's "model" split at rest (params, master, Adam's moments sharded over both axes)
  and in its unit's gather. Stacked: a scanned unit, a frozen tensor-parallel weight and
  two micro-batches kept gathered across them (`reshard_after_backward=False`)."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=AXES[axes])
  on = lambda tree, specs: jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )
  if form == "unrolled":
    params, loss_fn, batch = problem()
    specs, frozen, fsdp, kw = SPECS, None, jaxdp.FSDPConfig(), {}
  else:
    params, loss_fn, batch = stacked_problem()
    specs, frozen = STACKED_SPECS, STACKED_FROZEN
    fsdp = jaxdp.FSDPConfig(stacked=["blocks"], reshard_after_backward=False)
    kw = {"grad_accum_steps": 2}
  state = jaxdp.init_state(on(params, specs), TX, mesh, FSDP, frozen=frozen, fsdp=fsdp)
  step = jaxdp.make_train_step(loss_fn, TX, mesh, FSDP, fsdp=fsdp, **kw)
  if form == "unrolled" and axes == "explicit":
    # Every gather and reduce-scatter runs over "data" (groups of 4), none over all 8
    # devices (the clip's global norm, a scalar, is all-reduced over both); a weight's moves
    # half of it, its "model" half: 8 x 64 / 2 floats (b1, split
    # over "model" on its one dim, is gathered whole: 64 floats).
    ops = [
      (c.kind, c.result_bytes if c.kind == "all-gather" else c.operand_bytes, c.replica_groups)
      for c in jaxdp.inspect.schedule(step.lower(state, batch).compile()).collectives
    ]
    data = ((0, 2, 4, 6), (1, 3, 5, 7))
    moved = {(k, n) for k, n, g in ops if k in ("all-gather", "reduce-scatter") and g == data}
    assert {("all-gather", 4 * 8 * 64 // 2), ("reduce-scatter", 4 * 8 * 64 // 2)} <= moved
    assert ("all-gather", 4 * 8 * 64) not in moved
    assert not any(k != "all-reduce" and g == (tuple(range(8)),) for k, _, g in ops)
  for _ in range(STEPS):
    state, _ = step(state, batch)
  assert step._cache_size() == 1
  # The loss averages 16 x 8 squared errors (tests/tolerances.py has the argument).
  bound = AdamBound(1e-2, 16 * 8, params, clip=1.0)
  want = frozen_reference(
    params, loss_fn, batch, frozen or jax.tree.map(lambda _: False, params), bound
  )
  got = jaxdp.get_params(state)
  bound.check(got, want)
  for x, s in zip(jax.tree.leaves(got), jax.tree.leaves(specs)):
    assert full_spec(x.sharding.spec, x.ndim) == full_spec(s, x.ndim)
  if form == "unrolled":  # w1 on its rows over "data", w2 (rows split over "model") on its columns
    assert full_spec(state.master["w1"].sharding.spec, 2) == ("data", "model")
    assert full_spec(state.master["w2"].sharding.spec, 2) == ("model", "data")
    shards = {"w1": (2, 32), "w2": (32, 2)}
    for k, shard in shards.items():
      assert state.opt_state[1][0].mu[k].addressable_shards[0].data.shape == shard
    out = jaxdp.make_eval_step(forward, mesh, FSDP, fsdp=fsdp, per_example=True)(state, batch)
    host = jax.device_get(got)
    h = np.tanh(batch["x"] @ host["w1"] + host["b1"])
    magnitude = np.abs(h) @ np.abs(host["w2"]) + np.abs(host["b2"])
    assert np.all(
      np.abs(np.asarray(out) - forward(host, batch)) <= rtol_sum(8 + 64) * (1 + magnitude)
    )
  else:  # the frozen weight is stored 1/8 per device, over both axes, and comes back as it was
    w2 = state.params["blocks"]["w2"]
    assert full_spec(w2.sharding.spec, 3) == (None, "model", "data")
    assert w2.addressable_shards[0].data.shape == (LAYERS, 32, 2)
    np.testing.assert_array_equal(np.asarray(got["blocks"]["w2"]), params["blocks"]["w2"])


# ----------------------------------------------------------------------------- ZeRO, scanned


@pytest.mark.parametrize(
  "strategy,axes", [("optim", "explicit"), ("optim", "auto"), ("optim_grads", "explicit")]
)
def test_zero_scans_tensor_parallel_layers(strategy, axes):
  """ZeRO-1/2 with `DDPConfig(stacked=)` takes a stacked tensor-parallel leaf into the scan:
  sharded over "data" on a dim of a layer that "model" leaves whole (as FSDP shards it), each
  layer gathered in the forward loop and reduce-scattered in the backward loop, each
  collective on the device's own "model" slice; and it trains like the single-device
  program."""
  params, loss_fn, batch = stacked_problem()
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=AXES[axes])
  on = lambda tree, specs: jax.tree.map(
    lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs
  )
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, stacked=["blocks"])
  state = jaxdp.init_state(on(params, STACKED_SPECS), TX, mesh, config)
  step = jaxdp.make_train_step(loss_fn, TX, mesh, config)
  # w1 (8, 64) on its rows, w2 (64, 8) on its columns, b1 (64,) on its one dim, over both
  # axes (it has no dim "model" leaves whole): never on the layer axis.
  master = state.master["blocks"]
  assert full_spec(master["w1"].sharding.spec, 3) == (None, "data", "model")
  assert full_spec(master["w2"].sharding.spec, 3) == (None, "model", "data")
  assert full_spec(master["b1"].sharding.spec, 2) == (None, ("data", "model"))
  if strategy == "optim" and axes == "explicit":
    # One layer at a time (the loops run one layer ahead, the first and last layers'
    # collectives outside them: a layer gathered one iteration ahead): a weight's
    # all-gather returns its layer's "model" half, 8 x 64 / 2 floats, and its
    # reduce-scatter reads it, once per layer and step; never the whole layer.
    ops = jaxdp.inspect.schedule(step.lower(state, batch).compile()).collectives
    data = ((0, 2, 4, 6), (1, 3, 5, 7))
    half, whole = 4 * 8 * 64 // 2, 4 * 8 * 64
    per_step = {"all-gather": Counter(), "reduce-scatter": Counter()}
    for c in ops:
      n = c.result_bytes if c.kind == "all-gather" else c.operand_bytes
      if c.kind in per_step:
        per_step[c.kind][n, c.replica_groups] += c.trip_count
        assert n < whole, ops
    assert per_step["all-gather"][half, data] == 2 * LAYERS, ops
    assert per_step["reduce-scatter"][half, data] == 2 * LAYERS, ops
  for _ in range(STEPS):
    state, _ = step(state, batch)
  assert step._cache_size() == 1
  # The loss averages 16 x 8 squared errors (tests/tolerances.py has the argument).
  bound = AdamBound(1e-2, 16 * 8, params, clip=1.0)
  want = reference(params, loss_fn, batch, bound)
  got = jaxdp.get_params(state)
  bound.check(got, want)
  for x, s in zip(jax.tree.leaves(got), jax.tree.leaves(STACKED_SPECS)):
    assert full_spec(x.sharding.spec, x.ndim) == full_spec(s, x.ndim)


# ----------------------------------------------------------------------------- errors


def test_placements_fsdp_cannot_keep_are_refused_before_compiling():
  """Each names the leaf and the fix, from `init_state`, before anything compiles."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  on = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  optim = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
  with pytest.raises(ValueError, match=r"params\['w'\] is sharded .* over a data axis"):
    jaxdp.init_state({"w": on(jnp.zeros((8, 4)), "data", "model")}, TX, mesh, FSDP)
  # 10 rows over "model" (2) are fine alone; padded to 12 for the 4 "data" devices they do
  # not split 8 ways
  for config in (FSDP, optim):
    with pytest.raises(ValueError, match=r"params\['b'\] is split over \['model'\] .* = 8"):
      jaxdp.init_state({"b": on(jnp.zeros(10), "model")}, TX, mesh, config)
  stacked = jaxdp.FSDPConfig(stacked=["w"])
  with pytest.raises(ValueError, match=r"params\['w'\] is sharded .* over its layer axis"):
    jaxdp.init_state({"w": on(jnp.zeros((2, 8, 4)), "model")}, TX, mesh, FSDP, fsdp=stacked)
  chunks = jaxdp.FSDPConfig(chunks={"wte": 2})
  with pytest.raises(ValueError, match=r"chunks=.* params\['wte'\], which is sharded"):
    jaxdp.init_state({"wte": on(jnp.zeros((64, 8)), None, "model")}, TX, mesh, FSDP, fsdp=chunks)
  # A placement whose axes do not divide the dim (an abstract leaf; an array cannot be made so)
  auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=AXES["auto"])
  odd = jax.ShapeDtypeStruct((8, 7), jnp.float32, sharding=NamedSharding(auto, P(None, "model")))
  with pytest.raises(
    ValueError, match=r"params\['w'\] .* dim 1 \(7\) does not divide over 'model'"
  ):
    jaxdp.init_state({"w": odd}, TX, auto, FSDP)


# ----------------------------------------------------------------------------- compile only


def test_compile_train_step_keeps_placements_of_abstract_params():
  """`inspect.compile_train_step` from `ShapeDtypeStruct`s placed over "model" compiles the
  state `init_state` builds from arrays so placed (master over both axes, as in
  `test_fsdp_keeps_tensor_parallel_placements`); on Auto axes, where the abstract state cannot
  read a placement, it refuses them rather than compile them replicated."""
  params, loss_fn, batch = problem()
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=AXES["explicit"])
  abstract = lambda mesh: {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, SPECS[k]))
    for k, v in params.items()
  }
  compiled = jaxdp.inspect.compile_train_step(loss_fn, TX, mesh, FSDP, abstract(mesh), batch)
  master = compiled.input_shardings[0][0].master
  assert full_spec(master["w1"].spec, 2) == ("data", "model")
  assert full_spec(master["w2"].spec, 2) == ("model", "data")
  auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=AXES["auto"])
  with pytest.raises(ValueError, match=r"placed .* on a mesh with Auto axes .* Explicit axes"):
    jaxdp.inspect.compile_train_step(loss_fn, TX, auto, FSDP, abstract(auto), batch)
