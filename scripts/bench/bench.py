"""Benchmark jaxdp's strategies against the GSPMD programs a MaxText user writes for the same memory.

In one run, on the same model, global batch and optimizer (AdamW with global-norm
clipping), for every model size and data-parallel size dp, side by side (the GSPMD programs
are scripts/bench/gspmd_baselines.py's, every one but the last with the activations
constrained batch-sharded over "data" at the model's input and every layer's input and
output, as MaxText's model does):

    gspmd               `jax.jit`, params and optimizer state replicated, the batch
                        sharded P("data"); XLA inserts the gradient reduction
    gspmd_zero1         the same jit with the optimizer state sharded over "data" on its
                        first dim that dp divides (MaxText's shard_optimizer_over_data;
                        params stay replicated, so XLA gathers the updated params)
    gspmd_fsdp          the same jit with params *and* optimizer state sharded over "data"
                        on each weight's embed (d_model) dim, MaxText's `embed -> fsdp`
                        rule (what a MaxText user writes for FSDP); XLA gathers the weights
    gspmd_fsdp_unconstrained
                        gspmd_fsdp without the activation constraints (a labelled extra:
                        GSPMD then reshards activations and weights as it likes)
    psum_leaf           `jax.grad` inside `shard_map`, then one `pmean` per leaf
    psum_flat           `jax.grad` inside `shard_map`, grads ravelled, one `pmean`
    no_shard            jaxdp DDP                                 (baseline: gspmd)
    optim, optim_grads  jaxdp distributed optimizer (ZeRO-1/2)    (baseline: gspmd_zero1)
    optim_grads_params  jaxdp FSDP                                (baseline: gspmd_fsdp)

Every jaxdp strategy is reported against the GSPMD program that holds the same memory
(its "baseline"; the hand-written psum steps against gspmd, the GSPMD programs against
themselves), and against replicated gspmd too. The GSPMD baselines are checked after
their warmup steps: each leaf's sharding is the one asked for, and device 0 holds the
bytes the formula says (a sharded leaf's bytes / dp, a replicated leaf's in full;
`gspmd_baselines.check_placement`).

Models: the GPT of models/gpt.py (`tiny` for --quick, `small`, `medium`; global batch
--batch-size sequences of --block-size tokens) and an MLP (`mlpWxL`: L dense layers of
width W with tanh between them, mean squared error against random targets, its own global
batch B: `mlp512x8` B 256, `mlp256x4` B 64, `mlp32x2` B 16 for --quick).

Each variant is compiled with the options it would get by default (jaxdp's own options
keep its buckets separate: XLA:CPU's all-reduce combiner is off). A jaxdp variant named
with `+combine` (e.g. `--variants gspmd,optim,optim+combine`) is compiled with that
combiner back on, to measure what separate collectives cost on this machine; one named
with `+perleaf` (`optim+perleaf`) is built with `DDPConfig(fused_update=False)`: the
per-leaf optimizer update it had before the flat per-bucket one, in the same run; one named
with `+fused` (`no_shard+fused`) with `DDPConfig(fused_update=True)`; one named with
`+after` (`optim+after`) with `DDPConfig(overlap_param_gather=False)`: the params gathered
after the update and kept whole between steps, gspmd_zero1's memory (by default jaxdp's
`optim` keeps only the master shards between steps and gathers at the next step's start). The
baselines a variant needs are added to --variants when missing. All variants of one
(size, dp) are compiled first, then timed round-robin: `--rounds` rounds of `--steps`
steps each, the order rotated every round, so that load from other processes falls on
all of them alike. Reported: the median step time and its ratio to the baseline's median
*from the same run*, compile time (lower + compile) and its ratio to the baseline's, the
collectives of the compiled program (count and ring bytes per device per step, from
`jaxdp.inspect.schedule`), and the bytes of the training state (params, optimizer state,
master params) that device 0 holds. The targets (at the largest dp: step time
<= 0.85 and compile time <= 1.5 x the baseline's) are checked at the end.

Without an accelerator JAX's CPU backend is split into `--cpu-devices` (default 8)
simulated devices: collectives are real, and all devices share the machine's cores.

Usage:
    python scripts/bench/bench.py --dps 8            # GPT small, medium and both MLPs at dp = 8
    python scripts/bench/bench.py                    # the same at dp = 1, 2, 4, 8
    python scripts/bench/bench.py --quick --out out/bench-quick   # tiny sizes, for a test
    python scripts/bench/bench.py --sizes medium --dps 8 --rounds 10 --variants gspmd,psum_leaf,no_shard

Writes to `--out`: `bench.md` (the table, with the command that produced it: docs/bench.md's
table), `bench.png` (step-time ratios and step times against dp), `bench.json` (every
sample).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

import host_malloc  # scripts/bench/, beside this file

# -----------------------------------------------------------------------------
# defaults
sizes = "small,medium,mlp512x8,mlp256x4"
dps = "1,2,4,8"
batch_size = 16  # GPT global batch (sequences per step), the same for every dp
block_size = 64  # sequence length
steps = 3  # timed steps per variant per round
rounds = 8  # round-robin rounds (samples per variant = steps * rounds)
warmup = 2  # untimed steps per variant after compiling
lr = 3e-4
grad_clip = 1.0
variants = "gspmd,gspmd_zero1,gspmd_fsdp,gspmd_fsdp_unconstrained,no_shard,optim,optim_grads_params"
out = "out/bench"
cpu_devices = 8
seed = 0
TARGET_STEP, TARGET_COMPILE = 0.85, 1.5  # at the largest dp: x the baseline's
# -----------------------------------------------------------------------------

parser = argparse.ArgumentParser(
  description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
)
parser.add_argument(
  "--sizes", default=sizes, help="comma-separated, of scripts/bench/bench_programs.py's SIZES"
)
parser.add_argument("--dps", default=dps, help="comma-separated data-parallel sizes")
parser.add_argument("--batch-size", type=int, default=batch_size)
parser.add_argument("--block-size", type=int, default=block_size)
parser.add_argument("--steps", type=int, default=steps)
parser.add_argument("--rounds", type=int, default=rounds)
parser.add_argument("--warmup", type=int, default=warmup)
parser.add_argument("--variants", default=variants)
parser.add_argument("--out", default=out)
parser.add_argument("--cpu-devices", type=int, default=cpu_devices)
parser.add_argument(
  "--quick",
  action="store_true",
  help="tiny GPT (block 16, batch 8) and mlp32x2, dp 1 and 8, 2 rounds of 2 steps "
  "(options given explicitly win)",
)
host_malloc.add_flag(parser)
args = parser.parse_args()
host_malloc.apply(args)
QUICK = dict(
  sizes="tiny,mlp32x2", dps="1,8", block_size=16, batch_size=8, steps=2, rounds=2, warmup=1
)
if args.quick:
  for name, value in QUICK.items():
    if getattr(args, name) == parser.get_default(name):
      setattr(args, name, value)

# JAX reads the CPU device count when it initialises, so set it before importing jax; CPU
# unless told otherwise (JAX_PLATFORMS=cuda for the one-GPU row), which also lets
# jaxdp.inspect compile for the H100 target without CUDA libraries.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.cpu_devices}"
)
sys.path.insert(
  0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)  # repo root
import jaxdp  # noqa: E402  # before JAX: it imports JAX without the CUDA plugin's driver-probe lines
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.cpu_devices)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import optax  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench_programs import (  # noqa: E402
  JAXDP,
  SIZES,
  global_batch,
  gspmd_step,
  is_mlp,
  jaxdp_step,
  model,
  psum_step,
  run,
)
from gspmd_baselines import PROGRAMS, TWIN, check_placement, device0_bytes, placement  # noqa: E402

size_names = args.sizes.split(",")
dp_list = [int(d) for d in args.dps.split(",")]
EXTRAS = ("combine", "perleaf", "fused", "after")  # jaxdp variant suffixes, see the docstring
BASELINE = {  # the GSPMD program that holds the same memory as the variant
  **{name: name for name in PROGRAMS},
  "psum_leaf": "gspmd",
  "psum_flat": "gspmd",
  **TWIN,
}
for name in size_names:
  if name not in SIZES:
    sys.exit(f"--sizes: unknown size {name!r}; use some of {list(SIZES)}")
variant_names = args.variants.split(",")
for v in variant_names:
  if v not in tuple(BASELINE) + tuple(f"{s}+{x}" for s in JAXDP for x in EXTRAS):
    sys.exit(
      f"--variants: unknown variant {v!r}; use some of {list(BASELINE)} (+combine, +perleaf, +fused, +after)"
    )
needed = {"gspmd"} | {BASELINE[v.partition("+")[0]] for v in variant_names}
variant_names = [b for b in PROGRAMS if b in needed and b not in variant_names] + variant_names


for dp in dp_list:
  bad = [s for s in size_names if global_batch(s, args.batch_size) % dp]
  if dp > jax.device_count() or bad:
    sys.exit(
      f"--dps: dp={dp} needs {dp} devices (have {jax.device_count()}) and must "
      f"divide the global batch of every size ({', '.join(bad)} do not)"
    )

tx = optax.chain(optax.clip_by_global_norm(grad_clip), optax.adamw(lr))

# ----------------------------------------------------------------------------- variants
# Every variant is one of scripts/bench/bench_programs.py's steps (what scripts/bench/step_breakdown.py
# profiles): `gspmd_step` (a GSPMD program), `psum_step` or `jaxdp_step`.


def per_leaf(grads):
  return jax.tree.map(lambda g: jax.lax.pmean(g, "data"), grads)


def flat(grads):
  vector, unravel = ravel_pytree(grads)
  return unravel(jax.lax.pmean(vector, "data"))


COMBINE = {"xla_disable_hlo_passes": ""}  # XLA:CPU's all-reduce combiner back on
HAND_WRITTEN = {"psum_leaf": per_leaf, "psum_flat": flat}  # variant: how it reduces


def build(variant, problem, mesh):
  """(carry, batch, fn, compiler options) of a variant."""
  strategy, _, extra = variant.partition("+")
  if strategy in JAXDP:
    return *jaxdp_step(problem, mesh, tx, variant), (COMBINE if extra == "combine" else None)
  if variant in HAND_WRITTEN:
    return *psum_step(HAND_WRITTEN[variant], problem, mesh, tx), None
  return *gspmd_step(variant, problem, mesh, tx), None


def check_gspmd(variant, problem, carry, mesh):
  """The GSPMD baseline after its steps holds what it says (its placement, the bytes of the
  memory formula on device 0: `gspmd_baselines.check_placement`); a one-line summary."""
  program = PROGRAMS[variant]
  place = placement(program, problem, tx, mesh)
  return check_placement(program, place, carry[0], carry[1], mesh)


def mib(n):
  return f"{n / 2**20:.2f}"


# ----------------------------------------------------------------------------- run


jax.jit(lambda x: x + 1).lower(1.0).compile()  # the process's first compile pays for XLA's setup
results = []
gspmd_checks = []
total = len(size_names) * len(dp_list) * len(variant_names) * (1 + args.rounds)
bar = tqdm(total=total, desc="bench", unit="op", dynamic_ncols=True)
load_start = os.getloadavg()
for size in size_names:
  problem = model(size, args.block_size, args.batch_size, seed)
  n_params = sum(x.size for x in jax.tree.leaves(problem.params))
  for dp in dp_list:
    mesh = jax.make_mesh((dp,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:dp])
    runs = {}
    for variant in variant_names:
      bar.set_description(f"{size} dp={dp} compile {variant}")
      carry, placed, fn, options = build(variant, problem, mesh)
      t0 = time.perf_counter()
      compiled = fn.lower(*carry, placed).compile(compiler_options=options)
      compile_s = time.perf_counter() - t0
      s = jaxdp.inspect.schedule(compiled)
      comm = s.comm_bytes()["total"]
      for _ in range(max(args.warmup, 1)):
        carry = run(compiled, carry, placed)
      if variant in PROGRAMS:
        gspmd_checks.append(f"{size} dp={dp} " + check_gspmd(variant, problem, carry, mesh))
      runs[variant] = dict(
        compiled=compiled,
        carry=carry,
        batch=placed,
        times=[],
        compile_s=compile_s,
        collectives=int(comm["count"]),
        comm_bytes=float(comm["ring_bytes"]),
        state_bytes=device0_bytes(carry),  # params, master, optimizer state
      )
      bar.update()
    for r in range(args.rounds):
      order = variant_names[r % len(variant_names) :] + variant_names[: r % len(variant_names)]
      for variant in order:
        bar.set_description(f"{size} dp={dp} round {r + 1}/{args.rounds} {variant}")
        v = runs[variant]
        for _ in range(args.steps):
          t0 = time.perf_counter()
          v["carry"] = run(v["compiled"], v["carry"], v["batch"])
          v["times"].append(time.perf_counter() - t0)
        bar.update()
    medians = {variant: statistics.median(v["times"]) for variant, v in runs.items()}
    for variant, v in runs.items():
      base = BASELINE[variant.partition("+")[0]]
      results.append(
        dict(
          size=size,
          params=n_params,
          dp=dp,
          variant=variant,
          baseline=base,
          step_ms=1e3 * medians[variant],
          ratio=medians[variant] / medians[base],
          ratio_gspmd=medians[variant] / medians["gspmd"],
          compile_s=v["compile_s"],
          compile_ratio=v["compile_s"] / runs[base]["compile_s"],
          collectives=v["collectives"],
          comm_bytes=v["comm_bytes"],
          state_bytes=v["state_bytes"],
          times_ms=[1e3 * t for t in v["times"]],
        )
      )
    del runs
bar.close()
load_end = os.getloadavg()

# ----------------------------------------------------------------------------- report

command = "python scripts/bench/bench.py" + "".join(f" {a}" for a in sys.argv[1:])
os.makedirs(args.out, exist_ok=True)

gpts = [s for s in size_names if not is_mlp(s)]
mlps = [s for s in size_names if is_mlp(s)]
models = []
if gpts:
  models.append(
    f"GPT (vocab 256, block {args.block_size}; {', '.join(gpts)}), global batch "
    f"{args.batch_size} sequences"
  )
if mlps:
  models.append(
    "MLP ("
    + ", ".join(
      f"{s}: {SIZES[s]['layers']} tanh layers of width {SIZES[s]['width']}, "
      f"global batch {SIZES[s]['batch']}"
      for s in mlps
    )
    + "; MSE against random targets)"
  )
lines = [
  f"Command: `{command}`",
  "",
  f"{'; '.join(models)}. AdamW + global-norm clipping, fp32. {jax.device_count()} "
  f"{jax.devices()[0].platform} devices on {os.cpu_count()} cores "
  f"({platform.processor() or platform.machine()}), jax {jax.__version__}; load average "
  f"{load_start[0]:.1f} at start, {load_end[0]:.1f} at end; {host_malloc.describe()}. "
  f"Median of "
  f"{args.steps * args.rounds} steps per variant, timed round-robin; ratio = median step "
  f"time / the baseline's in the same run (< 1 is faster), the baseline being the GSPMD "
  f"program of the same memory; compile ratio likewise for lower + compile. comm = ring "
  f"bytes each device sends per step; state = params + master + optimizer state held by "
  f"device 0.",
  "",
  "| size | params | dp | variant | baseline | step ms | ratio | ratio to gspmd | compile s "
  "| compile ratio | collectives | comm MiB/dev | state MiB/dev |",
  "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
]
for row in results:
  lines.append(
    f"| {row['size']} | {row['params'] / 1e6:.2f}M | {row['dp']} | {row['variant']} "
    f"| {row['baseline']} | {row['step_ms']:.1f} | {row['ratio']:.2f} "
    f"| {row['ratio_gspmd']:.2f} | {row['compile_s']:.1f} | {row['compile_ratio']:.2f} "
    f"| {row['collectives']} | {mib(row['comm_bytes'])} | {mib(row['state_bytes'])} |"
  )
top = max(dp_list)
strategies = [v for v in variant_names if v.partition("+")[0] in JAXDP]
verdicts = []  # True: met
target_rows = []
for size in size_names:
  cells = []
  for variant in strategies:
    row = next(
      r for r in results if r["size"] == size and r["variant"] == variant and r["dp"] == top
    )
    step_ok, compile_ok = row["ratio"] <= TARGET_STEP, row["compile_ratio"] <= TARGET_COMPILE
    verdicts += [step_ok, compile_ok]
    cells.append(
      f"{row['ratio']:.2f} {'met' if step_ok else '**missed**'} "
      f"/ {row['compile_ratio']:.2f} {'met' if compile_ok else '**missed**'}"
    )
  target_rows.append(f"| {size} | " + " | ".join(cells) + " |")
if strategies:
  lines += [
    "",
    f"Targets at dp={top}, as ratios to the baseline: step time <= "
    f"{TARGET_STEP:.2f}, compile time <= {TARGET_COMPILE:.1f}. Met: {sum(verdicts)} of "
    f"{len(verdicts)}.",
    "",
    "| target (step / compile) | "
    + " | ".join(f"{v} vs {BASELINE[v.partition('+')[0]]}" for v in strategies)
    + " |",
    "|---|" + "---|" * len(strategies),
    *target_rows,
  ]
table = "\n".join(lines) + "\n"
with open(os.path.join(args.out, "bench.md"), "w") as f:
  f.write(table)
with open(os.path.join(args.out, "bench.json"), "w") as f:
  json.dump(
    dict(
      command=command,
      load_start=load_start,
      load_end=load_end,
      gspmd_checks=gspmd_checks,
      results=results,
    ),
    f,
    indent=1,
  )

fig, axes = plt.subplots(2, len(size_names), figsize=(5 * len(size_names), 7), squeeze=False)
for col, size in enumerate(size_names):
  for variant in variant_names:
    rows = [r for r in results if r["size"] == size and r["variant"] == variant]
    xs = [r["dp"] for r in rows]
    style = "-" if variant in JAXDP else ":" if "+" in variant else "--"
    label = variant if variant in PROGRAMS else f"{variant} / {rows[0]['baseline']}"
    key = "ratio_gspmd" if variant in PROGRAMS else "ratio"
    axes[0, col].plot(xs, [r[key] for r in rows], style, marker="o", label=label)
    axes[1, col].plot(xs, [r["step_ms"] for r in rows], style, marker="o", label=variant)
  axes[0, col].axhline(1.0, color="0.5", linewidth=0.8)
  axes[0, col].axhline(TARGET_STEP, color="0.5", linewidth=0.8, linestyle=":")
  axes[0, col].set_title(f"{size} ({rows[0]['params'] / 1e6:.2f}M params)")
  axes[0, col].set_ylabel("step time / baseline (GSPMD rows: / gspmd)")
  axes[1, col].set_ylabel("median step ms")
  for ax in axes[:, col]:
    ax.set_xscale("log", base=2)
    ax.set_xticks(dp_list, [str(d) for d in dp_list])
    ax.set_xlabel("dp")
axes[0, 0].legend(fontsize="small")
fig.suptitle(command, fontsize="small")
fig.tight_layout()
fig.savefig(os.path.join(args.out, "bench.png"), dpi=110)

print("\n".join(gspmd_checks))
print(table)
print(f"wrote {args.out}/bench.md, bench.png, bench.json")
