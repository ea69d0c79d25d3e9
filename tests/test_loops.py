"""Real Flax training loops: aux metrics, dropout RNG, BatchNorm state, eval, any optax on any
mesh; each against the plain single-device program where one exists."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import jaxdp

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


def assert_trees_close(a, b, atol):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                               atol=atol, err_msg=jax.tree_util.keystr(path))


def reference(loss_fn, params, model_state, batch, tx, steps):
  """Plain jax.grad + optax on the whole batch, one device, model state threaded."""
  opt_state, history = tx.init(params), []
  for _ in range(steps):
    (loss, (aux, model_state)), grads = jax.value_and_grad(
        lambda p: loss_fn(p, batch, model_state=model_state), has_aux=True)(params)
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
  ref_params, ref_ms, ref_hist = reference(jaxdp.nnx_split(plain, net_loss)[1], params,
                                           jaxdp.nnx_model_state(plain), batch, tx, 3)

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


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads", "optim_grads_params"])
def test_aux_with_grad_accumulation(strategy):
  """With k micro-batches the aux is averaged over them too: the mean of equal-size
  micro-batch means is the mean over the whole batch."""
  def loss_fn(p, b):
    err = b["x"] @ p["w"] - b["y"]
    return jnp.mean(err ** 2), {"mae": jnp.mean(jnp.abs(err)), "count": jnp.sum(err > 0)}

  params = {"w": jnp.arange(15.0).reshape(5, 3) / 10}
  batch = {"x": jax.random.normal(jax.random.key(0), (32, 5)), "y": jnp.ones((32, 3))}
  mesh, config = mesh8(), jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state = jaxdp.init_state(params, optax.sgd(0.1), mesh, config)
  step = jaxdp.make_train_step(loss_fn, optax.sgd(0.1), mesh, config, has_aux=True,
                               grad_accum_steps=2)
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
  step = jaxdp.make_train_step(lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1), mesh,
                               config, has_aux=True)
  with pytest.raises(TypeError, match=r"\(loss, aux\) with has_aux=True"):
    step(state, batch)
  step = jaxdp.make_train_step(lambda p, b: (jnp.mean(b["x"] @ p["w"]), {}), optax.sgd(0.1),
                               mesh, config)
  with pytest.raises(TypeError, match="with has_aux=True return"):
    step(state, batch)
