"""The memory ledger and the ring formula on meshes with more than a "data" axis.

`memory_ledger` of placed params (tensor parallel `P(None, "model")` on a ("data", "model")
mesh, expert parallel `P("expert", ...)` on a ("data", "expert") mesh) against the bytes
that device 0 holds of the `TrainState` `init_state` builds, byte for byte; `ring_formula`
against the collectives of the compiled CPU step (HSDP and HFSDP on ("replica", "data"),
tensor parallel, MoE), as `tests/test_overlap.py` reads them for the "data" axis alone.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdp
from jaxdp.inspect import memory_ledger, report, ring_formula, schedule
from models.moe import MoEGPT, gpt_loss, place_experts
from tests.test_hfsdp import HFSDP, stacked_mlp
from tests.test_meshes import MOE, MOE_TX, groups, mlp, tokens

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
# Column- then row-parallel MLP on a (data=4, model=2) mesh: w1 is sharded over "data" on
# its rows (6, padded to 8), w2 on its columns (24), b1 (split over "model" on its only dim)
# on that dim too (64 rows = 4 x 2 x 8); emb (bf16: an fp32 master and moments) on its rows
# (6, padded to 8).
SPECS = {
  "w1": P(None, "model"),
  "b1": P("model"),
  "w2": P("model", None),
  "b2": P(),
  "emb": P(None, "model"),
}
METRIC_BYTES = 8
"""Collectives this small carry the step's metrics (the loss, norms: scalars and pairs of
them), not buckets; some buckets of these small models are not much larger."""
# FSDP gathers each unit once: XLA:CPU may merge the backward's re-gather with the forward's
# (tests/test_overlap.py), which the formula of `reshard_after_forward` counts twice.
KEEP = jaxdp.FSDPConfig(reshard_after_forward=False)


def tp_problem():
  rng = np.random.default_rng(0)
  params = {
    "w1": 0.3 * rng.standard_normal((6, 64)).astype(np.float32),
    "b1": 0.1 * rng.standard_normal(64).astype(np.float32),
    "w2": 0.3 * rng.standard_normal((64, 24)).astype(np.float32),
    "b2": np.zeros(24, np.float32),
    "emb": jnp.asarray(0.3 * rng.standard_normal((6, 32)), jnp.bfloat16),
  }

  def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return jnp.mean((h - b["y"]) ** 2) + jnp.mean((b["x"] @ p["emb"]).astype(jnp.float32) ** 2)

  batch = {
    "x": rng.standard_normal((16, 6)).astype(np.float32),
    "y": rng.standard_normal((16, 24)).astype(np.float32),
  }
  return params, loss_fn, batch


def placed(params, mesh):
  return {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}


def moe_problem():
  """The whole MoE model's params and the loss of one expert rank (of 2)."""
  params, _ = jaxdp.nnx_split(MoEGPT(MOE, rngs=nnx.Rngs(0)), gpt_loss)
  rank = dataclasses.replace(MOE, expert_axis="expert", expert_parallel=2)
  _, rank_loss = jaxdp.nnx_split(nnx.eval_shape(lambda: MoEGPT(rank, rngs=nnx.Rngs(0))), gpt_loss)
  return params, rank_loss, tokens(MOE.vocab_size)


def device0_bytes(state):
  """Bytes of each field of `state` on the device of every leaf's first addressable shard."""

  def field(tree):
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    assert all(x.addressable_shards[0].device.id == 0 for x in leaves)
    return sum(x.addressable_shards[0].data.nbytes for x in leaves)

  return {k: field(getattr(state, k)) for k in ("params", "master", "opt_state")}


