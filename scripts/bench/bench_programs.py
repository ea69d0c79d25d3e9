"""The models and train steps that scripts/bench/bench.py and scripts/bench/step_breakdown.py time.

Both scripts build the same programs from here, so that a step timed by the one is the step
profiled by the other. Import it after setting the CPU device count (it imports jax).

    SIZES         the models: GPTs (vocabulary 256) and MLPs (width, layers, global batch)
    JAXDP, GSPMD  the strategies, and the GSPMD programs with what each shards
    model         a size's params (on the host), loss_fn and global batch
    gspmd_step    the `jax.jit` step a JAX user writes, with what it shards P("data")
    jaxdp_step    jaxdp's step of a strategy (`+perleaf`: `DDPConfig(fused_update=False)`)
    run           one step, waited for
"""

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdp
from models.gpt import GPT, GPTConfig, gpt_loss

SIZES = {  # GPT sizes (vocabulary 256 bytes) and MLPs (width, layers, global batch)
  "tiny": dict(n_layer=2, n_head=2, d_model=32),  # 30k, --quick only
  "small": dict(n_layer=4, n_head=4, d_model=128),  # 0.83M
  "medium": dict(n_layer=4, n_head=8, d_model=256),  # 3.2M
  "mlp32x2": dict(width=32, layers=2, batch=16),  # 2k, --quick only
  "mlp256x4": dict(width=256, layers=4, batch=64),  # 0.26M
  "mlp512x8": dict(width=512, layers=8, batch=256),  # 2.1M
}

JAXDP = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""jaxdp's strategies (`jaxdp_step`)."""
GSPMD = {  # `gspmd_step`'s programs: what each shards (see there)
  "gspmd": "",
  "gspmd_zero1": "opt",
  "gspmd_fsdp": "params+opt",
  "gspmd_fsdp_gather": "params+opt+gather",
}


def is_mlp(size: str) -> bool:
  return "width" in SIZES[size]


def global_batch(size: str, gpt_batch: int) -> int:
  """Examples per step: the MLP's own, or `gpt_batch` sequences for a GPT."""
  return SIZES[size].get("batch", gpt_batch)


def model(size: str, block_size: int, gpt_batch: int, seed: int = 0):
  """(params on the host, loss_fn, global batch) of a size."""
  rng = np.random.default_rng(seed)
  if is_mlp(size):  # L dense layers of width W, tanh between them, MSE against random targets
    width, layers, batch = (SIZES[size][k] for k in ("width", "layers", "batch"))
    params = [
      {
        "w": rng.normal(0.0, width**-0.5, (width, width)).astype(np.float32),
        "b": np.zeros(width, np.float32),
      }
      for _ in range(layers)
    ]

    def loss_fn(params, batch):
      x = batch["x"]
      for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
          x = jax.numpy.tanh(x)
      return jax.numpy.mean((x - batch["y"]) ** 2)

    data = {k: rng.normal(size=(batch, width)).astype(np.float32) for k in ("x", "y")}
    return params, loss_fn, data
  config = GPTConfig(vocab_size=256, block_size=block_size, **SIZES[size])
  params, loss_fn = jaxdp.nnx_split(GPT(config, rngs=nnx.Rngs(seed)), gpt_loss)
  params = jax.tree.map(np.asarray, params)  # on the host: every variant places its own
  tokens = rng.integers(0, 256, (gpt_batch, block_size + 1), dtype=np.int32)
  return params, loss_fn, {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def data_spec(shape, dp):
  """P("data") on the first dim that dp divides (dim 0 where it can), else replicated."""
  for i, n in enumerate(shape):
    if n % dp == 0:
      return P(*[None] * i, "data")
  return P()


def gspmd_step(loss_fn, params, mesh, batch, tx, shard="", reduce=None):
  """A hand-written data-parallel step: `(carry, placed batch, jitted fn)`, one step being
  `carry = fn(*carry, batch)[:-1]` with the loss last.

  `shard`: what is sharded P("data") with `data_spec` ("" nothing, "opt" the optimizer
  state, "params+opt" both; "+gather": the loss sees the params constrained to replicated,
  so XLA gathers them all at the top of the step). `reduce` None: GSPMD inserts the
  gradient reduction; else the grads are computed in `shard_map` and reduced by
  `reduce(grads)` (params replicated). The phases are functions named for the profile
  (`forward_backward`, `optimizer_update`).
  """
  dp = mesh.shape["data"]
  replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

  def shardings(tree, sharded):
    return jax.tree.map(
      lambda x: NamedSharding(mesh, data_spec(x.shape, dp)) if sharded else replicated, tree
    )

  param_shardings = shardings(params, "params" in shard)
  opt_shardings = shardings(jax.eval_shape(tx.init, params), "opt" in shard)
  params = jax.device_put(params, param_shardings)
  opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)

  def loss(params, batch):
    if "gather" in shard:  # every weight gathered at the top of the step
      params = jax.lax.with_sharding_constraint(params, shardings(params, False))
    return loss_fn(params, batch)

  def local(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return jax.lax.pmean(loss, "data"), reduce(grads)

  def forward_backward(params, batch):
    if reduce is None:
      return jax.value_and_grad(loss)(params, batch)
    return jax.shard_map(
      local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False
    )(params, batch)

  def optimizer_update(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def step(params, opt_state, batch):
    loss, grads = forward_backward(params, batch)
    params, opt_state = optimizer_update(grads, opt_state, params)
    return params, opt_state, loss

  fn = jax.jit(
    step,
    in_shardings=(param_shardings, opt_shardings, data),
    out_shardings=(param_shardings, opt_shardings, replicated),
    donate_argnums=(0, 1),
  )
  return (params, opt_state), jax.device_put(batch, data), fn


def jaxdp_step(loss_fn, params, mesh, batch, tx, variant):
  """jaxdp's step of `variant` (a strategy, `+perleaf` for the per-leaf optimizer update,
  `+fused` for the flat one, `+after` for the sharded strategies' params gathered after the
  update, `DDPConfig(overlap_param_gather=False)`): `(carry, placed batch, step)` as
  `gspmd_step`'s."""
  strategy, _, extra = variant.partition("+")
  fused_update = {"perleaf": False, "fused": True}.get(extra)
  config = jaxdp.DDPConfig(
    data_parallel_sharding_strategy=strategy,
    fused_update=fused_update,
    overlap_param_gather=extra != "after",
  )
  state = jaxdp.init_state(params, tx, mesh, config)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  return (state,), jax.device_put(batch, NamedSharding(mesh, P("data"))), step


def run(compiled, carry, batch):
  """One step; the new carry once the devices are done."""
  out = compiled(*carry, batch)
  carry = (out[0],) if len(carry) == 1 else out[:-1]  # jaxdp: (state, metrics)
  jax.block_until_ready(carry)
  return carry
