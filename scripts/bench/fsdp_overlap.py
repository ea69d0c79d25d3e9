"""jaxdp's FSDP against the GSPMD FSDP a MaxText user writes: peak memory and predicted time.

For one of the repository's models, scanned blocks each under `jax.checkpoint`, at each
layer count given, every program is compiled for N H100s without a GPU (8 per host,
`jaxdp.inspect.gpu_mesh((N,), num_hosts=N // 8)`; nothing runs) and reported as: peak GiB
per device (`memory_analysis()`, `jaxdp.inspect.memory_stats`); the step, its compute, its
communication and the exposed part of that communication in ms, from
`jaxdp.inspect.predict_step` (XLA's own cost model replayed over the compiled schedule: an
estimate, not a measurement). Each number stands beside its ratio to the MaxText-style
GSPMD FSDP program compiled in the same run (scripts/bench/gspmd_baselines.py: params and
optimizer state sharded over "data" on each weight's embed dim, the activations constrained
batch-sharded over "data" at the embedding output and every block's input and output).

Rows (`--rows`, in this order; the baseline is always compiled; each jaxdp row after the
first adds its setting to the row above):

    maxtext        GSPMD FSDP, MaxText-style: the baseline
    unconstrained  GSPMD FSDP without the activation constraints (a labelled extra)
    jaxdp          jaxdp FSDP, the default `FSDPConfig(stacked=["blocks"])`
    bf16_grads     + `DDPConfig(grad_reduce_dtype=jnp.bfloat16)`: grads reduced in bf16, as
                   the GSPMD program reduces each matmul's grad in its bf16 (the setting an
                   LLM with bf16 compute is advised)
    lookups        + `FSDPConfig(lookups=)` on the input embedding (llama: embed; the gpt's
                   wte is tied, the mlp has none): sharded by its columns, each lookup
                   moving its rows once (the setting an untied embedding is advised)
    gathered       + `FSDPConfig(vocab_parallel=False)` on the bf16_grads row: the vocabulary
                   tables gathered whole instead of computed by rows (what that default
                   buys)
    chunks         + `FSDPConfig(chunks=)` on the vocabulary tables (`--chunks` row blocks;
                   llama: embed and out, gpt: wte; the mlp has none, so no such rows as
                   gathered and chunks)

Models (`--model`, scripts/bench/fsdp_memory.py's): `llama` (models/llama.py at Llama-3-8B's
width: d 4096, GQA 32 / 8 heads, SwiGLU 14336, untied 128,256-token embed and out, f32 params
cast to bf16 where used; sequences of 2048 tokens), `gpt` (models/gpt.py at GPT-2 small's
width: d 768, 12 heads, tied 50304-token wte, f32; sequences of 1024) and `mlp` (the residual
MLP, d 1024, ffn 4096, f32; sequences of 256). AdamW; `--seqs-per-gpu` sequences per GPU.

Usage (times on 2 cores shared with other jobs; one compile at a time, 25 to 70 s each, the
process under 1 GiB of host memory at any depth, the blocks being scanned):
    python scripts/bench/fsdp_overlap.py --model llama --layers 4 8 32       # 8 H100s, 11 min
    python scripts/bench/fsdp_overlap.py --model llama --layers 8 --gpus 64  # 8 hosts, 3 min
    python scripts/bench/fsdp_overlap.py --model llama --layers 8 --gpus 64 --reshard-last-layer
    python scripts/bench/fsdp_overlap.py --model gpt --layers 12 --rows maxtext jaxdp
    python scripts/bench/fsdp_overlap.py --quick        # a 2-layer d 64 Llama, 2 to 3 min
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jaxdp  # before JAX: it imports JAX without the CUDA plugin's driver-probe lines
import jax
import jax.numpy as jnp
import optax

from jaxdp import inspect
from fsdp_memory import problem
from gspmd_baselines import PROGRAMS, compile_step

ROWS = {  # --rows name: its label in the table
  "maxtext": "GSPMD FSDP, MaxText-style",
  "unconstrained": "GSPMD FSDP, no activation constraints",
  "jaxdp": 'jaxdp FSDP `FSDPConfig(stacked=["blocks"])`',
  "bf16_grads": "+ `grad_reduce_dtype=bf16`",
  "lookups": "+ `lookups=[%s]`",
  "gathered": "+ `vocab_parallel=False`",
  "chunks": "+ `chunks={table: %d}`",
}
GSPMD = {"maxtext": "gspmd_fsdp", "unconstrained": "gspmd_fsdp_unconstrained"}
JAXDP = ("jaxdp", "bf16_grads", "lookups", "gathered", "chunks")  # each adds its setting
TABLES = {"llama": ["embed", "out"], "gpt": ["wte"], "mlp": []}  # the vocabulary tables
LOOKUPS = {"llama": ["embed"], "gpt": [], "mlp": []}  # the tables only looked up
SEQ = {"llama": 2048, "gpt": 1024, "mlp": 256}  # tokens per sequence
TX = optax.adamw(1e-4)
GiB, MS = 2**30, 1e-3  # bytes, microseconds -> ms
COLUMNS = ("peak GiB", "step ms", "compute ms", "comm ms", "exposed ms")


def jaxdp_configs(
  row: str, tables: list, chunks: int, reshard_last: bool = False, lookups: list = ()
):
  """`(DDPConfig, FSDPConfig)` of a jaxdp row: the default, plus every setting up to `row`
  but `lookups=` on its own row only (a chunked table is sharded by rows), and
  `reshard_last_layer=reshard_last` on every row."""
  upto = JAXDP[: JAXDP.index(row) + 1]
  config = jaxdp.DDPConfig(
    data_parallel_sharding_strategy="optim_grads_params",
    grad_reduce_dtype=jnp.bfloat16 if "bf16_grads" in upto else None,
  )
  fsdp = jaxdp.FSDPConfig(
    stacked=["blocks"],
    vocab_parallel="gathered" not in upto,
    chunks={name: chunks for name in tables} if "chunks" in upto else {},
    lookups=lookups if row == "lookups" else (),
    reshard_last_layer=reshard_last,
  )
  return config, fsdp


def measure(
  row: str, made, mesh, tables: list, chunks: int, reshard_last: bool, lookups: list
) -> dict:
  """One row compiled: its peak and predicted times (plain numbers), and its compile seconds."""
  start = time.perf_counter()
  if row in GSPMD:
    compiled = compile_step(PROGRAMS[GSPMD[row]], made, TX, mesh)
  else:
    config, fsdp = jaxdp_configs(row, tables, chunks, reshard_last, lookups)
    compiled = inspect.compile_train_step(
      made.make_loss(), TX, mesh, config, made.params, made.batch, fsdp=fsdp
    )
  seconds = time.perf_counter() - start
  prediction = inspect.predict_step(compiled)
  return {
    "peak GiB": inspect.memory_stats(compiled).peak_bytes / GiB,
    "step ms": prediction.step_us * MS,
    "compute ms": prediction.compute_us * MS,
    # the matmuls' share of the compute (json only): equal where both compute the same
    "gemm ms": sum(i.end_us - i.start_us for i in prediction.timeline if i.kind == "gemm") * MS,
    "comm ms": prediction.comm_us["total"] * MS,
    "exposed ms": prediction.exposed_us["total"] * MS,
    "compile s": seconds,
    "unestimated kernels": len(prediction.unestimated),
  }


def ratio(value: float, base: float) -> str:
  if base == 0:
    return "1.00x" if value == 0 else "-"
  return f"{value / base:.2f}x"


def number(value: float) -> str:
  return f"{value:.2f}" if value >= 0.1 else f"{value:.2g}"  # a tiny model's too


def table(results: dict, labels: dict) -> list:
  """Markdown lines: a row per program, each cell `value (value / the baseline's)`."""
  base = results["maxtext"]
  lines = ["| program | " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
  for row, numbers in results.items():
    cells = [f"{number(numbers[c])} ({ratio(numbers[c], base[c])})" for c in COLUMNS]
    lines.append(f"| {labels[row]} | " + " | ".join(cells) + " |")
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=list(TABLES), default="llama")
  parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
  parser.add_argument("--gpus", type=int, default=8, help="H100s, 8 per host")
  parser.add_argument("--seqs-per-gpu", type=int, default=1, help="sequences per GPU per step")
  parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
  parser.add_argument("--chunks", type=int, default=16, help="row blocks of the chunks row")
  parser.add_argument(
    "--reshard-last-layer",
    action="store_true",
    help="every jaxdp row with FSDPConfig(reshard_last_layer=True)",
  )
  parser.add_argument("--quick", action="store_true", help="a 2-layer d 64 model (seconds)")
  parser.add_argument("--json", help="also write every number to this file")
  args = parser.parse_args()
  if args.quick:
    args.layers = [2] if args.layers == parser.get_default("layers") else args.layers
  if args.gpus < 1 or (args.gpus > 8 and args.gpus % 8):
    parser.error(f"--gpus {args.gpus}: use 1 to 8, or a multiple of 8 (8 per host)")
  if min(args.layers) < 1:
    parser.error(f"--layers {args.layers}: every layer count must be >= 1")
  reason = inspect.gpu_compile_unavailable()
  if reason:
    sys.exit(f"cannot compile for GPU here: {reason}")
  tables = TABLES[args.model]
  rows = ["maxtext"] + [r for r in ROWS if r in args.rows and r != "maxtext"]
  if not tables:
    rows = [r for r in rows if r not in ("gathered", "chunks")]
    print(f"({args.model}: no vocabulary table, so no gathered or chunks row)", file=sys.stderr)
  lookups = LOOKUPS[args.model]
  if not lookups:
    rows = [r for r in rows if r != "lookups"]
    print(f"({args.model}: no table only looked up, so no lookups row)", file=sys.stderr)
  labels = {
    **ROWS,
    "lookups": ROWS["lookups"] % ", ".join(lookups),
    "chunks": ROWS["chunks"] % args.chunks,
  }
  hosts = max(1, args.gpus // 8)
  mesh = inspect.gpu_mesh((args.gpus,), ("data",), num_hosts=hosts)
  seq = {} if args.quick else {"seq": SEQ[args.model]}
  command = "python scripts/bench/fsdp_overlap.py" + "".join(f" {a}" for a in sys.argv[1:])
  print(
    f"Command: `{command}`\n\nPredicted by XLA's cost model (`jaxdp.inspect.predict_step`: "
    f"an estimate from the compiled schedule, no GPU run), peak from `memory_analysis()`; "
    f"{args.gpus} x H100 over {hosts} host{'s' if hosts > 1 else ''}, compiled without a "
    f"GPU. In brackets: / the MaxText-style program's in the same run.",
    flush=True,
  )
  everything = {}
  for n_layer in args.layers:
    made = problem(
      args.model,
      n_layer,
      scanned=True,
      remat=True,
      small=args.quick,
      batch=args.seqs_per_gpu * args.gpus,
      **seq,
    )
    count = sum(x.size for x in jax.tree.leaves(made.params))
    tokens = made.batch["x"].shape[1]
    results = {}
    for row in rows:
      results[row] = measure(row, made, mesh, tables, args.chunks, args.reshard_last_layer, lookups)
      print(
        f"  {args.model} L={n_layer} {row}: {results[row]['compile s']:.0f} s",
        file=sys.stderr,
        flush=True,
      )
    everything[n_layer] = results
    size = f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"
    print(
      f"\n{args.model}, {n_layer} layers ({size} params), {args.seqs_per_gpu} x "
      f"{tokens} tokens per GPU, AdamW:\n",
      flush=True,
    )
    print("\n".join(table(results, labels)), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"command": command, "results": everything}, f, indent=1)


if __name__ == "__main__":
  main()
