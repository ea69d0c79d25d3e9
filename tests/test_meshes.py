"""Hybrid meshes: HSDP, MoE expert groups, tensor parallel, and checkpoints across processes.

Every run trains a tiny model for `STEPS` steps and compares with plain `jax.grad` + optax on
one device. Replica groups are read from the compiled program with `jaxdp.inspect.schedule`;
on the 8 CPU devices of a `(4, 2)` mesh, device `(i, j)` has id `2 * i + j`.
"""

import dataclasses
import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdp
from jaxdp._src.mesh import model_specs_of
from models.gpt import GPT, GPTConfig
from models.moe import MoEConfig, MoEGPT, gpt_loss, is_expert, place_experts
from tests import mp_worker
from tests.tolerances import AdamBound, rtol_sum

STEPS = 3
REPO = pathlib.Path(__file__).resolve().parents[1]
AUTO = (jax.sharding.AxisType.Auto,) * 2


# ----------------------------------------------------------------------------- helpers


def reference(params, loss_fn, batch, tx, bound, steps=STEPS):
  """Plain jax.grad + optax on the whole batch, one device; each step's gradients go to
  `bound`, an AdamBound for `tx` (tests/tolerances.py)."""

  @jax.jit
  def step(params, opt_state):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, grads

  params = jax.device_get(params)
  opt_state = tx.init(params)
  for _ in range(steps):
    params, opt_state, grads = step(params, opt_state)
    bound.add(grads)
  return params


def train(params, loss_fn, batch, tx, mesh, config, steps=STEPS):
  state = jaxdp.init_state(params, tx, mesh, config)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  for _ in range(steps):
    state, _ = step(state, batch)
  return state, step


def assert_close(got, want, atol):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), atol=atol, rtol=0, err_msg=jax.tree_util.keystr(path)
    )


def groups(mesh, axis):
  """The device-id groups of a collective over one axis of a 2-D mesh."""
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  ids = ids if mesh.axis_names.index(axis) == 0 else ids.T
  return tuple(tuple(int(i) for i in col) for col in ids.T)


ALL = (tuple(range(8)),)


def collectives(step, state, batch):
  """`{(kind, operand bytes, replica groups as sets)}` of the compiled step."""
  schedule = jaxdp.inspect.schedule(step.lower(state, batch).compile())
  return [
    (c.kind, c.operand_bytes, frozenset(frozenset(g) for g in c.replica_groups))
    for c in schedule.collectives
  ]


def as_sets(groups):
  return frozenset(frozenset(g) for g in groups)


def bucket_bytes(layout, expert):
  return [
    4 * b.shard_size * layout.dp
    for buf in layout.buffers
    if buf.expert == expert
    for b in buf.buckets
  ]


def tokens(vocab, batch=16, length=8):
  x = np.random.default_rng(0).integers(0, vocab, (batch, length + 1)).astype(np.int32)
  return {"x": x[:, :-1], "y": x[:, 1:]}


# ----------------------------------------------------------------------------- HSDP


def mlp():
  rng = np.random.default_rng(0)
  params = {
    "l0": {
      "w": 0.5 * rng.standard_normal((6, 10)).astype(np.float32),
      "b": np.zeros(10, np.float32),
    },
    "l1": {
      "w": 0.5 * rng.standard_normal((10, 3)).astype(np.float32),
      "b": np.zeros(3, np.float32),
    },
  }

  def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["l0"]["w"] + p["l0"]["b"])
    return jnp.mean((h @ p["l1"]["w"] + p["l1"]["b"] - b["y"]) ** 2)

  batch = {
    "x": rng.standard_normal((16, 6)).astype(np.float32),
    "y": rng.standard_normal((16, 3)).astype(np.float32),
  }
  return params, loss_fn, batch


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_hsdp_shards_within_data_and_replicates_across_replica(strategy):
  """Megatron's outer_dp_sharding_strategy="no_shard": on a (replica=2, data=4) mesh the
  optimizer state (and under FSDP the params) is sharded 4 ways within "data" and the
  grads are reduce-scattered there, then the shards all-reduced across the 2 replicas."""
  params, loss_fn, batch = mlp()
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  config = jaxdp.DDPConfig(
    data_parallel_sharding_strategy=strategy, num_distributed_optimizer_instances=2
  )
  state, step = train(params, loss_fn, batch, tx, mesh, config)
  # The loss averages 16 x 3 squared errors (tests/tolerances.py has the argument).
  bound = AdamBound(1e-2, 16 * 3, params, clip=1.0)
  want = reference(params, loss_fn, batch, tx, bound)
  bound.check(jaxdp.get_params(state), want)
  # the grad-norm metric counts each element once, though 2 replicas hold every shard;
  # counting them twice would be off by sqrt(2). A norm sums squares: rtol_sum of the
  # 16 x 3 terms of each gradient and of the params' count.
  _, metrics = step(jaxdp.init_state(params, tx, mesh, config), batch)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  np.testing.assert_allclose(
    float(metrics["grad_norm"]),
    float(optax.tree.norm(jax.grad(loss_fn)(params, batch))),
    rtol=rtol_sum(16 * 3) + rtol_sum(n_params),
  )

  # sharded 4 ways, replicated 2 ways: the fused update keeps one flat array per bucket
  # (FSDP: per unit bucket)
  assert state.fused
  for mu in state.opt_state[1][0].mu.values():
    assert mu.sharding.spec[0] == "data"
    assert mu.addressable_shards[0].data.shape[0] == mu.shape[0] // 4

  data, replica = as_sets(groups(mesh, "data")), as_sets(groups(mesh, "replica"))
  ops = collectives(step, state, batch)
  shards = sorted(n for kind, n, g in ops if kind == "reduce-scatter")
  assert shards and all(g == data for kind, _, g in ops if kind == "reduce-scatter")
  # each reduce-scattered shard is then all-reduced over the replicas, and nothing else is
  assert sorted(n * 4 for kind, n, g in ops if kind == "all-reduce" and g == replica) == shards
  assert all(g == data for kind, _, g in ops if kind == "all-gather")


