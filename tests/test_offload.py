"""Host offload of the master params and optimizer state (`DDPConfig.optimizer_cpu_offload`).

The offloaded buckets live in `pinned_host` memory between steps (the CPU backend has that
memory kind too, a buffer apart from the device's), each step copies them to the device,
updates them there and copies them back: the same arithmetic as without offload, so every
strategy's params and optimizer state after a few steps are the same bits.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp._src import inspect as inspect_lib
from jaxdp._src import offload as offload_lib
from jaxdp._src.config import OFFLOAD_MIN_JAXLIB, jaxlib_version
from jaxdp._src.state import HOST, offloaded_buckets, offloads_master

# Host offload compiles on jaxlib >= OFFLOAD_MIN_JAXLIB only (older ones are refused:
# tests/test_jax_versions.py).
pytestmark = pytest.mark.skipif(
  jaxlib_version() < OFFLOAD_MIN_JAXLIB, reason=f"host offload needs jaxlib >= {OFFLOAD_MIN_JAXLIB}"
)

TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
STEPS = 3
WIDTH = 16
BUCKET = WIDTH * WIDTH + WIDTH  # one layer's elements


def mlp():
  """Four tanh layers of width 16: with `bucket_size=BUCKET` each layer (w and b) is a
  bucket of its own (FSDP: a unit of its own), so that a fraction offloads some of them."""
  rng = np.random.default_rng(0)
  params = {
    f"l{i}": {
      "w": 0.3 * rng.standard_normal((WIDTH, WIDTH)).astype(np.float32),
      "b": np.zeros(WIDTH, np.float32),
    }
    for i in range(4)
  }

  def loss_fn(p, b):
    h = b["x"]
    for i in range(4):
      h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
    return jnp.mean((h - b["y"]) ** 2)

  batch = {
    "x": rng.standard_normal((16, WIDTH)).astype(np.float32),
    "y": rng.standard_normal((16, WIDTH)).astype(np.float32),
  }
  return params, loss_fn, batch


def config(strategy, offload=False, fraction=1.0, fused=None, overlap=True):
  return jaxdp.DDPConfig(
    data_parallel_sharding_strategy=strategy,
    bucket_size=BUCKET,
    fused_update=fused,
    optimizer_cpu_offload=offload,
    optimizer_offload_fraction=fraction,
    overlap_param_gather=overlap,
  )


FSDP = jaxdp.FSDPConfig(units=[f"['l{i}']" for i in range(4)])


def train(cfg, steps=STEPS):
  params, loss_fn, batch = mlp()
  mesh = jax.make_mesh((8,), ("data",))
  kw = {"fsdp": FSDP} if cfg.shards_params else {}
  state = jaxdp.init_state(params, TX, mesh, cfg, **kw)
  step = jaxdp.make_train_step(loss_fn, TX, mesh, cfg, **kw)
  for _ in range(steps):
    state, _ = step(state, batch)
  return state, step


def kinds_of(tree):
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


# (strategy, fused_update, overlap_param_gather): without the overlap a ZeRO step reads the
# master only in its update, and the master is offloaded too (`offloads_master`)
CASES = [
  ("optim", None, True),
  ("optim", False, True),
  ("optim", None, False),
  ("optim", False, False),
  ("optim_grads", None, True),
  ("optim_grads_params", None, True),
  ("optim_grads_params", False, True),
]


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("strategy,fused,overlap", CASES)
def test_offload_is_bitwise_the_device_update(strategy, fused, overlap, fraction):
  device, _ = train(config(strategy, fused=fused, overlap=overlap))
  offloaded, step = train(config(strategy, True, fraction, fused, overlap))
  assert step._cache_size() == 1  # the state comes back where init_state put it
  names = offloaded_buckets(offloaded.layout, offloaded.config)
  assert len(offloaded.layout.buffers[0].buckets) == 4
  # whole buckets, the first ones: all four, or two of the four equal ones for 0.5
  assert len(names) == (4 if fraction == 1.0 else 2)
  master_kinds = kinds_of(offloaded.master)
  if overlap:  # the step gathers the params from it at its start: on the device
    assert master_kinds == {"device"}
  else:
    assert master_kinds == ({HOST} if fraction == 1.0 else {HOST, "device"})
  assert HOST in kinds_of(offloaded.opt_state)
  # the same arithmetic: the same bits, in the params and in every optimizer leaf; with the
  # master offloaded too, the new params are gathered from its copy back on the device, in
  # a fusion of XLA's own choosing: within float32 rounding (`assert_within_rounding`)
  same = np.testing.assert_array_equal if overlap else assert_within_rounding
  for got, want in [
    (jaxdp.get_params(offloaded), jaxdp.get_params(device)),
    (jaxdp.get_opt_state(offloaded), jaxdp.get_opt_state(device)),
  ]:
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      same(np.asarray(a), np.asarray(b))


def assert_within_rounding(got, want):
  """Two runs of the same float32 update whose programs XLA fused differently: each step is
  the same few dozen float32 operations per element, and XLA may contract or reorder a few
  of them differently inside a fusion (an ulp, 1.2e-7 relative, each); over three steps,
  32 ulps of the leaf's largest value bounds what that can add up to, while a wrong piece,
  group or bucket (rows updated twice, or with another leaf's state) moves a leaf by about
  the learning rate, 1e-2 or 1e-3."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = max(float(np.max(np.abs(want), initial=0.0)), np.finfo(np.float32).tiny)
  assert np.max(np.abs(got - want), initial=0.0) <= 32 * np.finfo(np.float32).eps * scale


def live_bytes() -> dict[str, int]:
  """Bytes of every live array, by memory kind, summed over the devices."""
  out = {}
  for x in jax.live_arrays():
    kind = x.sharding.memory_kind
    out[kind] = out.get(kind, 0) + sum(s.data.nbytes for s in x.addressable_shards)
  return out


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_device_bytes_between_steps_drop_by_the_offloaded_bytes(strategy):
  def between_steps(cfg):
    before = live_bytes()
    state, _ = train(cfg, steps=2)
    after = live_bytes()
    del state
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}

  # Once first, unmeasured: what a process makes once (a program's constants kept with its
  # cache, the first compile's arrays) would count in whichever run came first.
  between_steps(config(strategy))
  between_steps(config(strategy, True, 0.5))
  plain = between_steps(config(strategy))
  offloaded = between_steps(config(strategy, True, 0.5))
  # What the two offloaded buckets hold, counted here from the layout: Adam's two moments
  # (and the fp32 master where the step reads it only in its update: not these two, which
  # gather the params from it first), each dp * shard_size elements per bucket, over all
  # devices.
  cfg = config(strategy, True, 0.5)
  parts = 3 if offloads_master(cfg) else 2
  params, _, _ = mlp()
  mesh = jax.make_mesh((8,), ("data",))
  kw = {"fsdp": FSDP} if cfg.shards_params else {}
  layout = jaxdp.init_state(params, TX, mesh, cfg, **kw).layout
  names = offloaded_buckets(layout, cfg)
  host = sum(
    parts * 4 * b.shard_size * layout.dp
    for buf in layout.buffers
    for b in buf.buckets
    if f"{buf.name}/bucket{b.index}" in names
  )
  assert host > 0
  assert offloaded.get(HOST, 0) == host
  assert plain.get(HOST, 0) == 0
  assert plain["device"] - offloaded["device"] == host


