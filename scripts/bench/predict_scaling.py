"""What if the job grew: predicted step time of one model on 8, 16, 64 H100s, without a GPU.

Every program is compiled for N compile-only H100s, 8 per host
(`jaxdp.inspect.gpu_mesh((N,), num_hosts=N // 8)`), and timed by `jaxdp.inspect.predict_step`:
XLA's own cost model (its GPU scheduler's speed-of-light estimates) replayed over the
compiled schedule. Nothing runs; the numbers are XLA's estimate, not a measurement.

    python scripts/bench/predict_scaling.py                 # every sweep (about 25 minutes)
    python scripts/bench/predict_scaling.py --quick         # a 2-layer GPT, for a test

Sweeps (each row against the GSPMD program of the same memory, compiled in the same run):

    scaling   N in --dps for jaxdp's no_shard (DDP), optim (ZeRO-1) and optim_grads_params
              (FSDP) and their GSPMD twins gspmd, gspmd_zero1, gspmd_fsdp (the `jax.jit`
              step a MaxText user writes, XLA's default options: scripts/bench/
              gspmd_baselines.py), and, labelled, gspmd_fsdp_unconstrained (gspmd_fsdp
              without its activation constraints); --seqs-per-gpu sequences per GPU (the
              global batch grows with N)
    buckets   DDP and ZeRO-1 at the smallest N against `DDPConfig(bucket_size=)`
    prefetch  FSDP at the smallest N against `FSDPConfig(prefetch=)`
    models    the Llama-2-7B shape (models/llama.py: d 4096, 32 layers, 32 heads, ffn 11008,
              vocab 32000; seq 4096, 2 sequences per GPU, f32 params cast to bf16 where used,
              FSDP over 8 H100s) and the repository's GPTs (models/gpt.py) on 8 H100s

The scaling model is GPT-2 small's shape (models/gpt.py: d 768, 12 layers, 12 heads,
vocabulary 50304, 1024 tokens, tied embedding), fp32 params, AdamW. Attention in both models
is plain `jnp` (scores materialized, softmax in fp32; no flash kernel).

Writes to --out: `predict_scaling.md` (the tables, with the command: docs/bench.md's),
`predict_scaling.png` (step time and exposed communication against N: docs/predict_scaling.png),
`predict_scaling.json` (every prediction).
"""

import argparse
import json
import os
import sys
import time

parser = argparse.ArgumentParser(
  description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
)
parser.add_argument("--dps", default="8,16,64", help="comma-separated numbers of GPUs")
parser.add_argument("--seqs-per-gpu", type=int, default=8, help="sequences per GPU per step")
parser.add_argument(
  "--buckets", default="1048576,4194304,16777216,0", help="bucket sizes (elements; 0: default)"
)
parser.add_argument("--prefetch", default="1,2,3", help="FSDP prefetch depths")
parser.add_argument("--sweeps", default="scaling,buckets,prefetch,models", help="what to run")
parser.add_argument("--quick", action="store_true", help="a 2-layer GPT, N = 8 and 16")
parser.add_argument(
  "--out", default="out/predict_scaling", help="folder for the table, figure and json"
)
args = parser.parse_args()

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import functools  # noqa: E402

import jaxdp  # noqa: E402  (first: JAX without the CUDA plugin's driver-probe lines)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from jaxdp import inspect  # noqa: E402
from fsdp_memory import gpt_problem  # noqa: E402
from gspmd_baselines import PROGRAMS, TWIN, Problem, compile_step  # noqa: E402
from models.llama import LlamaConfig, abstract_params, llama_loss  # noqa: E402

JAXDP = {s: TWIN[s] for s in ("no_shard", "optim", "optim_grads_params")}  # strategy: baseline
GSPMD = list(JAXDP.values()) + ["gspmd_fsdp_unconstrained"]  # the scaling sweep's programs
BASELINE = {**JAXDP, "gspmd_fsdp_unconstrained": "gspmd_fsdp"}  # a row's ratio is to this
GPTS = {  # the repository's GPTs: bench.py's medium, gpu_check.py's 350m, GPT-2 small
  "GPT 3.2M (bench medium)": (dict(n_layer=4, n_head=8, d_model=256, vocab_size=256), 256, 32),
  "GPT 352M (gpu_check 350m)": (dict(n_layer=28, n_head=16, d_model=1024, vocab_size=256), 512, 8),
  "GPT-2 small 124M": (dict(n_layer=12, n_head=12, d_model=768, vocab_size=50304), 1024, 8),
}
SCALING = (dict(n_layer=12, n_head=12, d_model=768, vocab_size=50304), 1024)
QUICK = (dict(n_layer=2, n_head=4, d_model=128, vocab_size=256), 128)
TX = optax.adamw(1e-4)
MS = 1e-3  # microseconds -> milliseconds


