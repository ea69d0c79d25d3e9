"""Per-token loss (`make_train_step(per_token_loss=True)`) against the single-device program
on the whole global batch with the same masks, under every strategy, with grad
accumulation and with padding that differs between ranks and micro-batches."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdp
from models.mlp import MLP
from tests.tolerances import step_tolerances

STEPS = 4
LR = 3e-3
ROWS, TOKENS = 32, 8  # the global batch: 32 sequences of 8 tokens, 4 sequences a rank
N_LAYERS, WIDTH = 3, 16
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


def token_errors(model, batch):
  """(rows, tokens): each token's squared error over the 3 outputs."""
  return jnp.sum((model(batch["x"]) - batch["y"]) ** 2, axis=-1)


def sum_and_count(model, batch):
  """The per-token loss as `per_token_loss=True` takes it: (loss sum, token count)."""
  mask = batch["mask"]
  return jnp.sum(token_errors(model, batch) * mask), jnp.sum(mask)


def shard_mean(model, batch):
  """The mean over the real tokens of the batch it is given (the mean mode's loss); a
  shard with none gives 0."""
  loss_sum, count = sum_and_count(model, batch)
  return loss_sum / jnp.maximum(count, 1)


def padding_mask() -> np.ndarray:
  """(ROWS, TOKENS) with 1 for a real token: right-padded sequences of lengths drawn
  from 1..8, except rank 0's four rows (of dp=8), which hold one real token between them,
  in its first micro-batch of two, the second holding none at all."""
  lengths = np.random.default_rng(0).integers(1, TOKENS + 1, ROWS)
  lengths[:4] = [1, 0, 0, 0]
  return (np.arange(TOKENS)[None, :] < lengths[:, None]).astype(np.float32)


def problem():
  model = MLP(6, WIDTH, 3, n_layers=N_LAYERS, rngs=nnx.Rngs(0))
  params, loss_fn = jaxdp.nnx_split(model, sum_and_count)
  k1, k2 = jax.random.split(jax.random.key(1))
  batch = {
    "x": jax.random.normal(k1, (ROWS, TOKENS, 6)),
    "y": jax.random.normal(k2, (ROWS, TOKENS, 3)),
    "mask": jnp.asarray(padding_mask()),
  }
  return params, loss_fn, batch


def tolerances(params, batch):
  """(loss rtol, grad-norm rtol, AdamBound), as tests/tolerances.py argues them: the loss
  sums the real tokens' 3 squared errors (n terms of one sign), each through N_LAYERS
  layers of WIDTH; a gradient element sums as many terms. The step divides its reduced
  sums by the count once, in float32 (one rounding more, eps32 / 2, far inside these)."""
  n_terms = int(np.sum(np.asarray(batch["mask"]))) * 3
  return step_tolerances(params, n_terms, N_LAYERS * WIDTH, LR, clip=0.5)


def adamw_clip():
  return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(LR, weight_decay=0.1))


@functools.cache
def reference():
  """One device on the whole global batch: the sum over every real token over their count.
  Returns (params, losses, grad norms, each step's grads)."""
  params, loss_fn, batch = problem()
  tx = adamw_clip()

  def global_mean(params):
    loss_sum, count = loss_fn(params, batch)
    return loss_sum / count

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(global_mean)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  opt_state, losses, norms, history = tx.init(params), [], [], []
  for _ in range(STEPS):
    params, opt_state, loss, grads = step(params, opt_state)
    losses.append(float(loss))
    norms.append(float(optax.tree.norm(grads)))
    history.append(grads)
  return params, losses, norms, history