# ----------------------------------------------------------------------------- MoE

MOE = MoEConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, d_model=16, n_experts=8, top_k=2)
MOE_TX = optax.adamw(1e-3)


@functools.cache
def moe_problem():
  """Params of the whole model, the loss of one expert rank (of 2), and the reference."""
  params, loss_fn = jaxdp.nnx_split(MoEGPT(MOE, rngs=nnx.Rngs(0)), gpt_loss)
  rank = dataclasses.replace(MOE, expert_axis="expert", expert_parallel=2)
  _, rank_loss = jaxdp.nnx_split(nnx.eval_shape(lambda: MoEGPT(rank, rngs=nnx.Rngs(0))), gpt_loss)
  batch = tokens(MOE.vocab_size)
  bound = AdamBound(1e-3, 16 * 8, params)  # 16 x 8 tokens in the batch
  return params, rank_loss, batch, reference(params, loss_fn, batch, MOE_TX, bound), bound


@pytest.mark.slow  # an MoE / GPT train step, compiled per strategy
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_moe_expert_grads_reduced_over_expert_data_parallel_group(strategy, tmp_path):
  """Mesh (data=4, expert=2): dense params are data parallel over all 8 devices, the 8
  experts are sharded 4 per expert rank and their grads reduced over "data" only (FSDP:
  gathered over "data" only too, as the rank's 4 experts). The grad-norm metric, the
  sharded view, the eval step and the checkpoint see the whole model: it restores into a
  plain data-parallel state, and into the expert-parallel one's `abstract_state`."""
  params, rank_loss, batch, want, bound = moe_problem()
  mesh = jax.make_mesh((4, 2), ("data", "expert"))
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state, step = train(place_experts(params, mesh), rank_loss, batch, MOE_TX, mesh, config)
  got = jaxdp.get_params(state)
  bound.check(got, want)
  assert step._cache_size() == 1  # the state a step returns is placed like init_state's
  # the grad-norm metric counts each element once: a dense one is on both expert ranks, an
  # expert one on one. A norm sums squares: rtol_sum of the 16 x 8 terms of each gradient
  # and of the params' count.
  _, loss_fn = jaxdp.nnx_split(MoEGPT(MOE, rngs=nnx.Rngs(0)), gpt_loss)
  _, metrics = step(jaxdp.init_state(place_experts(params, mesh), MOE_TX, mesh, config), batch)
  np.testing.assert_allclose(
    float(metrics["grad_norm"]),
    float(optax.tree.norm(jax.grad(loss_fn)(params, batch))),
    rtol=rtol_sum(16 * 8) + rtol_sum(sum(x.size for x in jax.tree.leaves(params))),
  )

  layout = state.layout
  assert [(buf.name, buf.expert) for buf in layout.buffers] == [
    ("expert/float32", True),
    ("float32", False),
  ]
  assert {p.path for buf in layout.buffers if buf.expert for p in buf.params} == {
    jax.tree_util.keystr(k)
    for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    if is_expert(jax.tree_util.keystr(k))
  }
  w_fc = got["blocks"][0]["moe"]["w_fc"]  # (8, 16, 64): 4 experts per device
  assert w_fc.sharding.spec[0] == "expert" and w_fc.addressable_shards[0].data.shape[0] == 4
  mu = state.opt_state[0].mu["blocks"][0]["moe"]["w_fc"]
  if strategy == "optim":  # optimizer state: 4 experts per expert rank, 1 per device
    assert mu.sharding.spec[0] == ("expert", "data")
    assert mu.addressable_shards[0].data.shape[0] == 1
  if strategy == "optim_grads_params":  # master and Adam's moments: 4 experts per expert
    for x in (state.master["blocks"][0]["moe"]["w_fc"], mu):  # rank, 16 / 4 rows per device
      assert tuple(x.sharding.spec) == ("expert", "data", None)
      assert x.addressable_shards[0].data.shape == (4, 4, 64)
  # get_params(sharded=True): the same values, 1/8 of each expert param per device
  view = jaxdp.get_params(state, sharded=True)
  assert_close(view, got, atol=0)
  assert view["blocks"][0]["moe"]["w_fc"].addressable_shards[0].data.shape == (4, 4, 64)

  data, everyone = as_sets(groups(mesh, "data")), as_sets(ALL)
  expert = as_sets(groups(mesh, "expert"))
  ops = collectives(step, state, batch)
  kind = "all-reduce" if strategy == "no_shard" else "reduce-scatter"
  reductions = {}  # bytes -> replica groups (FSDP has several buckets of one size)
  for k, n, g in ops:
    if k == kind and n > 8:  # not the metrics
      reductions.setdefault(n, set()).add(g)
  expert_bytes, dense_bytes = bucket_bytes(layout, True), bucket_bytes(layout, False)
  assert sorted(reductions) == sorted(set(expert_bytes + dense_bytes))
  for n in expert_bytes:  # the expert-data-parallel group: devices holding the same experts
    assert reductions[n] == {data}
  for n in dense_bytes:  # all 8 devices: at once (DDP), or scattered over "data" and the
    if strategy == "no_shard":  # shard then all-reduced over "expert"
      assert reductions[n] == {everyone}
    else:
      assert reductions[n] == {data}
  if strategy != "no_shard":  # only the dense shards are all-reduced over "expert"
    assert {4 * n for k, n, g in ops if k == "all-reduce" and g == expert} == set(dense_bytes)
  if strategy == "optim_grads_params":  # every unit gathered over "data" alone, its shard
    gathers = {(4 * n, g) for k, n, g in ops if k == "all-gather"}  # a quarter of its bucket
    assert gathers == {(n, data) for n in expert_bytes + dense_bytes}

  # the eval step runs the rank's model on the same placements
  loss = jaxdp.make_eval_step(rank_loss, mesh, config)(state, batch)
  # a mean of 16 x 8 token losses, each a log-sum-exp of 64 logits
  np.testing.assert_allclose(
    float(loss), float(loss_fn(jax.device_get(got), batch)), rtol=rtol_sum(16 * 8 * 64)
  )

  with jaxdp.CheckpointManager(tmp_path) as mgr:
    mgr.save(STEPS, state)
    mgr.wait_until_finished()
    dense = jax.make_mesh((8,), ("data",))
    restored = mgr.restore(jaxdp.init_state(params, MOE_TX, dense, jaxdp.DDPConfig()))
    assert_close(jaxdp.get_params(restored), got, atol=0)  # a round trip: bit for bit
    # and back into the expert-parallel state, read into its abstract form
    like = jaxdp.abstract_state(place_experts(params, mesh), MOE_TX, mesh, config)
    back = mgr.restore(like)
  assert_close(jaxdp.get_params(back), got, atol=0)
  assert jax.tree.map(lambda x: x.sharding, back) == jax.tree.map(lambda x: x.sharding, state)
  state, _ = step(back, batch)  # and it trains on
  assert step._cache_size() == 1


