"""Real Flax training loops: aux metrics, dropout RNG, BatchNorm state, eval, any optax on any
mesh; each against the plain single-device program where one exists."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxdp
from models.mlp import MLP, mlp_loss
from tests.tolerances import assert_trees_close, rtol_sum

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
# f32 params after 3 Adam steps: the bound test_ddp uses (1e-5); the sums differ only in
# their order (psum of per-shard sums vs one sum over the batch), observed ~1e-7.
ATOL = 1e-5


def mesh8(axis_type=AxisType.Explicit):
  return jax.make_mesh((8,), ("data",), axis_types=(axis_type,))


class Net(nnx.Module):
  """Linear -> BatchNorm -> relu -> Dropout -> Linear: what a real classifier holds."""

  def __init__(self, rngs, sync=False, rate=0.0):
    self.l1 = nnx.Linear(6, 16, use_bias=False, rngs=rngs)  # BatchNorm removes a bias
    self.bn = nnx.BatchNorm(16, momentum=0.5, axis_name="data" if sync else None, rngs=rngs)
    self.drop = nnx.Dropout(rate, rngs=rngs)
    self.l2 = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def net_loss(model, batch):
  logits = model(batch["x"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


def net_batch(n=32):
  k1, k2 = jax.random.split(jax.random.key(3))
  return {"x": jax.random.normal(k1, (n, 6)) + 0.5, "y": jax.random.randint(k2, (n,), 0, 3)}


def reference(loss_fn, params, model_state, batch, tx, steps):
  """Plain jax.grad + optax on the whole batch, one device, model state threaded."""
  opt_state, history = tx.init(params), []
  for _ in range(steps):
    (loss, (aux, model_state)), grads = jax.value_and_grad(
      lambda p: loss_fn(p, batch, model_state=model_state), has_aux=True
    )(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    history.append((float(loss), float(aux["accuracy"])))
  return params, model_state, history


# ----------------------------------------------------------------------------- aux + BN


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_aux_and_sync_batchnorm_equal_single_device(strategy):
  """has_aux metrics, and SyncBatchNorm's running statistics carried in the state, equal
  the single-device run (whose BatchNorm sees the whole batch)."""
  tx, batch = optax.adam(1e-2), net_batch()
  params, loss_fn = jaxdp.nnx_split(Net(nnx.Rngs(0), sync=True), net_loss)
  plain = Net(nnx.Rngs(0))
  ref_params, ref_ms, ref_hist = reference(
    jaxdp.nnx_split(plain, net_loss)[1], params, jaxdp.nnx_model_state(plain), batch, tx, 3
  )

  mesh, config = mesh8(), jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  model = Net(nnx.Rngs(0), sync=True)
  state = jaxdp.init_state(params, tx, mesh, config, model_state=jaxdp.nnx_model_state(model))
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config, has_aux=True)
  hist = []
  for _ in range(3):
    state, metrics = step(state, batch)
    hist.append((float(metrics["loss"]), float(metrics["aux"]["accuracy"])))
  np.testing.assert_allclose(hist, ref_hist, rtol=1e-5)
  assert_trees_close(jaxdp.get_params(state), ref_params, ATOL)
  assert_trees_close(state.model_state, ref_ms, ATOL)
  assert not np.allclose(ref_ms["bn"]["mean"], 0)  # the statistics did move
  jaxdp.nnx_merge(model, state)  # params and running statistics back in the model
  assert_trees_close(model.bn.mean[...], ref_ms["bn"]["mean"], ATOL)
  step(state, batch)  # donates the state: the model holds copies, not its buffers
  assert_trees_close(model.bn.mean[...], ref_ms["bn"]["mean"], ATOL)
  assert step._cache_size() == 1


def test_unsynced_batchnorm_statistics_are_the_mean_over_shards():
  """A BatchNorm that does not sync: each device updates its statistics from its shard and
  the step averages them; the running mean is then the global batch's (equal shards), the
  running variance the mean of the shards' variances."""
  tx, batch = optax.sgd(0.0), net_batch()
  model = Net(nnx.Rngs(0))
  params, loss_fn = jaxdp.nnx_split(model, net_loss)
  ms = jaxdp.nnx_model_state(model)
  mesh, config = mesh8(), jaxdp.DDPConfig()
  state = jaxdp.init_state(params, tx, mesh, config, model_state=ms)
  state, _ = jaxdp.make_train_step(loss_fn, tx, mesh, config, has_aux=True)(state, batch)

  h = np.asarray(model.l1(batch["x"])).reshape(8, 4, 16)  # the BatchNorm's input per shard
  mean = 0.5 * 0 + 0.5 * h.mean(axis=(0, 1))
  var = 0.5 * 1 + 0.5 * h.var(axis=1).mean(axis=0)
  np.testing.assert_allclose(state.model_state["bn"]["mean"], mean, atol=1e-6)
  np.testing.assert_allclose(state.model_state["bn"]["var"], var, atol=1e-5)


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_model_state_leaves_kept_averaged_or_taken_from_the_first_shard(strategy):
  """What the step does with each kind of model-state leaf: the same on every device (a
  counter): kept; a float that differs: averaged; an integer that differs: shard 0's."""

  def loss_fn(p, b, *, model_state):
    new = {"steps": model_state["steps"] + 1, "mean": jnp.mean(b["x"]), "first": jnp.sum(b["i"])}
    return jnp.mean((b["x"] * p["w"]) ** 2), new

  batch = {"x": jnp.arange(32.0).reshape(32, 1), "i": jnp.arange(32)}
  ms = {"steps": jnp.zeros((), jnp.int32), "mean": jnp.zeros(()), "first": jnp.zeros((), jnp.int32)}
  mesh, config = mesh8(), jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state = jaxdp.init_state({"w": jnp.ones((1,))}, optax.sgd(0.0), mesh, config, model_state=ms)
  step = jaxdp.make_train_step(loss_fn, optax.sgd(0.0), mesh, config)
  for _ in range(2):
    state, _ = step(state, batch)
  assert int(state.model_state["steps"]) == 2
  assert float(state.model_state["mean"]) == 15.5  # the mean of the shard means: 0..31's
  assert int(state.model_state["first"]) == 0 + 1 + 2 + 3  # shard 0 holds rows 0..3
  assert state.model_state["first"].dtype == jnp.int32

  bad = jaxdp.make_train_step(
    lambda p, b, *, model_state: (jnp.sum(p["w"]), {}), optax.sgd(0.0), mesh, config
  )
  with pytest.raises(ValueError, match="return the whole model state"):
    bad(state, batch)


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads", "optim_grads_params"])
def test_aux_with_grad_accumulation(strategy):
  """With k micro-batches the aux is averaged over them too: the mean of equal-size
  micro-batch means is the mean over the whole batch."""

  def loss_fn(p, b):
    err = b["x"] @ p["w"] - b["y"]
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err)), "count": jnp.sum(err > 0)}

  params = {"w": jnp.arange(15.0).reshape(5, 3) / 10}
  batch = {"x": jax.random.normal(jax.random.key(0), (32, 5)), "y": jnp.ones((32, 3))}
  mesh, config = mesh8(), jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state = jaxdp.init_state(params, optax.sgd(0.1), mesh, config)
  step = jaxdp.make_train_step(
    loss_fn, optax.sgd(0.1), mesh, config, has_aux=True, grad_accum_steps=2
  )
  _, metrics = step(state, batch)
  loss, aux = loss_fn(params, batch)
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
  np.testing.assert_allclose(metrics["aux"]["mae"], aux["mae"], rtol=1e-6)
  # a count is averaged like everything else: the mean of the 16 micro-batches' counts
  np.testing.assert_allclose(metrics["aux"]["count"], aux["count"] / 16, rtol=1e-6)
  assert metrics["aux"]["count"].dtype == jnp.float32


