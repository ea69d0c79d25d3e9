"""The job around the step, sharded: init from a function or host arrays, checkpoints that
move shards, sharded views, old checkpoints.

Equalities here are bitwise: init computes the same values wherever it runs (JAX's
partitionable threefry draws the same bits shard by shard), and a checkpoint only moves
and pads values.
"""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp._src import checkpoint_format, train
from jaxdp._src.distributed_optimizer import per_leaf_state
from tests.test_checkpoint import TX, _batch, _params

HERE = os.path.dirname(os.path.abspath(__file__))
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _mesh(n=8, auto=False):
  types = (jax.sharding.AxisType.Auto if auto else jax.sharding.AxisType.Explicit,)
  return jax.make_mesh((n,), ("data",), axis_types=types, devices=jax.devices()[:n])


def _init():
  """Random leaves of widths dp divides and does not (33 rows: padded, sharded on its 16),
  a bf16 leaf, an int leaf."""
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  return {
    "w1": jax.random.normal(k1, (5, 7)) * 0.5,
    "b1": jnp.zeros((7,)),
    "emb": jax.random.normal(k3, (33, 16)),
    "w2": (jax.random.normal(k2, (7, 3)) * 0.5).astype(jnp.bfloat16),
    "count": jnp.array(3, jnp.int32),
  }


