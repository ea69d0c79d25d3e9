"""Models written with other libraries, handed over as their users hold them.

An equinox transformer (`eqx.nn` layers, `eqx.partition(model, eqx.is_inexact_array)`:
an `eqx.Module` of params, callable, with None where a field is no array) trains under
every strategy as the single-device program does, and so does its scan-over-layers form
(`eqx.filter_vmap`-built layers under `lax.scan`) under `stacked=`. A Linen model with
Gemma's small leading dims (`(2, d, ffn)` gating, `(heads, d, head_dim)` einsums) holds
1/dp of its state under FSDP, byte for byte, and its state moves between strategies and
data-parallel sizes through checkpoints, views and the eval step.
"""

import functools
import math

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp._src import fsdp as fsdp_lib
from jaxdp.inspect import memory_ledger
from tests.tolerances import rtol_sum, step_tolerances

DP = 8
LR = 3e-3
STEPS = 3
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def adamw_clip():
  return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(LR, weight_decay=0.1))


def config_of(strategy, **kw):
  return jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, **kw)


def mesh_of(n=DP):
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def reference(params, loss_fn, batch, tx, bound):
  """Plain jax.grad + optax on the whole batch, one device, `STEPS` steps; feeds each
  step's gradients to `bound` (an AdamBound)."""

  @jax.jit
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads), grads

  opt_state, losses, norms = tx.init(params), [], []
  for _ in range(STEPS):
    params, opt_state, loss, norm, grads = step(params, opt_state)
    bound.add(grads)
    losses.append(float(loss))
    norms.append(float(norm))
  return params, losses, norms


def train(params, loss_fn, batch, tx, config, fsdp=None):
  mesh = mesh_of()
  state = jaxdp.init_state(params, tx, mesh, config, fsdp=fsdp)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config, fsdp=fsdp)
  losses, norms = [], []
  for _ in range(STEPS):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    norms.append(float(metrics["grad_norm"]))
  assert step._cache_size() == 1, "the second step recompiled"
  return state, losses, norms


def tokens(vocab, batch=16, length=8):
  x = jax.random.randint(jax.random.key(7), (batch, length + 1), 0, vocab)
  return {"x": x[:, :-1], "y": x[:, 1:]}


# ----------------------------------------------------------------------------- equinox

VOCAB, D, HEADS, LAYERS, T = 36, 12, 2, 2, 8


class Block(eqx.Module):
  """Pre-norm block of eqx.nn layers: LayerNorm, causal MultiheadAttention (no biases:
  None leaves), LayerNorm without bias (None), MLP (its activations: None leaves)."""

  ln1: eqx.nn.LayerNorm
  attn: eqx.nn.MultiheadAttention
  ln2: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D, use_bias=False)
    self.attn = eqx.nn.MultiheadAttention(HEADS, D, key=k1)
    self.mlp = eqx.nn.MLP(D, D, 4 * D, 1, activation=jax.nn.gelu, key=k2)

  def __call__(self, x):  # (T, D)
    h = jax.vmap(self.ln1)(x)
    x = x + self.attn(h, h, h, mask=jnp.tril(jnp.ones((T, T), bool)))
    return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


class LM(eqx.Module):
  embed: eqx.nn.Embedding
  blocks: Block | list
  ln_f: eqx.nn.LayerNorm
  head: eqx.nn.Linear
  scanned: bool = eqx.field(static=True)

  def __init__(self, key, scanned=False):
    k_embed, k_blocks, k_head = jax.random.split(key, 3)
    keys = jax.random.split(k_blocks, LAYERS)
    self.embed = eqx.nn.Embedding(VOCAB, D, key=k_embed)
    # scanned: one Block whose arrays have a leading layer axis (equinox's scan-over-layers)
    self.blocks = eqx.filter_vmap(Block)(keys) if scanned else [Block(k) for k in keys]
    self.ln_f = eqx.nn.LayerNorm(D)
    self.head = eqx.nn.Linear(D, VOCAB, use_bias=False, key=k_head)
    self.scanned = scanned

  def __call__(self, ids):  # (T,) -> (T, VOCAB)
    x = jax.vmap(self.embed)(ids)
    if self.scanned:
      layers, static = eqx.partition(self.blocks, eqx.is_array)
      x, _ = jax.lax.scan(lambda x, layer: (eqx.combine(layer, static)(x), None), x, layers)
    else:
      for block in self.blocks:
        x = block(x)
    return jax.vmap(self.head)(jax.vmap(self.ln_f)(x))