def test_compile_train_step_shards_the_batch_like_the_step():
  """`jaxdp.inspect.compile_train_step` places the batch over the step's own data axes
  ("expert" included), so the compiled program starts with no reshard of the batch."""
  mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=AUTO)
  params = {"w": jax.ShapeDtypeStruct((4, 2), jnp.float32)}
  batch = {"x": jax.ShapeDtypeStruct((16, 4), jnp.float32)}
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
  compiled = jaxdp.inspect.compile_train_step(
    loss_fn, optax.sgd(0.1), mesh, jaxdp.DDPConfig(), params, batch
  )
  (_, batch_sharding), _ = compiled.input_shardings
  assert batch_sharding["x"].spec == P(("expert", "data"))


# ----------------------------------------------------------------------------- tensor parallel


def megatron_specs(params):
  """Megatron's column/row parallel GPT: c_attn and c_fc split their outputs over "model"
  (kernel columns and bias), the c_proj's split their inputs (kernel rows); the rest is
  replicated."""

  def spec(path, _):
    *_, layer, name = [None, None] + [getattr(k, "key", None) for k in path]
    if layer in ("c_attn", "c_fc"):
      return P(None, "model") if name == "kernel" else P("model")
    return P("model", None) if (layer, name) == ("c_proj", "kernel") else P()

  return jax.tree_util.tree_map_with_path(spec, params)


