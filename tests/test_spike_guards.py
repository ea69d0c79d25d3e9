"""Spike guards and the NaN check: a step that skips its update on the device.

Every run is compared with the plain single-device program (`jax.grad` + optax on the whole
global batch) that skips the same steps, within the Adam rounding bound of
tests/tolerances.py; what a skipped step leaves (the step counted, optax's count not, the
window of norms without the spike) is compared exactly; donation is read off the compiled
program and off the caller's arrays.
"""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdp
from jaxdp.inspect import compile_train_step, gpu_compile_unavailable
from models.mlp import MLP, mlp_loss
from tests.test_checkpoint import TX, _params
from tests.tolerances import rtol_sum, step_tolerances

HERE = os.path.dirname(os.path.abspath(__file__))
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
LR = 3e-3
SPIKE = 2  # the step whose batch blows the grad norm up (of 4)


def problem():
  """MLP 6 -> 30 -> 5 (leading dims 6, 30, 5: none divisible by 8, so the sharded
  strategies pad) and four batches of 32, the third with targets 1000 times larger: its
  grad norm is hundreds of times the others'."""
  params, loss_fn = jaxdp.nnx_split(
    MLP(6, 30, 5, n_layers=3, rngs=nnx.Rngs(0), param_dtype=jnp.float32), mlp_loss
  )
  batches = []
  for i in range(4):
    k1, k2 = jax.random.split(jax.random.key(10 + i))
    y = jax.random.normal(k2, (32, 5)) * (1000.0 if i == SPIKE else 1.0)
    batches.append({"x": jax.random.normal(k1, (32, 6)), "y": y})
  return params, loss_fn, batches


def adamw_clip():
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(LR, weight_decay=0.1))


def reference(params, loss_fn, batches, tx, skip, bound=None):
  """Plain jax.grad + optax on each whole batch, one device, not updating at the steps in
  `skip`: `(params, opt_state, losses, grad norms)`; the gradients of the steps taken go to
  `bound` (an AdamBound)."""

  @jax.jit
  def grads_of(params, batch):
    return jax.value_and_grad(loss_fn)(params, batch)

  @jax.jit
  def update(params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state, losses, norms = tx.init(params), [], []
  for i, batch in enumerate(batches):
    loss, grads = grads_of(params, batch)
    losses.append(float(loss))
    norms.append(float(optax.tree.norm(grads)))
    if i in skip:
      continue
    if bound is not None:
      bound.add(grads)
    params, opt_state = update(params, opt_state, grads)
  return params, opt_state, losses, norms


def run(params, loss_fn, batches, config, mesh=None, grad_accum_steps=1):
  """`(state, step, metrics per step)` of jaxdp's step over `batches`."""
  mesh = mesh or jax.make_mesh((8,), ("data",))
  state = jaxdp.init_state(params, adamw_clip(), mesh, config)
  step = jaxdp.make_train_step(
    loss_fn, adamw_clip(), mesh, config, grad_accum_steps=grad_accum_steps
  )
  history = []
  for batch in batches:
    state, metrics = step(state, batch)
    history.append(jax.device_get(metrics))
  return state, step, history


def int_leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.integer)]


