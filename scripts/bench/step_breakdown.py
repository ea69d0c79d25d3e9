"""Where each millisecond of one training step goes, per strategy, from XLA:CPU's profile.

For one model size at one data-parallel size (default: GPT small at dp = 8), builds the
same steps as scripts/bench/bench.py (scripts/bench/gspmd_baselines.py's GSPMD programs `gspmd`,
`gspmd_zero1`, `gspmd_fsdp` and jaxdp's `no_shard`, `optim`, `optim_grads_params`), times them
round-robin (median wall time per step), then profiles a few steps of each with
`jax.profiler` and reads the per-instruction events XLA:CPU records (one per thunk per
device per step). Each instruction of the compiled program is put in one phase by its opcode
and by the Python call stack that XLA keeps in its metadata (jaxdp's functions, the model's,
and the GSPMD step's `optimizer_update`), first rule that fits:

    param gathers       all-gather (jaxdp's, and the ones GSPMD inserts)
    grad reductions     all-reduce / reduce-scatter of more than 64 bytes (the gradients)
    scalar all-reduces  all-reduces of <= 64 bytes (the loss, per-leaf grad norms)
    ravel/unravel       under a function named *ravel* (jaxdp's buckets), or a copy,
                        slice or concatenation called from jaxdp itself
    optimizer update    under jaxdp's `tx_update` or the GSPMD step's `optimizer_update`
                        (the optax update, clip and AdamW, and applying it)
    param gathers       the rest under a function named *gather* (unpacking gathered params)
    forward+backward    under jvp / transpose (the loss and its gradient)
    ravel/unravel       any other copy, slice, concatenation
    other               the rest (see --details)

Reported per phase: its share of all the instruction events of a step (summed per
device, averaged over devices), and that share of the step's wall time (the median step
time measured without the profiler) in milliseconds, so that a column adds up to the
step. A collective's events are split: the time its device waits in XLA:CPU's rendezvous
for the last device to arrive is "waiting for other devices"; the rest (the exchange
itself) stays with the collective. On this backend the devices are threads sharing the
machine's cores, so an instruction's events include time its thread waited for a core:
when all devices compute at once each gets a fraction of a core, when most wait at a
rendezvous the others get whole cores. A program with many collectives therefore shows
less forward+backward and more waiting than one with few, for the same work; compare
"forward+backward + waiting" across strategies, and shares, not absolute numbers.

Usage:
    python scripts/bench/step_breakdown.py                           # GPT small, dp = 8
    python scripts/bench/step_breakdown.py --size mlp512x8 --details
    python scripts/bench/step_breakdown.py --size tiny --rounds 2 --out out/breakdown-tiny   # a test

Writes `breakdown.md` (the table) and `breakdown.json` (per instruction) to `--out`.
"""

import argparse
import collections
import glob
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time

import host_malloc  # scripts/bench/, beside this file

# -----------------------------------------------------------------------------
# defaults
size = "small"
dp = 8
batch_size = 16  # GPT global batch (sequences)
block_size = 64
variants = "gspmd,gspmd_zero1,gspmd_fsdp,no_shard,optim,optim_grads_params"
rounds = 5  # round-robin rounds of `steps` timed steps (wall-time medians)
steps = 2
profile_steps = 3  # profiled steps per variant
out = "out/breakdown"
lr = 3e-4
grad_clip = 1.0
seed = 0
# -----------------------------------------------------------------------------

