"""A small mixture-of-experts GPT in Flax NNX: `gpt.py`'s GPT with top-k routed MLP experts.

Every block's MLP is replaced by `n_experts` expert MLPs (d -> 4d -> GELU -> d, params
stacked on a leading expert dim) and a router, as in Switch/GShard: a token goes to its
`top_k` experts by router probability, and its output is their outputs weighted by the
top-k probabilities renormalised to sum to one.

Dispatch is *dropless and dense*: every expert runs on every token and the combine weights
of the experts a token was not routed to are zero (so those experts get no gradient from
it). That costs `n_experts / top_k` times the expert compute of a capacity-based dispatch,
but no token is ever dropped and the result does not depend on how the tokens are grouped
over devices, so one device and any expert-parallel run compute the same function. There is
no load-balancing loss for the same reason (its batch statistics depend on the grouping).

Expert parallelism (`expert_axis="expert", expert_parallel=ep`): the expert params are
sharded over that mesh axis on their leading dim (`place_experts`), and the model runs
inside a jaxdp step whose "expert" axis is manual. As in Megatron, each rank's model holds
its `n_experts / ep` local experts (the router still scores all `n_experts`), and tokens
are exchanged with one `all_to_all` before the experts and one after (GShard's dispatch
and combine). jaxdp reduces the expert params' grads over the expert-data-parallel group
only. With `expert_axis=None` (one device) there is no exchange. Build the loss of an
expert-parallel run from the per-rank model and train the params of the whole model:

    params, _ = jaxdp.nnx_split(MoEGPT(config, rngs=nnx.Rngs(0)), gpt_loss)
    ep_config = dataclasses.replace(config, expert_axis="expert", expert_parallel=2)
    _, loss_fn = jaxdp.nnx_split(MoEGPT(ep_config, rngs=nnx.Rngs(0)), gpt_loss)
    state = jaxdp.init_state(place_experts(params, mesh), tx, mesh, ddp_config)

Examples:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> config = MoEConfig(block_size=8, n_layer=1, n_head=2, d_model=16, n_experts=4)
    >>> model = MoEGPT(config, rngs=nnx.Rngs(0))
    >>> model.blocks[0].moe.w_fc.shape  # (n_experts, d_model, 4 * d_model)
    (4, 16, 64)
    >>> x = jnp.zeros((2, 8), jnp.int32)
    >>> bool(abs(gpt_loss(model, {"x": x, "y": x + 1}) - jnp.log(256)) < 0.1)
    True
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from models.gpt import CausalSelfAttention, GPTConfig, LayerNorm, gpt_loss, normal

EXPERT_NAMES = ("w_fc", "b_fc", "w_proj", "b_proj")  # param names of the expert leaves
__all__ = ["MoEConfig", "MoE", "MoEBlock", "MoEGPT", "gpt_loss", "is_expert", "place_experts"]


@dataclasses.dataclass(frozen=True)
class MoEConfig(GPTConfig):
  """`GPTConfig` plus the experts (unrolled layers, no LoRA)."""

  n_experts: int = 4
  """Expert MLPs per block."""
  top_k: int = 2
  """Experts each token is routed to."""
  expert_axis: str | None = None
  """Mesh axis the experts are sharded over (tokens are exchanged over it); None: all
    experts local."""
  expert_parallel: int = 1
  """Size of `expert_axis`: this model holds `n_experts / expert_parallel` experts."""

  def __post_init__(self):
    super().__post_init__()
    if not 1 <= self.top_k <= self.n_experts:
      raise ValueError(f"top_k={self.top_k}: must be in [1, n_experts={self.n_experts}]")
    if self.expert_parallel < 1 or self.n_experts % self.expert_parallel:
      raise ValueError(
        f"expert_parallel={self.expert_parallel} must divide n_experts={self.n_experts}"
      )
    if self.expert_parallel > 1 and self.expert_axis is None:
      raise ValueError(
        "expert_parallel > 1 needs expert_axis, the mesh axis to exchange tokens over"
      )
    if self.scan_layers or self.lora_rank:
      raise ValueError(
        "MoEConfig: scan_layers and lora_rank are not supported; leave them at their defaults"
      )


class MoE(nnx.Module):
  """Top-k routed expert MLPs; `x: [B, T, d] -> [B, T, d]`."""

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
    d, h, dtype = config.d_model, 4 * config.d_model, config.param_dtype
    e = config.n_experts // config.expert_parallel  # this rank's experts
    self.top_k, self.expert_axis = config.top_k, config.expert_axis
    self.router = nnx.Param(normal(rngs, (d, config.n_experts), 0.02, dtype))
    self.w_fc = nnx.Param(normal(rngs, (e, d, h), 0.02, dtype))
    self.b_fc = nnx.Param(jnp.zeros((e, h), dtype))
    self.w_proj = nnx.Param(normal(rngs, (e, h, d), 0.02 / math.sqrt(2 * config.n_layer), dtype))
    self.b_proj = nnx.Param(jnp.zeros((e, d), dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    B, T, C = x.shape
    tokens = x.reshape(B * T, C)  # [n, d]
    probs = jax.nn.softmax((tokens @ self.router[...]).astype(jnp.float32), axis=-1)
    n_experts = probs.shape[-1]
    top_p, top_e = jax.lax.top_k(probs, self.top_k)  # [n, k]
    weights = top_p / top_p.sum(-1, keepdims=True)
    combine = jnp.einsum("nke,nk->ne", jax.nn.one_hot(top_e, n_experts), weights)
    expert_in = jnp.broadcast_to(tokens, (n_experts, *tokens.shape))  # [e, n, d]
    if self.expert_axis:  # [e, n, d] -> [e / ep, ep * n, d]: my experts, everyone's tokens
      expert_in = jax.lax.all_to_all(expert_in, self.expert_axis, 0, 1, tiled=True)
    h = jax.nn.gelu(jnp.einsum("end,edh->enh", expert_in, self.w_fc[...]) + self.b_fc[...][:, None])
    out = jnp.einsum("enh,ehd->end", h, self.w_proj[...]) + self.b_proj[...][:, None]
    if self.expert_axis:  # back: every expert's output for my tokens, [e, n, d]
      out = jax.lax.all_to_all(out, self.expert_axis, 1, 0, tiled=True)
    y = jnp.einsum("ne,end->nd", combine.astype(out.dtype), out)
    return y.reshape(B, T, C)


class MoEBlock(nnx.Module):
  """Pre-LN block: `x + attn(ln_1(x))`, then `x + moe(ln_2(x))`."""

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
    self.ln_1 = LayerNorm(config.d_model, config)
    self.attn = CausalSelfAttention(config, rngs=rngs)
    self.ln_2 = LayerNorm(config.d_model, config)
    self.moe = MoE(config, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln_1(x))
    return x + self.moe(self.ln_2(x))


class MoEGPT(nnx.Module):
  """Token ids `int32[B, T]` -> logits `float32[B, T, vocab]`; tied embedding."""

  def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
    self.config = config
    dtype = config.param_dtype
    self.wte = nnx.Param(normal(rngs, (config.vocab_size, config.d_model), 0.02, dtype))
    self.wpe = nnx.Param(normal(rngs, (config.block_size, config.d_model), 0.02, dtype))
    self.blocks = nnx.List([MoEBlock(config, rngs=rngs) for _ in range(config.n_layer)])
    self.ln_f = LayerNorm(config.d_model, config)

  def __call__(self, idx: jax.Array, constrain=None) -> jax.Array:
    T = idx.shape[1]
    if T > self.config.block_size:
      raise ValueError(f"sequence length {T} > block_size {self.config.block_size}")
    keep = constrain or (lambda x: x)  # as GPT's: the residual stream's hook
    x = jax.nn.one_hot(idx, self.config.vocab_size, dtype=self.wte.dtype) @ self.wte[...]
    x = keep(x + self.wpe[...][:T])
    for block in self.blocks:
      x = keep(block(keep(x)))
    x = self.ln_f(x)
    return jnp.einsum("btd,vd->btv", x, self.wte[...], preferred_element_type=jnp.float32)


def is_expert(path: str, _=None) -> bool:
  """Whether the param at `path` (a `jax.tree_util.keystr`) is an expert leaf.

  Examples:
      >>> is_expert("['blocks'][0]['moe']['w_fc']"), is_expert("['blocks'][0]['moe']['router']")
      (True, False)
  """
  return any(path.endswith(f"[{name!r}]") for name in EXPERT_NAMES)


def place_experts(params, mesh, axis: str = "expert"):
  """Puts expert leaves on `mesh` sharded over `axis` on their expert dim, the rest
  replicated: the placement jaxdp reads expert parallelism from.

  Examples:
      >>> import jax
      >>> from flax import nnx
      >>> config = MoEConfig(block_size=8, n_layer=1, n_head=2, d_model=16, n_experts=4)
      >>> params = nnx.to_pure_dict(nnx.state(MoEGPT(config, rngs=nnx.Rngs(0)), nnx.Param))
      >>> mesh = jax.make_mesh((4, 2), ("data", "expert"))
      >>> placed = place_experts(params, mesh)
      >>> placed["blocks"][0]["moe"]["w_fc"].sharding.spec
      P('expert',)
  """

  def place(path, x):
    spec = P(axis) if is_expert(jax.tree_util.keystr(path)) else P()
    return jax.device_put(x, NamedSharding(mesh, spec))

  return jax.tree_util.tree_map_with_path(place, params)
