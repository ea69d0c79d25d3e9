"""Bad input fails early with an error that names the problem; NaN grads leave the state as is."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdp
from tests.tolerances import rtol_sum

TX = optax.adam(1e-2)


def _mesh(n):
  return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))


def _params():
  return {"a": jnp.arange(6.0).reshape(3, 2) / 10, "b": jnp.ones((2,))}


def _loss(p, batch):
  return jnp.mean(batch["x"] @ p["a"]) + jnp.mean(batch["y"] * p["b"])


def _batch(n=16, y=1.0):
  return {"x": jnp.ones((n, 3)), "y": jnp.full((n, 2), y)}


@pytest.fixture(scope="module")
def ddp8():
  mesh, config = _mesh(8), jaxdp.DDPConfig()
  return mesh, config, jaxdp.make_train_step(_loss, TX, mesh, config)


def _state(mesh, config, params=None):
  return jaxdp.init_state(_params() if params is None else params, TX, mesh, config)


# ----------------------------------------------------------------------------- batch


def test_batch_not_divisible(ddp8):
  mesh, config, step = ddp8
  with pytest.raises(ValueError, match=r"batch\['x'\]: batch dim 12 is not divisible by 8"):
    step(_state(mesh, config), _batch(12))


def test_batch_leading_dims_differ(ddp8):
  mesh, config, step = ddp8
  batch = {"x": jnp.ones((16, 3)), "y": jnp.ones((8, 2))}
  with pytest.raises(
    ValueError,
    match=r"different leading dims.*batch\['x'\] has 16.*"
    r"batch\['y'\] has 8",
  ):
    step(_state(mesh, config), batch)


def test_errors_come_before_compilation(ddp8):
  mesh, config, step = ddp8
  with pytest.raises(ValueError, match="not divisible"):
    step.lower(_state(mesh, config), _batch(12))


# ----------------------------------------------------------------------------- mesh, config


def test_mesh_without_data_axis():
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("batch",))
  with pytest.raises(ValueError, match=r"no 'data' axis"):
    jaxdp.init_state(_params(), TX, mesh, jaxdp.DDPConfig())
  with pytest.raises(ValueError, match=r"no 'data' axis"):
    jaxdp.make_train_step(_loss, TX, mesh, jaxdp.DDPConfig())


@pytest.mark.parametrize("size", [0, -5])
def test_bucket_size_not_positive(size):
  with pytest.raises(ValueError, match=rf"bucket_size={size}: must be a positive number"):
    jaxdp.DDPConfig(bucket_size=size)


def test_unknown_strategy():
  with pytest.raises(
    ValueError,
    match=r"'zero3': unknown strategy; use one of no_shard, "
    r"optim, optim_grads, optim_grads_params",
  ):
    jaxdp.DDPConfig(data_parallel_sharding_strategy="zero3")


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_stacked_needs_optim_or_optim_grads(strategy):
  """DDPConfig(stacked=) is ZeRO-1/2's: DDP has no shards to place, FSDP's stacks are
  FSDPConfig's (silently ignoring them would leave the stacks gathered whole)."""
  fix = (
    "use data_parallel_sharding_strategy='optim'"
    if strategy == "no_shard"
    else (r"pass FSDPConfig\(stacked=\['blocks'\]\)")
  )
  with pytest.raises(ValueError, match=fix):
    jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, stacked=["blocks"])


def test_params_without_float_leaf():
  with pytest.raises(ValueError, match="no trainable floating-point leaf"):
    jaxdp.init_state({"n": jnp.arange(4)}, TX, _mesh(8), jaxdp.DDPConfig())


def test_state_from_another_mesh(ddp8):
  _, config, step = ddp8
  with pytest.raises(ValueError, match=r"mesh of shape \{'data': 4\}.*runs on \{'data': 8\}"):
    step(_state(_mesh(4), config), _batch())


def test_state_on_other_devices_of_the_same_shape():
  config = jaxdp.DDPConfig()
  lo, hi = _mesh(4), jax.sharding.Mesh(np.array(jax.devices()[4:]), ("data",))
  step = jaxdp.make_train_step(_loss, TX, hi, config)
  with pytest.raises(ValueError, match=r"devices \[0, 1, 2, 3\].*devices \[4, 5, 6, 7\]"):
    step(_state(lo, config), _batch())


def test_state_from_another_config(ddp8):
  mesh, _, step = ddp8
  other = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
  with pytest.raises(
    ValueError,
    match=r"state was built for DDPConfig\("
    r"data_parallel_sharding_strategy='optim'",
  ):
    step(_state(mesh, other), _batch())


# ----------------------------------------------------------------------------- edited state