def _same(a, b):
  """Bitwise equal leaves with equal shardings (the step's cache key)."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert x.sharding == y.sharding, (x.sharding, y.sharding)


@pytest.mark.parametrize("auto", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_init_from_a_function_or_host_arrays_equals_init_from_arrays(strategy, auto):
  mesh, config = _mesh(auto=auto), jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  want = jaxdp.init_state(_init(), TX, mesh, config)
  _same(jaxdp.init_state(_init, TX, mesh, config), want)
  _same(jaxdp.init_state(jax.tree.map(np.asarray, _init()), TX, mesh, config), want)


def test_the_init_program_computes_shards_only():
  """The init function's program: each device's output is its shard (no all-gather, no
  output or temporary as large as the model)."""
  mesh = _mesh()
  big = lambda: {"w": jax.random.normal(jax.random.key(0), (1024, 512))}  # 2 MiB
  compiled = (
    jax.jit(big, out_shardings={"w": jax.NamedSharding(mesh, jax.P("data"))}).lower().compile()
  )
  memory = compiled.memory_analysis()
  assert memory.output_size_in_bytes == 1024 * 512 * 4 // 8
  # threefry's counters and bits: a few shards' worth, never the 2 MiB of the whole leaf
  assert memory.temp_size_in_bytes < 1024 * 512 * 4 // 2
  assert "all-gather" not in compiled.as_text()
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
  state = jaxdp.init_state(big, optax.adam(1e-3), mesh, config)
  (flat,) = jax.tree.leaves(state.master)  # fused: one flat bucket
  assert flat.addressable_shards[0].data.size == 1024 * 512 // 8


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_init_from_host_arrays_holds_no_more_than_the_state(strategy, monkeypatch):
  """Each program of an init from host arrays holds, per device, what it reads and writes
  and no temporary: the params as they arrive and the master params, then the master and
  the optimizer state. Neither holds more than the state itself (master and Adam's two
  moments), so the transferred params are gone before the moments are allocated."""
  mesh = _mesh()
  host = {"w1": np.ones((256, 512), np.float32), "w2": np.ones((512, 256), np.float32)}
  model = sum(x.nbytes for x in host.values()) // 8  # per device, sharded
  peaks = []
  jit = jax.jit

  def measured(fn, **kwargs):
    program = jit(fn, **kwargs)

    def run(*args):
      memory = program.lower(*args).compile().memory_analysis()
      peaks.append(
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        + memory.temp_size_in_bytes
        - memory.alias_size_in_bytes
      )
      return program(*args)

    return run

  monkeypatch.setattr(jax, "jit", measured)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  jaxdp.init_state(host, optax.adam(1e-3), mesh, config)
  assert len(peaks) == 2, peaks  # the state, then its optimizer state
  # 1% over: Adam's counter and the buckets' alignment padding (256 x 512 divides by 8)
  assert peaks[0] <= 2 * model * 1.01, (peaks, model)  # params in, master out
  assert peaks[1] <= 3 * model * 1.01, (peaks, model)  # master in, two moments out


def test_init_function_errors_name_the_fix():
  mesh, config = _mesh(), jaxdp.DDPConfig()
  with pytest.raises(TypeError, match="no arguments"):
    jaxdp.init_state(lambda key: {"w": jnp.zeros(3)}, TX, mesh, config)
  with pytest.raises(TypeError, match="return the param pytree"):
    jaxdp.init_state(lambda: {"w": "zeros"}, TX, mesh, config)
  # a frozen mask that does not match what the function returns: refused before any init
  calls = []

  def counted():
    calls.append(1)
    return {"w": jnp.zeros((4, 2))}

  with pytest.raises(ValueError, match="frozen"):
    jaxdp.init_state(counted, TX, mesh, config, frozen={"v": True})
  assert len(calls) == 1  # traced once for its shapes (jax.eval_shape), never run


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_sharded_views_hold_a_dp_th_of_each_leaf_and_equal_the_whole_ones(strategy):
  mesh = _mesh()
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state = jaxdp.init_state(_init, TX, mesh, config)
  step = jaxdp.make_train_step(_loss_init, TX, mesh, config)
  state, _ = step(state, _batch_init(0))
  for whole, sharded in (
    (jaxdp.get_params(state), jaxdp.get_params(state, sharded=True)),
    (jaxdp.get_opt_state(state), jaxdp.get_opt_state(state, sharded=True)),
  ):
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(whole), jax.tree.leaves(sharded)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
      assert x.shape == y.shape
      divisible = any(n % 8 == 0 for n in x.shape)
      per_device = y.addressable_shards[0].data.size
      assert per_device == (x.size // 8 if divisible else x.size), (path, y.sharding)


def test_sharded_get_params_of_a_padded_leaf_moves_it_without_gathering():
  """A stacked FSDP leaf is sharded on a dim of a layer, padded there (each dim pads: 33
  rows to 40, 15 columns to 16, the least, at dp 8): its view is sharded on the layers
  instead, reached by an all-to-all."""
  mesh = _mesh()
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
  fsdp = jaxdp.FSDPConfig(stacked=["blocks"])
  params = {"blocks": {"w": jnp.ones((8, 33, 15))}, "head": jnp.ones((16, 4))}
  state = jaxdp.init_state(params, optax.sgd(0.1), mesh, config, fsdp=fsdp)
  assert state.master["blocks"]["w"].shape == (8, 33, 16)
  program = jax.jit(train.whole_params, static_argnums=(1, 2))
  text = program.lower(state, mesh, True).compile().as_text()
  assert "all-to-all" in text and "all-gather" not in text


def _loss_init(p, batch):
  h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"].astype(jnp.float32) - batch["y"]) ** 2) + 1e-3 * jnp.mean(
    p["emb"] ** 2
  )


def _batch_init(i):
  return _batch(i)


@pytest.mark.parametrize("fused", [True, False])
def test_a_save_stores_the_states_own_arrays(fused):
  """No program runs to save a sharded state: what is stored is the state's own arrays
  (a fused state's flat buckets as they are), each device writing its shards."""
  mesh = _mesh()
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim", fused_update=fused)
  state = jaxdp.init_state(_init, TX, mesh, config)
  assert state.fused == fused
  stored, flat = checkpoint_format.stored_arrays(state)
  own = {id(x) for x in jax.tree.leaves(state)}
  assert all(id(x) in own for x in stored.values())
  # leaves b1, count, emb, w1, w2: the int one replicated, the trainable ones sharded (the
  # bf16 one as its fp32 master), in flat buckets when fused
  assert stored["params_1"].sharding.is_fully_replicated and "params_4" not in stored
  sharded = {k for k, x in stored.items() if not x.sharding.is_fully_replicated}
  if fused:
    assert {k for k in stored if k.startswith("flat_")} <= sharded
    assert set(flat["sources"]) >= {"params_0", "params_2", "params_3", "master_4"}
  else:
    assert {"params_0", "params_2", "params_3", "master_4"} <= sharded and not flat


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params", "no_shard"])
def test_format_1_checkpoints_restore(strategy, tmp_path):
  """A checkpoint written by format 1 (every leaf whole, logical shapes; optim, dp = 8,
  AdamW after 3 steps) restores on dp 4 into any strategy, every value as saved."""
  want = dict(np.load(os.path.join(HERE, "data", "format1_expected.npz")))
  with jaxdp.CheckpointManager(os.path.join(HERE, "data", "format1")) as mgr:
    assert mgr.metadata()["format"] == 1
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
    state = mgr.restore(jaxdp.init_state(_params(), TX, _mesh(4), config))
  assert int(state.step) == 3
  got = {
    **{f"params{jax.tree_util.keystr(k)}": v for k, v in _leaves(jaxdp.get_params(state))},
    **{f"opt{jax.tree_util.keystr(k)}": v for k, v in _leaves(jaxdp.get_opt_state(state))},
  }
  for key, x in got.items():
    np.testing.assert_array_equal(np.asarray(x, np.float32), want[key], err_msg=key)
  master = per_leaf_state(state, state.step.sharding.mesh).master["w2"]
  np.testing.assert_array_equal(np.asarray(master)[:7], want["master['w2']"])


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params", "no_shard"])
def test_format_2_checkpoints_restore(strategy):
  """A checkpoint written by format 2 (each leaf as the state holds it; a fused `optim` state
  on dp = 8, its flat buckets stored as they are, AdamW after 3 steps) restores on dp 4 into
  any strategy, every value as saved."""
  want = dict(np.load(os.path.join(HERE, "data", "format2_expected.npz")))
  with jaxdp.CheckpointManager(os.path.join(HERE, "data", "format2")) as mgr:
    assert mgr.metadata()["format"] == 2 and "flat" in mgr.metadata()
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
    state = mgr.restore(jaxdp.init_state(_params(), TX, _mesh(4), config))
  assert int(state.step) == 3
  got = {
    **{f"params{jax.tree_util.keystr(k)}": v for k, v in _leaves(jaxdp.get_params(state))},
    **{f"opt{jax.tree_util.keystr(k)}": v for k, v in _leaves(jaxdp.get_opt_state(state))},
  }
  assert set(got) | {"master['w2']"} == set(want)
  for key, x in got.items():
    np.testing.assert_array_equal(np.asarray(x, np.float32), want[key], err_msg=key)
  master = per_leaf_state(state, state.step.sharding.mesh).master["w2"]
  np.testing.assert_array_equal(np.asarray(master)[:7], want["master['w2']"])


@pytest.mark.parametrize("name", ["format1", "format2"])
def test_checkpoint_metadata_reads_back_and_writes_the_stored_bytes(name):
  """The metadata records read a stored checkpoint's metadata and write it back to the very
  bytes stored: a save writes what the format says."""
  path = os.path.join(HERE, "data", name, "3", "meta", "metadata")
  with open(path) as f:
    text = f.read()
  meta = checkpoint_format.Metadata.from_json(json.loads(text))
  assert json.dumps(meta.to_json()) == text


def _leaves(tree):
  return jax.tree_util.tree_leaves_with_path(tree)


def test_a_refused_restore_reads_nothing_writes_nothing_and_keeps_like(tmp_path):
  mesh, config = _mesh(), jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
  with jaxdp.CheckpointManager(tmp_path / "ckpt") as mgr:
    mgr.save(0, jaxdp.init_state(_params(), TX, mesh, config))
    mgr.wait_until_finished()
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "ckpt").rglob("*")}
    other = {**_params(), "w1": jnp.zeros((6, 7))}
    like = jaxdp.init_state(other, TX, mesh, config)
    with pytest.raises(ValueError, match=r"params\['w1'\]: shape \(5, 7\) in the checkpoint"):
      mgr.restore(like)
  assert {p: p.stat().st_mtime_ns for p in (tmp_path / "ckpt").rglob("*")} == files
  jax.tree.map(lambda x: x.block_until_ready(), like)  # not donated