@pytest.mark.parametrize(
  "strategy, guard, grad_accum_steps",
  [(strategy, guard, 1) for strategy in STRATEGIES for guard in ("threshold", "spikes")]
  + [("optim_grads", "spikes", 2), ("optim_grads_params", "threshold", 2)],
)
def test_a_spike_is_skipped_as_by_the_single_device_program(strategy, guard, grad_accum_steps):
  params, loss_fn, batches = problem()
  # MLP: 32 x 5 squared errors per loss, 3 layers of 30 products per output
  loss_rtol, norm_rtol, bound = step_tolerances(params, 32 * 5, 3 * 30, LR, clip=1.0)
  want, want_opt, want_losses, want_norms = reference(
    params, loss_fn, batches, adamw_clip(), skip={SPIKE}, bound=bound
  )
  calm = max(n for i, n in enumerate(want_norms) if i != SPIKE)
  assert want_norms[SPIKE] > 100 * calm  # a spike by any guard's measure
  if guard == "threshold":
    # halfway (geometrically) between the calm steps' norms and the spike's
    config = dict(grad_norm_skip_threshold=float(np.sqrt(calm * want_norms[SPIKE])))
  else:  # the last 2 norms: judged from the third step on
    config = dict(skip_step_on_spikes=True, skip_step_interval=2)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, **config)
  state, step, history = run(params, loss_fn, batches, config, grad_accum_steps=grad_accum_steps)

  assert [bool(m["skipped"]) for m in history] == [i == SPIKE for i in range(4)]
  assert int(state.step) == 4  # the skipped step is counted
  np.testing.assert_allclose([m["loss"] for m in history], want_losses, rtol=loss_rtol)
  np.testing.assert_allclose([m["grad_norm"] for m in history], want_norms, rtol=norm_rtol)
  bound.check(jaxdp.get_params(state), want)
  # optax's own count did not move on the skipped step: 3 updates, as the reference's
  got_counts = int_leaves(jaxdp.get_opt_state(state))
  assert got_counts == int_leaves(want_opt) and all(c == 3 for c in got_counts)
  if guard == "spikes":  # the window: steps 0, 1 and 3's norms, the spike left out
    window = state.spike_window
    assert int(window.count) == 3
    np.testing.assert_array_equal(
      np.asarray(window.norms), [history[3]["grad_norm"], history[1]["grad_norm"]]
    )
  else:
    assert state.spike_window is None
  assert step._cache_size() == 1, "the second step recompiled"


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_a_non_finite_grad_is_skipped_without_the_nan_check(strategy):
  """A guard skips a step whose grad norm is NaN or Inf too (here an Inf target), without
  raising: the step after it trains on as if the bad batch had not come."""
  params, loss_fn, batches = problem()
  batches[SPIKE] = {**batches[SPIKE], "y": batches[SPIKE]["y"].at[3, 0].set(jnp.inf)}
  _, _, bound = step_tolerances(params, 32 * 5, 3 * 30, LR, clip=1.0)
  want, *_ = reference(params, loss_fn, batches, adamw_clip(), skip={SPIKE}, bound=bound)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, grad_norm_skip_threshold=1e6)
  state, _, history = run(params, loss_fn, batches, config)
  assert not np.isfinite(history[SPIKE]["grad_norm"])
  assert [bool(m["skipped"]) for m in history] == [i == SPIKE for i in range(4)]
  bound.check(jaxdp.get_params(state), want)


def _host_copy(tree):
  return jax.tree.map(lambda x: np.array(x), tree)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_the_nan_check_keeps_donation_and_hands_back_the_state(strategy):
  """`check_for_nan_in_grad`: the step donates its state; on a NaN/Inf gradient it skips
  the update on the device and `NonFiniteGradError.state` is the state it was given (its
  step not counted), bitwise; training on from it equals the single-device program that
  skipped the bad batch."""
  params, loss_fn, batches = problem()
  bad = 1
  batches[bad] = {**batches[bad], "x": batches[bad]["x"].at[0, 0].set(jnp.inf)}
  _, _, bound = step_tolerances(params, 32 * 5, 3 * 30, LR, clip=1.0)
  want, *_ = reference(params, loss_fn, batches, adamw_clip(), skip={bad}, bound=bound)
  mesh = jax.make_mesh((8,), ("data",))
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, check_for_nan_in_grad=True)
  state = jaxdp.init_state(params, adamw_clip(), mesh, config)
  step = jaxdp.make_train_step(loss_fn, adamw_clip(), mesh, config)
  state, metrics = step(state, batches[0])
  assert not bool(metrics["skipped"]) and "finite" not in metrics
  before = _host_copy(state)
  with pytest.raises(jaxdp.NonFiniteGradError, match=r"step 1: NaN or Inf .* e\.state") as err:
    step(state, batches[bad])
  assert all(x.is_deleted() for x in jax.tree.leaves(state))  # donated all the same
  kept = err.value.state
  assert err.value.step == 1 and int(kept.step) == 1
  assert jax.tree.structure(kept) == jax.tree.structure(before)
  for x, y in zip(jax.tree.leaves(kept), jax.tree.leaves(before)):
    np.testing.assert_array_equal(np.asarray(x), y)
  state = kept
  for batch in batches[bad + 1 :]:
    state, metrics = step(state, batch)
  assert int(state.step) == 3
  bound.check(jaxdp.get_params(state), want)
  assert step._cache_size() == 1


