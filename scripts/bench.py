"""Benchmark jaxdp's strategies against the data parallelism a JAX user writes today.

In one run, on the same GPT, global batch and optimizer (AdamW with global-norm clipping),
for every model size and data-parallel size dp, side by side:

    gspmd               the baseline: `jax.jit` with params replicated and the batch
                        sharded P("data"); XLA inserts the gradient reduction
    psum_leaf           `jax.grad` inside `shard_map`, then one `pmean` per leaf
    psum_flat           `jax.grad` inside `shard_map`, grads ravelled, one `pmean`
    no_shard            jaxdp DDP
    optim               jaxdp distributed optimizer (ZeRO-1)
    optim_grads_params  jaxdp FSDP

Each variant is compiled with the options it would get by default (jaxdp's own options
keep its buckets separate: XLA:CPU's all-reduce combiner is off). A jaxdp variant named
with `+combine` (e.g. `--variants gspmd,optim,optim+combine`) is compiled with that
combiner back on, to measure what separate collectives cost on this machine. All variants of one (size, dp) are compiled first, then timed
round-robin: `--rounds` rounds of `--steps` steps each, the order rotated every round, so
that load from other processes falls on all of them alike. Reported: the median step time
and its ratio to the baseline's median *from the same run*, compile time (lower +
compile), the collectives of the compiled program (count and ring bytes per device per
step, from `jaxdp.inspect.schedule`), and the bytes of the training state (params,
optimizer state, master params) that device 0 holds.

Without an accelerator JAX's CPU backend is split into `--cpu-devices` (default 8)
simulated devices: collectives are real, and all devices share the machine's cores.

Usage:
    python scripts/bench.py                    # small + medium GPT, dp = 1, 2, 4, 8
    python scripts/bench.py --quick --out /tmp/bench   # tiny sizes, for a test
    python scripts/bench.py --sizes medium --dps 8 --rounds 10

Writes to `--out`: `bench.md` (the table, with the command that produced it),
`bench.png` (step-time ratios and step times against dp), `bench.json` (every sample).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

# -----------------------------------------------------------------------------
# defaults
SIZES = {  # GPT sizes (vocabulary 256 bytes); params in the comment
  "tiny": dict(n_layer=2, n_head=2, d_model=32),  # 30k, --quick only
  "small": dict(n_layer=4, n_head=4, d_model=128),  # 0.83M
  "medium": dict(n_layer=4, n_head=8, d_model=256),  # 3.2M
}
sizes = "small,medium"
dps = "1,2,4,8"
batch_size = 16  # global batch (sequences per step), the same for every dp
block_size = 64  # sequence length
steps = 3  # timed steps per variant per round
rounds = 8  # round-robin rounds (samples per variant = steps * rounds)
warmup = 2  # untimed steps per variant after compiling
lr = 3e-4
grad_clip = 1.0
variants = "gspmd,psum_leaf,psum_flat,no_shard,optim,optim_grads_params"
out = "out/bench"
cpu_devices = 8
seed = 0
TARGETS = {"no_shard": 0.90, "optim": 0.70, "optim_grads_params": 0.80}  # issue 8, dp = 8
# -----------------------------------------------------------------------------

parser = argparse.ArgumentParser(
  description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
)
parser.add_argument("--sizes", default=sizes, help=f"comma-separated, of {list(SIZES)}")
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
  help="tiny GPT, block 16, batch 8, dp 1 and 8, 2 rounds of 2 steps "
  "(options given explicitly win)",
)
args = parser.parse_args()
QUICK = dict(sizes="tiny", dps="1,8", block_size=16, batch_size=8, steps=2, rounds=2, warmup=1)
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
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.cpu_devices)

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.flatten_util import ravel_pytree  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
import jaxdp  # noqa: E402
from models.gpt import GPT, GPTConfig, gpt_loss  # noqa: E402

size_names = args.sizes.split(",")
dp_list = [int(d) for d in args.dps.split(",")]
variant_names = args.variants.split(",")
JAXDP = ("no_shard", "optim", "optim_grads", "optim_grads_params")
for name in size_names:
  if name not in SIZES:
    sys.exit(f"--sizes: unknown size {name!r}; use some of {list(SIZES)}")
for v in variant_names:
  if v not in ("gspmd", "psum_leaf", "psum_flat") + JAXDP + tuple(f"{s}+combine" for s in JAXDP):
    sys.exit(f"--variants: unknown variant {v!r}")
if "gspmd" not in variant_names:
  sys.exit("--variants must include gspmd: every ratio is to it")
for dp in dp_list:
  if dp > jax.device_count() or args.batch_size % dp:
    sys.exit(
      f"--dps: dp={dp} needs {dp} devices (have {jax.device_count()}) and must "
      f"divide --batch-size {args.batch_size}"
    )

tx = optax.chain(optax.clip_by_global_norm(grad_clip), optax.adamw(lr))

# ----------------------------------------------------------------------------- variants
# Each builder returns (carry, batch, fn): one step is `carry = fn(*carry, batch)[:-1]`
# with the loss last; `fn` is jitted (or jaxdp's step) and lowers itself.


def baseline(loss_fn, params, mesh, batch, reduce):
  """A hand-written data-parallel step; `reduce` None: GSPMD inserts the reduction."""
  replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params = jax.device_put(params, replicated)
  opt_state = jax.jit(tx.init, out_shardings=replicated)(params)

  if reduce is None:
    grad_fn = jax.value_and_grad(loss_fn)
  else:

    def local(params, batch):
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
      return jax.lax.pmean(loss, "data"), reduce(grads)

    grad_fn = jax.shard_map(
      local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), check_vma=False
    )

  def step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  fn = jax.jit(
    step,
    in_shardings=(replicated, replicated, data),
    out_shardings=(replicated, replicated, replicated),
    donate_argnums=(0, 1),
  )
  return (params, opt_state), jax.device_put(batch, data), fn


def per_leaf(grads):
  return jax.tree.map(lambda g: jax.lax.pmean(g, "data"), grads)


def flat(grads):
  vector, unravel = ravel_pytree(grads)
  return unravel(jax.lax.pmean(vector, "data"))


def jaxdp_variant(loss_fn, params, mesh, batch, strategy):
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  state = jaxdp.init_state(params, tx, mesh, config)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
  return (state,), batch, step


COMBINE = {"xla_disable_hlo_passes": ""}  # XLA:CPU's all-reduce combiner back on


def build(variant, loss_fn, params, mesh, batch):
  """(carry, batch, fn, compiler options) of a variant."""
  strategy, _, extra = variant.partition("+")
  if strategy in JAXDP:
    return *jaxdp_variant(loss_fn, params, mesh, batch, strategy), (
      COMBINE if extra == "combine" else None
    )
  reduce = {"gspmd": None, "psum_leaf": per_leaf, "psum_flat": flat}[variant]
  return *baseline(loss_fn, params, mesh, batch, reduce), None


def run(compiled, carry, batch):
  """One step; returns the new carry once the device is done."""
  out = compiled(*carry, batch)
  if len(carry) == 1:  # jaxdp: (state, metrics)
    carry = (out[0],)
  else:
    carry = out[:-1]
  jax.block_until_ready(carry)
  return carry


def state_bytes(carry) -> int:
  """Bytes of the training state on device 0 (params, master, optimizer state)."""
  device = jax.devices()[0]
  return sum(
    s.data.nbytes
    for x in jax.tree.leaves(carry)
    if isinstance(x, jax.Array)
    for s in x.addressable_shards
    if s.device == device
  )


# ----------------------------------------------------------------------------- run


def model(size):
  config = GPTConfig(vocab_size=256, block_size=args.block_size, **SIZES[size])
  params, loss_fn = jaxdp.nnx_split(GPT(config, rngs=nnx.Rngs(seed)), gpt_loss)
  params = jax.tree.map(np.asarray, params)  # on the host: every variant places its own
  tokens = np.random.default_rng(seed).integers(
    0, 256, (args.batch_size, args.block_size + 1), dtype=np.int32
  )
  return params, loss_fn, {"x": tokens[:, :-1], "y": tokens[:, 1:]}


results = []
total = len(size_names) * len(dp_list) * len(variant_names) * (1 + args.rounds)
bar = tqdm(total=total, desc="bench", unit="op", dynamic_ncols=True)
load_start = os.getloadavg()
for size in size_names:
  params, loss_fn, batch = model(size)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  for dp in dp_list:
    mesh = jax.make_mesh((dp,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:dp])
    runs = {}
    for variant in variant_names:
      bar.set_description(f"{size} dp={dp} compile {variant}")
      carry, placed, fn, options = build(variant, loss_fn, params, mesh, batch)
      t0 = time.perf_counter()
      compiled = fn.lower(*carry, placed).compile(compiler_options=options)
      compile_s = time.perf_counter() - t0
      s = jaxdp.inspect.schedule(compiled)
      comm = s.comm_bytes()["total"]
      for _ in range(args.warmup):
        carry = run(compiled, carry, placed)
      runs[variant] = dict(
        compiled=compiled,
        carry=carry,
        batch=placed,
        times=[],
        compile_s=compile_s,
        collectives=int(comm["count"]),
        comm_bytes=float(comm["ring_bytes"]),
        state_bytes=state_bytes(carry),
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
    base = statistics.median(runs["gspmd"]["times"])
    for variant, v in runs.items():
      median = statistics.median(v["times"])
      results.append(
        dict(
          size=size,
          params=n_params,
          dp=dp,
          variant=variant,
          step_ms=1e3 * median,
          ratio=median / base,
          compile_s=v["compile_s"],
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

command = "python scripts/bench.py" + "".join(f" {a}" for a in sys.argv[1:])
os.makedirs(args.out, exist_ok=True)


def mib(n):
  return f"{n / 2**20:.2f}"


lines = [
  f"Command: `{command}`",
  "",
  f"GPT (vocab 256, block {args.block_size}), global batch {args.batch_size} sequences, "
  f"AdamW + global-norm clipping, fp32. {jax.device_count()} {jax.devices()[0].platform} "
  f"devices on {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
  f"jax {jax.__version__}; load average {load_start[0]:.1f} at start, "
  f"{load_end[0]:.1f} at end. Median of {args.steps * args.rounds} steps per variant, "
  f"timed round-robin; ratio = median step time / the gspmd baseline's in the same run "
  f"(< 1 is faster). comm = ring bytes each device sends per step; state = params + "
  f"master + optimizer state held by device 0.",
  "",
  "| size | params | dp | variant | step ms | ratio to gspmd | compile s | collectives "
  "| comm MiB/dev | state MiB/dev |",
  "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
]
for row in results:
  lines.append(
    f"| {row['size']} | {row['params'] / 1e6:.2f}M | {row['dp']} | {row['variant']} "
    f"| {row['step_ms']:.1f} | {row['ratio']:.2f} | {row['compile_s']:.1f} "
    f"| {row['collectives']} | {mib(row['comm_bytes'])} | {mib(row['state_bytes'])} |"
  )
top = max(dp_list)
checks = []
for variant, target in TARGETS.items():
  for size in size_names:
    row = next(
      (r for r in results if r["variant"] == variant and r["size"] == size and r["dp"] == top), None
    )
    if row is not None:
      verdict = "meets" if row["ratio"] <= target else "misses"
      checks.append(f"{variant} {row['ratio']:.2f} ({size}; target <= {target:.2f}: {verdict})")
if checks:
  lines += ["", f"At dp={top}: " + "; ".join(checks) + "."]
table = "\n".join(lines) + "\n"
with open(os.path.join(args.out, "bench.md"), "w") as f:
  f.write(table)
with open(os.path.join(args.out, "bench.json"), "w") as f:
  json.dump(
    dict(command=command, load_start=load_start, load_end=load_end, results=results), f, indent=1
  )

fig, axes = plt.subplots(2, len(size_names), figsize=(5 * len(size_names), 7), squeeze=False)
for col, size in enumerate(size_names):
  for variant in variant_names:
    rows = [r for r in results if r["size"] == size and r["variant"] == variant]
    xs = [r["dp"] for r in rows]
    style = "-" if variant in JAXDP else ":" if "+" in variant else "--"
    axes[0, col].plot(xs, [r["ratio"] for r in rows], style, marker="o", label=variant)
    axes[1, col].plot(xs, [r["step_ms"] for r in rows], style, marker="o", label=variant)
  axes[0, col].axhline(1.0, color="0.5", linewidth=0.8)
  axes[0, col].set_title(f"{size} ({rows[0]['params'] / 1e6:.2f}M params)")
  axes[0, col].set_ylabel("step time / gspmd")
  axes[1, col].set_ylabel("median step ms")
  for ax in axes[:, col]:
    ax.set_xscale("log", base=2)
    ax.set_xticks(dp_list, [str(d) for d in dp_list])
    ax.set_xlabel("dp")
axes[0, 0].legend(fontsize="small")
fig.suptitle(command, fontsize="small")
fig.tight_layout()
fig.savefig(os.path.join(args.out, "bench.png"), dpi=110)

print(table)
print(f"wrote {args.out}/bench.md, bench.png, bench.json")