parser = argparse.ArgumentParser(
  description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
)
parser.add_argument("--size", default=size, help="one of scripts/bench/bench_programs.py's SIZES")
parser.add_argument("--dp", type=int, default=dp)
parser.add_argument("--batch-size", type=int, default=batch_size)
parser.add_argument("--block-size", type=int, default=block_size)
parser.add_argument("--variants", default=variants)
parser.add_argument("--rounds", type=int, default=rounds)
parser.add_argument("--steps", type=int, default=steps)
parser.add_argument("--profile-steps", type=int, default=profile_steps)
parser.add_argument("--out", default=out)
parser.add_argument("--details", action="store_true", help="print each phase's top instructions")
host_malloc.add_flag(parser)
args = parser.parse_args()
host_malloc.apply(args)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.dp}"
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the repo root
import jaxdp  # noqa: E402, F401  # before JAX: it imports JAX without the CUDA plugin's driver-probe lines
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.dp)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from bench_programs import (  # noqa: E402
  JAXDP,
  SIZES,
  gspmd_step,
  is_mlp,
  jaxdp_step,
  model,
  run,
)
from gspmd_baselines import PROGRAMS  # noqa: E402

if args.size not in SIZES:
  sys.exit(f"--size: unknown size {args.size!r}; use one of {list(SIZES)}")
variant_names = args.variants.split(",")
for v in variant_names:
  strategy, _, extra = v.partition("+")
  if v not in PROGRAMS and (
    strategy not in JAXDP or extra not in ("", "perleaf", "fused", "after")
  ):
    sys.exit(
      f"--variants: unknown variant {v!r}; use some of {list(PROGRAMS) + list(JAXDP)} "
      "(a jaxdp one with +perleaf, +fused or +after: DDPConfig(fused_update=False / True, "
      "overlap_param_gather=False))"
    )

tx = optax.chain(optax.clip_by_global_norm(grad_clip), optax.adamw(lr))


# ----------------------------------------------------------------------------- the HLO


def table(text, name):
  """One of the optimized HLO's metadata tables (FileNames, FunctionNames, ...): id -> row."""
  rows = {}
  start = text.find(f"\n{name}\n")
  if start < 0:
    return rows
  for line in text[start + len(name) + 2 :].split("\n"):
    m = re.match(r"(\d+) (.*)", line)
    if not m:
      break
    rows[int(m.group(1))] = m.group(2)
  return rows