def _aliased_parameters(compiled_text: str) -> set[int]:
  """The entry parameters the compiled program writes its outputs into (donated buffers),
  from its `input_output_alias` attribute."""
  header = next(line for line in compiled_text.splitlines() if line.startswith("HloModule"))
  aliases = re.search(r"input_output_alias=\{(.*?)\}, entry", header)
  return {int(p) for p in re.findall(r":\s*\((\d+),", aliases.group(1))} if aliases else set()


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_guarded_steps_donate_every_state_buffer(strategy):
  """With every guard and the NaN check on, the compiled step still writes each output
  leaf of the state into its input's buffer, as the unguarded step does: the select
  between the old and the new state costs no second state."""
  params, loss_fn, batches = problem()
  mesh = jax.make_mesh((8,), ("data",))
  aliased = {}
  for name, guards in [
    ("off", {}),
    (
      "on",
      dict(check_for_nan_in_grad=True, grad_norm_skip_threshold=1e3, skip_step_on_spikes=True),
    ),
  ]:
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, **guards)
    state = jaxdp.init_state(params, adamw_clip(), mesh, config)
    step = jaxdp.make_train_step(loss_fn, adamw_clip(), mesh, config)
    leaves = len(jax.tree.leaves(state))
    aliased[name] = _aliased_parameters(step.lower(state, batches[0]).compile().as_text())
    assert aliased[name] == set(range(leaves)), (name, aliased[name], leaves)
    step(state, batches[0])
    assert all(x.is_deleted() for x in jax.tree.leaves(state))
  # the guarded state is the unguarded one and the window's two leaves
  assert len(aliased["on"]) == len(aliased["off"]) + 2


@pytest.mark.skipif(
  gpu_compile_unavailable() is not None,
  reason=f"no deviceless GPU compile: {gpu_compile_unavailable()}",
)
@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_guarded_steps_cost_no_second_state_on_the_gpu_target(strategy):
  """Compiled for 8 H100s (without a GPU): the step with every guard and the NaN check
  aliases every state buffer and peaks where the unguarded step does (up to the window's
  128 floats and the flags), where a NaN check that kept the caller's state would hold a
  second state. 8 layers of 1024 x 1024 fp32 under Adam: the state is 96 MiB."""
  params = {f"w{i}": jax.ShapeDtypeStruct((1024, 1024), jnp.float32) for i in range(8)}
  batch = {"x": jax.ShapeDtypeStruct((64, 1024), jnp.float32)}

  def loss_fn(params, batch):
    h = batch["x"]
    for i in range(8):
      h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean(h**2)

  peaks, aliased = {}, {}
  for name, guards in [
    ("off", {}),
    (
      "on",
      dict(check_for_nan_in_grad=True, grad_norm_skip_threshold=1e3, skip_step_on_spikes=True),
    ),
  ]:
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, **guards)
    compiled = compile_train_step(loss_fn, optax.adam(1e-3), 8, config, params, batch)
    memory = compiled.memory_analysis()
    peaks[name] = (
      memory.temp_size_in_bytes
      + memory.argument_size_in_bytes
      + memory.output_size_in_bytes
      - memory.alias_size_in_bytes
    )
    aliased[name] = _aliased_parameters(compiled.as_text())
  assert len(aliased["on"]) == len(aliased["off"]) + 2  # + the window's two leaves
  # the window (512 bytes), one finite flag per leaf, the skipped flag: under 4 KiB
  assert 0 <= peaks["on"] - peaks["off"] < 4096, peaks


@pytest.mark.parametrize(
  "field, value, message",
  [
    ("grad_norm_skip_threshold", 0.0, r"grad_norm_skip_threshold=0.0: must be a number > 0"),
    ("grad_norm_skip_threshold", -1, r"grad_norm_skip_threshold=-1: must be a number > 0"),
    ("grad_norm_skip_threshold", float("nan"), r"grad_norm_skip_threshold=nan: must be"),
    ("grad_norm_skip_threshold", "10", r"grad_norm_skip_threshold='10': must be"),
    ("skip_step_scaling_factor", 0.0, r"skip_step_scaling_factor=0.0: must be a finite"),
    ("skip_step_scaling_factor", float("inf"), r"skip_step_scaling_factor=inf: must be"),
    ("skip_step_scaling_factor", float("nan"), r"skip_step_scaling_factor=nan: must be"),
    ("skip_step_interval", 1, r"skip_step_interval=1: must be an int >= 2"),
    ("skip_step_interval", 8.0, r"skip_step_interval=8.0: must be an int >= 2"),
    ("skip_step_on_spikes", 1, r"skip_step_on_spikes=1: must be True or False"),
  ],
)
def test_a_bad_guard_setting_is_refused_by_the_config(field, value, message):
  with pytest.raises(ValueError, match=message):
    jaxdp.DDPConfig(**{field: value})


def test_guards_off_is_the_default():
  config = jaxdp.DDPConfig()
  assert not config.skips_steps and config.grad_norm_skip_threshold == float("inf")
  assert jaxdp.DDPConfig(grad_norm_skip_threshold=float("inf")) == config


