"""A nanoGPT-style decoder-only transformer in Flax NNX, in one readable file.

Pre-LayerNorm blocks (attention, then a 4x GELU MLP), learned positional embeddings,
causal self-attention written with plain `jnp` (no flash kernel), no dropout, and a
**tied** embedding: the output projection is `wte.T`, as in nanoGPT and GPT-2.

Options:

* `param_dtype`: `float32` or `bfloat16` params. Matmuls run in the param dtype;
  LayerNorm statistics, attention scores/softmax and the logits are computed in float32.
* `scan_layers`: the blocks' params are stacked along a leading layer axis
  (`params['blocks']['attn']['c_attn']['kernel'].shape == (n_layer, d, 3 * d)`) and run
  with `jax.lax.scan`, one iteration per layer (under jaxdp's FSDP with
  `FSDPConfig(stacked=["blocks"])` each iteration gathers its layer).
  Unrolled, the blocks are an `nnx.List` and their params read
  `params['blocks'][3]['attn'][...]`. The same seed gives the same weights in both forms;
  `stack_blocks` / `unstack_blocks` convert params.
* `gpt_loss(model, batch, constrain=f)` / `model(idx, constrain=f)`: `f` is applied to the
  residual stream at the embedding output and at every block's input and output, where a
  GSPMD program pins the activations' sharding (`jax.lax.with_sharding_constraint`, as
  MaxText's model does); identity by default.
* `lora_rank > 0`: every projection (`c_attn`, `c_proj`, `c_fc`) gets a rank-r
  LoRA adapter `y += (x @ lora_a) @ lora_b * lora_alpha / lora_rank` with `lora_b`
  initialised to zero, so at init the model computes exactly the base model.
  `lora_trainable` marks the adapter leaves, to freeze the base.

Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> config = GPTConfig(block_size=16, n_layer=2, n_head=2, d_model=32)
    >>> model = GPT(config, rngs=nnx.Rngs(0))
    >>> x = jnp.zeros((4, 16), jnp.int32)
    >>> model(x).shape
    (4, 16, 256)
    >>> loss = gpt_loss(model, {"x": x, "y": x + 1})
    >>> bool(abs(loss - jnp.log(256)) < 0.1)  # near-uniform predictions at init
    True
    >>> seen = []
    >>> _ = gpt_loss(model, {"x": x, "y": x + 1}, constrain=lambda h: seen.append(h.shape) or h)
    >>> len(seen)  # the embedding output, then each of the 2 blocks' input and output
    5
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

LORA_NAMES = ("lora_a", "lora_b")  # param names of the LoRA adapter leaves


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """Hyperparameters of `GPT` (defaults: a small byte-level model)."""

  vocab_size: int = 256
  """Vocabulary size; 256 = one token per byte."""
  block_size: int = 128
  """Maximum sequence length (size of the positional embedding)."""
  n_layer: int = 4
  """Number of transformer blocks."""
  n_head: int = 4
  """Attention heads per block; must divide `d_model`."""
  d_model: int = 128
  """Width of the residual stream."""
  param_dtype: Any = jnp.float32
  """dtype of every param (`jnp.float32` or `jnp.bfloat16`); compute follows it."""
  scan_layers: bool = False
  """Stack the blocks' params on a leading layer axis and run them with `lax.scan`."""
  lora_rank: int = 0
  """Rank of the LoRA adapters on every projection; 0 means no adapters."""
  lora_alpha: float = 16.0
  """LoRA scale numerator: the adapter output is multiplied by `lora_alpha / lora_rank`."""
  remat: bool = False
  """Run each block under `jax.checkpoint`: the backward recomputes the block from its
    input instead of keeping its activations."""
  dropout: float = 0.0
  """Dropout rate on the embeddings (nanoGPT's `drop`); 0: no dropout and no RNG stream
    in the model."""

  def __post_init__(self):
    object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))
    if self.param_dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
      raise ValueError(f"param_dtype={self.param_dtype}; use jnp.float32 or jnp.bfloat16")
    if self.d_model % self.n_head:
      raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
    if min(self.vocab_size, self.block_size, self.n_layer, self.n_head) < 1:
      raise ValueError(f"sizes must be >= 1, got {self}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout={self.dropout}; use a rate in [0, 1)")
    if self.lora_rank < 0:
      raise ValueError(f"lora_rank={self.lora_rank}; use 0 (no LoRA) or a positive rank")