TP_TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


@functools.cache
def gpt_problem():
  gpt = GPT(
    GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, d_model=16), rngs=nnx.Rngs(0)
  )
  params, loss_fn = jaxdp.nnx_split(gpt, gpt_loss)
  batch = tokens(64)
  bound = AdamBound(1e-3, 16 * 8, params, clip=1.0)  # 16 x 8 tokens in the batch
  return params, loss_fn, batch, reference(params, loss_fn, batch, TP_TX, bound), bound


@pytest.mark.slow  # an MoE / GPT train step, compiled per strategy
@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_tensor_parallel_weights_keep_their_model_sharding(strategy):
  """Mesh (data=4, model=2): jaxdp runs manual over "data" only; the model's own "model"
  placement of its weights survives in params, master params and optimizer state."""
  params, loss_fn, batch, want, bound = gpt_problem()
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=AUTO)
  specs = megatron_specs(params)
  placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state, step = train(placed, loss_fn, batch, TP_TX, mesh, config)
  got = jaxdp.get_params(state)
  bound.check(got, want)
  assert step._cache_size() == 1  # the state a step returns is placed like init_state's

  c_fc = ["blocks", 0, "mlp", "c_fc", "kernel"]
  c_proj = ["blocks", 0, "mlp", "c_proj", "kernel"]

  def at(tree, keys):
    for k in keys:
      tree = tree[k]
    return tree

  for keys, dim in ((c_fc, 1), (c_proj, 0)):
    assert "model" in jax.tree.leaves(tuple(at(got, keys).sharding.spec))
    assert at(got, keys).addressable_shards[0].data.shape[dim] == at(got, keys).shape[dim] // 2
    mu = at(state.opt_state[1][0].mu, keys)
    shard = mu.addressable_shards[0].data.shape
    if strategy == "no_shard":  # mu: (16, 64) -> (16, 32), (64, 16) -> (32, 16)
      assert shard[dim] == mu.shape[dim] // 2 and shard[1 - dim] == mu.shape[1 - dim]
    else:  # plus "data" on the dim "model" leaves whole: (16, 64) -> (4, 32), (64, 16) -> (32, 4)
      assert shard[dim] == mu.shape[dim] // 2 and shard[1 - dim] == mu.shape[1 - dim] // 4
  # the gradient bucket is reduced over "data" (groups of 4), never over all 8 devices
  # (the "model" groups of 2 are the compiler's tensor-parallel collectives)
  reduced = {
    g
    for kind, n, g in collectives(step, state, batch)
    if kind in ("all-reduce", "reduce-scatter") and n >= 4000
  }
  assert as_sets(groups(mesh, "data")) in reduced and as_sets(ALL) not in reduced


# ----------------------------------------------------------------------------- errors


