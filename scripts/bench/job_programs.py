"""Peak memory of every program of a sharded job, compiled for 8 x H100 without a GPU.

    python scripts/bench/job_programs.py --model llama --layers 2 32
    python scripts/bench/job_programs.py --model gpt --layers 8

For each strategy (`optim`: ZeRO-1, `fsdp`: `optim_grads_params`), the programs a job runs:
`init` (`init_state` from the model's init function), `step` (one train step), `params`
(`get_params(state, sharded=True)`) and `eval` (`make_eval_step` of the loss), each one's
peak bytes per device (`memory_analysis()`), and its ratio to the step's. A checkpoint save
runs no program (it writes the state's own arrays), nor does a restore onto the same
layout (it reads each leaf into `like`'s buffers' places).

Models: `models/llama.py` (Llama-3-shaped: d 4096, 32 heads, 8 KV heads, ffn 14336, vocab
128256, f32 params cast to bf16 in the loss, scanned blocks under remat; 2 sequences of
2048 tokens per GPU) and `models/gpt.py` (d 768, 12 heads, vocab 50304, seq 128, one
sequence per GPU, blocks under remat). The last lines fit `peak = a * params + b` of FSDP's
step over the layer counts given and print the largest model that trains on N x 80 GB.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jaxdp  # before JAX: it imports JAX without the CUDA plugin's driver-probe lines
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from jaxdp import inspect as jinspect
from jaxdp._src import train
from models.gpt import GPT, GPTConfig, gpt_loss
from models.llama import LlamaConfig, abstract_params, init_params, llama_loss

GiB = 2**30
DP = 8
PROGRAMS = ("init", "step", "params", "eval")


def llama_problem(n_layer):
  config = LlamaConfig.llama3_8b(n_layer=n_layer)
  params = abstract_params(config)
  tokens = jax.ShapeDtypeStruct((2 * DP, 2048), jnp.int32)
  init_fn = lambda: init_params(config, jax.random.key(0))
  return params, init_fn, llama_loss(config), {"x": tokens, "y": tokens}, ["blocks"], {}


def gpt_problem(n_layer):
  config = GPTConfig(
    vocab_size=50304, block_size=128, n_layer=n_layer, n_head=12, d_model=768, remat=True
  )
  model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
  params, loss_fn = jaxdp.nnx_split(model, gpt_loss)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  init_fn = lambda: jaxdp.nnx_split(GPT(config, rngs=nnx.Rngs(0)), gpt_loss)[0]
  tokens = jax.ShapeDtypeStruct((DP, 128), jnp.int32)
  return params, init_fn, loss_fn, {"x": tokens, "y": tokens}, [], {"wte": 16}


def compile_programs(model, n_layer, strategy):
  """`{program: peak bytes per device}` of one job, and its param count."""
  make = llama_problem if model == "llama" else gpt_problem
  params, init_fn, loss_fn, batch, stacked, chunks = make(n_layer)
  mesh = jinspect.gpu_mesh((DP,), ("data",))
  tx = optax.adamw(1e-4)
  fsdp = None
  if strategy == "fsdp":
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
    fsdp = jaxdp.FSDPConfig(stacked=stacked, chunks=chunks)
  else:
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, stacked=stacked)
  extra = {"fsdp": fsdp} if fsdp else {}
  abstract = jax.eval_shape(lambda: train.init_state(init_fn, tx, mesh, config, **extra))
  specs = train.state_specs(abstract)
  state = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
    abstract,
    specs,
  )
  out = {}

  def peak(program: str, compile_it) -> None:
    """Compiles one program, says how long it took, keeps its peak bytes per device."""
    start = time.time()
    out[program] = jinspect.memory_stats(compile_it()).peak_bytes
    print(
      f"    {program}: {out[program] / GiB:.2f} GiB, {time.time() - start:.0f} s", file=sys.stderr
    )

  peak(
    "init",
    lambda: jinspect.compile_for_gpu(lambda: train.init_state(init_fn, tx, mesh, config, **extra)),
  )
  peak(
    "step", lambda: jinspect.compile_train_step(loss_fn, tx, mesh, config, params, batch, **extra)
  )
  views = jax.jit(train.whole_params, static_argnums=(1, 2))
  peak("params", lambda: jinspect.compile_for_gpu(views, state, mesh, True))
  eval_step = jaxdp.make_eval_step(loss_fn, mesh, config, **extra)
  placed = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, jax.P("data"))),
    batch,
  )
  peak("eval", lambda: jinspect.compile_for_gpu(eval_step, state, placed))
  count = sum(x.size for x in jax.tree.leaves(params))
  shard = lambda x: (
    x.size
    * x.dtype.itemsize
    // len(set(map(str, x.sharding.devices_indices_map(x.shape).values())))
  )
  out["state"] = sum(shard(x) for x in jax.tree.leaves(state))
  return out, count


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=["llama", "gpt"], default="llama")
  parser.add_argument("--layers", type=int, nargs="+", default=[2, 32])
  parser.add_argument("--strategies", nargs="+", default=["optim", "fsdp"])
  args = parser.parse_args()
  rows, fsdp_steps = [], []
  jobs = [(n, strategy) for n in args.layers for strategy in args.strategies]
  print(
    f"{len(jobs)} jobs x {len(PROGRAMS)} programs ({', '.join(PROGRAMS)}), each compiled for "
    "8 x H100; a program of a large model takes minutes (docs/sharded-job.md gives each "
    "command's time)",
    file=sys.stderr,
  )
  start = time.time()
  for i, (n, strategy) in enumerate(jobs, start=1):
    print(f"  {args.model} L={n} {strategy} ({i} of {len(jobs)}) ...", file=sys.stderr)
    t = time.time()
    peaks, count = compile_programs(args.model, n, strategy)
    print(
      f"  {args.model} L={n} {strategy}: {time.time() - t:.0f} s "
      f"({(time.time() - start) / 60:.1f} min so far)",
      file=sys.stderr,
    )
    rows.append((n, count, strategy, peaks))
    if strategy == "fsdp":
      fsdp_steps.append((n, count, peaks["state"] * DP, peaks["step"] - peaks["state"]))
  print(f"\n{args.model}, 8 x H100, peak GiB per device (ratio to the step's)\n")
  print("| layers | params | strategy | " + " | ".join(PROGRAMS) + " |")
  print("|---:|---:|---|" + "---:|" * len(PROGRAMS))
  for n, count, strategy, peaks in rows:
    cells = [f"{peaks[p] / GiB:.2f} ({peaks[p] / peaks['step']:.2f})" for p in PROGRAMS]
    print(f"| {n} | {count / 1e9:.2f}B | {strategy} | " + " | ".join(cells) + " |")
  if len(fsdp_steps) >= 2:
    # per layer, linear in the layer count: the state (sharded over N) and the rest of the
    # step's peak (activations, the gathered units; not sharded)
    (l0, c0, s0, r0), (l1, c1, s1, r1) = fsdp_steps[0], fsdp_steps[-1]
    per = lambda a, b: (b - a) / (l1 - l0)
    dc, ds, dr = per(c0, c1), per(s0, s1), per(r0, r1)
    print(
      f"\nFSDP, per layer: {dc / 1e6:.0f}M params, {ds / GiB:.2f} GiB of state in all, "
      f"{dr / GiB:.3f} GiB of the rest of the step's peak per device"
    )
    for n in (8, 64):
      fits = lambda L: (s0 + ds * (L - l0)) / n + r0 + dr * (L - l0) <= 80e9
      L = l0
      while fits(L + 1):
        L += 1
      print(f"largest on {n} x 80 GB: {L} layers, {(c0 + dc * (L - l0)) / 1e9:.0f}B params")


if __name__ == "__main__":
  main()