def test_the_spike_window_is_checkpointed(tmp_path):
  """The window round-trips bitwise; a like with a window of another size keeps its own,
  empty one; an abstract like gets an empty one on the mesh; the step then runs on each
  without compiling twice."""
  params, loss_fn, batches = problem()
  mesh = jax.make_mesh((8,), ("data",))
  config = jaxdp.DDPConfig(
    data_parallel_sharding_strategy="optim", skip_step_on_spikes=True, skip_step_interval=4
  )
  state, _, history = run(params, loss_fn, batches[:2], config, mesh)
  saved = _host_copy(state.spike_window)
  np.testing.assert_array_equal(saved.norms[:2], [m["grad_norm"] for m in history])
  other = jaxdp.DDPConfig(
    data_parallel_sharding_strategy="optim", skip_step_on_spikes=True, skip_step_interval=8
  )
  step = jaxdp.make_train_step(loss_fn, adamw_clip(), mesh, config)
  with jaxdp.CheckpointManager(tmp_path / "ckpt") as mgr:
    mgr.save(2, state)
    mgr.wait_until_finished()
    for like in (
      jaxdp.init_state(params, adamw_clip(), mesh, config),
      jaxdp.abstract_state(params, adamw_clip(), mesh, config),
    ):
      got = mgr.restore(like)
      for x, y in zip(jax.tree.leaves(got.spike_window), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(x), y)
      step(got, batches[2])
    got = mgr.restore(jaxdp.abstract_state(params, adamw_clip(), mesh, other))
    assert int(got.spike_window.count) == 0 and got.spike_window.norms.shape == (8,)
    assert not np.asarray(got.spike_window.norms).any()
    jaxdp.make_train_step(loss_fn, adamw_clip(), mesh, other)(got, batches[2])
  assert step._cache_size() == 1


@pytest.mark.parametrize("strategy", ["optim", "no_shard"])
def test_an_old_checkpoint_restores_into_a_guarded_state(strategy):
  """A checkpoint saved without a window (format 2, before the guards) restores into a
  state with one: the window starts empty."""
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, skip_step_on_spikes=True)
  with jaxdp.CheckpointManager(os.path.join(HERE, "data", "format2")) as mgr:
    assert "spike_window" not in mgr.metadata()
    state = mgr.restore(jaxdp.init_state(_params(), TX, mesh, config))
  assert int(state.step) == 3 and int(state.spike_window.count) == 0
  assert state.spike_window.norms.shape == (128,)


def test_the_window_mean_and_deviation_are_bessels():
  """The spike rule itself, against numpy: a norm is a spike above mean + factor * std
  (ddof=1) of the window's written entries, and never before half the window is written."""
  from jaxdp._src.checks import is_spike
  from jaxdp._src.state import SpikeWindow

  norms = np.array([1.0, 2.0, 4.0, 0.0, 0.0, 0.0], np.float32)
  window = SpikeWindow(jnp.asarray(norms), jnp.asarray(3, jnp.int32))
  limit = norms[:3].mean() + 2.0 * norms[:3].std(ddof=1)
  rtol = rtol_sum(3)
  assert bool(is_spike(window, jnp.float32(limit * (1 + rtol)), 2.0))
  assert not bool(is_spike(window, jnp.float32(limit * (1 - rtol)), 2.0))
  early = SpikeWindow(jnp.asarray(norms), jnp.asarray(2, jnp.int32))  # 2 < 6 // 2
  assert not bool(is_spike(early, jnp.float32(1e9), 2.0))


def test_the_nnx_optimizer_keeps_its_state_through_a_nan_check_error():
  """`nnx_train_step`: the optimizer's state was donated to the failed step; the optimizer
  takes the state the error hands back, so the next batch trains on from it."""
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  mesh = jax.make_mesh((8,), ("data",))
  config = jaxdp.DDPConfig(check_for_nan_in_grad=True)
  optimizer = jaxdp.NNXOptimizer(model, optax.sgd(0.1), mesh, config)
  train_step = jaxdp.nnx_train_step(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))
  good = {"x": jnp.ones((16, 3)), "y": jnp.zeros((16, 1))}
  train_step(model, optimizer, good)
  before = _host_copy(jaxdp.get_params(optimizer.state))
  with pytest.raises(jaxdp.NonFiniteGradError):
    train_step(model, optimizer, {**good, "y": jnp.full((16, 1), jnp.inf)})
  assert int(optimizer.step) == 1
  for x, y in zip(jax.tree.leaves(jaxdp.get_params(optimizer.state)), jax.tree.leaves(before)):
    np.testing.assert_array_equal(np.asarray(x), y)
  train_step(model, optimizer, good)
  assert int(optimizer.step) == 2
