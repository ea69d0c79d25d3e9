"""Peak GPU memory of one train step on a ("data", "model") mesh: FSDP x tensor parallel.

A Llama-shaped decoder (`models/llama.py`, scanned blocks under `jax.checkpoint`) with its
params placed Megatron-style over "model" (https://arxiv.org/abs/1909.08053): wq, wk, wv,
w_gate, w_up column-parallel `P(None, "model")`, wo and w_down row-parallel
`P("model", None)`, the `embed` and `out` tables vocabulary-parallel `P("model", None)`,
the norms replicated. Each program is compiled for compile-only H100s without a GPU
(`jaxdp.inspect.gpu_mesh(..., axis_types=Explicit)`) and `memory_analysis()` gives the
per-device peak (`jaxdp.inspect.memory_stats`). Adam, fp32 params cast to bf16 where used.

Meshes (`--meshes`): `4x2` (data 4 x model 2, 8 H100s on one host) and `8x8` (data 8 x
model 8, 64 H100s over 8 hosts, "model" within a host).

Rows, each against the GSPMD program of the same placement compiled in the same run (a
`jax.jit` of `value_and_grad` + `tx.update`, what a MaxText user writes:
scripts/bench/gspmd_baselines.py, the activations constrained `P("data")`, batch-sharded
and whole over "model", at the embedding output and every block's input and output):

* GSPMD ZeRO-1: params at their TP placement, Adam's moments also sharded over "data" on
  another dim (the first one that "model" leaves whole and "data" divides, MaxText's
  `shard_optimizer_over_data`); its jaxdp twins are `optim` (`DDPConfig(stacked=["blocks"])`:
  the params kept sharded between steps and gathered in the next forward,
  `overlap_param_gather=True`) and `optim` with `overlap_param_gather=False` (the params
  gathered at the end of the step),
  and `optim` with `grad_reduce_dtype=jnp.bfloat16` (the GSPMD program's numerics: it
  reduces each matmul's grad in the matmul's bf16, jaxdp by default in fp32).
* GSPMD FSDP: params and Adam's moments at their TP placement plus "data" on each weight's
  embed (d_model) dim, MaxText's `embed -> fsdp`; its twin is `optim_grads_params`
  (`FSDPConfig(stacked=["blocks"])`: gathers and reduce-scatters over "data" alone), and
  the same with `prefetch=0` (each layer gathered in its own loop iteration). Below
  it, labelled, a GSPMD FSDP without MaxText's rules: "data" on the first dim past the layer
  axis that "model" leaves whole, the activations unconstrained.

Usage:
    python scripts/bench/tp_memory.py                       # both meshes, ~15 min on 2 cores
    python scripts/bench/tp_memory.py --meshes 4x2 --layers 4
    python scripts/bench/tp_memory.py --small               # d 256: seconds per program
"""

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import functools

import jaxdp  # before JAX: it imports JAX without the CUDA plugin's driver-probe lines
import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxdp import inspect
from gspmd_baselines import PROGRAMS, Problem, compile_step
from models.llama import LlamaConfig, abstract_params, llama_loss

MiB = 2**20
TX = optax.adam(1e-4)
# Megatron's placements over "model" of one layer's params (the stacked layer axis first).
COLUMN, ROW = P(None, None, "model"), P(None, "model", None)
LAYER_SPECS = {
  "attn_norm": P(),
  "wq": COLUMN,
  "wk": COLUMN,
  "wv": COLUMN,
  "wo": ROW,
  "mlp_norm": P(),
  "w_gate": COLUMN,
  "w_up": COLUMN,
  "w_down": ROW,
}
SPECS = {"embed": P("model", None), "blocks": LAYER_SPECS, "norm": P(), "out": P("model", None)}
MESHES = {"4x2": ((4, 2), 1), "8x8": ((8, 8), 8)}  # (data, model), hosts
# Each GSPMD program, then jaxdp's programs that hold the same memory at rest.
PAIRS = (
  ("GSPMD ZeRO-1", "jaxdp optim", "jaxdp optim, no overlap", "jaxdp optim, bf16 grads"),
  ("GSPMD FSDP", "jaxdp FSDP", "jaxdp FSDP, prefetch=0", "GSPMD FSDP, no activation constraints"),
)
GSPMD = {p.label: p for p in PROGRAMS.values()}