def normal(rngs: nnx.Rngs, shape, std: float, dtype) -> jax.Array:
  """Initialise a weight from N(0, std^2) (drawn in f32, then cast)."""
  return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
  """`x @ kernel + bias`, plus an optional rank-r LoRA adapter."""

  def __init__(self, din: int, dout: int, config: GPTConfig, *, rngs: nnx.Rngs, std: float = 0.02):
    dtype = config.param_dtype
    self.kernel = nnx.Param(normal(rngs, (din, dout), std, dtype))
    self.bias = nnx.Param(jnp.zeros((dout,), dtype))
    self.lora_rank = config.lora_rank
    if config.lora_rank:
      r = config.lora_rank
      self.lora_a = nnx.Param(normal(rngs, (din, r), 1.0 / math.sqrt(din), dtype))
      self.lora_b = nnx.Param(jnp.zeros((r, dout), dtype))  # zero: LoRA starts as a no-op
      self.lora_scale = config.lora_alpha / r

  def __call__(self, x: jax.Array) -> jax.Array:
    y = x @ self.kernel[...] + self.bias[...]
    if self.lora_rank:
      y = y + (x @ self.lora_a[...]) @ self.lora_b[...] * jnp.asarray(self.lora_scale, x.dtype)
    return y


class LayerNorm(nnx.Module):
  """LayerNorm with learned scale and bias; statistics in float32."""

  def __init__(self, d: int, config: GPTConfig):
    self.scale = nnx.Param(jnp.ones((d,), config.param_dtype))
    self.bias = nnx.Param(jnp.zeros((d,), config.param_dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5)
    return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(
      x.dtype
    )


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention: position t attends to positions <= t."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    d = config.d_model
    self.n_head = config.n_head
    self.c_attn = Linear(d, 3 * d, config, rngs=rngs)
    self.c_proj = Linear(d, d, config, rngs=rngs, std=0.02 / math.sqrt(2 * config.n_layer))

  def __call__(self, x: jax.Array) -> jax.Array:
    B, T, C = x.shape
    hd = C // self.n_head
    q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
    q, k, v = (a.reshape(B, T, self.n_head, hd) for a in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    scores = jnp.where(causal, scores, -jnp.inf)  # the diagonal is never masked
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    y = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, T, C)
    return self.c_proj(y)


class MLP(nnx.Module):
  """Position-wise feed-forward: d -> 4d -> GELU -> d."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    d = config.d_model
    self.c_fc = Linear(d, 4 * d, config, rngs=rngs)
    self.c_proj = Linear(4 * d, d, config, rngs=rngs, std=0.02 / math.sqrt(2 * config.n_layer))

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.c_proj(jax.nn.gelu(self.c_fc(x)))


class Block(nnx.Module):
  """One pre-LN transformer block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.ln_1 = LayerNorm(config.d_model, config)
    self.attn = CausalSelfAttention(config, rngs=rngs)
    self.ln_2 = LayerNorm(config.d_model, config)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class GPT(nnx.Module):
  """Decoder-only transformer: token ids `int32[B, T]` -> logits `float32[B, T, vocab]`."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.config = config
    dtype = config.param_dtype
    self.wte = nnx.Param(normal(rngs, (config.vocab_size, config.d_model), 0.02, dtype))
    self.wpe = nnx.Param(normal(rngs, (config.block_size, config.d_model), 0.02, dtype))
    blocks = [Block(config, rngs=rngs) for _ in range(config.n_layer)]
    if config.scan_layers:
      # One Block whose every param carries a leading layer axis of size n_layer.
      graphdef, *_ = nnx.split(blocks[0])
      layers = [nnx.state(b) for b in blocks]
      self.blocks = nnx.merge(graphdef, jax.tree.map(lambda *a: jnp.stack(a), *layers))
    else:
      self.blocks = nnx.List(blocks)
    self.ln_f = LayerNorm(config.d_model, config)
    if config.dropout:  # last: the params draw the same values with and without it
      self.drop = nnx.Dropout(config.dropout, rngs=rngs)

  def __call__(self, idx: jax.Array, constrain=None) -> jax.Array:
    B, T = idx.shape
    if T > self.config.block_size:
      raise ValueError(f"sequence length {T} > block_size {self.config.block_size}")
    keep = constrain or (lambda x: x)  # the residual stream's hook (module docstring)
    # Token embedding as a one-hot matmul (cheap at vocab 256): unlike a gather it needs
    # no out_sharding when the batch is explicitly sharded over a mesh.
    tok = jax.nn.one_hot(idx, self.config.vocab_size, dtype=self.wte.dtype) @ self.wte[...]
    x = tok + self.wpe[...][:T]
    if self.config.dropout:
      x = self.drop(x)
    x = keep(x)
    if self.config.scan_layers:
      graphdef, stacked = nnx.split(self.blocks)

      # One scan iteration = one block = one FSDP unit: under jaxdp FSDP with
      # FSDPConfig(stacked=["blocks"]) jaxdp runs this scan over the layer shards and
      # gathers each layer in its iteration; the model needs no marker for it.
      def layer(x, layer_state):
        return keep(nnx.merge(graphdef, layer_state)(keep(x))), None

      if self.config.remat:
        layer = jax.checkpoint(layer)
      x, _ = jax.lax.scan(layer, x, stacked)
    else:
      for block in self.blocks:
        if self.config.remat:
          graphdef, state = nnx.split(block)
          x = jax.checkpoint(lambda s, x: keep(nnx.merge(graphdef, s)(keep(x))))(state, x)
        else:
          x = keep(block(keep(x)))
    x = self.ln_f(x)
    # Tied output projection; logits in float32 whatever the param dtype.
    return jnp.einsum("btd,vd->btv", x, self.wte[...], preferred_element_type=jnp.float32)


def gpt_loss(model: GPT, batch: dict, constrain=None) -> jax.Array:
  """Mean next-token cross entropy; `batch = {"x": int32[B, T], "y": int32[B, T]}`;
  `constrain`: the residual stream's hook, passed to `model` (the module docstring)."""
  logits = model(batch["x"], constrain=constrain)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def lora_trainable(params) -> Any:
  """Return a bool pytree like `params`: True for LoRA adapter leaves, False for the base.

  Use it to freeze the base model, e.g. `optax.masked(optax.adamw(1e-3),
  lora_trainable(params))` or as jaxdp's frozen-param mask (negated).

  Examples:
      >>> from flax import nnx
      >>> config = GPTConfig(block_size=8, n_layer=1, n_head=1, d_model=8, lora_rank=2)
      >>> model = GPT(config, rngs=nnx.Rngs(0))
      >>> params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
      >>> mask = lora_trainable(params)
      >>> mask["blocks"][0]["attn"]["c_attn"]["lora_b"], mask["wte"]
      (True, False)
  """

  def is_lora(path, _):
    return any(getattr(k, "key", None) in LORA_NAMES for k in path)

  return jax.tree_util.tree_map_with_path(is_lora, params)


def stack_blocks(params: dict) -> dict:
  """Convert unrolled params (`['blocks'][i][...]`) to the `scan_layers` layout."""
  blocks = params["blocks"]
  layers = [blocks[i] for i in range(len(blocks))]
  return {**params, "blocks": jax.tree.map(lambda *a: jnp.stack(a), *layers)}


def unstack_blocks(params: dict) -> dict:
  """Convert `scan_layers` params (leading layer axis) to the unrolled layout."""
  stacked = params["blocks"]
  n_layer = jax.tree.leaves(stacked)[0].shape[0]
  layers = {i: jax.tree.map(lambda a: a[i], stacked) for i in range(n_layer)}
  return {**params, "blocks": layers}