def train(loss_fn, batch, strategy, mesh=None, fsdp=None, **step_kw):
  """`STEPS` jaxdp steps from the problem's params: (final params, losses, grad norms)."""
  params = problem()[0]
  mesh = mesh or jax.make_mesh((8,), ("data",))
  config = jaxdp.DDPConfig(
    data_parallel_sharding_strategy=strategy,
    num_distributed_optimizer_instances=mesh.shape.get("replica", 1),
  )
  tx = adamw_clip()
  state = jaxdp.init_state(params, tx, mesh, config, fsdp=fsdp)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config, fsdp=fsdp, **step_kw)
  losses, norms = [], []
  for _ in range(STEPS):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    norms.append(float(metrics["grad_norm"]))
    if step_kw.get("per_token_loss"):  # the global count, exact: integers and halves
      assert float(metrics["tokens"]) == float(np.sum(np.asarray(batch["mask"])))
    else:
      assert "tokens" not in metrics
  assert step._cache_size() == 1, "the second step recompiled"
  return jaxdp.get_params(state), losses, norms


def check_against_reference(params, losses, norms):
  ref_params, ref_losses, ref_norms, history = reference()
  loss_rtol, norm_rtol, bound = tolerances(*problem()[::2])
  for grads in history:
    bound.add(grads)
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
  np.testing.assert_allclose(norms, ref_norms, rtol=norm_rtol)
  bound.check(params, ref_params)


@pytest.mark.parametrize("grad_accum_steps", [1, 2])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_per_token_equals_single_device(strategy, grad_accum_steps):
  """Rank 0 holds one real token, the others up to 32, and with two micro-batches one of
  rank 0's holds none: the step still weighs every real token the same, as one device on
  the whole batch does. Loss, grad norm (of the grads the optimizer gets, after the
  division) and params after the steps within the float32 bounds of tests/tolerances.py."""
  _, loss_fn, batch = problem()
  params, losses, norms = train(
    loss_fn, batch, strategy, grad_accum_steps=grad_accum_steps, per_token_loss=True
  )
  check_against_reference(params, losses, norms)


def test_per_token_fsdp_with_units_gathered_once():
  """FSDP's third micro-batch mode (`reshard_after_backward=False`): whole grads of both
  micro-batches summed locally, one reduce-scatter per unit, then the division."""
  _, loss_fn, batch = problem()
  params, losses, norms = train(
    loss_fn,
    batch,
    "optim_grads_params",
    fsdp=jaxdp.FSDPConfig(reshard_after_backward=False),
    grad_accum_steps=2,
    per_token_loss=True,
  )
  check_against_reference(params, losses, norms)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
def test_per_token_on_an_hsdp_mesh(strategy):
  """On a (replica=2, data=4) mesh the counts are summed over both axes, in the loss's
  all-reduce, and the grads are divided once, after their reduction across the replicas."""
  _, loss_fn, batch = problem()
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  params, losses, norms = train(
    loss_fn, batch, strategy, mesh=mesh, grad_accum_steps=2, per_token_loss=True
  )
  check_against_reference(params, losses, norms)


def test_mean_mode_differs_from_per_token_on_this_batch():
  """The default step on the same batch, each shard's mean loss weighing the same: rank 0's
  one token counts as much as another rank's 30. Its loss and params are far outside the
  bounds the per-token step meets, so the tests above can fail."""
  params, loss_fn, batch = problem()
  mean_fn = jaxdp.nnx_split(MLP(6, WIDTH, 3, n_layers=N_LAYERS, rngs=nnx.Rngs(0)), shard_mean)[1]
  got, losses, _ = train(mean_fn, batch, "no_shard")
  ref_params, ref_losses, _, history = reference()
  loss_rtol, _, bound = tolerances(params, batch)
  for grads in history:
    bound.add(grads)
  assert np.all(np.abs(np.asarray(losses) / np.asarray(ref_losses) - 1) > 100 * loss_rtol)
  with pytest.raises(AssertionError, match="Adam rounding bound"):
    bound.check(got, ref_params)