def test_views_and_abstract_state():
  state, _ = train(config("optim", True), steps=1)
  like = jaxdp.abstract_state(mlp()[0], TX, jax.make_mesh((8,), ("data",)), config("optim", True))
  for x, a in zip(jax.tree.leaves(state), jax.tree.leaves(like), strict=True):
    assert x.sharding.memory_kind == a.sharding.memory_kind
    assert x.sharding.spec == a.sharding.spec and x.shape == a.shape


@pytest.mark.parametrize("into", [True, False])
def test_checkpoint_offloaded_to_either_and_back(tmp_path, into):
  mesh = jax.make_mesh((8,), ("data",))
  params, loss_fn, batch = mlp()
  state, _ = train(config("optim", True, overlap=False))
  saved = (jaxdp.get_params(state), jaxdp.get_opt_state(state))
  mgr = jaxdp.CheckpointManager(tmp_path / "a")
  mgr.save(STEPS, state)
  mgr.wait_until_finished()
  cfg = config("optim", into, overlap=False)
  restored = mgr.restore(jaxdp.init_state(params, TX, mesh, cfg))
  # the master too: this ZeRO step reads it only in its update (`offloads_master`)
  assert kinds_of(restored.master) == ({HOST} if into else {"device"})
  assert (HOST in kinds_of(restored.opt_state)) == into
  got = (jaxdp.get_params(restored), jaxdp.get_opt_state(restored))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(saved), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # ... and back into an offloaded state, which trains on without a second compile
  mgr2 = jaxdp.CheckpointManager(tmp_path / "b")
  mgr2.save(STEPS, restored)
  mgr2.wait_until_finished()
  back = mgr2.restore(jaxdp.init_state(params, TX, mesh, config("optim", True, overlap=False)))
  assert kinds_of(back.master) == {HOST}
  step = jaxdp.make_train_step(loss_fn, TX, mesh, config("optim", True, overlap=False))
  back, _ = step(back, batch)
  back, _ = step(back, batch)
  assert step._cache_size() == 1