def problem(n_layer, small):
  """(LlamaConfig, abstract params without placement, loss_fn, sequence length)."""
  if small:
    sizes = dict(vocab=512, d=256, n_head=4, n_kv_head=2, ffn=512)
    seq = 128
  else:  # Llama-shaped at d 2048 (TinyLlama-1.1B's width), Llama-2's vocabulary
    sizes = dict(vocab=32000, d=2048, n_head=16, n_kv_head=8, ffn=5632)
    seq = 2048
  config = LlamaConfig(n_layer=n_layer, scan_layers=True, remat=True, **sizes)
  params = abstract_params(config)
  return config, params, llama_loss(config), seq


def jaxdp_step(program, params, loss_fn, batch, mesh):
  placed = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
    params,
    SPECS,
  )
  if program.startswith("jaxdp optim"):
    config = jaxdp.DDPConfig(
      data_parallel_sharding_strategy="optim",
      stacked=["blocks"],
      overlap_param_gather=not program.endswith("no overlap"),
      grad_reduce_dtype=jnp.bfloat16 if program.endswith("bf16 grads") else None,
    )
    return inspect.compile_train_step(loss_fn, TX, mesh, config, placed, batch)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
  prefetch = 0 if program.endswith("prefetch=0") else 1  # 0: each layer in its own iteration
  fsdp = jaxdp.FSDPConfig(stacked=["blocks"], prefetch=prefetch)
  return inspect.compile_train_step(loss_fn, TX, mesh, config, placed, batch, fsdp=fsdp)


def measure(mesh_name, n_layer, small, seqs):
  (dp, tp), hosts = MESHES[mesh_name]
  # jaxdp reads the placements off abstract params on Explicit axes; GSPMD's step, whose
  # model code carries no sharding annotations, runs on the same devices with Auto axes.
  mesh = inspect.gpu_mesh(
    (dp, tp), ("data", "model"), num_hosts=hosts, axis_types=(AxisType.Explicit,) * 2
  )
  auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * 2)
  config, params, loss_fn, seq = problem(n_layer, small)
  tokens = jax.ShapeDtypeStruct((seqs * dp, seq), jnp.int32)
  batch = {"x": tokens, "y": tokens}
  specs = jax.tree.map(lambda _, s: s, params, SPECS)
  make_loss = functools.partial(llama_loss, config)
  placed = Problem(params, batch, make_loss, config.d, stacked=("blocks",), model_specs=specs)
  out = {}
  for pair in PAIRS:
    for program in pair:
      t = time.time()
      if program in GSPMD:
        compiled = compile_step(GSPMD[program], placed, TX, auto)
      else:
        compiled = jaxdp_step(program, params, loss_fn, batch, mesh)
      out[program] = inspect.memory_stats(compiled).peak_bytes
      print(
        f"  {mesh_name} {program:<13} {out[program] / MiB:9.1f} MiB ({time.time() - t:.0f} s)",
        file=sys.stderr,
        flush=True,
      )
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
  parser.add_argument("--layers", type=int, default=8, help="decoder layers")
  parser.add_argument("--seqs", type=int, default=2, help="sequences per data rank")
  parser.add_argument("--small", action="store_true", help="d 256, seq 128: seconds")
  args = parser.parse_args()
  reason = inspect.gpu_compile_unavailable()
  if reason:
    sys.exit(f"cannot compile for GPU here: {reason}")
  config, params, _, seq = problem(args.layers, args.small)
  n = sum(x.size for x in jax.tree.leaves(params))
  stats = {m: measure(m, args.layers, args.small, args.seqs) for m in args.meshes}
  print(
    f"\nLlama-shaped, d {config.d}, {args.layers} layers, {config.n_head} / {config.n_kv_head}"
    f" heads, ffn {config.ffn}, vocab {config.vocab} ({n / 1e6:.0f}M params), {args.seqs} x"
    f" {seq} tokens per data rank; Adam, fp32 params: peak MiB per device\n"
  )
  head = " | ".join(
    f"{'x'.join(map(str, MESHES[m][0]))} ({MESHES[m][1]} host{'s' if MESHES[m][1] > 1 else ''})"
    for m in args.meshes
  )
  print("| program (data x model) | " + head + " |")
  print("|---|" + "---:|" * len(args.meshes))
  for gspmd, *ours in PAIRS:
    for program in (gspmd, *ours):
      cells = []
      for m in args.meshes:
        cell = f"{stats[m][program] / MiB:.0f}"
        if program not in GSPMD:
          cell += f" ({stats[m][program] / stats[m][gspmd]:.2f}x)"
        cells.append(cell)
      print(f"| {program} | " + " | ".join(cells) + " |")
  print(
    "\n(ratio: jaxdp's peak / the GSPMD program's of the same placement, above it; the GSPMD "
    "FSDP without activation constraints is an extra row, shown without a ratio)"
  )


if __name__ == "__main__":
  main()