def mesh_of(n):
  return inspect.gpu_mesh((n,), ("data",), num_hosts=max(1, n // 8))


def gpt(shape, seq, batch) -> Problem:
  """A GPT's abstract params, loss and abstract global batch (unrolled blocks, no remat)."""
  sizes = dict(d=shape["d_model"], n_head=shape["n_head"], vocab=shape["vocab_size"])
  return gpt_problem(shape["n_layer"], scanned=False, remat=False, seq=seq, batch=batch, **sizes)


def llama2_7b(n, n_layer=32) -> Problem:
  config = LlamaConfig(
    vocab=32000, d=4096, n_layer=n_layer, n_head=32, n_kv_head=32, ffn=11008, rope_theta=1e4
  )
  tokens = jax.ShapeDtypeStruct((2 * n, 4096), jnp.int32)
  make_loss = functools.partial(llama_loss, config)
  batch = {"x": tokens, "y": tokens}
  return Problem(abstract_params(config), batch, make_loss, config.d, stacked=("blocks",))


def compile_gspmd(problem: Problem, mesh, name):
  """The `jax.jit` step a MaxText user writes for that memory (gspmd_baselines.py)."""
  return compile_step(PROGRAMS[name], problem, TX, mesh)


def compile_jaxdp(problem: Problem, mesh, strategy, bucket_size=None, fsdp=None):
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, bucket_size=bucket_size)
  extra = {"fsdp": fsdp} if strategy == "optim_grads_params" and fsdp else {}
  return inspect.compile_train_step(
    problem.make_loss(), TX, mesh, config, problem.params, problem.batch, **extra
  )


def predict(name, compile_fn):
  """The prediction of one program as a plain dict (and how long the compile took)."""
  t = time.perf_counter()
  p = inspect.predict_step(compile_fn())
  row = dict(
    program=name,
    step_us=p.step_us,
    compute_us=p.compute_us,
    comm_us=p.comm_us,
    exposed_us=p.exposed_us,
    hidden=p.hidden_fraction,
    unestimated=len(p.unestimated),
    compile_s=time.perf_counter() - t,
  )
  print(
    f"  {name}: step {p.step_us * MS:.2f} ms, exposed {p.exposed_us['total'] * MS:.2f} ms "
    f"of {p.comm_us['total'] * MS:.2f} ({row['compile_s']:.0f} s)",
    file=sys.stderr,
    flush=True,
  )
  return row


def cells(row, base):
  return (
    f"{row['step_us'] * MS:.2f} | {row['step_us'] / base['step_us']:.2f} | "
    f"{row['compute_us'] * MS:.2f} | {row['comm_us']['total'] * MS:.2f} | "
    f"{row['exposed_us']['total'] * MS:.2f} | {100 * row['hidden']:.0f}%"
  )


HEAD = "step ms | / baseline | compute ms | comm ms | exposed ms | hidden"
RULE = "---:|---:|---:|---:|---:|---:"


def main():
  shape, seq = QUICK if args.quick else SCALING
  dps = [8, 16] if args.quick else [int(n) for n in args.dps.split(",")]
  sweeps = args.sweeps.split(",")
  results = {}
  lines = [
    "Command: `python scripts/bench/predict_scaling.py"
    + "".join(f" {a}" for a in sys.argv[1:])
    + "`",
    "",
    f"XLA's estimate (jax {jax.__version__}), N x H100 compiled without a GPU, 8 per host; "
    "ratio = predicted step / the GSPMD program of the same memory's, in the same run.",
  ]
  if "scaling" in sweeps:
    lines += [
      "",
      f"GPT d {shape['d_model']}, {shape['n_layer']} layers, vocab {shape['vocab_size']}, "
      f"seq {seq}, {args.seqs_per_gpu} sequences per GPU, fp32 params, AdamW:",
      "",
      f"| N | program | baseline | {HEAD} |",
      f"|---:|---|---|{RULE}|",
    ]
    rows = results["scaling"] = {}
    for n in dps:
      mesh, problem = mesh_of(n), gpt(shape, seq, args.seqs_per_gpu * n)
      print(f"N = {n}", file=sys.stderr)
      row = {g: predict(g, lambda: compile_gspmd(problem, mesh, g)) for g in GSPMD}
      for strategy in JAXDP:
        row[strategy] = predict(strategy, lambda: compile_jaxdp(problem, mesh, strategy))
      rows[n] = row
      for name in list(JAXDP) + GSPMD:
        base = BASELINE.get(name, name)
        lines.append(f"| {n} | {name} | {base} | {cells(row[name], row[base])} |")
  n0 = dps[0]
  if "buckets" in sweeps:
    mesh, problem = mesh_of(n0), gpt(shape, seq, args.seqs_per_gpu * n0)
    lines += [
      "",
      f"Bucket size, N = {n0} (0: the strategy's default):",
      "",
      f"| program | bucket_size | {HEAD} |",
      f"|---|---:|{RULE}|",
    ]
    rows = results["buckets"] = {}
    for strategy in ("no_shard", "optim"):
      base = predict(JAXDP[strategy], lambda: compile_gspmd(problem, mesh, JAXDP[strategy]))
      for size in [int(b) for b in args.buckets.split(",")]:
        row = predict(
          f"{strategy} {size}", lambda: compile_jaxdp(problem, mesh, strategy, size or None)
        )
        rows[f"{strategy} {size}"] = row
        lines.append(f"| {strategy} | {size:,} | {cells(row, base)} |")
  if "prefetch" in sweeps:
    mesh, problem = mesh_of(n0), gpt(shape, seq, args.seqs_per_gpu * n0)
    lines += [
      "",
      f"FSDP prefetch depth, N = {n0}:",
      "",
      f"| program | prefetch | {HEAD} |",
      f"|---|---:|{RULE}|",
    ]
    rows = results["prefetch"] = {}
    base = predict("gspmd_fsdp", lambda: compile_gspmd(problem, mesh, "gspmd_fsdp"))
    for depth in [int(d) for d in args.prefetch.split(",")]:
      fsdp = jaxdp.FSDPConfig(prefetch=depth)
      row = predict(
        f"fsdp prefetch {depth}",
        lambda: compile_jaxdp(problem, mesh, "optim_grads_params", fsdp=fsdp),
      )
      rows[depth] = row
      lines.append(f"| optim_grads_params | {depth} | {cells(row, base)} |")
  if "models" in sweeps:
    mesh = mesh_of(8)
    lines += [
      "",
      "Models on 8 H100s (the Llama-2-7B shape: FSDP, blocks scanned, each block under remat):",
      "",
      f"| model | params | program | baseline | {HEAD} |",
      f"|---|---:|---|---|{RULE}|",
    ]
    rows = results["models"] = {}
    models = {}
    if not args.quick:
      models["Llama-2-7B shape, seq 4096"] = (llama2_7b(8), {"optim_grads_params": "gspmd_fsdp"})
    for name, (gshape, gseq, per_gpu) in GPTS.items() if not args.quick else ():
      models[name] = (gpt(gshape, gseq, per_gpu * 8), JAXDP)
    if args.quick:
      models["GPT quick"] = (gpt(shape, seq, 8 * args.seqs_per_gpu), JAXDP)
    for name, (problem, programs) in models.items():
      print(name, file=sys.stderr)
      count = sum(x.size for x in jax.tree.leaves(problem.params))
      stacked = ["blocks"] if name.startswith("Llama") else []
      fsdp = jaxdp.FSDPConfig(stacked=stacked)
      row = {}
      for strategy, twin in programs.items():
        row[twin] = predict(twin, lambda: compile_gspmd(problem, mesh, twin))
        row[strategy] = predict(strategy, lambda: compile_jaxdp(problem, mesh, strategy, fsdp=fsdp))
      rows[name] = row
      for strategy, twin in programs.items():
        for prog in (strategy, twin):
          lines.append(
            f"| {name} | {count / 1e6:,.0f}M | {prog} | {twin} | {cells(row[prog], row[twin])} |"
          )
  os.makedirs(args.out, exist_ok=True)
  table = "\n".join(lines) + "\n"
  with open(os.path.join(args.out, "predict_scaling.md"), "w") as f:
    f.write(table)
  with open(os.path.join(args.out, "predict_scaling.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)
  if "scaling" in sweeps:
    plot(results["scaling"], os.path.join(args.out, "predict_scaling.png"))
  print(table)


def plot(rows, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ns = sorted(rows)
  step = {name: [rows[n][name]["step_us"] * MS for n in ns] for name in rows[ns[0]]}
  top = 1.2 * max(max(step[s]) for s in JAXDP)  # a GSPMD program far above: off the scale
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
  for color, (strategy, twin) in zip(("tab:blue", "tab:orange", "tab:green"), JAXDP.items()):
    for name, style in ((strategy, "-"), (twin, "--")):
      exposed = [max(rows[n][name]["exposed_us"]["total"] * MS, 1e-2) for n in ns]
      off = max(step[name]) > top
      label = f"{name} (off the scale: {min(step[name]):,.0f} to {max(step[name]):,.0f} ms)"
      if not off:
        a.plot(ns, step[name], style, color=color, marker="o")
      b.plot(ns, exposed, style, color=color, marker="o", label=label if off else name)
  a.set_ylim(0.95 * min(min(v) for v in step.values()), top)
  b.set_yscale("log")
  for ax, what in ((a, "predicted step (ms)"), (b, "exposed communication (ms, 0 at 0.01)")):
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("H100s (8 per host)")
    ax.set_ylabel(what)
  b.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
  fig.suptitle(
    "XLA's estimate per step, per-GPU batch fixed: jaxdp (solid) and the GSPMD program "
    "of the same memory (dashed)",
    fontsize="medium",
  )
  fig.savefig(path, dpi=100)


if __name__ == "__main__":
  main()