@pytest.mark.parametrize(
  "kwargs,match",
  [
    ({"optimizer_offload_fraction": 1.5}, "optimizer_offload_fraction=1.5"),
    ({"optimizer_offload_fraction": -0.1}, "optimizer_offload_fraction=-0.1"),
    ({"optimizer_cpu_offload": True}, "no_shard"),
    ({"optimizer_cpu_offload": 1}, "optimizer_cpu_offload=1"),
  ],
)
def test_bad_config(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jaxdp.DDPConfig(**kwargs)


def test_no_host_memory_is_refused_before_compiling():
  """A backend whose devices have no `pinned_host` memory: stood in for by a mesh whose
  device lists only a device memory (the CPU backend has both)."""
  from jaxdp._src.state import check_offload

  @dataclasses.dataclass
  class Memory:
    kind: str

  class Device:
    platform = "tpu"

    def addressable_memories(self):
      return [Memory("device")]

  class Mesh:
    devices = np.array([Device()], dtype=object)

  with pytest.raises(ValueError, match="optimizer_cpu_offload=True.*pinned_host"):
    check_offload(Mesh(), config("optim", True))
  check_offload(Mesh(), config("optim"))  # nothing asked: nothing checked


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("strategy,fused,overlap", CASES)
def test_ledger_counts_host_bytes_apart(strategy, fused, overlap, fraction):
  from jaxdp.inspect import measured_bytes, memory_ledger

  cfg = config(strategy, True, fraction, fused, overlap)
  params = mlp()[0]
  kw = {"fsdp": FSDP} if cfg.shards_params else {}
  state = jaxdp.init_state(params, TX, jax.make_mesh((8,), ("data",)), cfg, **kw)
  offloaded = memory_ledger(params, TX, 8, cfg, **kw)
  plain = memory_ledger(params, TX, 8, config(strategy, fused=fused, overlap=overlap), **kw)
  assert offloaded.state == {k: v for k, v in measured_bytes(state).items() if k != "step"}
  assert offloaded.host > 0
  # the same bytes, split between the memories
  assert offloaded.master + offloaded.host_master == plain.master
  assert offloaded.opt_state + offloaded.host_opt_state == plain.opt_state
  if fraction == 1.0:  # all but the step counts (Adam's and the clip's) offloaded
    assert offloaded.opt_state < 64
    assert offloaded.master == (plain.master if overlap else 0)


def test_h100_program_takes_the_offloaded_state_in_host_memory():
  """Compiled for 8 H100s without a GPU: the offloaded state is the program's host
  arguments (the ledger's host bytes per device), copied in and out by async copies that
  `predict_step` times on the host link."""
  from jaxdp import inspect

  if reason := inspect.gpu_compile_unavailable():
    pytest.skip(reason)
  params, loss_fn, batch = mlp()
  cfg = config("optim_grads_params", True, 0.5)
  compiled = inspect.compile_train_step(loss_fn, TX, 8, cfg, params, batch, fsdp=FSDP)
  ledger = inspect.memory_ledger(params, TX, 8, cfg, fsdp=FSDP)
  assert compiled.memory_analysis().host_argument_size_in_bytes == ledger.host
  text = compiled.as_text()
  assert "copy-start" in text and "S(5)" in text
  prediction = inspect.predict_step(compiled)
  assert set(prediction.host_us) == {"host-to-device", "device-to-host", "total"}
  # each way: the offloaded bytes at the host link's rate
  expected_us = ledger.host / inspect_lib.HOST_LINK_BYTES_PER_S * 1e6
  assert prediction.host_us["host-to-device"] == pytest.approx(expected_us)
  assert prediction.host_us["device-to-host"] == pytest.approx(expected_us)
  assert prediction.step_us == pytest.approx(
    prediction.compute_us + prediction.exposed_us["total"] + prediction.host_exposed_us["total"]
  )


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_eval_step_reads_an_offloaded_state(strategy):
  params, loss_fn, batch = mlp()
  mesh = jax.make_mesh((8,), ("data",))
  kw = {"fsdp": FSDP} if strategy == "optim_grads_params" else {}
  losses = []
  for offload in (False, True):
    state, _ = train(config(strategy, offload), steps=1)
    cfg = config(strategy, offload)
    losses.append(jaxdp.make_eval_step(loss_fn, mesh, cfg, **kw)(state, batch))
  np.testing.assert_array_equal(np.asarray(losses[0]), np.asarray(losses[1]))


MESHES = {  # name: (mesh shape, axis names, axis types, config fields beyond the strategy)
  "optim-auto": ((8,), ("data",), jax.sharding.AxisType.Auto, {}),
  "fsdp-auto": ((8,), ("data",), jax.sharding.AxisType.Auto, {}),
  "hfsdp": (
    (2, 4),
    ("replica", "data"),
    jax.sharding.AxisType.Explicit,
    {"num_distributed_optimizer_instances": 2, "outer_dp_sharding_strategy": "optim"},
  ),
}


@pytest.mark.parametrize("name", list(MESHES))
def test_offload_on_auto_meshes_and_hfsdp(name):
  shape, axes, kind, fields = MESHES[name]
  mesh = jax.make_mesh(shape, axes, axis_types=(kind,) * len(shape))
  strategy = "optim" if name == "optim-auto" else "optim_grads_params"
  params, loss_fn, batch = mlp()
  kw = {"fsdp": FSDP} if strategy == "optim_grads_params" else {}
  out = []
  for offload in (False, True):
    cfg = dataclasses.replace(config(strategy, offload, 0.5), **fields)
    state = jaxdp.init_state(params, TX, mesh, cfg, **kw)
    step = jaxdp.make_train_step(loss_fn, TX, mesh, cfg, **kw)
    for _ in range(STEPS):
      state, _ = step(state, batch)
    assert step._cache_size() == 1
    assert (HOST in kinds_of(state.opt_state)) == offload
    out.append((jaxdp.get_params(state), jaxdp.get_opt_state(state)))
  for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
  "strategy,overlap", [("optim", True), ("optim", False), ("optim_grads_params", True)]
)
def test_a_skipped_step_keeps_an_offloaded_state_as_it_was(strategy, overlap):
  """A guard's select reads the state before the step, some of it in host memory (the
  master too without `overlap_param_gather`): the skipped step hands back the same bits,
  the offloaded leaves back in host memory; the NaN check's step (nothing to skip) equals
  the device update's."""
  params, loss_fn, batch = mlp()
  mesh = jax.make_mesh((8,), ("data",))
  kw = {"fsdp": FSDP} if strategy == "optim_grads_params" else {}
  results = {}
  for name, guard in [("skip", dict(grad_norm_skip_threshold=1e-9)), ("nan", {})]:
    for offload in (False, True):
      cfg = dataclasses.replace(
        config(strategy, offload, overlap=overlap), check_for_nan_in_grad=name == "nan", **guard
      )
      state = jaxdp.init_state(params, TX, mesh, cfg, **kw)
      before = jax.device_get((state.master, state.opt_state))
      state, metrics = jaxdp.make_train_step(loss_fn, TX, mesh, cfg, **kw)(state, batch)
      assert bool(metrics["skipped"]) == (name == "skip")
      if offload:
        assert HOST in kinds_of(state.opt_state)
        assert (HOST in kinds_of(state.master)) == (not overlap)
      if name == "skip":  # not updated: the state it was given, bit for bit
        jax.tree.map(
          np.testing.assert_array_equal, jax.device_get((state.master, state.opt_state)), before
        )
      results[name, offload] = jax.device_get((state.master, state.opt_state))
  # (the NaN check's update, the master offloaded too: within rounding, as in
  # `test_offload_is_bitwise_the_device_update`)
  same = {"skip": np.testing.assert_array_equal}.get
  for name in ("skip", "nan"):
    check = same(name) or (np.testing.assert_array_equal if overlap else assert_within_rounding)
    jax.tree.map(check, results[name, True], results[name, False])


