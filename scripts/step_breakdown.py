"""Where each millisecond of one training step goes, per strategy, from XLA:CPU's profile.

For one model size at one data-parallel size (default: GPT small at dp = 8), builds the
same steps as scripts/bench.py (the GSPMD programs `gspmd`, `gspmd_zero1`, `gspmd_fsdp` and
jaxdp's `no_shard`, `optim`, `optim_grads_params`), times them round-robin (median wall
time per step), then profiles a few steps of each with `jax.profiler` and reads the
per-instruction events XLA:CPU records (one per thunk per device per step). Each
instruction of the compiled program is put in one phase by its opcode and by the Python
call stack that XLA keeps in its metadata (jaxdp's functions, the model's, and those of
this script's GSPMD step, `forward_backward` and `optimizer_update`), first rule that fits:

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
    python scripts/step_breakdown.py                           # GPT small, dp = 8
    python scripts/step_breakdown.py --size mlp512x8 --details
    python scripts/step_breakdown.py --size tiny --rounds 2 --out /tmp/breakdown   # a test

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

# -----------------------------------------------------------------------------
# defaults
SIZES = {  # as in scripts/bench.py
  "tiny": dict(n_layer=2, n_head=2, d_model=32),
  "small": dict(n_layer=4, n_head=4, d_model=128),
  "medium": dict(n_layer=4, n_head=8, d_model=256),
  "mlp32x2": dict(width=32, layers=2, batch=16),
  "mlp256x4": dict(width=256, layers=4, batch=64),
  "mlp512x8": dict(width=512, layers=8, batch=256),
}
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
parser.add_argument("--size", default=size, help=f"one of {list(SIZES)}")
parser.add_argument("--dp", type=int, default=dp)
parser.add_argument("--batch-size", type=int, default=batch_size)
parser.add_argument("--block-size", type=int, default=block_size)
parser.add_argument("--variants", default=variants)
parser.add_argument("--rounds", type=int, default=rounds)
parser.add_argument("--steps", type=int, default=steps)
parser.add_argument("--profile-steps", type=int, default=profile_steps)
parser.add_argument("--out", default=out)
parser.add_argument("--details", action="store_true", help="print each phase's top instructions")
args = parser.parse_args()
if args.size not in SIZES:
  sys.exit(f"--size: unknown size {args.size!r}; use one of {list(SIZES)}")

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.dp}"
)
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.dp)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repo root
import jaxdp  # noqa: E402
from models.gpt import GPT, GPTConfig, gpt_loss  # noqa: E402

JAXDP = ("no_shard", "optim", "optim_grads", "optim_grads_params")
GSPMD = {  # what is sharded, as in scripts/bench.py
  "gspmd": "",
  "gspmd_zero1": "opt",
  "gspmd_fsdp": "params+opt",
  "gspmd_fsdp_gather": "params+opt+gather",
}
variant_names = args.variants.split(",")
for v in variant_names:
  if v not in JAXDP + tuple(GSPMD) + tuple(f"{s}+perleaf" for s in JAXDP):
    sys.exit(
      f"--variants: unknown variant {v!r}; use some of {list(GSPMD) + list(JAXDP)} "
      "(a jaxdp one with +perleaf: DDPConfig(fused_update=False))"
    )

tx = optax.chain(optax.clip_by_global_norm(grad_clip), optax.adamw(lr))


def model(size):
  """(params on the host, loss_fn, global batch), as in scripts/bench.py."""
  rng = np.random.default_rng(seed)
  if "width" in SIZES[size]:
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
  config = GPTConfig(vocab_size=256, block_size=args.block_size, **SIZES[size])
  params, loss_fn = jaxdp.nnx_split(GPT(config, rngs=nnx.Rngs(seed)), gpt_loss)
  params = jax.tree.map(np.asarray, params)
  tokens = rng.integers(0, 256, (args.batch_size, args.block_size + 1), dtype=np.int32)
  return params, loss_fn, {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def data_spec(shape, dp):
  """P("data") on the first dim that dp divides, else replicated (as scripts/bench.py)."""
  for i, n in enumerate(shape):
    if n % dp == 0:
      return P(*[None] * i, "data")
  return P()


def gspmd_step(loss_fn, params, mesh, batch, shard):
  """scripts/bench.py's GSPMD program, its phases in functions named for the profile."""
  replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

  def shardings(tree, sharded):
    return jax.tree.map(
      lambda x: NamedSharding(mesh, data_spec(x.shape, args.dp)) if sharded else replicated,
      tree,
    )

  param_shardings = shardings(params, "params" in shard)
  opt_shardings = shardings(jax.eval_shape(tx.init, params), "opt" in shard)
  params = jax.device_put(params, param_shardings)
  opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)

  def loss(params, batch):
    if "gather" in shard:  # every weight gathered at the top of the step
      params = jax.lax.with_sharding_constraint(params, shardings(params, False))
    return loss_fn(params, batch)

  def forward_backward(params, batch):
    return jax.value_and_grad(loss)(params, batch)

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


def jaxdp_step(loss_fn, params, mesh, batch, variant):
  strategy, _, extra = variant.partition("+")
  fused_update = False if extra == "perleaf" else None
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, fused_update=fused_update)
  state = jaxdp.init_state(params, tx, mesh, config)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  return (state,), jax.device_put(batch, NamedSharding(mesh, P("data"))), step


def run(compiled, carry, batch):
  """One step; the new carry once the devices are done."""
  out = compiled(*carry, batch)
  carry = (out[0],) if len(carry) == 1 else out[:-1]
  jax.block_until_ready(carry)
  return carry


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

params, loss_fn, batch = model(args.size)
n_params = sum(x.size for x in jax.tree.leaves(params))
mesh = jax.make_mesh(
  (args.dp,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[: args.dp]
)
runs = {}
for variant in variant_names:
  print(f"compiling {variant}", flush=True)
  if variant in GSPMD:
    carry, placed, fn = gspmd_step(loss_fn, params, mesh, batch, GSPMD[variant])
  else:
    carry, placed, fn = jaxdp_step(loss_fn, params, mesh, batch, variant)
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

command = "python scripts/step_breakdown.py" + "".join(f" {a}" for a in sys.argv[1:])
what = (
  f"GPT {args.size} (block {args.block_size}, global batch {args.batch_size})"
  if "width" not in SIZES[args.size]
  else f"MLP {args.size} (global batch {SIZES[args.size]['batch']})"
)
lines = [
  f"Command: `{command}`",
  "",
  f"{what}, {n_params / 1e6:.2f}M params, AdamW + global-norm clipping, dp={args.dp} "
  f"({jax.devices()[0].platform} devices on {os.cpu_count()} cores, "
  f"{platform.processor() or platform.machine()}, jax {jax.__version__}; load average "
  f"{os.getloadavg()[0]:.1f} at the end). Each phase's share (in brackets) of the "
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