def test_params_gain_a_leaf(ddp8):
  mesh, config, step = ddp8
  state = _state(mesh, config)
  edited = dataclasses.replace(state, params={**state.params, "c": jnp.ones(2)})
  with pytest.raises(
    ValueError,
    match=r"state.params has the structure .*'c'.*changed "
    r"structure after init_state",
  ):
    step(edited, _batch())


def test_params_lose_a_leaf(ddp8):
  mesh, config, step = ddp8
  state = _state(mesh, config)
  edited = dataclasses.replace(state, params={"a": state.params["a"]})
  with pytest.raises(ValueError, match="changed structure after init_state"):
    step(edited, _batch())


def test_param_reshaped(ddp8):
  mesh, config, step = ddp8
  state = _state(mesh, config)
  edited = dataclasses.replace(state, params={**state.params, "b": jnp.ones((3,))})
  with pytest.raises(
    ValueError,
    match=r"state.params\['b'\]: float32\[3\], but init_state "
    r"made it float32\[2\]",
  ):
    step(edited, _batch())


def test_fsdp_params_gain_a_leaf():
  mesh, config = _mesh(8), jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
  state = _state(mesh, config)
  step = jaxdp.make_train_step(_loss, TX, mesh, config)
  edited = dataclasses.replace(state, params={**state.params, "c": jnp.ones(2)})
  with pytest.raises(ValueError, match="changed structure after init_state"):
    step(edited, _batch())


def test_sharded_master_reshaped():
  mesh = _mesh(8)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim", fused_update=False)
  state = _state(mesh, config)
  step = jaxdp.make_train_step(_loss, TX, mesh, config)
  edited = dataclasses.replace(state, master={**state.master, "a": jnp.ones((3, 2))})
  with pytest.raises(
    ValueError,
    match=r"state.master\['a'\]: shape \(3, 2\), but init_state "
    r"made it \(8, 2\)",
  ):
    step(edited, _batch())


def test_fused_master_reshaped():
  mesh, config = _mesh(8), jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
  state = _state(mesh, config)
  assert state.fused  # adam: the fused update, one flat array per bucket
  step = jaxdp.make_train_step(_loss, TX, mesh, config)
  edited = dataclasses.replace(state, master={k: jnp.ones((64,)) for k in state.master})
  with pytest.raises(ValueError, match=r"state.master holds the flat buckets .* but init_state"):
    step(edited, _batch())


# ----------------------------------------------------------------------------- NaN check


def _copy(tree):
  return jax.tree.map(lambda x: np.array(x), tree)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
def test_nan_check_names_leaf_and_step_and_keeps_state(strategy):
  mesh = _mesh(8)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, check_for_nan_in_grad=True)
  step = jaxdp.make_train_step(_loss, TX, mesh, config)
  state, _ = step(_state(mesh, config), _batch())
  before = _copy(state)
  message = r"step 1: NaN or Inf in the reduced gradient of params\['b'\]\. The step skipped"
  with pytest.raises(jaxdp.NonFiniteGradError, match=message) as err:
    step(state, _batch(y=np.inf))
  assert err.value.paths == ("['b']",) and err.value.step == 1
  assert state.step.is_deleted()  # donated, as every step's state
  after = _copy(err.value.state)  # the state the step handed back: the one it was given
  assert jax.tree.structure(after) == jax.tree.structure(before)
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(x, y)
  state, metrics = step(err.value.state, _batch())  # and usable
  assert int(state.step) == 2 and np.isfinite(float(metrics["loss"]))
  assert not bool(metrics["skipped"])


def test_nan_check_off_keeps_donation_and_plain_outputs(ddp8):
  mesh, config, step = ddp8
  state = _state(mesh, config)
  new, metrics = step(state, _batch())
  assert state.step.is_deleted() and set(metrics) == {"loss", "grad_norm"}
  assert step.lower(new, _batch()).compile() is not None


# ----------------------------------------------------------------------------- a donated state

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DONATED = "this state was donated to the previous step; use the state it returned"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_donated_state_is_refused_before_any_program_runs(strategy, tmp_path):
  """`new, _ = step(state, b); step(state, b)` crashed the process (JAX segfaults when a
  compiled program is handed a donated array of 8 devices): the step, the eval step, the
  views and a save refuse the donated state on the host, before JAX touches its buffers.
  Every program is compiled before the donation, the case that crashed."""
  mesh = jax.make_mesh((8,), ("data",))
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  step = jaxdp.make_train_step(_loss, TX, mesh, config)
  evaluate = jaxdp.make_eval_step(_loss, mesh, config)
  state = _state(mesh, config)
  jaxdp.get_params(state), jaxdp.get_opt_state(state), evaluate(state, _batch())
  new, _ = step(state, _batch())
  calls = {
    r"train_step\(state, batch\)": lambda: step(state, _batch()),
    r"eval_step\(state, batch\)": lambda: evaluate(state, _batch()),
    r"jaxdp\.get_params\(state\)": lambda: jaxdp.get_params(state),
    r"jaxdp\.get_opt_state\(state\)": lambda: jaxdp.get_opt_state(state),
  }
  for where, call in calls.items():
    with pytest.raises(ValueError, match=rf"{where}: {DONATED}.*\(state\.step, "):
      call()
  with jaxdp.CheckpointManager(tmp_path) as manager:
    with pytest.raises(ValueError, match=DONATED):
      manager.save(1, state)
  new, metrics = step(new, _batch())  # the state the step returned goes on
  assert int(new.step) == 2 and np.isfinite(float(metrics["loss"]))