def test_a_save_with_bounded_concurrency_restores_bitwise_and_refuses_a_larger_shard(tmp_path):
  """`save_concurrent_gb` bounds the bytes being written at once; the checkpoint is the same.
  A shard is written in one piece, so a state with a shard over the bound is refused before
  anything is written."""
  mesh = _mesh()
  params = {f"w{i}": jnp.full((64, 32), float(i)) for i in range(10)}  # 1 KiB shards
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim", fused_update=False)
  state = jaxdp.init_state(params, TX, mesh, config)
  with jaxdp.CheckpointManager(tmp_path / "ok", save_concurrent_gb=4e-6) as mgr:
    assert mgr.save(0, state)  # 4 KB in flight: a few shards at a time
    mgr.wait_until_finished()
    got = mgr.restore(jaxdp.abstract_state(params, TX, mesh, config))
  _same(got, state)
  with jaxdp.CheckpointManager(tmp_path / "small", save_concurrent_gb=1e-6) as mgr:
    with pytest.raises(ValueError, match=r"shard of 1.02e-06 GB per device.*above 1.02e-06"):
      mgr.save(0, state)
    assert mgr.all_steps() == []
  with pytest.raises(ValueError, match="save_concurrent_gb=0: must be a positive number"):
    jaxdp.CheckpointManager(tmp_path / "zero", save_concurrent_gb=0)