def instructions(text):
  """name -> (opcode, bytes of the result, op_name, its call stack, innermost first).

  The call stack is XLA's metadata (StackFrames): "file:function" per frame, the file
  relative to the repo root where it is in the repo.
  """
  files = {i: s.strip('"') for i, s in table(text, "FileNames").items()}
  funcs = {i: s.strip('"') for i, s in table(text, "FunctionNames").items()}
  locs = {}  # location -> "path relative to the repo:function"
  for i, s in table(text, "FileLocations").items():
    f = files.get(int(re.search(r"file_name_id=(\d+)", s).group(1)), "?")
    f = os.path.relpath(f, ROOT) if f.startswith(ROOT) else os.path.basename(f)
    locs[i] = f + ":" + funcs.get(int(re.search(r"function_name_id=(\d+)", s).group(1)), "?")
  frames = {}
  for i, s in table(text, "StackFrames").items():
    m = re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", s)
    frames[i] = (int(m.group(1)), int(m.group(2)) - 1)  # parent printed 1-based, 0: none

  def stack(frame):
    names, seen = [], set()
    while frame in frames and frame not in seen:
      seen.add(frame)
      loc, frame = frames[frame]
      names.append(locs.get(loc, "?"))
    return names

  found = {}
  for line in text.split("\n"):
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\(", line)
    if not m:
      continue
    name, shape, opcode = m.groups()
    nbytes = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
      bits = 8 if dtype == "pred" else int(re.search(r"\d+", dtype).group())
      nbytes += bits // 8 * int(np.prod([int(d) for d in dims.split(",") if d]))
    op_name = re.search(r'op_name="([^"]*)"', line)
    frame = re.search(r"stack_frame_id=(\d+)", line)
    found[name] = (
      opcode,
      nbytes,
      op_name.group(1) if op_name else "",
      stack(int(frame.group(1))) if frame else [],
    )
  return found


PHASES = [
  "forward+backward",
  "grad reductions",
  "scalar all-reduces",
  "param gathers",
  "optimizer update",
  "ravel/unravel",
  "other",
  "waiting for other devices",
]
WAITING = PHASES[-1]
COLLECTIVES = {"all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all"}
CONTAINERS = {"while", "call", "conditional", "async-start", "async-done"}  # parents of thunks
COPIES = {"copy", "concatenate", "slice", "dynamic-slice", "dynamic-update-slice", "pad"}
COPIES |= {"transpose", "reshape", "bitcast", "broadcast", "iota", "gather", "scatter"}


def phase(name, opcode, nbytes, op_name, stack):
  """The phase one instruction of the step belongs to (the module docstring's list)."""
  base = opcode.removesuffix("-start").removesuffix("-done")
  if base == "all-gather":
    return "param gathers"
  if base in COLLECTIVES:
    return "scalar all-reduces" if nbytes <= 64 else "grad reductions"
  functions = [f.rsplit(":", 1)[-1].rsplit(".", 1)[-1] for f in stack]
  copy = opcode in COPIES or name.split("_")[0].split(".")[0] in ("copy", "concatenate", "slice")
  if any("ravel" in f for f in functions) or (
    copy and stack and stack[0].startswith("jaxdp/_src/")  # jaxdp's own copies (buckets)
  ):
    return "ravel/unravel"
  if any(f in ("tx_update", "optimizer_update", "apply_updates") for f in functions):
    return "optimizer update"
  if any("gather" in f for f in functions):
    return "param gathers"
  if "jvp(" in op_name or "transpose(" in op_name:
    return "forward+backward"
  if copy:
    return "ravel/unravel"
  return "other"


# ----------------------------------------------------------------------------- run

problem = model(args.size, args.block_size, args.batch_size, seed)
n_params = sum(x.size for x in jax.tree.leaves(problem.params))
mesh = jax.make_mesh(
  (args.dp,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[: args.dp]
)
runs = {}
for variant in variant_names:
  print(f"compiling {variant}", flush=True)
  if variant in PROGRAMS:
    carry, placed, fn = gspmd_step(variant, problem, mesh, tx)
  else:
    carry, placed, fn = jaxdp_step(problem, mesh, tx, variant)
  compiled = fn.lower(*carry, placed).compile()
  carry = run(compiled, carry, placed)
  runs[variant] = dict(compiled=compiled, carry=carry, batch=placed, times=[])

for r in range(args.rounds):
  order = variant_names[r % len(variant_names) :] + variant_names[: r % len(variant_names)]
  for variant in order:
    v = runs[variant]
    for _ in range(args.steps):
      t0 = time.perf_counter()
      v["carry"] = run(v["compiled"], v["carry"], v["batch"])
      v["times"].append(time.perf_counter() - t0)

results = {}
for variant in variant_names:
  print(f"profiling {variant}", flush=True)
  v = runs[variant]
  hlo = instructions(v["compiled"].as_text())
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir)
    for _ in range(args.profile_steps):
      v["carry"] = run(v["compiled"], v["carry"], v["batch"])
    jax.profiler.stop_trace()
    (trace,) = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    profile = jax.profiler.ProfileData.from_file(trace)
    per_instruction, count = collections.Counter(), 0
    for plane in profile.planes:
      for line in plane.lines:  # one thread; its events nest, so sort by start
        inside = ("", 0)  # the collective this thread is in, and when it ends
        for event in sorted(line.events, key=lambda e: e.start_ns):
          if event.name in hlo and hlo[event.name][0] not in CONTAINERS:
            per_instruction[event.name] += event.duration_ns
            count += 1
            if hlo[event.name][0].removesuffix("-start") in COLLECTIVES:
              inside = (event.name, event.end_ns)
          elif event.name.startswith("Wait: pending_threads") and event.start_ns < inside[1]:
            # XLA:CPU's rendezvous: this device waits for the others to reach the
            # collective. Charged to WAITING, not to the collective's own phase.
            per_instruction[inside[0]] -= event.duration_ns
            per_instruction[WAITING] += event.duration_ns
  scale = 1e-6 / (args.dp * args.profile_steps)  # ns summed over devices and steps -> ms
  phases = collections.Counter()
  top = collections.defaultdict(list)
  for name, ns in per_instruction.items():
    p = WAITING if name == WAITING else phase(name, *hlo[name])
    phases[p] += ns * scale
    if name != WAITING:
      top[p].append((ns * scale, name, hlo[name][0], hlo[name][2]))
  results[variant] = dict(
    wall_ms=1e3 * statistics.median(v["times"]),
    instructions_per_step=count / (args.dp * args.profile_steps),
    sum_ms=sum(phases.values()),
    phases={p: phases[p] for p in PHASES},
    top={p: sorted(top[p], reverse=True)[:8] for p in PHASES},
    instructions={
      name: dict(
        ms=ns * scale,
        phase=phase(name, *hlo[name]),
        opcode=hlo[name][0],
        bytes=hlo[name][1],
        op_name=hlo[name][2],
        stack=hlo[name][3],
      )
      for name, ns in per_instruction.most_common()
      if name != WAITING
    },
  )
  del v["compiled"], v["carry"]

# ----------------------------------------------------------------------------- report

command = "python scripts/bench/step_breakdown.py" + "".join(f" {a}" for a in sys.argv[1:])
what = (
  f"GPT {args.size} (block {args.block_size}, global batch {args.batch_size})"
  if not is_mlp(args.size)
  else f"MLP {args.size} (global batch {SIZES[args.size]['batch']})"
)
lines = [
  f"Command: `{command}`",
  "",
  f"{what}, {n_params / 1e6:.2f}M params, AdamW + global-norm clipping, dp={args.dp} "
  f"({jax.devices()[0].platform} devices on {os.cpu_count()} cores, "
  f"{platform.processor() or platform.machine()}, jax {jax.__version__}; load average "
  f"{os.getloadavg()[0]:.1f} at the end; {host_malloc.describe()}). Each phase's share (in brackets) of the "
  f"instruction events in XLA:CPU's profile of {args.profile_steps} steps (summed per "
  f"device, averaged over devices), times the step's wall time in ms (the median of "
  f"{args.rounds * args.steps} unprofiled steps, timed round-robin). Waiting = a "
  f"device's time in a collective's rendezvous before the last device arrives.",
  "",
  "| phase | " + " | ".join(variant_names) + " |",
  "|---|" + "---:|" * len(variant_names),
]
for p in PHASES:
  cells = []
  for variant in variant_names:
    r = results[variant]
    share = r["phases"][p] / r["sum_ms"]
    cells.append(f"{share * r['wall_ms']:.1f} ({100 * share:.0f}%)" if share >= 0.0005 else "")
  lines.append(f"| {p} | " + " | ".join(cells) + " |")
for label, key, form in (
  ("**step (wall ms)**", "wall_ms", "{:.1f}"),
  ("profiled events (ms)", "sum_ms", "{:.1f}"),
  ("instructions run per device", "instructions_per_step", "{:.0f}"),
):
  lines.append(
    f"| {label} | " + " | ".join(form.format(results[v][key]) for v in variant_names) + " |"
  )
text = "\n".join(lines) + "\n"
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, "breakdown.md"), "w") as f:
  f.write(text)
with open(os.path.join(args.out, "breakdown.json"), "w") as f:
  json.dump(dict(command=command, results=results), f, indent=1)
if args.details:
  for variant in variant_names:
    print(f"\n{variant}: the largest instructions of each phase (ms per step, opcode, op_name)")
    for p in PHASES:
      for ms, name, opcode, op_name in results[variant]["top"][p][:5]:
        print(f"  {p:18s} {ms:7.2f}  {name} ({opcode}) {op_name[:70]}")
print(text)
print(f"wrote {args.out}/breakdown.md, breakdown.json")