def test_has_aux_errors_name_the_fix():
  mesh, config = mesh8(), jaxdp.DDPConfig()
  params = {"w": jnp.ones((2, 1))}
  batch = {"x": jnp.ones((8, 2))}
  state = jaxdp.init_state(params, optax.sgd(0.1), mesh, config)
  step = jaxdp.make_train_step(
    lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1), mesh, config, has_aux=True
  )
  with pytest.raises(TypeError, match=r"\(loss, aux\) with has_aux=True"):
    step(state, batch)
  step = jaxdp.make_train_step(
    lambda p, b: (jnp.mean(b["x"] @ p["w"]), {}), optax.sgd(0.1), mesh, config
  )
  with pytest.raises(TypeError, match="with has_aux=True return"):
    step(state, batch)


# ----------------------------------------------------------------------------- dropout RNG


def dropout_loss(model, batch):
  """The loss through dropout, and the dropout mask of this device's shard as aux."""
  logits = model(batch["x"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss, {"mask": model.drop(jnp.ones((batch["x"].shape[0], 16))) * 0.5}


def dropout_run(strategy, steps, mesh=None, state=None, key=7):
  """`steps` steps of the dropout net; the per-step mean over shards of the masks."""
  mesh = mesh or mesh8()
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  model = Net(nnx.Rngs(0), rate=0.5)
  params, loss_fn = jaxdp.nnx_split(model, dropout_loss)
  tx = optax.adam(1e-2)
  if state is None:
    state = jaxdp.init_state(
      params, tx, mesh, config, rng=jax.random.key(key), model_state=jaxdp.nnx_model_state(model)
    )
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config, has_aux=True)
  masks = []
  for _ in range(steps):
    state, metrics = step(state, net_batch())
    masks.append(np.asarray(metrics["aux"]["mask"]))
  return state, masks


def test_dropout_masks_differ_per_step_and_per_shard():
  _, masks = dropout_run("optim", 2)
  for m in masks:
    # the mean over the 8 shards of 0/1 masks: all-equal masks would leave only 0 and 1
    assert m.shape == (4, 16) and 0.3 < m.mean() < 0.7
    assert np.mean((m > 0) & (m < 1)) > 0.5, "the shards drew the same mask"
  assert not np.array_equal(masks[0], masks[1]), "two steps drew the same masks"
  # another key, other masks; the same key, the same masks, under another strategy
  assert not np.array_equal(dropout_run("optim", 1, key=8)[1][0], masks[0])
  np.testing.assert_array_equal(dropout_run("optim_grads_params", 1)[1][0], masks[0])


def test_resumed_run_draws_the_masks_of_the_uninterrupted_run(tmp_path):
  state, masks = dropout_run("optim", 3)
  half, first = dropout_run("optim", 1)
  with jaxdp.CheckpointManager(tmp_path) as mgr:
    mgr.save(1, half)
    mgr.wait_until_finished()
    like, _ = dropout_run("optim", 0, key=123)  # its key and statistics are overwritten
    resumed, rest = dropout_run("optim", 2, state=mgr.restore(like))
  for a, b in zip(first + rest, masks):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(
    jax.tree.leaves((jaxdp.get_params(resumed), resumed.model_state)),
    jax.tree.leaves((jaxdp.get_params(state), state.model_state)),
  ):
    np.testing.assert_array_equal(a, b)


def test_model_state_and_key_restore_across_dp_and_strategy(tmp_path):
  state, _ = dropout_run("no_shard", 2)
  with jaxdp.CheckpointManager(tmp_path) as mgr:
    mgr.save(2, state)
    mgr.wait_until_finished()
    mesh4 = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    like, _ = dropout_run("optim_grads_params", 0, mesh=mesh4, key=5)
    restored = mgr.restore(like)
    assert restored.model_state["bn"]["mean"].sharding.mesh.shape["data"] == 4
    for a, b in zip(
      jax.tree.leaves((restored.model_state, restored.rng)),
      jax.tree.leaves((state.model_state, state.rng)),
    ):
      np.testing.assert_array_equal(a, b)
    no_key, _ = dropout_run("no_shard", 0)
    no_key = dataclasses.replace(no_key, rng=None)
    with pytest.raises(ValueError, match="holds a key"):
      mgr.restore(no_key)


def test_nnx_split_refuses_dropout_without_a_key():
  """Without a key the streams would be frozen (the same masks every step and device):
  refused, naming rng=; with one the masks follow it; in eval mode nothing is drawn."""
  model = Net(nnx.Rngs(0), rate=0.5)
  params, loss_fn = jaxdp.nnx_split(model, dropout_loss)
  ms = jaxdp.nnx_model_state(model)
  with pytest.raises(ValueError, match=r"\['drop'\].*init_state\(\.\.\., rng="):
    loss_fn(params, net_batch(), model_state=ms)
  _, (a, _) = loss_fn(params, net_batch(), rng=jax.random.key(0), model_state=ms)
  _, (b, _) = loss_fn(params, net_batch(), rng=jax.random.key(1), model_state=ms)
  assert not np.array_equal(a["mask"], b["mask"])
  mesh, config = mesh8(), jaxdp.DDPConfig()
  state = jaxdp.init_state(params, optax.adam(1e-2), mesh, config, model_state=ms)
  step = jaxdp.make_train_step(loss_fn, optax.adam(1e-2), mesh, config, has_aux=True)
  with pytest.raises(ValueError, match="rng="):  # at the first step, before it compiles
    step(state, net_batch())
  model.eval()
  _, eval_fn = jaxdp.nnx_split(model, lambda m, b: m(b["x"]).sum())
  assert np.isfinite(eval_fn(params, net_batch()))


def test_nnx_split_refuses_batchnorm_statistics_without_model_state():
  """A training-mode BatchNorm without model_state= would keep its statistics frozen:
  refused at the first step, naming what to pass; NNXOptimizer carries them."""
  model = Net(nnx.Rngs(0))
  params, loss_fn = jaxdp.nnx_split(model, net_loss)
  mesh, config = mesh8(), jaxdp.DDPConfig()
  state = jaxdp.init_state(params, optax.adam(1e-2), mesh, config)
  step = jaxdp.make_train_step(loss_fn, optax.adam(1e-2), mesh, config, has_aux=True)
  with pytest.raises(ValueError, match=r"\['bn'\]\['mean'\].*model_state=jaxdp.nnx_model_state"):
    step(state, net_batch())
  optimizer = jaxdp.NNXOptimizer(model, optax.adam(1e-2), mesh, config)
  jaxdp.nnx_train_step(net_loss, has_aux=True)(model, optimizer, net_batch())
  assert not np.allclose(optimizer.state.model_state["bn"]["mean"], 0)  # the statistics moved


# ----------------------------------------------------------------------------- Linen


class LinenNet(nn.Module):
  sync: bool = False

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(16, use_bias=False)(x)
    x = nn.BatchNorm(
      use_running_average=not train, momentum=0.5, axis_name="data" if self.sync else None
    )(x)
    x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
    return nn.Dense(3)(x)


def linen_loss(model):
  def loss_fn(params, batch, *, rng, model_state):
    logits, updates = model.apply(
      {"params": params, **model_state},
      batch["x"],
      train=True,
      mutable=["batch_stats"],
      rngs={"dropout": rng},
    )
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, updates

  return loss_fn


def test_linen_dropout_and_sync_batchnorm():
  """Linen's idiom (`mutable=["batch_stats"]`, `rngs={"dropout": rng}`) under `optim`: the
  running statistics of SyncBatchNorm equal a single-device run that draws, on the whole
  batch, the masks the 8 devices drew on their shards."""
  variables = LinenNet().init(jax.random.key(0), net_batch()["x"], train=False)
  mesh, config = mesh8(), jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
  tx = optax.sgd(0.0)  # params stay: the statistics of one forward are compared
  state = jaxdp.init_state(
    variables["params"],
    tx,
    mesh,
    config,
    rng=11,
    model_state={"batch_stats": variables["batch_stats"]},
  )
  step = jaxdp.make_train_step(linen_loss(LinenNet(sync=True)), tx, mesh, config)
  state, metrics = step(state, net_batch())
  _, ref = linen_loss(LinenNet())(
    variables["params"],
    net_batch(),
    rng=jax.random.key(0),
    model_state={"batch_stats": variables["batch_stats"]},
  )
  # BatchNorm precedes dropout: its statistics do not depend on the masks
  assert_trees_close(state.model_state, ref, 1e-6)
  assert np.isfinite(metrics["loss"])


# ----------------------------------------------------------------------------- optax


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_muon_on_explicit_and_auto_meshes(strategy, axis_type):
  """muon's Newton-Schulz iteration multiplies a leaf by its transpose; on a leaf sharded on
  its rows over an Explicit mesh that crashed at step 1 (ShardingTypeError)."""
  params = {"w": jax.random.normal(jax.random.key(0), (64, 64)) / 8, "b": jnp.zeros(64)}
  batch = {"x": jax.random.normal(jax.random.key(1), (16, 64)), "y": jnp.ones((16, 64))}

  def loss_fn(p, b):
    return jnp.mean((jnp.tanh(b["x"] @ p["w"] + p["b"]) - b["y"]) ** 2)

  tx = optax.contrib.muon(1e-2)
  ref, opt_state = params, tx.init(params)
  for _ in range(2):
    updates, opt_state = tx.update(jax.grad(loss_fn)(ref, batch), opt_state, ref)
    ref = optax.apply_updates(ref, updates)
  mesh, config = mesh8(axis_type), jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state = jaxdp.init_state(params, tx, mesh, config)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  for _ in range(2):
    state, _ = step(state, batch)
  # 2 steps of unit-scale orthogonalized updates (lr 1e-2): observed ~6e-8
  assert_trees_close(jaxdp.get_params(state), ref, 1e-6)


# ----------------------------------------------------------------------------- host-set hyperparameters


def mlp_problem():
  params, loss_fn = jaxdp.nnx_split(MLP(6, 16, 3, n_layers=2, rngs=nnx.Rngs(0)), mlp_loss)
  k1, k2 = jax.random.split(jax.random.key(1))
  return params, loss_fn, {"x": jax.random.normal(k1, (16, 6)), "y": jax.random.normal(k2, (16, 3))}


LRS = (1e-2, 5e-3, 2e-2)  # one learning rate per step, set on the host before it


def with_lr(opt_state, lr):
  """optax's documented way to change a hyperparameter between steps."""
  return optax.tree_utils.tree_set(opt_state, learning_rate=jnp.asarray(lr))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_learning_rate_set_on_the_host_between_steps(strategy):
  """`inject_hyperparams` + `tree_set` on `state.opt_state` before each step (a scalar on
  one device, or a Python float) equals the single-device loop setting the same values,
  with one compile."""
  tx = optax.inject_hyperparams(optax.adamw)(learning_rate=LRS[0])
  params, loss_fn, batch = mlp_problem()
  ref, opt_state = params, tx.init(params)
  for lr in LRS:
    opt_state = with_lr(opt_state, lr)
    updates, opt_state = tx.update(jax.grad(loss_fn)(ref, batch), opt_state, ref)
    ref = optax.apply_updates(ref, updates)

  mesh, config = mesh8(), jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state = jaxdp.init_state(params, tx, mesh, config)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  for k, lr in enumerate(LRS):
    lr = lr if k == 1 else jnp.asarray(lr)  # a Python float works too
    state = dataclasses.replace(
      state, opt_state=optax.tree_utils.tree_set(state.opt_state, learning_rate=lr)
    )
    state, _ = step(state, batch)
  assert float(jaxdp.get_opt_state(state).hyperparams["learning_rate"]) == np.float32(LRS[-1])
  # 3 Adam steps on f32: the bound of the other equality tests
  assert_trees_close(jaxdp.get_params(state), ref, ATOL)
  assert step._cache_size() == 1


def test_an_optimizer_array_set_off_the_mesh_is_refused_by_name():
  params = {"w": jnp.ones((16, 4))}
  tx, mesh = optax.adam(1e-2), mesh8()
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="no_shard")
  state = jaxdp.init_state(params, tx, mesh, config)
  step = jaxdp.make_train_step(lambda p, b: jnp.sum(p["w"] * b["x"]), tx, mesh, config)
  opt_state = optax.tree_utils.tree_set(state.opt_state, mu={"w": jnp.zeros((16, 4))})
  with pytest.raises(ValueError, match=r"state\.opt_state.*mu.*'w'.*jax\.device_put"):
    step(dataclasses.replace(state, opt_state=opt_state), {"x": jnp.ones((8, 16, 4))})


