"""Models (MLP, GPT) and the NNX adapter, on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdp import nnx_merge, nnx_split
from models.gpt import GPT, GPTConfig, gpt_loss, lora_trainable, stack_blocks, unstack_blocks
from models.mlp import MLP, mlp_loss
from tests.tolerances import assert_grads_close, rtol_sum

TINY = dict(block_size=16, n_layer=2, n_head=2, d_model=32)


def tokens(key, shape):
  return jax.random.randint(jax.random.key(key), shape, 0, 256, dtype=jnp.int32)


def gpt_batch(key=0, B=4, T=16):
  x = tokens(key, (B, T + 1))
  return {"x": x[:, :-1], "y": x[:, 1:]}


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def test_mlp_shapes_and_loss():
  model = MLP(3, 8, 2, n_layers=3, rngs=nnx.Rngs(0))
  x = jnp.ones((5, 3))
  assert model(x).shape == (5, 2)
  params, loss_fn = nnx_split(model, mlp_loss)
  assert sorted(params["layers"]) == [0, 1, 2]
  assert params["layers"][1]["kernel"].shape == (8, 8)
  batch = {"x": x, "y": jnp.zeros((5, 2))}
  expected = jnp.mean(model(x) ** 2)
  np.testing.assert_allclose(loss_fn(params, batch), expected, rtol=1e-6)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_gpt_shapes(scan_layers):
  config = GPTConfig(**TINY, scan_layers=scan_layers)
  model = GPT(config, rngs=nnx.Rngs(0))
  batch = gpt_batch(B=3, T=10)  # shorter than block_size is fine
  logits = model(batch["x"])
  assert logits.shape == (3, 10, 256) and logits.dtype == jnp.float32
  params, _ = nnx_split(model, gpt_loss)
  d = config.d_model
  if scan_layers:
    assert params["blocks"]["attn"]["c_attn"]["kernel"].shape == (2, d, 3 * d)
  else:
    assert sorted(params["blocks"]) == [0, 1]
    assert params["blocks"][1]["mlp"]["c_fc"]["kernel"].shape == (d, 4 * d)
  assert params["wte"].shape == (256, d) and params["wpe"].shape == (16, d)
  assert "lm_head" not in params  # tied embedding: the output projection is wte.T
  n_params = sum(a.size for a in jax.tree.leaves(params))
  per_block = 12 * d * d + 13 * d  # qkv + proj + fc + fc_proj, biases, two LayerNorms
  assert n_params == 256 * d + 16 * d + 2 * per_block + 2 * d
  with pytest.raises(ValueError, match="block_size"):
    model(tokens(0, (1, 17)))


def test_gpt_config_validation():
  with pytest.raises(ValueError, match="divisible"):
    GPTConfig(d_model=30, n_head=4)
  with pytest.raises(ValueError, match="param_dtype"):
    GPTConfig(param_dtype=jnp.float16)
  with pytest.raises(ValueError, match="lora_rank"):
    GPTConfig(lora_rank=-1)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_gpt_is_causal(scan_layers):
  model = GPT(GPTConfig(**TINY, scan_layers=scan_layers), rngs=nnx.Rngs(0))
  x = tokens(1, (2, 16))
  t = 9
  x2 = x.at[:, t].set((x[:, t] + 1) % 256)
  a, b = model(x), model(x2)
  # Positions before t cannot see token t; positions from t on must.
  np.testing.assert_allclose(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
  assert np.all(np.abs(np.asarray(a[:, t:] - b[:, t:])).max(axis=-1) > 1e-4)


def test_gpt_unrolled_equals_scanned():
  unrolled = GPT(GPTConfig(**{**TINY, "n_layer": 3}), rngs=nnx.Rngs(0))
  scanned = GPT(GPTConfig(**{**TINY, "n_layer": 3}, scan_layers=True), rngs=nnx.Rngs(1))
  p_unrolled, loss_unrolled = nnx_split(unrolled, gpt_loss)
  p_scanned = stack_blocks(p_unrolled)
  nnx_merge(scanned, p_scanned)  # same weights, scanned layout
  _, loss_scanned = nnx_split(scanned, gpt_loss)
  assert_trees_equal(unstack_blocks(p_scanned), p_unrolled)  # converters are inverses

  batch = gpt_batch()
  l_u, g_u = jax.jit(jax.value_and_grad(loss_unrolled))(p_unrolled, batch)
  l_s, g_s = jax.jit(jax.value_and_grad(loss_scanned))(p_scanned, batch)
  # The same arithmetic, fused differently by XLA (a loop body vs 3 copies): float32
  # rounding only. The loss is a mean of 4 x 16 tokens' cross-entropies (each a row of
  # d_model + vocab products), each gradient a sum over those tokens (tests/tolerances.py).
  np.testing.assert_allclose(
    l_u, l_s, rtol=rtol_sum(4 * 16) + rtol_sum(TINY["d_model"] + GPTConfig(**TINY).vocab_size)
  )
  assert_grads_close(unstack_blocks(g_s), g_u, 4 * 16)


def test_gpt_same_seed_same_weights_in_both_layouts():
  p_unrolled = nnx.to_pure_dict(nnx.state(GPT(GPTConfig(**TINY), rngs=nnx.Rngs(3)), nnx.Param))
  scanned = GPT(GPTConfig(**TINY, scan_layers=True), rngs=nnx.Rngs(3))
  assert_trees_equal(stack_blocks(p_unrolled), nnx.to_pure_dict(nnx.state(scanned, nnx.Param)))


@pytest.mark.parametrize(
  "make",
  [
    lambda: MLP(3, 8, 2, n_layers=2, rngs=nnx.Rngs(0)),
    lambda: GPT(GPTConfig(**TINY, lora_rank=2), rngs=nnx.Rngs(0)),
    lambda: GPT(GPTConfig(**TINY, scan_layers=True, param_dtype=jnp.bfloat16), rngs=nnx.Rngs(0)),
  ],
)
def test_adapter_round_trip_is_bitwise(make):
  model = make()
  params, _ = nnx_split(model, lambda m, b: 0.0)
  kept = jax.tree.map(np.array, params)  # host copies
  # Merge new values, then the original ones back: the model ends where it started.
  nnx_merge(model, jax.tree.map(lambda a: a + 1, params))
  moved, _ = nnx_split(model, lambda m, b: 0.0)
  assert all(
    not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(kept))
  )
  nnx_merge(model, jax.tree.map(jnp.asarray, kept))
  again, _ = nnx_split(model, lambda m, b: 0.0)
  assert_trees_equal(again, kept)


def test_adapter_loss_fn_matches_model_and_rejects_bad_params():
  model = GPT(GPTConfig(**TINY), rngs=nnx.Rngs(0))
  params, loss_fn = nnx_split(model, gpt_loss)
  batch = gpt_batch()
  np.testing.assert_allclose(loss_fn(params, batch), gpt_loss(model, batch), rtol=1e-6)

  missing = {k: v for k, v in params.items() if k != "wpe"}
  with pytest.raises(ValueError, match="wpe"):
    loss_fn(missing, batch)
  with pytest.raises(ValueError, match="wpe"):
    nnx_merge(model, missing)
  wrong_shape = {**params, "wpe": params["wpe"][:8]}
  with pytest.raises(ValueError, match=r"\['wpe'\].*float32\[8, 32\]"):
    nnx_merge(model, wrong_shape)
  wrong_dtype = {**params, "wpe": params["wpe"].astype(jnp.bfloat16)}
  with pytest.raises(ValueError, match=r"\['wpe'\].*bfloat16"):
    nnx_merge(model, wrong_dtype)


def test_adapter_is_pure_and_refuses_to_drop_what_the_forward_writes():
  class Noisy(nnx.Module):  # a Param plus a BatchStat that the forward advances
    def __init__(self):
      self.w = nnx.Param(jnp.ones(3))
      self.count = nnx.BatchStat(jnp.array(2.0))

    def __call__(self, x):
      self.count[...] = self.count[...] + 1
      return x * self.w[...] * self.count[...]

  model = Noisy()
  params, loss_fn = nnx_split(model, lambda m, b: m(b).sum())
  assert list(params) == ["w"]
  # Without model_state the written count would be dropped: refused, naming the fix.
  with pytest.raises(ValueError, match=r"\['count'\].*model_state=jaxdp.nnx_model_state"):
    loss_fn(params, jnp.ones(3))
  ms = {"count": jnp.array(2.0)}
  for call in (loss_fn, loss_fn, jax.jit(loss_fn)):  # pure: the same each call, no tracer leaks
    loss, new = call(params, jnp.ones(3), model_state=ms)
    assert float(loss) == 9.0 and float(new["count"]) == 3.0
  assert float(model.count[...]) == 2.0


@pytest.mark.parametrize("scan_layers", [False, True])
def test_gpt_bf16_params(scan_layers):
  config = GPTConfig(**TINY, scan_layers=scan_layers, param_dtype="bfloat16")
  assert config.param_dtype == jnp.bfloat16
  model = GPT(config, rngs=nnx.Rngs(0))
  params, loss_fn = nnx_split(model, gpt_loss)
  assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  batch = gpt_batch()
  assert model(batch["x"]).dtype == jnp.float32  # logits in f32
  loss = jax.jit(loss_fn)(params, batch)
  assert loss.dtype == jnp.float32 and np.isfinite(loss)
  grads = jax.eval_shape(jax.grad(loss_fn), params, batch)  # dtypes without a compile
  assert {a.dtype for a in jax.tree.leaves(grads)} == {jnp.dtype(jnp.bfloat16)}
  # Same weights in f32 give nearly the same loss.
  f32 = GPT(GPTConfig(**TINY, scan_layers=scan_layers), rngs=nnx.Rngs(0))
  nnx_merge(f32, jax.tree.map(lambda a: a.astype(jnp.float32), params))
  np.testing.assert_allclose(loss, gpt_loss(f32, batch), rtol=2e-2)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_lora_at_init_equals_base(scan_layers):
  base = GPT(GPTConfig(**TINY, scan_layers=scan_layers), rngs=nnx.Rngs(0))
  lora = GPT(GPTConfig(**TINY, scan_layers=scan_layers, lora_rank=4), rngs=nnx.Rngs(1))
  p_base, _ = nnx_split(base, gpt_loss)
  p_lora, _ = nnx_split(lora, gpt_loss)
  mask = lora_trainable(p_lora)
  # Copy the base weights into the LoRA model; keep its fresh adapters.
  flat_base = dict(jax.tree_util.tree_leaves_with_path(p_base))
  merged = jax.tree_util.tree_map_with_path(
    lambda path, a: a if "lora" in jax.tree_util.keystr(path) else flat_base[path], p_lora
  )
  nnx_merge(lora, merged)

  # Adapters on (c_attn, attn.c_proj, c_fc, mlp.c_proj) x (lora_a, lora_b) per block.
  lora_paths = [jax.tree_util.keystr(p) for p, m in jax.tree_util.tree_leaves_with_path(mask) if m]
  assert all(p.endswith(("['lora_a']", "['lora_b']")) for p in lora_paths)
  assert len(lora_paths) == (8 if scan_layers else 8 * TINY["n_layer"])
  assert len(jax.tree.leaves(p_lora)) == len(jax.tree.leaves(p_base)) + len(lora_paths)

  x = gpt_batch()["x"]
  np.testing.assert_allclose(lora(x), base(x), atol=1e-6, rtol=0)


def test_lora_training_moves_only_the_adapters():
  model = GPT(GPTConfig(**TINY, lora_rank=4), rngs=nnx.Rngs(0))
  params, loss_fn = nnx_split(model, gpt_loss)
  mask = lora_trainable(params)
  tx = optax.multi_transform({True: optax.adam(1e-2), False: optax.set_to_zero()}, mask)

  @jax.jit
  def step(params, opt_state, batch):
    grads = jax.grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  new, opt_state = params, tx.init(params)
  for _ in range(2):  # two steps: lora_b moves on the first, lora_a from the second
    new, opt_state = step(new, opt_state, gpt_batch())
  for (path, a), b, trainable in zip(
    jax.tree_util.tree_leaves_with_path(new), jax.tree.leaves(params), jax.tree.leaves(mask)
  ):
    moved = not np.array_equal(a, b)
    assert moved == trainable, jax.tree_util.keystr(path)


def test_adamw_steps_lower_the_loss():
  model = GPT(GPTConfig(**TINY), rngs=nnx.Rngs(0))
  params, loss_fn = nnx_split(model, gpt_loss)
  tx = optax.adamw(3e-3)
  opt_state = tx.init(params)
  batch = gpt_batch(B=8)

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(10):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert losses[-1] < losses[0] - 0.5, losses
  nnx_merge(model, params)
  np.testing.assert_allclose(gpt_loss(model, batch), loss_fn(params, batch), rtol=1e-6)
