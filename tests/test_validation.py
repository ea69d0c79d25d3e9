"""Bad input fails early with an error that names the problem; NaN grads leave the state as is."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp

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
  message = r"step 1: NaN or Inf in the reduced gradient of params\['b'\]\. The state"
  with pytest.raises(jaxdp.NonFiniteGradError, match=message) as err:
    step(state, _batch(y=np.inf))
  assert err.value.paths == ("['b']",) and err.value.step == 1
  after = _copy(state)  # still readable: not donated
  assert jax.tree.structure(after) == jax.tree.structure(before)
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(x, y)
  state, metrics = step(state, _batch())  # and usable
  assert int(state.step) == 2 and np.isfinite(float(metrics["loss"]))


def test_nan_check_off_keeps_donation_and_plain_outputs(ddp8):
  mesh, config, step = ddp8
  state = _state(mesh, config)
  new, metrics = step(state, _batch())
  assert state.step.is_deleted() and set(metrics) == {"loss", "grad_norm"}
  assert step.lower(new, _batch()).compile() is not None