HABITS = {  # what optax's docs and nanoGPT/MaxText-style scripts wrap their optimizer in
  "MultiSteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
  "apply_if_finite": lambda: optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=3),
  "warmup_cosine": lambda: optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), weight_decay=0.1),
  ),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_optax_wrappers_and_a_host_numpy_batch_equal_single_device(strategy):
  """optax.MultiSteps (accumulation inside the optimizer), apply_if_finite, a warmup-cosine
  schedule behind a clip; the batch a host numpy array as a data loader yields it."""
  params, loss_fn, batch = mlp_problem()
  mesh, config = mesh8(), jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  for name, make in HABITS.items():
    tx = make()
    ref, opt_state = params, tx.init(params)
    for _ in range(4):
      updates, opt_state = tx.update(jax.grad(loss_fn)(ref, batch), opt_state, ref)
      ref = optax.apply_updates(ref, updates)
    state = jaxdp.init_state(params, tx, mesh, config)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
    for _ in range(4):
      state, _ = step(state, jax.tree.map(np.asarray, batch))
    # 4 Adam steps on f32: the bound of the other equality tests
    assert_trees_close(jaxdp.get_params(state), ref, ATOL)


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_an_update_that_needs_the_loss_is_refused_naming_the_host_route(strategy):
  """reduce_on_plateau's update takes value=loss, which the step does not pass."""
  params, loss_fn, batch = mlp_problem()
  tx = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau())
  mesh, config = mesh8(), jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  with pytest.raises(ValueError, match=r"'value'.*inject_hyperparams.*tree_set"):
    state = jaxdp.init_state(params, tx, mesh, config)
    jaxdp.make_train_step(loss_fn, tx, mesh, config)(state, batch)