def test_restore_reads_in_groups_and_consumes_like(tmp_path, monkeypatch):
  """A restore holds one state and one group: the leaves are read in several groups, and
  each group frees the leaves of `like` it replaces (or writes into them)."""
  mesh = _mesh()
  params = {f"w{i}": jnp.full((64, 32), float(i)) for i in range(10)}
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim", fused_update=False)
  state = jaxdp.init_state(params, TX, mesh, config)
  reads = []
  with jaxdp.CheckpointManager(tmp_path / "ckpt") as mgr:
    mgr.save(0, state)
    mgr.wait_until_finished()
    like = jaxdp.init_state(params, TX, mesh, config)
    restore = mgr._mgr.restore
    monkeypatch.setattr(mgr._mgr, "restore", lambda *a, **k: reads.append(1) or restore(*a, **k))
    got = mgr.restore(like)
  assert len(reads) >= 1 + 8  # the metadata, then groups of about an eighth of the state
  assert all(x.is_deleted() for x in jax.tree.leaves(like))
  _same(got, state)  # bitwise, on the shardings the step's cache expects


def test_abstract_state_is_init_states_shapes_and_shardings():
  mesh = _mesh()
  for strategy in STRATEGIES:
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
    want = jaxdp.init_state(_init, TX, mesh, config, rng=jax.random.key(1))
    for params in (_init, jax.tree.map(np.asarray, _init())):
      got = jaxdp.abstract_state(params, TX, mesh, config, rng=jax.random.key(1))
      assert jax.tree.structure(got) == jax.tree.structure(want)
      for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert isinstance(x, jax.ShapeDtypeStruct)
        assert (x.shape, x.dtype, x.sharding) == (y.shape, y.dtype, y.sharding)