def config_of(strategy, **kw):
  return jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, **kw)


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ledger_equals_device_bytes_tensor_parallel(strategy, overlap):
  params, _, _ = tp_problem()
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  config = config_of(strategy, overlap_param_gather=overlap)
  state = jaxdp.init_state(placed(params, mesh), TX, mesh, config)
  measured = device0_bytes(state)
  ledger = memory_ledger(placed(params, mesh), TX, 4, config)
  assert ledger.state == measured
  # abstract params that carry the placement say the same
  abstract = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding)
    for k, v in placed(params, mesh).items()
  }
  assert memory_ledger(abstract, TX, 4, config) == ledger
  # Independently: each leaf's bytes over "model" (2) and, sharded, over "data" (4) too,
  # its shard dim padded to a multiple of 4 (w1's and emb's rows to 8; b1's 64 rows over
  # both axes); Adam's two moments like the master, and its int32 count (clip keeps none).
  nbytes = {k: v.size * v.dtype.itemsize for k, v in params.items()}
  padded = {"w1": 8 * 64 * 4, "b1": 64 * 4, "w2": 64 * 24 * 4, "b2": 24 * 4, "emb": 8 * 32 * 4}
  split = {k: 1 if k == "b2" else 2 for k in params}
  whole = sum(nbytes[k] // split[k] for k in params)
  if strategy == "no_shard":  # an fp32 copy of emb only
    want = {"params": whole, "master": 6 * 32 * 4 // 2}
    want["opt_state"] = 2 * (whole + 6 * 32 * 2 // 2) + 4
  else:
    master = sum(padded[k] // (4 * split[k]) for k in params)
    gathered = overlap or strategy == "optim_grads_params"
    want = {"params": 0 if gathered else whole, "master": master, "opt_state": 2 * master + 4}
  assert measured == want
  # the placement matters: the same params unplaced are counted whole on every device
  unplaced = memory_ledger(params, TX, 4, config)
  assert unplaced.master + unplaced.opt_state > ledger.master + ledger.opt_state


def test_ledger_refuses_params_placed_for_another_data_size():
  params, _, _ = tp_problem()
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  with pytest.raises(ValueError, match=r"params\['b1'\] is placed .* not dp=8; pass dp=4"):
    memory_ledger(placed(params, mesh), TX, 8, config_of("optim"))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ledger_equals_device_bytes_experts(strategy):
  params, _, _ = moe_problem()
  mesh = jax.make_mesh((4, 2), ("data", "expert"))
  config = config_of(strategy)
  state = jaxdp.init_state(place_experts(params, mesh), MOE_TX, mesh, config)
  ledger = memory_ledger(place_experts(params, mesh), MOE_TX, 4, config)
  assert ledger.state == device0_bytes(state)
  # each expert rank holds 4 of the 8 experts: less than the same params unplaced
  unplaced = memory_ledger(params, MOE_TX, 4, config)
  assert unplaced.opt_state > ledger.opt_state


# ----------------------------------------------------------------------------- communication


def data_volume(step, state, batch, skip=()):
  """Ring bytes per device of the compiled CPU step by kind, of the collectives whose buffer
  (an all-gather's result, else the operand) is over `METRIC_BYTES`, over none of the groups
  in `skip` (the model's own collectives over "model"), and of the kinds that reduce or
  gather: no all-to-all (an MoE's token dispatch), no collective-permute (XLA moving a
  block between two placements: under FSDP one of b1's size, 8 floats, whose one dim is
  split over both axes)."""
  s = schedule(step, state, batch)
  volume = {}
  for c in s.collectives:
    if c.buffer_bytes <= METRIC_BYTES or c.kind in ("all-to-all", "collective-permute"):
      continue
    if frozenset(map(frozenset, c.replica_groups)) in skip:
      continue
    volume[c.kind] = volume.get(c.kind, 0.0) + c.ring_bytes * c.trip_count
  return volume, s


def assert_ring(params, loss_fn, batch, mesh, config, tx=TX, fsdp=None, skip=(), k=1):
  kw = {"fsdp": fsdp} if fsdp is not None else {}
  state = jaxdp.init_state(params, tx, mesh, config, **kw)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config, grad_accum_steps=k, **kw)
  volume, s = data_volume(step, state, batch, skip)
  expected = ring_formula(state, grad_accum_steps=k, **kw)
  assert volume.keys() == expected.keys(), report(s, expected=expected)
  for kind, value in expected.items():
    assert volume[kind] == pytest.approx(value, rel=1e-9), report(s, expected=expected)
  return expected


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ring_formula_tensor_parallel(strategy):
  params, loss_fn, batch = tp_problem()
  params["emb"] = params["emb"].astype(jnp.float32)  # XLA:CPU gathers bf16 in f32
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  model = frozenset(map(frozenset, groups(mesh, "model")))
  fsdp = KEEP if strategy == "optim_grads_params" else None
  expected = assert_ring(
    placed(params, mesh), loss_fn, batch, mesh, config_of(strategy), fsdp=fsdp, skip={model}
  )
  # w1, w2 and emb move their own "model" half; b1 (split on its shard dim) moves whole
  if strategy == "no_shard":
    grads = 4 * (6 * 64 // 2 + 64 // 2 + 64 * 24 // 2 + 24 + 6 * 32 // 2)  # unpadded, fp32
    assert expected == {"all-reduce": 2 * 3 / 4 * grads}


def test_ring_formula_hsdp():
  """A ZeRO-1 state replicated over "replica": each reduce-scattered shard is all-reduced
  across "replica"; under `optim_grads` and FSDP with grad accumulation the micro-batches
  reduce-scatter within "data" and the summed shard crosses "replica" once per step."""
  params, loss_fn, batch = mlp()
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  optim = config_of("optim", num_distributed_optimizer_instances=2)
  expected = assert_ring(params, loss_fn, batch, mesh, optim)
  assert expected["all-reduce"] == pytest.approx(2 * 1 / 2 * expected["reduce-scatter"] / 3)
  grads = dataclasses.replace(optim, data_parallel_sharding_strategy="optim_grads")
  once = assert_ring(params, loss_fn, batch, mesh, grads)
  accumulated = assert_ring(params, loss_fn, batch, mesh, grads, k=2)
  # twice the reduce-scatters within "data", the same all-reduce across "replica"
  assert accumulated["reduce-scatter"] == pytest.approx(2 * once["reduce-scatter"])
  assert accumulated["all-reduce"] == pytest.approx(once["all-reduce"])
  fsdp = dataclasses.replace(optim, data_parallel_sharding_strategy="optim_grads_params")
  once = assert_ring(params, loss_fn, batch, mesh, fsdp, fsdp=KEEP)
  # FSDP with k > 1: the reductions only, since XLA:CPU hoists a unit's all-gather of the
  # unchanged master out of the micro-batch loop, which the formula counts per micro-batch
  per_leaf = dataclasses.replace(fsdp, fused_update=False)
  gathered = jaxdp.FSDPConfig(reshard_after_forward=False, reshard_after_backward=False)
  for config, fsdp_config in ((fsdp, KEEP), (per_leaf, KEEP), (fsdp, gathered)):
    state = jaxdp.init_state(params, TX, mesh, config, fsdp=fsdp_config)
    step = jaxdp.make_train_step(loss_fn, TX, mesh, config, grad_accum_steps=2, fsdp=fsdp_config)
    volume, s = data_volume(step, state, batch)
    expected = ring_formula(state, grad_accum_steps=2, fsdp=fsdp_config)
    for kind in ("reduce-scatter", "all-reduce"):
      assert volume[kind] == pytest.approx(expected[kind], rel=1e-9), report(s, expected=expected)
    if config is fsdp and fsdp_config is KEEP:  # the same state as `once`, accumulated
      assert expected["all-reduce"] == pytest.approx(once["all-reduce"])
      assert expected["reduce-scatter"] == pytest.approx(2 * once["reduce-scatter"])


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_hsdp_with_tensor_parallel(strategy):
  """HSDP of the tensor-parallel MLP on (replica=2, data=2, model=2): the ledger is device
  0's bytes; the formula is the compiled step's, each shard all-reduced across "replica"
  on its "model" slice (b1's too, split over "model" on its shard dim), except that under
  FSDP XLA splits the shard of b1's unit (one bias raveled alone) over "model" as well,
  which the formula counts whole (`ring_formula`): it moves half of it."""
  params, loss_fn, batch = tp_problem()
  params["emb"] = params["emb"].astype(jnp.float32)  # XLA:CPU gathers bf16 in f32
  mesh = jax.make_mesh((2, 2, 2), ("replica", "data", "model"))
  config = config_of(strategy, num_distributed_optimizer_instances=2)
  fsdp = KEEP if strategy == "optim_grads_params" else None
  kw = {"fsdp": fsdp} if fsdp is not None else {}
  state = jaxdp.init_state(placed(params, mesh), TX, mesh, config, **kw)
  assert memory_ledger(placed(params, mesh), TX, 2, config, **kw).state == device0_bytes(state)
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  model = frozenset(frozenset(int(i) for i in ids[r, d]) for r in range(2) for d in range(2))
  step = jaxdp.make_train_step(loss_fn, TX, mesh, config, **kw)
  volume, s = data_volume(step, state, batch, {model})
  expected = ring_formula(state, **kw)
  assert volume.keys() == expected.keys(), report(s, expected=expected)
  if fsdp is not None:
    (b1,) = [
      4 * b.shard_size  # bytes of the unit's shard, all-reduced across 2: 2 (2-1)/2 x
      for buf in state.layout.buffers
      for b in buf.buckets
      if [p.path for p in b.params] == ["['b1']"]
    ]
    expected = {**expected, "all-reduce": expected["all-reduce"] - b1 / 2}
  for kind, value in expected.items():
    assert volume[kind] == pytest.approx(value, rel=1e-9), report(s, expected=expected)


@pytest.mark.parametrize("model", ["unrolled", "stacked"])
def test_ring_formula_hfsdp(model):
  """HFSDP: the units' reduce-scatters and all-gathers over "data", then one reduce-scatter
  per unit bucket across "replica" and one all-gather of the updated params across it."""
  if model == "stacked":
    params, loss_fn, batch = stacked_mlp()
    fsdp = dataclasses.replace(KEEP, stacked=["blocks"])
  else:
    params, loss_fn, batch = mlp()
    fsdp = KEEP
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  assert_ring(params, loss_fn, batch, mesh, HFSDP, fsdp=fsdp)


@pytest.mark.slow  # an MoE train step, compiled per strategy
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_ring_formula_experts(strategy):
  """Expert buckets are reduced over "data" alone, dense ones over "expert" too."""
  params, rank_loss, batch = moe_problem()
  mesh = jax.make_mesh((4, 2), ("data", "expert"))
  config = config_of(strategy)
  fsdp = KEEP if strategy == "optim_grads_params" else None
  state = jaxdp.init_state(place_experts(params, mesh), MOE_TX, mesh, config, fsdp=fsdp)
  step = jaxdp.make_train_step(rank_loss, MOE_TX, mesh, config, fsdp=fsdp)
  volume, s = data_volume(step, state, batch)
  expected = ring_formula(state, fsdp=fsdp)
  assert volume.keys() == expected.keys(), report(s, expected=expected)
  for kind, value in expected.items():
    assert volume[kind] == pytest.approx(value, rel=1e-9), report(s, expected=expected)
