"""The models and train steps that scripts/bench/bench.py and scripts/bench/step_breakdown.py time.

Both scripts build the same programs from here, so that a step timed by the one is the step
profiled by the other. Import it after setting the CPU device count (it imports jax).

    SIZES         the models: GPTs (vocabulary 256) and MLPs (width, layers, global batch)
    JAXDP         jaxdp's strategies (their GSPMD baselines: gspmd_baselines.PROGRAMS)
    model         a size's `gspmd_baselines.Problem` (params on the host)
    gspmd_step    one of gspmd_baselines.py's programs, its state placed
    psum_step     `jax.grad` in `shard_map`, the grads reduced by hand, params replicated
    jaxdp_step    jaxdp's step of a strategy (`+perleaf`: `DDPConfig(fused_update=False)`)
    run           one step, waited for
"""

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdp
from gspmd_baselines import PROGRAMS, Problem, jit_step, train_step
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


def is_mlp(size: str) -> bool:
  return "width" in SIZES[size]


def global_batch(size: str, gpt_batch: int) -> int:
  """Examples per step: the MLP's own, or `gpt_batch` sequences for a GPT."""
  return SIZES[size].get("batch", gpt_batch)


def mlp_loss(constrain=None):
  """The MLP's loss: dense layers, tanh between them, MSE against `batch["y"]`; `constrain`
  applied to the input and to every layer's output (each layer's input is the one before's
  output)."""
  keep = constrain or (lambda h: h)

  def loss_fn(params, batch):
    x = keep(batch["x"])
    for i, layer in enumerate(params):
      x = keep(x @ layer["w"] + layer["b"])
      if i < len(params) - 1:
        x = jax.numpy.tanh(x)
    return jax.numpy.mean((x - batch["y"]) ** 2)

  return loss_fn


def model(size: str, block_size: int, gpt_batch: int, seed: int = 0) -> Problem:
  """A size's params (on the host: every variant places its own), loss and global batch."""
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
    data = {k: rng.normal(size=(batch, width)).astype(np.float32) for k in ("x", "y")}
    return Problem(params, data, mlp_loss, width)
  config = GPTConfig(vocab_size=256, block_size=block_size, **SIZES[size])
  gpt = GPT(config, rngs=nnx.Rngs(seed))
  params, _ = jaxdp.nnx_split(gpt, gpt_loss)
  params = jax.tree.map(np.asarray, params)
  make_loss = lambda constrain=None: jaxdp.nnx_split(
    gpt, functools.partial(gpt_loss, constrain=constrain)
  )[1]
  tokens = rng.integers(0, 256, (gpt_batch, block_size + 1), dtype=np.int32)
  return Problem(params, {"x": tokens[:, :-1], "y": tokens[:, 1:]}, make_loss, config.d_model)


def gspmd_step(name: str, problem: Problem, mesh, tx):
  """A GSPMD program of gspmd_baselines.py: `(carry, placed batch, jitted fn)`, one step
  being `carry = fn(*carry, batch)[:-1]` with the loss last."""
  fn, place = jit_step(PROGRAMS[name], problem, tx, mesh)
  named = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  params = jax.device_put(problem.params, named(place.params))
  opt_state = jax.jit(tx.init, out_shardings=named(place.opt_state))(params)
  return (params, opt_state), jax.device_put(problem.batch, NamedSharding(mesh, P("data"))), fn


def psum_step(reduce, problem: Problem, mesh, tx):
  """A hand-written data-parallel step: the grads computed in `shard_map` and reduced by
  `reduce(grads)`, params and optimizer state replicated; returns what `gspmd_step` does."""
  replicated = NamedSharding(mesh, P())
  loss_fn = problem.make_loss()

  def local(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return jax.lax.pmean(loss, "data"), reduce(grads)

  def forward_backward(params, batch):
    return jax.shard_map(
      local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False
    )(params, batch)

  params = jax.device_put(problem.params, replicated)
  opt_state = jax.jit(tx.init, out_shardings=replicated)(params)
  data = NamedSharding(mesh, P("data"))
  fn = jax.jit(
    train_step(forward_backward, tx),
    in_shardings=(replicated, replicated, data),
    out_shardings=(replicated, replicated, replicated),
    donate_argnums=(0, 1),
  )
  return (params, opt_state), jax.device_put(problem.batch, data), fn


def jaxdp_step(problem: Problem, mesh, tx, variant):
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
  state = jaxdp.init_state(problem.params, tx, mesh, config)
  step = jaxdp.make_train_step(problem.make_loss(), tx, mesh, config)
  return (state,), jax.device_put(problem.batch, NamedSharding(mesh, P("data"))), step


def run(compiled, carry, batch):
  """One step; the new carry once the devices are done."""
  out = compiled(*carry, batch)
  carry = (out[0],) if len(carry) == 1 else out[:-1]  # jaxdp: (state, metrics)
  jax.block_until_ready(carry)
  return carry