def test_abstract_state_on_a_mesh_built_by_hand():
  """`jax.sharding.Mesh(devices, names)`, which `init_state` takes too: every leaf placed
  as `init_state` places it (the same devices and layout of shards)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  for strategy in STRATEGIES:
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
    want = jaxdp.init_state(_init, TX, mesh, config, rng=jax.random.key(1))
    got = jaxdp.abstract_state(_init, TX, mesh, config, rng=jax.random.key(1))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert (x.shape, x.dtype) == (y.shape, y.dtype)
      assert x.sharding.is_equivalent_to(y.sharding, len(x.shape)), (x.sharding, y.sharding)


def test_abstract_state_keeps_tensor_parallel_placements():
  """From arrays or their `jax.ShapeDtypeStruct`s, a param's split over "model" is read."""
  mesh = jax.make_mesh((4, 2), ("data", "model"))
  put = lambda x, spec: jax.device_put(x, jax.NamedSharding(mesh, spec))
  params = {
    "w1": put(jnp.ones((16, 8)), jax.P(None, "model")),
    "w2": put(jnp.ones((8, 16)), jax.P("model", None)),
  }
  shapes = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params
  )
  for strategy in ("optim", "optim_grads_params"):
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
    want = jaxdp.init_state(params, TX, mesh, config)
    for source in (params, shapes):
      got = jaxdp.abstract_state(source, TX, mesh, config)
      assert jax.tree.map(lambda x: (x.shape, x.sharding), got) == jax.tree.map(
        lambda x: (x.shape, x.sharding), want
      )


@pytest.mark.parametrize(
  "strategy,fused",
  [("optim", None), ("optim", False), ("optim_grads_params", None), ("no_shard", None)],
)
def test_restore_into_an_abstract_state_allocates_as_it_reads(tmp_path, strategy, fused):
  """Into `abstract_state` a resume reads each leaf into its place: the same state, bit
  for bit and on the same shardings, as a restore into `init_state`'s."""
  mesh = _mesh()
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, fused_update=fused)
  state = jaxdp.init_state(_init, TX, mesh, config)
  step = jaxdp.make_train_step(_loss_init, TX, mesh, config)
  state, _ = step(state, _batch(0))
  with jaxdp.CheckpointManager(tmp_path / "ckpt") as mgr:
    mgr.save(1, state)
    mgr.wait_until_finished()
    want = mgr.restore(jaxdp.init_state(_init, TX, mesh, config))
    got = mgr.restore(jaxdp.abstract_state(_init, TX, mesh, config))
  _same(got, want)
  _same(got, state)
  got, _ = step(got, _batch(1))
  assert step._cache_size() == 1, "the restored state recompiled the step"


@pytest.mark.slow
def test_a_restore_in_a_fresh_process_holds_no_more_than_orbaxs(tmp_path):
  """A restore as a resumed job meets it: once, the one thing a fresh process does, at
  256 MiB of f32 params (AdamW: 768 MiB of state) on 8 CPU devices. Its peak host memory
  growth (VmHWM) into `abstract_state`, under ZeRO-1 and FSDP, is within 1.2x of orbax's
  `StandardCheckpointer` restoring the GSPMD-sharded state into `jax.ShapeDtypeStruct`
  targets (scripts/bench/job_memory.py --restore-only: each checkpoint is written by a
  process of its own first), with glibc's defaults and with its mmap threshold fixed."""
  out = tmp_path / "memory.json"
  command = [
    sys.executable,
    os.path.join(os.path.dirname(HERE), "scripts", "bench", "job_memory.py"),
    *("--mib", "256", "--variants", "gspmd", "optim", "fsdp", "--restore-only"),
    *("--json", str(out)),
  ]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-4000:]
  report = json.loads(out.read_text())
  state = 3 * report["model"]  # the master and Adam's two moments
  # as glibc runs by default, and with freed buffers returned at once (what each allocates)
  for phase in ("restore (fresh process)", "restore (fresh process, freed returned)"):
    grow = {v: r[phase]["grow"] for v, r in report["results"].items()}
    assert all(g >= state for g in grow.values()), (phase, grow)  # each allocated the state
    for variant in ("optim", "fsdp"):
      assert grow[variant] <= 1.2 * grow["gspmd"], (phase, variant, grow, done.stdout)