def test_a_state_with_one_donated_field_names_it(ddp8):
  """A state put together from a returned state and a donated one's optimizer state."""
  mesh, config, step = ddp8
  state = _state(mesh, config)
  new, _ = step(state, _batch())
  mixed = dataclasses.replace(new, opt_state=state.opt_state)
  with pytest.raises(
    ValueError, match=r"deleted \(state\.opt_state\[0\]\.count, .* of \d+ leaves\)"
  ) as err:
    step(mixed, _batch())
  assert "state.params" not in str(err.value)
  step(new, _batch())


# ----------------------------------------------------------------------------- optimizer, fsdp


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
  "tx", [optax.sgd(0.1), optax.sgd(0.1, momentum=0.9)], ids=["sgd", "sgd_momentum"]
)
def test_a_step_with_another_optimizer_is_refused_before_compiling(strategy, tx):
  """An Adam state stepped with plain SGD trained silently (SGD's state is empty), with
  momentum SGD it failed inside optax ('ScaleByAdamState' object has no attribute 'trace'):
  the step compares `tx.init`'s structure with the state's when it is traced."""
  mesh, config = _mesh(8), jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state = _state(mesh, config)  # adam
  step = jaxdp.make_train_step(_loss, tx, mesh, config)
  with pytest.raises(
    ValueError,
    match=r"optimizer state \(ScaleByAdamState, EmptyState\) was built by another optax "
    r"transformation than this step's, whose init gives \((Trace|Empty)State, EmptyState\)",
  ):
    step.lower(state, _batch())
  assert not state.step.is_deleted()
  jaxdp.make_train_step(_loss, optax.adam(1e-3), mesh, config)(state, _batch())  # adam, any lr


def test_a_step_with_another_fsdp_config_is_refused():
  """`fsdp=` given to init_state and not to the step (or another one) gathered and
  computed otherwise than the state was built for, silently (here: fp32 instead of bf16)."""
  mesh = _mesh(8)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
  bf16 = jaxdp.FSDPConfig(param_dtype=jnp.bfloat16)
  state = jaxdp.init_state(_params(), TX, mesh, config, fsdp=bf16)
  fix = "pass the same fsdp= to init_state and make_train_step"
  with pytest.raises(
    ValueError, match=rf"param_dtype=dtype\(bfloat16\) in the state, None in this step\); {fix}"
  ):
    jaxdp.make_train_step(_loss, TX, mesh, config).lower(state, _batch())
  with pytest.raises(ValueError, match=rf"prefetch=1 in the state, 2 in this step.*{fix}"):
    step = jaxdp.make_train_step(_loss, TX, mesh, config, fsdp=jaxdp.FSDPConfig(prefetch=2))
    step.lower(_state(mesh, config), _batch())
  with pytest.raises(ValueError, match=fix):
    jaxdp.make_eval_step(_loss, mesh, config)(state, _batch())
  jaxdp.make_train_step(_loss, TX, mesh, config, fsdp=bf16)(state, _batch())


# ----------------------------------------------------------------------------- loss_fn


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_integer_loss_is_refused_naming_its_dtype(strategy):
  """An int loss trained nothing (zero gradient, no error); jax.grad refuses it."""
  mesh, config = _mesh(8), jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  step = jaxdp.make_train_step(lambda p, b: jnp.sum(b["x"] @ p["a"] > 0), TX, mesh, config)
  with pytest.raises(TypeError, match=r"loss_fn returned an int32 loss: .*floating point"):
    step.lower(_state(mesh, config), _batch())


def test_has_aux_with_a_scalar_loss_says_what_was_returned(ddp8):
  """It said `it returned LinearizeTracer`."""
  mesh, config, _ = ddp8
  step = jaxdp.make_train_step(_loss, TX, mesh, config, has_aux=True)
  with pytest.raises(
    TypeError,
    match=r"loss_fn must return \(loss, aux\) with has_aux=True; it returned a scalar "
    r"float32 array \(a loss alone\? then leave has_aux out\)",
  ):
    step.lower(_state(mesh, config), _batch())
  three = jaxdp.make_train_step(lambda p, b: (_loss(p, b), 1, 2), TX, mesh, config, has_aux=True)
  with pytest.raises(TypeError, match=r"it returned a tuple of length 3\n"):
    three.lower(_state(mesh, config), _batch())