def test_reduce_on_plateau_driven_from_the_host():
  """The host route the refusal names: reduce_on_plateau updated with each step's loss on
  the host, its scale set as the learning rate of an inject_hyperparams optimizer."""
  params, loss_fn, batch = mlp_problem()
  base = 0.0  # a learning rate that makes no progress: the loss plateaus
  tx = optax.inject_hyperparams(optax.sgd)(learning_rate=base)
  plateau = optax.contrib.reduce_on_plateau(factor=0.5, patience=1)
  plateau_state = plateau.init(None)
  mesh, config = mesh8(), jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
  state = jaxdp.init_state(params, tx, mesh, config)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  for _ in range(4):
    lr = base * plateau_state.scale
    state = dataclasses.replace(state, opt_state=with_lr(state.opt_state, lr))
    state, metrics = step(state, batch)
    _, plateau_state = plateau.update({}, plateau_state, value=metrics["loss"])
  assert float(plateau_state.scale) < 1.0  # it saw the plateau and cut the rate
  assert step._cache_size() == 1


def test_the_step_under_jax_jit_is_refused():
  """MaxText-style `jax.jit(train_step)` around the step: it is jitted already."""
  params, loss_fn, batch = mlp_problem()
  tx, mesh, config = optax.adam(1e-2), mesh8(), jaxdp.DDPConfig()
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  with pytest.raises(TypeError, match="jitted already.*call it from Python"):
    jax.jit(step)(jaxdp.init_state(params, tx, mesh, config), batch)