def equinox_problem(scanned):
  params, static = eqx.partition(LM(jax.random.key(0), scanned), eqx.is_inexact_array)

  def loss_fn(params, batch):
    logits = jax.vmap(eqx.combine(params, static))(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return params, loss_fn, tokens(VOCAB, length=T)


def assert_equals_single_device(params, loss_fn, batch, config, fsdp=None):
  """Every strategy gives the single-device program's losses, norms and params, to the
  rounding tests/tolerances.py argues: a mean over 16 x T tokens, each a row of D + VOCAB
  products."""
  loss_rtol, norm_rtol, bound = step_tolerances(params, 16 * T, D + VOCAB, LR, clip=0.5)
  ref, ref_losses, ref_norms = reference(params, loss_fn, batch, adamw_clip(), bound)
  state, losses, norms = train(params, loss_fn, batch, adamw_clip(), config, fsdp)
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
  np.testing.assert_allclose(norms, ref_norms, rtol=norm_rtol)
  got = jaxdp.get_params(state)
  assert jax.tree.structure(got) == jax.tree.structure(params)  # the eqx.Module, Nones kept
  bound.check(got, ref)
  # a wrong shard or a lost gradient moves an element by O(lr) per step: most elements are
  # held to a tenth of one step
  assert bound.tight_fraction(LR / 10) > 0.75
  return state


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_equinox_model_equals_single_device(strategy):
  params, loss_fn, batch = equinox_problem(scanned=False)
  assert callable(params) and isinstance(params, LM)  # a Module: never called as an init
  leaves = jax.tree.leaves(params, is_leaf=lambda x: x is None)
  assert sum(x is None for x in leaves) >= 8  # biases off, activations: empty subtrees
  assert_equals_single_device(params, loss_fn, batch, config_of(strategy))


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_equinox_scan_over_layers_under_stacked_equals_single_device(strategy):
  params, loss_fn, batch = equinox_problem(scanned=True)
  assert params.blocks.mlp.layers[0].weight.shape == (LAYERS, 4 * D, D)
  fsdp = jaxdp.FSDPConfig(stacked=[".blocks"]) if strategy == "optim_grads_params" else None
  stacked = {} if fsdp else {"stacked": [".blocks"]}
  state = assert_equals_single_device(params, loss_fn, batch, config_of(strategy, **stacked), fsdp)
  # the stacked leaves are sharded on a dim of a layer, never on the layers
  axes = dict(zip(state.layout.paths, state.layout.shard_axes))
  stacked_paths = [p for p in state.layout.paths if p.startswith(".blocks")]
  assert stacked_paths and all(axes[p] >= 1 for p in stacked_paths), axes


def test_a_params_pytree_is_never_called_and_an_ambiguous_one_is_refused():
  """A callable pytree (an eqx.Module) is params, also as a `frozen=` mask; a function, a
  lambda or a functools.partial is an init function; a callable pytree without arrays is
  refused with the fix."""
  params, _, _ = equinox_problem(scanned=False)
  mesh, config, tx = mesh_of(), config_of("optim_grads_params"), optax.sgd(0.1)
  frozen = eqx.tree_at(lambda m: m.embed.weight, jax.tree.map(lambda _: False, params), True)
  assert callable(frozen)  # an LM of bools: a mask, not a function
  state = jaxdp.init_state(params, tx, mesh, config, frozen=frozen)
  trainable = dict(zip(state.layout.paths, state.layout.trainable))
  assert not trainable[".embed.weight"] and trainable[".head.weight"]
  assert sum(trainable.values()) == len(trainable) - 1
  # an init function of any of these kinds gives the same state as the arrays
  make = lambda key: eqx.partition(LM(key), eqx.is_inexact_array)[0]
  from_arrays = jaxdp.init_state(params, tx, mesh, config)
  want = jax.tree.leaves(from_arrays.master)
  for init in (lambda: make(jax.random.key(0)), functools.partial(make, jax.random.key(0))):
    got = jax.tree.leaves(jaxdp.init_state(init, tx, mesh, config).master)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
  like = jaxdp.abstract_state(functools.partial(make, jax.random.key(0)), tx, mesh, config)
  assert jax.tree.structure(like) == jax.tree.structure(from_arrays)

  class Init(eqx.Module):  # an init object: callable, no array leaves
    seed: int = eqx.field(static=True)

    def __call__(self):
      return make(jax.random.key(self.seed))

  with pytest.raises(TypeError, match=r"Init, a callable pytree without array leaves.*lambda"):
    jaxdp.init_state(Init(0), tx, mesh, config)
  jaxdp.abstract_state(lambda: Init(0)(), tx, mesh, config)  # the fix the error names


# ----------------------------------------------------------------------------- Gemma's shapes

G_VOCAB, G_D, G_HEADS, G_KV, G_HEAD_DIM, G_FFN, G_LAYERS = 36, 12, 2, 1, 8, 24, 2


def rms_norm(x, scale):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + scale)