def stacked_mlp(layers=8, width=WIDTH):
  """`layers` tanh layers stacked on a leading layer axis (the loss scans over them): with
  FSDP's `stacked=` each param's master and moments shard a dim of one layer, so the update
  of an offloaded state streams them in pieces of whole layers."""
  rng = np.random.default_rng(3)
  params = {
    "blocks": {
      "w": 0.3 * rng.standard_normal((layers, width, width)).astype(np.float32),
      "b": np.zeros((layers, width), np.float32),
    }
  }

  def loss_fn(p, b):
    h, _ = jax.lax.scan(lambda h, l: (jnp.tanh(h @ l["w"] + l["b"]), None), b["x"], p["blocks"])
    return jnp.mean((h - b["y"]) ** 2)

  batch = {
    "x": rng.standard_normal((16, width)).astype(np.float32),
    "y": rng.standard_normal((16, width)).astype(np.float32),
  }
  return params, loss_fn, batch


# Per device, a layer's w master shard is WIDTH * WIDTH / 8 float32: with its two moments, 3
# of them; a piece of two layers' worth of a group (the moments; the master is on the device
# already, read by the forward) makes the eight layers four pieces.
TWO_LAYERS = 2 * 2 * 4 * WIDTH * WIDTH // 8


def train_stacked(strategy, offload, tx=TX, mesh_shape=(8,), grad_accum_steps=1, **fields):
  """`STEPS` steps of `stacked_mlp` with the blocks stacked (ZeRO's `stacked=`, FSDP's
  stacked unit), per-leaf update: (final state, its step, the batch)."""
  params, loss_fn, batch = stacked_mlp()
  axes = ("replica", "data")[-len(mesh_shape) :]
  mesh = jax.make_mesh(mesh_shape, axes)
  cfg = jaxdp.DDPConfig(
    data_parallel_sharding_strategy=strategy,
    optimizer_cpu_offload=offload,
    stacked=("blocks",) if strategy == "optim_grads" else (),
    fused_update=False,
    **fields,
  )
  kw = {"fsdp": jaxdp.FSDPConfig(stacked=["blocks"])} if cfg.shards_params else {}
  state = jaxdp.init_state(params, tx, mesh, cfg, **kw)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, cfg, grad_accum_steps=grad_accum_steps, **kw)
  for _ in range(STEPS):
    state, _ = step(state, batch)
  return state, step, batch