# ----------------------------------------------------------------------------- views


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_schedule_free_eval_params_and_hyperparams_from_the_unpadded_view(strategy):
  """30 rows pad to 32 under dp=8: optax helpers read the state through `get_opt_state`."""
  params = {"w": jax.random.normal(jax.random.key(0), (30,)), "b": jnp.zeros(())}
  batch = {"x": jax.random.normal(jax.random.key(1), (16, 30))}

  def loss_fn(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - 1.0) ** 2)

  tx = optax.inject_hyperparams(optax.contrib.schedule_free_adamw)(learning_rate=1e-2)
  ref, opt_state = params, tx.init(params)
  for _ in range(3):
    updates, opt_state = tx.update(jax.grad(loss_fn)(ref, batch), opt_state, ref)
    ref = optax.apply_updates(ref, updates)
  mesh, config = mesh8(), jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state = jaxdp.init_state(params, tx, mesh, config)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  for _ in range(3):
    state, _ = step(state, batch)
  view = jaxdp.get_opt_state(state)
  assert float(view.hyperparams["learning_rate"]) == pytest.approx(1e-2)
  assert view.inner_state.z["w"].shape == (30,)
  # 3 Adam-like steps on f32: the bound of the other equality tests
  assert_trees_close(
    optax.contrib.schedule_free_eval_params(view.inner_state, jaxdp.get_params(state)),
    optax.contrib.schedule_free_eval_params(opt_state.inner_state, ref),
    ATOL,
  )