class GemmaBlock(nn.Module):
  """Gemma's param shapes (gm.nn): einsum weights with a small leading dim."""

  @nn.compact
  def __call__(self, x):  # (B, T, d)
    init = nn.initializers.normal(0.2)
    q = self.param("q_einsum", init, (G_HEADS, G_D, G_HEAD_DIM))
    kv = self.param("kv_einsum", init, (2, G_KV, G_D, G_HEAD_DIM))
    out = self.param("attn_vec_einsum", init, (G_HEADS, G_HEAD_DIM, G_D))
    gating = self.param("gating_einsum", init, (2, G_FFN, G_D))
    down = self.param("linear", init, (G_FFN, G_D))
    norm = lambda name, n=G_D: self.param(name, nn.initializers.zeros, (n,))
    h = rms_norm(x, norm("pre_attention_norm"))
    q_ = rms_norm(jnp.einsum("btd,ndh->btnh", h, q), norm("query_norm", G_HEAD_DIM))
    k_, v_ = jnp.einsum("btd,cndh->cbtnh", h, kv)
    k_ = jnp.repeat(rms_norm(k_, norm("key_norm", G_HEAD_DIM)), G_HEADS // G_KV, axis=2)
    v_ = jnp.repeat(v_, G_HEADS // G_KV, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q_, k_) / math.sqrt(G_HEAD_DIM)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    attn = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
    x = x + rms_norm(jnp.einsum("bnts,bsnh,nhd->btd", attn, v_, out), norm("post_attention_norm"))
    gate, up = jnp.einsum("btd,cfd->cbtf", rms_norm(x, norm("pre_ffw_norm")), gating)
    mlp = jnp.einsum("btf,fd->btd", nn.gelu(gate) * up, down)
    return x + rms_norm(mlp, norm("post_ffw_norm"))


class Gemma(nn.Module):
  @nn.compact
  def __call__(self, ids):
    embed = self.param("input_embedding", nn.initializers.normal(1.0), (G_VOCAB, G_D))
    x = embed[ids] * math.sqrt(G_D)
    for i in range(G_LAYERS):
      x = GemmaBlock(name=f"layer_{i}")(x)
    x = rms_norm(x, self.param("final_norm", nn.initializers.zeros, (G_D,)))
    return x @ embed.T  # tied output


def gemma_problem():
  batch = tokens(G_VOCAB)
  params = Gemma().init(jax.random.key(0), batch["x"])["params"]

  def loss_fn(params, batch):
    logits = Gemma().apply({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  return params, loss_fn, batch


def device0_bytes(tree):
  return sum(
    s.data.nbytes
    for x in jax.tree.leaves(tree)
    for s in x.addressable_shards
    if s.device == jax.devices()[0]
  )


def least_padded_elements(shape, dp):
  """A leaf's elements once one of its dims is padded to a multiple of dp, that dim chosen
  to pad least (computed here over every dim, not by jaxdp's rule)."""
  size = math.prod(shape)
  return min(size // n * (-(-n // dp) * dp) for n in shape) if shape else dp


def one_row(shape, dp):
  """The elements of one row of the leaf on the dim that pads least (a slice across it)."""
  best = min(range(len(shape)), key=lambda k: (-(-shape[k] // dp) * dp) / shape[k])
  return math.prod(shape) // shape[best]


@pytest.mark.parametrize("fused", [False, None])
def test_gemma_shapes_fsdp_holds_one_dpth_plus_a_row_per_leaf(fused):
  """Each leaf sharded on the dim that pads least: a device holds 1/dp of the fp32 master
  and of Adam's moments, plus at most one row per leaf on that dim (here: the embedding's
  36 rows and the 12-wide norms pad), and the ledger predicts it byte for byte. Padding
  `(2, d, ffn)` on its leading dim, as FSDP did, held about 3 x this."""
  params, _, _ = gemma_problem()
  shapes = [x.shape for x in jax.tree.leaves(params)]
  assert (2, G_FFN, G_D) in shapes and (G_HEADS, G_D, G_HEAD_DIM) in shapes
  tx, mesh = optax.adam(1e-3), mesh_of()
  config = config_of("optim_grads_params", fused_update=fused)
  state = jaxdp.init_state(params, tx, mesh, config)
  held = device0_bytes((state.master, state.opt_state))
  count = 4  # Adam's step count, int32, replicated
  whole = sum(math.prod(s) for s in shapes)
  padded = sum(least_padded_elements(s, DP) for s in shapes)
  rows = sum(one_row(s, DP) for s in shapes)
  assert padded > whole  # some leaf cannot avoid padding
  if fused is False:  # per leaf: exactly the least-padded leaves, 1/dp each
    assert held == 3 * 4 * padded // DP + count
  else:  # flat unit buckets: their ends padded to lcm(dp, 128) / dp elements per device
    buckets = sum(len(buf.buckets) for buf in state.layout.buffers)
    assert state.fused
    assert 3 * 4 * padded // DP + count <= held <= 3 * 4 * (padded // DP + 16 * buckets) + count
  assert held - count <= 3 * 4 * (whole / DP + rows)  # 1/dp, plus a row per leaf
  ledger = memory_ledger(params, tx, DP, config)
  assert ledger.master + ledger.opt_state == held


@pytest.mark.slow  # 5 compiles of a 2-layer model: ~40 s on 2 cores
def test_gemma_shapes_train_and_move_between_strategies(tmp_path):
  """FSDP on Gemma's shapes (gathers and reduce-scatters on non-leading dims) equals the
  single-device program; its checkpoint restores under `optim` on 4 devices and under
  `no_shard`, and an `optim` checkpoint into FSDP's `abstract_state`, bit for bit; the
  sharded views and the eval step read the same params."""
  params, loss_fn, batch = gemma_problem()
  tx = adamw_clip()
  fsdp_config = config_of("optim_grads_params")
  loss_rtol, norm_rtol, bound = step_tolerances(params, 16 * 8, G_D + G_VOCAB, LR, clip=0.5)
  ref, ref_losses, ref_norms = reference(params, loss_fn, batch, tx, bound)
  state, losses, norms = train(params, loss_fn, batch, tx, fsdp_config)
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
  np.testing.assert_allclose(norms, ref_norms, rtol=norm_rtol)
  bound.check(jaxdp.get_params(state), ref)
  assert bound.tight_fraction(LR / 10) > 0.75
  moved = [p for p, a in zip(state.layout.paths, state.layout.shard_axes) if a]
  assert "['layer_0']['gating_einsum']" in moved and "['layer_0']['q_einsum']" in moved

  whole, opt = jaxdp.get_params(state), jaxdp.get_opt_state(state)
  for x, y in zip(jax.tree.leaves(whole), jax.tree.leaves(jaxdp.get_params(state, sharded=True))):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(jax.tree.leaves(opt), jax.tree.leaves(jaxdp.get_opt_state(state, sharded=True))):
    np.testing.assert_array_equal(x, y)
  evaluate = jaxdp.make_eval_step(loss_fn, mesh_of(), fsdp_config)
  np.testing.assert_allclose(
    float(evaluate(state, batch)), float(loss_fn(whole, batch)), rtol=rtol_sum(16 * 8)
  )

  def assert_same(restored):
    for x, y in zip(jax.tree.leaves(jaxdp.get_params(restored)), jax.tree.leaves(whole)):
      np.testing.assert_array_equal(x, y)
    for x, y in zip(jax.tree.leaves(jaxdp.get_opt_state(restored)), jax.tree.leaves(opt)):
      np.testing.assert_array_equal(x, y)

  def save(state, name):
    mgr = jaxdp.CheckpointManager(tmp_path / name)
    mgr.save(STEPS, state)
    mgr.wait_until_finished()
    return mgr

  fsdp_ckpt = save(state, "fsdp")
  assert_same(fsdp_ckpt.restore(jaxdp.abstract_state(params, tx, mesh_of(), fsdp_config)))
  assert_same(fsdp_ckpt.restore(jaxdp.init_state(params, tx, mesh_of(2), config_of("no_shard"))))
  optim_state = fsdp_ckpt.restore(jaxdp.init_state(params, tx, mesh_of(4), config_of("optim")))
  assert_same(optim_state)
  back = save(optim_state, "optim")  # 4 devices' padding, another shard dim per leaf
  assert_same(back.restore(jaxdp.init_state(params, tx, mesh_of(), fsdp_config)))


def test_fsdp_shard_dims_are_zeros_but_row_blocks_layers_and_replicas():
  """FSDP's layout takes ZeRO's dim for each leaf (the one that pads least), except that a
  leaf gathered by row blocks keeps its leading dim, a stacked leaf picks a dim of a layer,
  and HFSDP counts replicas x dp; an integer leaf stays whole."""
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  params = {
    "wte": sds(50, 16),
    "gate": sds(2, 12, 8),
    "blocks": {"w": sds(4, 2, 16)},
    "count": jax.ShapeDtypeStruct((3,), jnp.int32),
  }
  fsdp = jaxdp.FSDPConfig(stacked=["blocks"])
  dims = lambda layout: dict(zip(layout.paths, layout.shard_axes))
  fsdp_config = config_of("optim_grads_params")
  got = dims(fsdp_lib.layout_for(params, {"data": 8}, fsdp_config, fsdp))
  zero = dims(jaxdp.layout.make_layout({k: params[k] for k in ("wte", "gate")}, dp=8))
  assert got["['wte']"] == zero["['wte']"] == 1  # 16 columns, not 50 -> 56 rows
  assert got["['gate']"] == zero["['gate']"] == 2  # 8, not 2 -> 8 or 12 -> 16
  assert got["['blocks']['w']"] == 2  # a layer's (2, 16): its 16
  chunked = jaxdp.FSDPConfig(stacked=["blocks"], chunks={"wte": 4})
  assert dims(fsdp_lib.layout_for(params, {"data": 8}, fsdp_config, chunked))["['wte']"] == 0
  hfsdp = config_of(
    "optim_grads_params", num_distributed_optimizer_instances=2, outer_dp_sharding_strategy="optim"
  )
  assert dims(fsdp_lib.layout_for(params, {"data": 4}, fsdp_config, fsdp))["['gate']"] == 1
  assert dims(fsdp_lib.layout_for(params, {"data": 4}, hfsdp, fsdp))["['gate']"] == 2


def test_gemma_shapes_under_hfsdp_equal_single_device():
  """HFSDP (master and Adam sharded over "replica" too) on a leaf it shards on its last dim:
  the outer reduce-scatter and all-gather split each device's block on that dim; 1/(R x D)
  of the master per device, and the single-device program's params."""
  rng = np.random.default_rng(3)
  f32 = lambda *shape: jnp.asarray(0.3 * rng.standard_normal(shape), jnp.float32)
  params = {"gating": f32(2, 12, 8), "linear": f32(8, 12)}
  batch = {"x": f32(16, 12), "y": f32(16, 12)}

  def loss_fn(p, b):
    gate, up = jnp.einsum("bd,cdf->cbf", b["x"], p["gating"])
    return jnp.mean(((nn.gelu(gate) * up) @ p["linear"] - b["y"]) ** 2)

  config = config_of(
    "optim_grads_params", num_distributed_optimizer_instances=2, outer_dp_sharding_strategy="optim"
  )
  mesh, tx = jax.make_mesh((2, 4), ("replica", "data")), adamw_clip()
  state = jaxdp.init_state(params, tx, mesh, config)
  assert dict(zip(state.layout.paths, state.layout.shard_axes))["['gating']"] == 2
  # fp32 master: 1/8 of each leaf, no padding (8 and 8 divide by 2 x 4)
  assert device0_bytes(state.master) == 4 * sum(x.size for x in jax.tree.leaves(params)) // 8
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  # a mean of 16 x 12 squared errors, each through 2 matmuls of 12 and 8 products
  loss_rtol, _, bound = step_tolerances(params, 16 * 12, 12 + 8, LR, clip=0.5)
  ref, ref_losses, _ = reference(params, loss_fn, batch, tx, bound)
  losses = []
  for _ in range(STEPS):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
  bound.check(jaxdp.get_params(state), ref)