def test_placements_jaxdp_cannot_keep_are_refused():
  mesh = jax.make_mesh((4, 2), ("data", "expert"))
  tx, config = optax.sgd(0.1), jaxdp.DDPConfig()
  on = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  with pytest.raises(ValueError, match=r"params\['w'\] is sharded .* over a data axis"):
    jaxdp.init_state({"w": on(jnp.zeros((8, 2)), "data")}, tx, mesh, config)
  with pytest.raises(ValueError, match=r"params\['w'\] .* leading \(expert\) dim"):
    jaxdp.init_state({"w": on(jnp.zeros((2, 8)), None, "expert")}, tx, mesh, config)
  other = jax.make_mesh((2, 4), ("data", "expert"))
  with pytest.raises(ValueError, match=r"params\['w'\] is sharded .* on another mesh"):
    jaxdp.init_state(
      {"w": jax.device_put(jnp.zeros((8, 2)), NamedSharding(other, P("expert")))}, tx, mesh, config
    )
  # 2 experts per expert rank cannot be split over the 4 "data" devices by the optimizer
  optim = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
  with pytest.raises(ValueError, match=r"params\['w'\]: 2 experts per expert-parallel rank"):
    jaxdp.init_state({"w": on(jnp.zeros((4, 3)), "expert")}, tx, mesh, optim)
  # FSDP: an expert param with no dim besides its experts is split like the optimizer's; one
  # FSDP does not gather (frozen), scans (stacked) or gathers by row blocks (chunks)
  fsdp = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
  with pytest.raises(ValueError, match=r"params\['w'\]: 2 experts per expert-parallel rank"):
    jaxdp.init_state({"w": on(jnp.zeros(4), "expert")}, tx, mesh, fsdp)
  expert = {"w": on(jnp.zeros((8, 16)), "expert"), "b": jnp.zeros(3)}
  with pytest.raises(ValueError, match=r"params\['w'\] is an expert param .* frozen"):
    jaxdp.init_state(expert, tx, mesh, fsdp, frozen={"w": True, "b": False})
  stacked = jaxdp.FSDPConfig(stacked=["w"])
  with pytest.raises(ValueError, match=r"params\['w'\] is an expert param .* out of stacked"):
    jaxdp.init_state(expert, tx, mesh, fsdp, fsdp=stacked)
  chunks = jaxdp.FSDPConfig(chunks={"w": 2})
  with pytest.raises(ValueError, match=r"chunks=.* params\['w'\], which is sharded"):
    jaxdp.init_state(expert, tx, mesh, fsdp, fsdp=chunks)
  assert model_specs_of({"w": on(jnp.zeros((8, 3)), "expert")}, mesh) == ((("expert",), ()),)


# ----------------------------------------------------------------------------- processes


def launch(*args, timeout=300):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxdp.launch",
      "--num-processes",
      "2",
      "--devices-per-process",
      "4",
      "--",
      *args,
    ],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


@pytest.mark.slow
def test_two_process_checkpoint_restores_in_one_process(tmp_path):
  """2 processes x 4 devices train under `optim` and save; this one process restores onto
  its 8 devices (`optim`) and onto 4 (`no_shard`), equal to training here."""
  result = launch(str(REPO / "tests" / "mesh_worker.py"), str(tmp_path))
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  tx = mp_worker.make_tx()
  mesh8 = jax.make_mesh((8,), ("data",))
  want, _ = mp_worker.train("optim", mesh8, lambda b: b)
  # 2 processes sum the partial grads in another order (gloo) than one process: the Adam
  # bound for the worker's problem (a loss over 16 x 2 outputs; tests/tolerances.py).
  bound = AdamBound(1e-2, 16 * 2, mp_worker.init_params(), clip=1.0)
  mp_worker.single_device_reference(bound)
  mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  for mesh, strategy in ((mesh8, "optim"), (mesh4, "no_shard")):
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
    like = jaxdp.init_state(mp_worker.init_params(), tx, mesh, config)
    with jaxdp.CheckpointManager(tmp_path) as mgr:
      state = mgr.restore(like)
      assert mgr.data_position() == mp_worker.STEPS
    assert int(state.step) == mp_worker.STEPS
    bound.check(jaxdp.get_params(state), want)


@pytest.mark.slow
def test_train_script_runs_under_the_launcher(tmp_path):
  """scripts/train.py, unchanged, as 2 processes x 4 devices: one 8-device data-parallel
  job; process 0 alone writes the metrics; every process takes part in the checkpoint."""
  result = launch(
    str(REPO / "scripts" / "train.py"),
    "--steps",
    "2",
    "--eval-every",
    "2",
    "--save-every",
    "2",
    "--out",
    str(tmp_path),
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--d-model",
    "32",
    "--block-size",
    "32",
    "--batch-size",
    "16",
    "--bucket-size",
    "4000",
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  for p in (0, 1):
    assert f"[p{p}] devices: 8 x cpu" in result.stdout
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert [sorted(e) for e in map(json.loads, lines)] == [
    ["step", "val_loss"],
    ["grad_norm", "loss", "lr", "step", "time_s", "tokens_per_s"],
    ["grad_norm", "loss", "lr", "step", "time_s", "tokens_per_s"],
    ["step", "val_loss"],
  ]
  with jaxdp.CheckpointManager(tmp_path / "checkpoints") as mgr:
    # The position carries the run's learning-rate schedule, so a resumed run keeps it.
    assert mgr.latest_step() == 2 and mgr.data_position() == {
      "next_step": 3,
      "schedule": {"peak_lr": 0.003, "warmup_steps": 1, "decay_steps": 2},
    }