# ----------------------------------------------------------------------------- eval


def eval_fns(model):
  """The eval-mode forward of `model` (running averages, no dropout): metrics and logits."""
  model.eval()

  def metrics(m, batch):
    logits = m(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}

  return jaxdp.nnx_split(model, metrics)[1], jaxdp.nnx_split(model, lambda m, b: m(b["x"]))[1]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_eval_step_equals_the_single_device_eval(strategy):
  state, _ = dropout_run(strategy, 2)
  mesh, config = mesh8(), jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  metrics_fn, logits_fn = eval_fns(Net(nnx.Rngs(0), rate=0.5))
  batch = net_batch(64)
  metrics = jaxdp.make_eval_step(metrics_fn, mesh, config)(state, batch)
  logits = jaxdp.make_eval_step(logits_fn, mesh, config, per_example=True)(state, batch)
  assert logits.shape == (64, 3) and logits.sharding.spec[0] == "data"

  model = jaxdp.nnx_merge(Net(nnx.Rngs(1), rate=0.5), state)
  model.eval()
  ref_logits = model(batch["x"])
  ref_loss = optax.softmax_cross_entropy_with_integer_labels(ref_logits, batch["y"]).mean()
  # one forward of f32 (the per-shard means averaged: a sum order apart)
  np.testing.assert_allclose(logits, ref_logits, atol=1e-6)
  np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-6)
  np.testing.assert_allclose(
    metrics["accuracy"], jnp.mean(jnp.argmax(ref_logits, -1) == batch["y"]), rtol=1e-6
  )
  assert not jax.tree.leaves((state.params, state.master))[0].is_deleted()  # not donated


