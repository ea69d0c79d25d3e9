"""DDP (`no_shard`) against the plain single-device program, and its compiled collectives."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxdp
from models.gpt import GPT, GPTConfig, gpt_loss
from models.mlp import MLP, mlp_loss
from tests.tolerances import assert_trees_close, step_tolerances

STEPS = 5
LR = 3e-3


def mlp_problem(dtype=jnp.float32):
  params, loss_fn = jaxdp.nnx_split(
    MLP(6, 32, 3, n_layers=4, rngs=nnx.Rngs(0), param_dtype=dtype), mlp_loss
  )
  k1, k2 = jax.random.split(jax.random.key(1))
  batch = {"x": jax.random.normal(k1, (32, 6)), "y": jax.random.normal(k2, (32, 3))}
  return params, loss_fn, batch


def gpt_problem(**kw):
  config = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32, **kw)
  params, loss_fn = jaxdp.nnx_split(GPT(config, rngs=nnx.Rngs(0)), gpt_loss)
  tokens = jax.random.randint(jax.random.key(2), (16, 17), 0, 64)
  return params, loss_fn, {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def tolerances(problem, params):
  """(loss rtol, grad-norm rtol, AdamBound), tests/tolerances.py: the MLP's loss averages
  32 x 3 squared errors through 4 layers of 32; GPT's, 16 x 16 tokens, each a row of
  d_model + vocab products."""
  if problem is mlp_problem:
    return step_tolerances(params, 32 * 3, 4 * 32, LR, clip=0.5)
  return step_tolerances(params, 16 * 16, 32 + 64, LR, clip=0.5)


def adamw_clip():
  return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(LR, weight_decay=0.1))


def reference(params, loss_fn, batch, tx, steps=STEPS, bound=None):
  """Plain jax.grad + optax on the whole global batch, one device; each step's gradients
  go to `bound` (an AdamBound)."""

  @jax.jit  # one compile instead of op-by-op dispatch: the same arithmetic, fused by XLA
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  opt_state, losses = tx.init(params), []
  for _ in range(steps):
    params, opt_state, loss, grads = step(params, opt_state)
    if bound is not None:
      bound.add(grads)
    losses.append(float(loss))
  return params, losses


def train(params, loss_fn, batch, tx, config, mesh=None, steps=STEPS, **step_kw):
  mesh = mesh or jax.make_mesh((8,), ("data",))
  state = jaxdp.init_state(params, tx, mesh, config)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config, **step_kw)
  losses = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return state, step, losses


@pytest.mark.parametrize(
  "problem", [mlp_problem, pytest.param(gpt_problem, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("bucket_size", [None, 100])
def test_ddp_equals_single_device(problem, bucket_size):
  params, loss_fn, batch = problem()
  loss_rtol, _, bound = tolerances(problem, params)
  ref_params, ref_losses = reference(params, loss_fn, batch, adamw_clip(), bound=bound)
  config = jaxdp.DDPConfig(bucket_size=bucket_size)
  state, step, losses = train(params, loss_fn, batch, adamw_clip(), config)
  if bucket_size:
    assert state.layout.num_buckets >= 4
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
  # Per element, from the reference's gradients: tight where a gradient stands above its
  # rounding, up to 2 lr per step where it is rounding noise (tests/tolerances.py).
  bound.check(jaxdp.get_params(state), ref_params)
  assert step._cache_size() == 1, "the second step recompiled"


def test_averaging_in_collective_equals_prescaling():
  params, loss_fn, batch = mlp_problem()
  runs = [
    train(
      params,
      loss_fn,
      batch,
      adamw_clip(),
      jaxdp.DDPConfig(bucket_size=300, average_in_collective=avg),
    )[0]
    for avg in (False, True)
  ]
  # Dividing by dp = 8 before or after the sum is exact (a power of two) unless a partial
  # sum under- or overflows, so the two runs differ only where the collective itself sums
  # in another order: the same Adam bound as against one device.
  _, _, bound = tolerances(mlp_problem, params)
  reference(params, loss_fn, batch, adamw_clip(), bound=bound)
  bound.check(jaxdp.get_params(runs[0]), jaxdp.get_params(runs[1]))


def test_grad_norm_is_global_and_before_clipping():
  params, loss_fn, batch = mlp_problem()
  grads = jax.grad(loss_fn)(params, batch)
  mesh = jax.make_mesh((8,), ("data",))
  config = jaxdp.DDPConfig(bucket_size=300)
  state = jaxdp.init_state(params, adamw_clip(), mesh, config)
  _, metrics = jaxdp.make_train_step(loss_fn, adamw_clip(), mesh, config)(state, batch)
  _, norm_rtol, _ = tolerances(mlp_problem, params)  # a sum of squares, tests/tolerances.py
  np.testing.assert_allclose(
    float(metrics["grad_norm"]), float(optax.tree.norm(grads)), rtol=norm_rtol
  )
  assert float(metrics["grad_norm"]) > 0.5  # so clipping at 0.5 did act


def test_auto_axis_mesh_and_other_mesh_axes_work():
  params, loss_fn, batch = mlp_problem()
  _, _, bound = tolerances(mlp_problem, params)
  ref_params, _ = reference(params, loss_fn, batch, adamw_clip(), steps=2, bound=bound)
  for mesh in (
    jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,)),
    jax.make_mesh((4, 2), ("data", "model")),
  ):
    state, _, _ = train(params, loss_fn, batch, adamw_clip(), jaxdp.DDPConfig(), mesh=mesh, steps=2)
    bound.check(jaxdp.get_params(state), ref_params)


def test_bf16_params_fp32_reduction_returns_fp32_grads():
  params, loss_fn, batch = mlp_problem(jnp.bfloat16)
  tx = optax.adamw(3e-3)
  config = jaxdp.DDPConfig(bucket_size=300)
  state, _, _ = train(params, loss_fn, batch, tx, config)
  # fp32 main params: the optimizer's copy is fp32, the model's params stay bf16.
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.master))
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(jaxdp.get_params(state)))
  # Reference: fp32 master params, bf16 forward, fp32 grads.
  master = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  opt_state = tx.init(master)
  for _ in range(STEPS):
    grads = jax.grad(loss_fn)(jax.tree.map(lambda x: x.astype(jnp.bfloat16), master), batch)
    updates, opt_state = tx.update(
      jax.tree.map(lambda g: g.astype(jnp.float32), grads), opt_state, master
    )
    master = optax.apply_updates(master, updates)
  # bf16 forward/backward: each device's bf16 grads are summed in fp32 in another order
  # than the single-device bf16 backward, so grads differ by ~bf16 eps (2^-8) relative;
  # adam normalises them, so params differ by a few lr-sized steps at most.
  assert_trees_close(state.master, master, atol=3 * 3e-3 * STEPS, rtol=0)


def _collectives(hlo: str, kind: str) -> list[str]:
  return [line for line in hlo.splitlines() if re.search(rf"= \S+ {kind}(-start)?\(", line)]


def _bucket_all_reduces(hlo):
  """All-reduces of a non-scalar buffer (the loss and norms are scalars)."""
  return [
    line
    for line in _collectives(hlo, "all-reduce")
    if not re.search(r"= \S+\[\] ", line) and not re.search(r"= \(", line)
  ]


@pytest.mark.parametrize("overlap", [True, False])
def test_one_all_reduce_per_bucket(overlap):
  params, loss_fn, batch = gpt_problem()
  mesh = jax.make_mesh((8,), ("data",))
  config = jaxdp.DDPConfig(bucket_size=2000, overlap_grad_reduce=overlap)
  tx = adamw_clip()
  state = jaxdp.init_state(params, tx, mesh, config)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  hlo = step.lower(state, batch).compile().as_text()
  buckets = state.layout.buffers[0].buckets
  sizes = sorted(b.shard_size * 8 for b in buckets)
  found = sorted(
    int(re.search(r"f32\[(\d+)\]", line).group(1)) for line in _bucket_all_reduces(hlo)
  )
  assert found == sizes
  assert len(buckets) >= 4 if overlap else len(buckets) == 1
  assert not _collectives(hlo, "reduce-scatter") and not _collectives(hlo, "all-gather")


@pytest.mark.parametrize("fp32", [True, False])
def test_reduction_dtype(fp32):
  params, loss_fn, batch = gpt_problem(param_dtype=jnp.bfloat16)
  mesh = jax.make_mesh((8,), ("data",))
  config = jaxdp.DDPConfig(bucket_size=2000, grad_reduce_in_fp32=fp32)
  state = jaxdp.init_state(params, optax.sgd(0.1), mesh, config)
  step = jaxdp.make_train_step(loss_fn, optax.sgd(0.1), mesh, config)
  # XLA:CPU promotes bf16 all-reduces to f32 when compiling: read the HLO jaxdp emitted.
  hlo = step.lower(state, batch).as_text(dialect="hlo")
  dtypes = {re.search(r"= (\w+)\[\d+\]", line).group(1) for line in _bucket_all_reduces(hlo)}
  assert dtypes == ({"f32"} if fp32 else {"bf16"})


def test_init_state_copies_the_callers_params():
  params, loss_fn, batch = mlp_problem()
  mesh = jax.make_mesh((8,), ("data",))
  placed = jax.device_put(params, NamedSharding(mesh, P()))
  before = jax.tree.map(np.asarray, placed)
  train(placed, loss_fn, batch, optax.sgd(0.1), jaxdp.DDPConfig(), mesh=mesh, steps=2)
  for x, y in zip(jax.tree.leaves(placed), jax.tree.leaves(before)):
    assert not x.is_deleted()
    np.testing.assert_array_equal(np.asarray(x), y)


def test_frozen_params_are_not_trained_or_reduced():
  params, loss_fn, batch = mlp_problem()
  frozen = jax.tree_util.tree_map_with_path(lambda p, _: "0" in jax.tree_util.keystr(p), params)
  mesh = jax.make_mesh((8,), ("data",))
  tx = optax.adam(1e-2)
  config = jaxdp.DDPConfig()
  state = jaxdp.init_state(params, tx, mesh, config, frozen=frozen)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  hlo = step.lower(state, batch).compile().as_text()
  state, _ = step(state, batch)
  new = jaxdp.get_params(state)
  n_trainable = sum(
    x.size for x, f in zip(jax.tree.leaves(params), jax.tree.leaves(frozen)) if not f
  )
  (line,) = _bucket_all_reduces(hlo)
  assert int(re.search(r"f32\[(\d+)\]", line).group(1)) == -(-n_trainable // 128) * 128
  for x, y, f in zip(jax.tree.leaves(new), jax.tree.leaves(params), jax.tree.leaves(frozen)):
    assert np.array_equal(np.asarray(x), np.asarray(y)) == f


def test_bad_config_and_batch_errors():
  with pytest.raises(ValueError, match="unknown strategy"):
    jaxdp.DDPConfig(data_parallel_sharding_strategy="zero3")
  with pytest.raises(ValueError, match="bucket_size"):
    jaxdp.DDPConfig(bucket_size=-1)
  with pytest.raises(ValueError, match="num_distributed_optimizer_instances"):
    jaxdp.DDPConfig(num_distributed_optimizer_instances=2)
  params, loss_fn, batch = mlp_problem()
  mesh = jax.make_mesh((8,), ("data",))
  config = jaxdp.DDPConfig()
  state = jaxdp.init_state(params, optax.sgd(0.1), mesh, config)
  step = jaxdp.make_train_step(loss_fn, optax.sgd(0.1), mesh, config)
  with pytest.raises(ValueError, match=r"batch\['x'\]: batch dim 30 is not divisible by 8"):
    step.lower(state, {"x": batch["x"][:30], "y": batch["y"][:30]})
  with pytest.raises(ValueError, match="different leading dims"):
    step.lower(state, {"x": batch["x"], "y": batch["y"][:16]})
  with pytest.raises(ValueError, match="'data' axis"):
    jaxdp.init_state(params, optax.sgd(0.1), jax.make_mesh((8,), ("batch",)), config)
  with pytest.raises(ValueError, match="no trainable floating-point leaf"):
    jaxdp.init_state({"n": jnp.arange(3)}, optax.sgd(0.1), mesh, config)