@pytest.mark.parametrize("skip", [False, True], ids=["updated", "skipped"])
@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_an_update_streamed_in_pieces_is_bitwise_the_device_update(monkeypatch, strategy, skip):
  """The update of an offloaded state, split in pieces of whole layers, each copied in,
  updated and written back into its host buffer in place: the same bits as the device
  update, in the params and every optimizer leaf, over three steps. With a spike guard that
  skips every step, the select between the state before and after is streamed the same
  way, and hands back the state before."""
  monkeypatch.setattr(offload_lib, "PIECE_BYTES", TWO_LAYERS)
  params = stacked_mlp()[0]
  out = []
  for on in (False, True):
    threshold = 1e-9 if skip else math.inf
    state, step, batch = train_stacked(strategy, on, grad_norm_skip_threshold=threshold)
    assert step._cache_size() == 1
    if on:
      text = step.lower(state, batch).as_text()
      # w's two moments written back in 4 pieces each by the update (with b's, or the
      # master's where the forward did not read it: 16 at least), and again by the guard
      assert text.count("dynamic_update_slice") >= 2 * 2 * 4 + (2 * 4 if skip else 0)
    out.append((jaxdp.get_params(state), jaxdp.get_opt_state(state)))
  if skip:
    for a, b in zip(jax.tree.leaves(out[1][0]), jax.tree.leaves(params), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_h100_update_in_pieces_holds_a_piece_of_the_offloaded_state(monkeypatch):
  """Compiled for 8 H100s: FSDP over 16 stacked layers of width 1024, the moments (16 MiB
  per device) in host memory, the master on the device (the forward reads it). Streamed in
  pieces of two layers, the step's device peak is the plain step's less the offloaded
  moments, plus two pieces in flight (one copied in while the one before is copied out);
  streamed whole it is larger. So with a spike guard, whose select of the state before or
  after the update is streamed the same way. Every byte crosses the host link once each
  way, slices included, and the guard's select reads the moments of both states and
  writes them once more."""
  from jaxdp import inspect

  if reason := inspect.gpu_compile_unavailable():
    pytest.skip(reason)
  layers, width = 16, 1024
  params, loss_fn, batch = stacked_mlp(layers, width)
  fsdp = jaxdp.FSDPConfig(stacked=["blocks"])
  piece = 2 * 2 * 4 * width * width // 8  # two layers of w's two moments, per device
  peaks = {}
  cases = [("plain", None), ("whole", 2**40), ("pieces", piece), ("guarded", piece)]
  for name, piece_bytes in cases:
    if piece_bytes is not None:
      monkeypatch.setattr(offload_lib, "PIECE_BYTES", piece_bytes)
    cfg = jaxdp.DDPConfig(
      data_parallel_sharding_strategy="optim_grads_params",
      optimizer_cpu_offload=piece_bytes is not None,
      skip_step_on_spikes=name == "guarded",  # its select of the state streamed too
    )
    compiled = inspect.compile_train_step(loss_fn, TX, 8, cfg, params, batch, fsdp=fsdp)
    peaks[name] = inspect.memory_stats(compiled).peak_bytes
    ledger = inspect.memory_ledger(params, TX, 8, cfg, fsdp=fsdp)
    if name != "plain":
      host_us = inspect.predict_step(compiled).host_us
      one_way = ledger.host / inspect_lib.HOST_LINK_BYTES_PER_S * 1e6
      if name != "guarded":
        assert host_us["host-to-device"] == pytest.approx(one_way)
        assert host_us["device-to-host"] == pytest.approx(one_way)
      else:  # the select reads the moments before and after the update, and writes them
        # once more; XLA may forward a piece the update just wrote (or drop a copy it finds
        # unchanged): within two pieces of the count
        piece_us = piece / 2 / inspect_lib.HOST_LINK_BYTES_PER_S * 1e6  # one moment's
        for direction, times in [("host-to-device", 3), ("device-to-host", 2)]:
          got, want = host_us[direction], one_way * times
          assert want - 2 * piece_us <= got <= want * (1 + 1e-9), direction
  for name in ("pieces", "guarded"):
    assert peaks[name] <= peaks["plain"] - ledger.host + 2 * piece, name
  assert peaks["pieces"] < peaks["whole"]


STREAMED_TXS = {
  # elementwise: streamed in pieces
  "lion": optax.lion(1e-3),
  "adamw, lr in the state": optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2),
  "adamw, masked decay": optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 2, p)),
  # a trust ratio from each param's norm: its groups are updated whole
  "lamb": optax.lamb(1e-2),
}