def test_fsdp_eval_gathers_unit_by_unit():
  """Under FSDP the eval gathers each unit with its own all-gather (here l1, bn, l2: one
  each), never the whole model in one."""
  state, _ = dropout_run("optim_grads_params", 0)
  mesh = mesh8()
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
  hlo = (
    jaxdp.make_eval_step(eval_fns(Net(nnx.Rngs(0)))[0], mesh, config)
    .lower(state, net_batch())
    .as_text(dialect="hlo")
  )
  sizes = sorted(int(n) for n in re.findall(r"= \w+\[(\d+)\]\{0\} all-gather\(", hlo))
  # l1: 6x16 kernel -> 96; bn: scale+bias 2x16 -> 32; l2: 16x3 kernel + 3 bias, rows
  # padded to a multiple of 8 (16 + 8) x 3 -> 72 (bucket sizes, padded to dp)
  assert len(sizes) == 3, sizes
  total = sum(x.size for x in jax.tree.leaves(jaxdp.get_params(state)))
  assert max(sizes) < total


# ----------------------------------------------------------------------------- the NNX loop


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_nnx_loop_equals_nnx_optimizer_on_one_device(strategy):
  """The README's before/after: `nnx.Optimizer` + `@nnx.jit` on one device, and the same
  loop with `jaxdp.NNXOptimizer` + `jaxdp.nnx_train_step`, give the same model (params and
  SyncBatchNorm statistics) after 3 steps."""
  tx, batch = optax.adam(1e-2), net_batch()

  model = Net(nnx.Rngs(0))  # before: one device
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch):
    (loss, aux), grads = nnx.value_and_grad(net_loss, has_aux=True)(model, batch)
    optimizer.update(model, grads)
    return loss, aux

  for _ in range(3):
    ref_loss, ref_aux = train_step(model, optimizer, batch)

  dp_model = Net(nnx.Rngs(0), sync=True)  # after: the mesh
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  dp_optimizer = jaxdp.NNXOptimizer(dp_model, tx, mesh8(), config)
  dp_step = jaxdp.nnx_train_step(net_loss, has_aux=True)
  for _ in range(3):
    metrics = dp_step(dp_model, dp_optimizer, batch)

  np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)
  np.testing.assert_allclose(metrics["aux"]["accuracy"], ref_aux["accuracy"], rtol=1e-5)
  assert_trees_close(
    nnx.to_pure_dict(nnx.state(dp_model, nnx.Param)),
    nnx.to_pure_dict(nnx.state(model, nnx.Param)),
    ATOL,
  )
  assert_trees_close(jaxdp.nnx_model_state(dp_model), jaxdp.nnx_model_state(model), ATOL)
  assert int(dp_optimizer.step) == 3