# ----------------------------------------------------------------------------- views for your code


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_views_live_on_your_mesh_and_feed_back_into_init_state(strategy):
  """`get_params` and `get_opt_state` of a state on `jax.make_mesh`'s Explicit axes give
  arrays on that very mesh, as `jax.device_put` would: a user's `jax.jit` over them and a
  batch placed on the mesh runs (it raised "Mesh for all inputs should be equal" while the
  views lived on an Auto copy of the mesh), eager ops JAX refuses on Explicit arrays run
  under `jax.set_mesh(mesh)`, and a state built from them trains. Same values. The loss of
  the step's metrics is the eval step's loss of the same params (the same sums in the same
  order: float32 rounding at most)."""
  mesh = jax.make_mesh((8,), ("data",))
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state = _state(mesh, config)
  params, opt_state = jaxdp.get_params(state), jaxdp.get_opt_state(state)
  for x in jax.tree.leaves((params, opt_state)):
    assert x.sharding.mesh == mesh, x.sharding
  batch = jax.device_put(_batch(), NamedSharding(mesh, P("data")))
  np.testing.assert_allclose(jax.jit(_loss)(params, batch), _loss(_params(), _batch()), rtol=1e-6)
  with jax.set_mesh(mesh):
    assert float(params["a"].imag.sum()) == 0.0
    np.testing.assert_array_equal(params["b"].at[0].set(2.0), [2.0, 1.0])
    want = np.linalg.norm(np.concatenate([np.ravel(x) for x in jax.tree.leaves(_params())]))
    np.testing.assert_allclose(float(optax.tree.norm(params)), want, rtol=1e-6)
  np.testing.assert_array_equal(opt_state[0].mu["a"], np.zeros((3, 2)))
  again = jaxdp.init_state(params, TX, mesh, config)
  step = jaxdp.make_train_step(_loss, TX, mesh, config)
  evaluate = jaxdp.make_eval_step(lambda p, b: {"loss": _loss(p, b)}, mesh, config)
  before = evaluate(again, _batch())["loss"]
  again, metrics = step(again, _batch())
  assert int(again.step) == 1
  # The step's metrics and the eval step's outputs live on the mesh too: they combine, in
  # the user's jit and eagerly.
  assert metrics["loss"].sharding.mesh == mesh and before.sharding.mesh == mesh
  np.testing.assert_allclose(float(metrics["loss"] - before), 0.0, atol=1e-6)
  total = jax.jit(lambda m, p: m + optax.tree.norm(p))(metrics["loss"], params)
  assert float(total) > 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_linen_models_jitted_apply_takes_the_params_beside_a_batch_on_your_mesh(strategy):
  """The most common eval of a Flax loop, `jax.jit(model.apply)(jaxdp.get_params(state), x)`
  with `x` placed on the user's `jax.make_mesh` mesh: it raised "Mesh for all inputs should
  be equal ... Explicit ... Auto" under every strategy. Same logits as the initial params
  (no step taken): the same matmuls, another placement (float32 rounding of 8-term sums)."""
  model = nn.Sequential([nn.Dense(8), nn.relu, nn.Dense(5)])
  x = jax.random.normal(jax.random.key(0), (16, 7))
  params = model.init(jax.random.key(1), x)
  mesh = jax.make_mesh((8,), ("data",))
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state = jaxdp.init_state(params, TX, mesh, config)
  predict = jax.jit(model.apply)
  logits = predict(jaxdp.get_params(state), jax.device_put(x, NamedSharding(mesh, P("data"))))
  assert logits.sharding.mesh == mesh
  np.testing.assert_allclose(logits, model.apply(params, x), rtol=rtol_sum(8), atol=1e-6)


@pytest.mark.parametrize(
  "axis_types",
  [
    (jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto),  # re-wrapped after the call
    (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Auto),  # already for eager use
  ],
  ids=["mixed", "auto"],
)
def test_views_on_meshes_with_auto_axes(axis_types):
  """A mesh of mixed axis types and an Auto mesh give views on that mesh as well, with the
  same values; on the Auto mesh eager ops need no `jax.set_mesh`."""
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=axis_types)
  state = _state(mesh, jaxdp.DDPConfig())
  params = jaxdp.get_params(state)
  for x, want in zip(jax.tree.leaves(params), jax.tree.leaves(_params())):
    assert x.sharding.mesh == mesh, x.sharding
    np.testing.assert_array_equal(x, want)
  with jax.set_mesh(mesh):
    assert all(float(x.imag.sum()) == 0.0 for x in jax.tree.leaves(params))