@pytest.mark.parametrize("name", list(STREAMED_TXS))
@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
def test_other_optimizers_streamed_equal_the_device_update(monkeypatch, strategy, name):
  """The streamed update runs the optimizer's own equations on each element, so any optax
  transformation gives the device update's result: bit for bit where XLA fuses the two
  programs alike, else within float32 rounding (`assert_within_rounding`)."""
  monkeypatch.setattr(offload_lib, "PIECE_BYTES", TWO_LAYERS)
  out = []
  for on in (False, True):
    state, _, _ = train_stacked(strategy, on, tx=STREAMED_TXS[name])
    out.append((jaxdp.get_params(state), jaxdp.get_opt_state(state)))
  for got, want in zip(jax.tree.leaves(out[1]), jax.tree.leaves(out[0]), strict=True):
    assert_within_rounding(got, want)


@pytest.mark.parametrize("outer", ["no_shard", "optim"], ids=["hsdp", "hfsdp"])
def test_pieces_on_a_replica_mesh_with_accumulation(monkeypatch, outer):
  """FSDP over stacked layers on a ("replica", "data") mesh, two micro-batches, the state
  streamed in pieces of one layer: the device update's bits (HSDP keeps a copy per
  replica, HFSDP shards the master and state across "replica" too)."""
  monkeypatch.setattr(offload_lib, "PIECE_BYTES", TWO_LAYERS // 2)
  out = []
  for on in (False, True):
    state, _, _ = train_stacked(
      "optim_grads_params",
      on,
      mesh_shape=(2, 4),
      grad_accum_steps=2,
      num_distributed_optimizer_instances=2,
      outer_dp_sharding_strategy=outer,
    )
    out.append((jaxdp.get_params(state), jaxdp.get_opt_state(state)))
  for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
