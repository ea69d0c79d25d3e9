"""A Llama-3-shaped decoder as a param dict and a loss function, in one readable file.

RMSNorm, grouped-query attention with rotary embeddings, SwiGLU MLP, an untied embedding
(read by indexing, `embed[ids]`) and output matrix (`(vocab, d)`, as Hugging Face's
`lm_head.weight`: the logits are `h @ out.T`). The params are float32 and the loss
casts each to bfloat16 where it is used (a layer's inside its scan iteration, the
embedding's rows after the lookup); the blocks' params are stacked on a leading layer axis
and run with `jax.lax.scan` (or, `scan_layers=False`, a list run by a Python loop), each
block under `jax.checkpoint`. Attention is plain `jnp` (no flash kernel): causal, softmax in float32.
`llama_loss(config, constrain=...)` applies a function to the residual stream at the
embedding output and at every block's input and output: where a GSPMD program pins the
activations' sharding (`jax.lax.with_sharding_constraint`, as MaxText's model does).

`LlamaConfig.llama3_8b()` is the 8.03B-param shape (32 layers, d 4096, 32 heads, 8 KV
heads, ffn 14336, vocab 128256).

Examples:
    >>> import jax, jax.numpy as jnp
    >>> config = LlamaConfig(vocab=64, d=32, n_layer=2, n_head=4, n_kv_head=2, ffn=64)
    >>> params = init_params(config, jax.random.key(0))
    >>> params["blocks"]["wq"].shape, params["blocks"]["wk"].shape
    ((2, 32, 32), (2, 32, 16))
    >>> ids = jnp.zeros((2, 8), jnp.int32)
    >>> loss = llama_loss(config)(params, {"x": ids, "y": ids})
    >>> bool(abs(loss - jnp.log(64)) < 0.2)  # near-uniform predictions at init
    True
    >>> seen = []  # where `constrain` runs: the embedding output, a block's input and output
    >>> _ = llama_loss(config, constrain=lambda h: seen.append(h.shape) or h)(params, {"x": ids, "y": ids})
    >>> seen  # (the scan traces its one block once)
    [(2, 8, 32), (2, 8, 32), (2, 8, 32)]
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  vocab: int = 128256
  d: int = 4096
  n_layer: int = 32
  n_head: int = 32
  n_kv_head: int = 8
  ffn: int = 14336
  rope_theta: float = 500000.0
  compute_dtype: type = jnp.bfloat16
  scan_layers: bool = True
  """True: the blocks' params stacked on a leading layer axis, run by `jax.lax.scan`;
  False: a list of per-layer dicts, run by a Python loop (unrolled)."""
  remat: bool = True
  """Each block under `jax.checkpoint` (its input saved, the rest recomputed)."""

  @classmethod
  def llama3_8b(cls, **kw) -> "LlamaConfig":
    return cls(**kw)

  @property
  def head_dim(self) -> int:
    return self.d // self.n_head


def param_shapes(config: LlamaConfig) -> dict:
  """Every param's shape: `embed`, `blocks` (stacked over layers, or a list of layers),
  `norm`, `out`."""
  c, hd = config, config.head_dim
  layer = {
    "attn_norm": (c.d,),
    "wq": (c.d, c.n_head * hd),
    "wk": (c.d, c.n_kv_head * hd),
    "wv": (c.d, c.n_kv_head * hd),
    "wo": (c.n_head * hd, c.d),
    "mlp_norm": (c.d,),
    "w_gate": (c.d, c.ffn),
    "w_up": (c.d, c.ffn),
    "w_down": (c.ffn, c.d),
  }
  stacked = {k: (c.n_layer, *s) for k, s in layer.items()}
  return {
    "embed": (c.vocab, c.d),
    "blocks": stacked if c.scan_layers else [dict(layer) for _ in range(c.n_layer)],
    "norm": (c.d,),
    "out": (c.vocab, c.d),
  }


def abstract_params(config: LlamaConfig, dtype=jnp.float32) -> dict:
  """Every param as a `jax.ShapeDtypeStruct` (what an AOT compile takes)."""
  return jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s, dtype),
    param_shapes(config),
    is_leaf=lambda s: isinstance(s, tuple),
  )


def init_params(config: LlamaConfig, key: jax.Array) -> dict:
  """float32 params: norms at one, matrices normal with std 0.02."""
  shapes = param_shapes(config)
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
  keys = jax.random.split(key, len(leaves))
  paths = [
    jax.tree_util.keystr(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(
      shapes, is_leaf=lambda s: isinstance(s, tuple)
    )[0]
  ]
  out = [
    jnp.ones(s, jnp.float32) if "norm" in p else 0.02 * jax.random.normal(k, s, jnp.float32)
    for p, s, k in zip(paths, leaves, keys)
  ]
  return jax.tree.unflatten(treedef, out)


def _rms_norm(x, w):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32**2, -1, keepdims=True) + 1e-5) * w).astype(x.dtype)


def _rope(x, theta):
  """Rotary embedding of `x` `(batch, seq, heads, head_dim)` (the halves rotated)."""
  seq, hd = x.shape[1], x.shape[-1]
  freq = theta ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
  angle = jnp.arange(seq, dtype=jnp.float32)[:, None] * freq[None]
  cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def _block(config: LlamaConfig, h, w):
  b, s, _ = h.shape
  hd, nh, nkv = config.head_dim, config.n_head, config.n_kv_head
  x = _rms_norm(h, w["attn_norm"])
  q = _rope((x @ w["wq"]).reshape(b, s, nh, hd), config.rope_theta)
  k = _rope((x @ w["wk"]).reshape(b, s, nkv, hd), config.rope_theta)
  v = (x @ w["wv"]).reshape(b, s, nkv, hd)
  k, v = jnp.repeat(k, nh // nkv, axis=2), jnp.repeat(v, nh // nkv, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(hd)
  causal = jnp.tril(jnp.ones((s, s), bool))
  probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), -1).astype(h.dtype)
  attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, nh * hd)
  h = h + attn @ w["wo"]
  x = _rms_norm(h, w["mlp_norm"])
  return h + (jax.nn.silu(x @ w["w_gate"]) * (x @ w["w_up"])) @ w["w_down"]


def llama_loss(config: LlamaConfig, constrain=None):
  """`loss(params, batch) -> mean cross-entropy` of next tokens `batch["y"]` given
  `batch["x"]` (int32 `(batch, seq)`), the params cast to `config.compute_dtype`.
  `constrain(h)`, if given, is applied to the residual stream `h` `(batch, seq, d)` at the
  embedding output and at every block's input and output (identity by default)."""

  cast = lambda tree: jax.tree.map(lambda x: x.astype(config.compute_dtype), tree)
  keep = constrain or (lambda h: h)

  def loss(params, batch):
    h = keep(cast(params["embed"][batch["x"]]))  # the rows read, then cast
    block = lambda h, w: keep(_block(config, keep(h), cast(w)))  # one layer at a time
    block = jax.checkpoint(block) if config.remat else block
    if config.scan_layers:
      h, _ = jax.lax.scan(lambda h, w: (block(h, w), None), h, params["blocks"])
    else:
      for w in params["blocks"]:
        h = block(h, w)
    logits = (_rms_norm(h, params["norm"]) @ cast(params["out"]).T).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], -1))

  return loss