def test_aux_with_a_per_token_loss():
  """`has_aux` with a per-token loss: `((loss_sum, count), aux)`; the aux is averaged over
  micro-batches and ranks as without it (here each shard's count: their mean is the global
  count over dp * k), and the step stays the per-token one."""
  params, loss_fn, batch = problem()

  def with_aux(params, batch):
    loss_sum, count = loss_fn(params, batch)
    return (loss_sum, count), {"tokens": count}

  mesh = jax.make_mesh((8,), ("data",))
  config = jaxdp.DDPConfig()
  state = jaxdp.init_state(params, adamw_clip(), mesh, config)
  step = jaxdp.make_train_step(
    with_aux, adamw_clip(), mesh, config, grad_accum_steps=2, has_aux=True, per_token_loss=True
  )
  _, metrics = step(state, batch)
  total = float(np.sum(np.asarray(batch["mask"])))
  np.testing.assert_allclose(float(metrics["aux"]["tokens"]), total / 16, rtol=1e-6)
  np.testing.assert_allclose(float(metrics["loss"]), reference()[1][0], rtol=1e-5)


# ----------------------------------------------------------------------------- bad input


def _returning(out):
  """A per-token loss_fn that returns `out(loss_sum, count)`."""

  def loss_fn(params, batch):
    errors = jnp.sum(batch["x"] @ params["w"], axis=-1)
    loss_sum = jnp.sum(errors * batch["mask"])
    return out(loss_sum, jnp.sum(batch["mask"]))

  return loss_fn


BAD_RETURNS = {
  "a scalar": (lambda s, c: s / c, False, "it returned a scalar float32 array"),
  "a triple": (lambda s, c: (s, c, c), False, "it returned a tuple of length 3"),
  "a count per row": (
    lambda s, c: (s, jnp.ones(4)),
    False,
    r"its token_count is a float32\[4\] array, not a scalar",
  ),
  "a sum per row": (
    lambda s, c: (jnp.ones(4) * s, c),
    False,
    r"its loss_sum is a float32\[4\] array, not a scalar",
  ),
  "a complex count": (
    lambda s, c: (s, c + 0j),
    False,
    "its token_count is a scalar complex64 array, not a real number",
  ),
  "no aux": (lambda s, c: (s, c), True, "it returned a scalar float32 array"),
}


@pytest.mark.parametrize("case", list(BAD_RETURNS))
def test_a_loss_of_another_shape_is_refused_while_tracing(case):
  """A per-token `loss_fn` returning other than `(loss_sum, token_count)` (scalars) raises a
  TypeError naming what it returned and the return it needs, when the step is traced:
  before anything compiles."""
  out, has_aux, found = BAD_RETURNS[case]
  mesh = jax.make_mesh((8,), ("data",))
  config, tx = jaxdp.DDPConfig(), optax.sgd(0.1)
  state = jaxdp.init_state({"w": jnp.zeros((3, 2))}, tx, mesh, config)
  step = jaxdp.make_train_step(
    _returning(out), tx, mesh, config, has_aux=has_aux, per_token_loss=True
  )
  batch = {"x": jnp.ones((16, 4, 3)), "mask": jnp.ones((16, 4))}
  with pytest.raises(TypeError, match=found) as raised:
    step.trace(state, batch)
  message = str(raised.value)
  assert "(loss_sum, token_count)" in message and "jnp.sum(mask)" in message
  if has_aux:
    assert "((loss_sum, token_count), aux) with has_aux=True" in message


def test_per_token_loss_must_be_a_bool():
  mesh = jax.make_mesh((8,), ("data",))
  with pytest.raises(ValueError, match="per_token_loss='yes': must be True or False"):
    jaxdp.make_train_step(
      lambda p, b: (0.0, 1.0), optax.sgd(0.1), mesh, jaxdp.DDPConfig(), per_token_loss="yes"
    )


def test_nnx_train_step_takes_a_per_token_loss():
  """The NNX loop passes `per_token_loss` on: its first step's loss is the global one."""
  _, _, batch = problem()
  model = MLP(6, WIDTH, 3, n_layers=N_LAYERS, rngs=nnx.Rngs(0))
  mesh = jax.make_mesh((8,), ("data",))
  optimizer = jaxdp.NNXOptimizer(model, adamw_clip(), mesh, jaxdp.DDPConfig())
  train_step = jaxdp.nnx_train_step(sum_and_count, per_token_loss=True, update_model=False)
  metrics = train_step(model, optimizer, batch)
  np.testing.assert_allclose(float(metrics["loss"]), reference()[1][0], rtol=1e-5)