def test_nnx_train_step_keeps_one_step_per_optimizer_object(monkeypatch):
  """A train step made once serves each optimizer with the step of that optimizer's own
  `tx`: the cache is keyed on the optimizer object, so a new optimizer that CPython puts at
  the address of one just freed never gets another's compiled step. Address reuse is
  simulated: `id` in the adapter's module returns one number for every object."""
  from jaxdp._src import nnx as nnx_adapter

  monkeypatch.setattr(nnx_adapter, "id", lambda obj: 0, raising=False)
  loss = lambda model, batch: jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
  batch = {"x": jnp.ones((16, 3)), "y": jnp.zeros((16, 1))}
  mesh, config = mesh8(), jaxdp.DDPConfig()
  train_step = jaxdp.nnx_train_step(loss)
  for lr in (0.1, 0.0, 0.1, 0.0):
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    optimizer = jaxdp.NNXOptimizer(model, optax.sgd(lr), mesh, config)
    train_step(model, optimizer, batch)
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    moved = not np.array_equal(after["kernel"], before["kernel"])
    assert moved == (lr > 0), lr
    del model, optimizer


# ----------------------------------------------------------------------------- eval after training


class AttentionNet(nnx.Module):
  """Causal self-attention, dropout, a head: the NNX transformer block a user evaluates."""

  def __init__(self, rngs):
    self.attn = nnx.MultiHeadAttention(
      num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=rngs
    )
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):  # (B, T, 8) -> (B, 3)
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))  # (B, 1, T, T)
    return self.head(self.drop(self.attn(x, mask=mask))).mean(axis=1)


def attention_loss(model, batch):
  logits = model(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_the_guides_eval_pattern_runs_eagerly_after_training(strategy):
  """docs/guide.md, "Evaluate after training": after `nnx_train_step`, `model.eval();
  model(x_test)` raised "Length of device assignment 1 is not equal to the size of the mesh
  8" (the params written back lived on `jax.make_mesh`'s Explicit axes, where the causal
  mask's broadcast fails outside `jax.set_mesh`). The model's variables come back on the
  same devices with Auto axes, and compute what the same params compute as plain
  one-device arrays (the same eager ops on the same values: equal); `get_params` gives the
  params on the mesh itself, for a jitted eval beside a batch placed there. DDP's views are
  copies of the state's own params, FSDP's are gathered; `tests/test_validation.py` checks
  every strategy's views on a small tree."""
  k1, k2 = jax.random.split(jax.random.key(5))
  batch = {"x": jax.random.normal(k1, (16, 4, 8)), "y": jax.random.randint(k2, (16,), 0, 3)}
  model = AttentionNet(nnx.Rngs(0))
  mesh = mesh8()
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  optimizer = jaxdp.NNXOptimizer(model, optax.adam(1e-2), mesh, config)
  train_step = jaxdp.nnx_train_step(attention_loss)
  for _ in range(2):
    metrics = train_step(model, optimizer, batch)

  model.eval()
  x_test = batch["x"][:3]
  logits = model(x_test)  # eager, outside any mesh context
  norm = optax.tree.norm(nnx.state(model, nnx.Param))
  assert float(metrics["loss"] + norm) > 0  # the metrics sit with the model's variables

  params = jaxdp.get_params(optimizer.state)
  on_one_device = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), params)
  reference = AttentionNet(nnx.Rngs(0))
  jaxdp.nnx_merge(reference, on_one_device)
  reference.eval()
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(reference(x_test)))
  flat = np.concatenate([np.ravel(x) for x in jax.tree.leaves(on_one_device)])
  np.testing.assert_allclose(float(norm), np.linalg.norm(flat), rtol=1e-6)
  for x in jax.tree.leaves(nnx.state(model, nnx.Param)):
    assert x.sharding.device_set == set(mesh.devices.flat)
    assert x.sharding.mesh.axis_types == (AxisType.Auto,)
  # A jitted eval loss of the params beside a batch placed on the user's mesh: the loss
  # summed over 16 examples in another order than the eager one (float32 rounding).
  for x in jax.tree.leaves(params):
    assert x.sharding.mesh == mesh
  _, eval_loss = jaxdp.nnx_split(reference, attention_loss)
  placed = jax.device_put(batch, NamedSharding(mesh, P("data")))
  np.testing.assert_allclose(
    jax.jit(eval_loss)(params, placed), attention_loss(reference, batch), rtol=rtol_sum(16)
  )