def test_an_abstract_state_onto_other_padding_is_refused_before_reading(tmp_path, monkeypatch):
  """Onto another dp a padded leaf's new padding rows are `like`'s values (an optimizer's
  initial state there: Adagrad's 0.1), which shapes do not give: refused, naming the way."""
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim", fused_update=False)
  with jaxdp.CheckpointManager(tmp_path / "ckpt") as mgr:
    mgr.save(0, jaxdp.init_state(_init, TX, _mesh(3), config))
    mgr.wait_until_finished()
    reads = []
    restore = mgr._mgr.restore
    monkeypatch.setattr(mgr._mgr, "restore", lambda *a, **k: reads.append(1) or restore(*a, **k))
    like = jaxdp.abstract_state(_init, TX, _mesh(8), config)
    with pytest.raises(ValueError, match=r"other padding .* Pass like=jaxdp.init_state"):
      mgr.restore(like)
    assert len(reads) == 1  # the metadata only
    mixed = dataclasses.replace(like, step=jnp.zeros((), jnp.int32))
    with pytest.raises(ValueError, match="some leaves are arrays"):
      mgr.restore(mixed)
    on_abstract_mesh = jax.eval_shape(lambda: jaxdp.init_state(_init, TX, _mesh(8), config))
    with pytest.raises(ValueError, match="abstract mesh.*jaxdp.abstract_state"):
      mgr.restore(on_abstract_mesh)


def test_relative_checkpoint_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  mesh, config = _mesh(), jaxdp.DDPConfig()
  with jaxdp.CheckpointManager("ckpt") as mgr:
    mgr.save(0, jaxdp.init_state(_params(), TX, mesh, config))
    mgr.wait_until_finished()
    assert mgr.latest_step() == 0
  assert (tmp_path / "ckpt" / "0").is_dir()


def test_nnx_optimizer_from_a_function_equals_from_a_model():
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(4, 16, rngs=rngs)
      self.bn = nnx.BatchNorm(16, rngs=rngs)
      self.l2 = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
      return self.l2(self.bn(jax.nn.relu(self.l1(x))))

  build = lambda: Model(nnx.Rngs(0))
  mesh = _mesh()
  loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  batch = {"x": jax.random.normal(jax.random.key(1), (16, 4)), "y": jnp.ones((16, 1))}
  for strategy in ("optim", "optim_grads_params"):
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
    a = jaxdp.NNXOptimizer(build(), optax.adam(1e-3), mesh, config)
    b = jaxdp.NNXOptimizer(build, optax.adam(1e-3), mesh, config)
    _same(a.state, b.state)
    ma, mb = build(), nnx.eval_shape(build)
    got_a = jaxdp.nnx_train_step(loss)(ma, a, batch)
    got_b = jaxdp.nnx_train_step(loss, update_model=False)(mb, b, batch)
    assert float(got_a["loss"]) == float(got_b["loss"])
    _same(a.state, b.state)
  with pytest.raises(TypeError, match="nnx.Module, or a function"):
    jaxdp.NNXOptimizer(3, optax.adam(1e-3), mesh, jaxdp.DDPConfig())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_host_arrays_are_never_written_by_the_donated_steps(strategy):
  """Host arrays reach the devices slice by slice (the transfer may alias them), and the
  state never shares their buffers: steps that donate the state leave them as they were."""
  host = {"w": np.ones((64, 32), np.float32), "b": np.zeros((32,), np.float32)}
  mesh, tx = _mesh(), optax.sgd(0.5)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state = jaxdp.init_state(host, tx, mesh, config)
  loss = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"]) ** 2)
  step = jaxdp.make_train_step(loss, tx, mesh, config)
  for _ in range(2):
    state, _ = step(state, {"x": jnp.ones((16, 64))})
  np.testing.assert_array_equal(host["w"], 1.0)
  np.testing.assert_array_equal(host["b"], 0.0)
  assert float(jnp.abs(jaxdp.get_params(state)["w"] - 1.0).max()) > 0  # it trained
