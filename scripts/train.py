"""Train a small GPT on the bytes of Python's standard library, with any jaxdp strategy.

The corpus needs no download: every `.py` file under `sysconfig.get_paths()["stdlib"]`
(site-packages excluded), read in sorted path order and concatenated, one token per byte
(vocabulary 256). The last 1% of the bytes is held out for validation.

Training is data parallel over every device present. Without an accelerator, JAX's CPU
backend is split into `--cpu-devices` (default 8) simulated devices, so the collectives
and sharding are real even on a laptop.

Usage:
    python scripts/train.py                          # defaults: < 3 min on 2 CPU cores (~140 cpu-s)
    python scripts/train.py --strategy optim         # ZeRO-1: optimizer state sharded
    python scripts/train.py --strategy optim_grads_params --dtype bfloat16  # FSDP, bf16
    python scripts/train.py --steps 2000 --n-layer 6 --d-model 256 --block-size 128
    python scripts/train.py --dropout 0.1            # embedding dropout: a key per step and device
    python scripts/train.py --save-every 100         # checkpoint to <out>/checkpoints
    python scripts/train.py --save-every 100 --resume  # continue after a crash, any strategy
    python scripts/train.py --save-every 100 --preemption-signal SIGUSR1  # SLURM --signal=USR1@90
    python scripts/train.py --strategy optim --optimizer-cpu-offload  # Adam state in host memory
    python -m jaxdp.launch -n 2 -d 4 -- scripts/train.py  # 2 processes x 4 CPU devices

Strategies (Megatron's `data_parallel_sharding_strategy`): no_shard (DDP), optim
(ZeRO-1), optim_grads (ZeRO-2), optim_grads_params (FSDP).

Writes to `--out`: `metrics.jsonl` (one JSON object per step: step, loss, grad_norm, lr,
tokens_per_s, time_s; plus one {"step", "val_loss"} object per evaluation) and
`loss.png` (the loss curves). Prints the gradient-buffer layout (buffers, buckets,
padding) at start. With `--save-every N`, `checkpoints/` holds a checkpoint every N steps
(and at the end); `--resume` continues from the latest one, on any device count and
strategy, exactly where the data left off (step k's batch depends on seed and k alone) and
with the run's own learning-rate schedule (a larger `--steps` trains on at its final rate).
With checkpoints on, a SIGTERM (`--preemption-signal`) from the scheduler, to any process
or to `python -m jaxdp.launch`, makes every process save at the same next step boundary and
exit with 128 + the signal's number (143 for SIGTERM: the job was stopped, not finished),
to be continued with `--resume`. A bad flag is refused at once, before JAX is imported.
"""

import argparse
import json
import math
import os
import signal
import sys
import sysconfig
import time

import numpy as np

# -----------------------------------------------------------------------------
# defaults: tuned so the default run takes < 3 minutes on a 2-core CPU (8 simulated
# devices) and the loss falls from ~5.5 (uniform over 256 bytes) to ~2.5
strategy = "no_shard"  # no_shard | optim | optim_grads | optim_grads_params
steps = 300
batch_size = 16  # global batch (sequences per step); must divide by the device count
block_size = 64  # sequence length
n_layer = 4
scan_layers = False  # stack the blocks and run them with lax.scan (FSDP: one unit per layer)
n_head = 4
d_model = 128
dtype = "float32"  # param dtype: float32 | bfloat16 (grads are reduced in fp32)
lr = 3e-3  # peak learning rate; linear warmup, cosine decay to lr / 10
warmup_steps = 30
weight_decay = 0.1
grad_clip = 1.0
bucket_size = 100_000  # elements per bucket; small so this small model has several
# (the defaults, 25 MiB of fp32 under no_shard and max(16M, 1M * dp) under the
# sharded strategies, give this model one bucket)
eval_every = 50  # steps between validation losses (also at step 0 and at the end)
eval_batches = 4
dropout = 0.0  # embedding dropout rate; > 0 trains with a key per step and device
seed = 0
out = "out/train"
cpu_devices = 8  # simulated devices when JAX has no accelerator
save_every = 0  # steps between checkpoints (0: none)
preemption_signal = "SIGTERM"  # with checkpoints: save at the next step and stop on it
optimizer_cpu_offload = False  # sharded strategies: master and Adam state in host memory
optimizer_offload_fraction = 1.0  # the fraction of them offloaded (whole buckets)
skip_step_on_spikes = False  # skip a step whose grad norm is 6 sigma above the last 128's
grad_norm_skip_threshold = math.inf  # skip a step whose grad norm is above this
# -----------------------------------------------------------------------------


def at_least(low: int):
  """An argparse type: an integer >= `low`, refused at once otherwise (exit 2, no traceback)."""

  def integer(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
      raise argparse.ArgumentTypeError(f"{value}: must be at least {low}")
    return value

  return integer


def positive_float(text: str) -> float:
  """An argparse type: a finite float > 0."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
  if not math.isfinite(value) or value <= 0:
    raise argparse.ArgumentTypeError(f"{value:g}: must be a finite number > 0")
  return value


def rate(text: str) -> float:
  """An argparse type: a probability in [0, 1)."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
  if not 0.0 <= value < 1.0:
    raise argparse.ArgumentTypeError(f"{value:g}: use a rate in [0, 1)")
  return value


def signal_name(text: str) -> signal.Signals | None:
  """An argparse type: a signal a process can catch, by name (SIGUSR1 or USR1), or none."""
  if text.lower() == "none":
    return None
  name = text.upper() if text.upper().startswith("SIG") else "SIG" + text.upper()
  sig = getattr(signal.Signals, name, None)
  if sig is None:
    raise argparse.ArgumentTypeError(
      f"{text!r} is not a signal; use a name such as SIGTERM or SIGUSR1, or none"
    )
  if sig in (signal.SIGKILL, signal.SIGSTOP):
    raise argparse.ArgumentTypeError(f"{sig.name} cannot be caught; use SIGTERM or SIGUSR1")
  return sig


def fraction(text: str) -> float:
  """An argparse type: a fraction in [0, 1]."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
  if not 0.0 <= value <= 1.0:
    raise argparse.ArgumentTypeError(f"{value:g}: use a fraction in [0, 1]")
  return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Writes each flag's default after its help, unless the help says it (a computed one)."""

  def _get_help_string(self, action):
    if "(default:" in (action.help or ""):
      return action.help
    return super()._get_help_string(action)


parser = argparse.ArgumentParser(
  description=__doc__.split("\n\n")[0],
  epilog="Writes to --out: metrics.jsonl (one JSON object per step: step, loss, grad_norm, "
  "lr, tokens_per_s, time_s, skipped with a spike guard; and {step, val_loss} per evaluation), loss.png (the "
  "loss curves) and, with --save-every, checkpoints/. Runs on every device present; "
  "without a GPU on --cpu-devices simulated CPU devices.",
  formatter_class=HelpFormatter,
)
parser.add_argument(
  "--strategy",
  default=strategy,
  choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
  help="Megatron's data_parallel_sharding_strategy: no_shard (DDP), optim "
  "(ZeRO-1), optim_grads (ZeRO-2), optim_grads_params (FSDP)",
)
parser.add_argument(
  "--steps",
  type=at_least(1),
  default=steps,
  help="last training step; on --resume the run's learning-rate schedule is kept",
)
parser.add_argument(
  "--batch-size",
  type=at_least(1),
  default=batch_size,
  help="global batch in sequences per step; must divide by the device count",
)
parser.add_argument(
  "--block-size", type=at_least(1), default=block_size, help="sequence length in bytes (tokens)"
)
parser.add_argument("--n-layer", type=at_least(1), default=n_layer, help="transformer blocks")
parser.add_argument(
  "--scan-layers",
  action=argparse.BooleanOptionalAction,
  default=scan_layers,
  help="stack the blocks and run them with lax.scan (FSDP: one unit per layer)",
)
parser.add_argument(
  "--n-head", type=at_least(1), default=n_head, help="attention heads; must divide --d-model"
)
parser.add_argument("--d-model", type=at_least(1), default=d_model, help="model width")
parser.add_argument(
  "--dtype",
  default=dtype,
  choices=["float32", "bfloat16"],
  help="param dtype; bfloat16 keeps fp32 master params and reduces grads in fp32",
)
parser.add_argument(
  "--lr",
  type=positive_float,
  default=None,
  help=f"peak learning rate (AdamW; linear warmup, cosine decay to lr/10) (default: {lr:g}; "
  "on --resume, the run's own)",
)
parser.add_argument(
  "--warmup-steps",
  type=at_least(0),
  default=None,
  help=f"linear warmup steps, at most half of --steps (default: {warmup_steps}, or half of "
  "--steps if that is less; on --resume, the run's own)",
)
parser.add_argument(
  "--bucket-size",
  type=at_least(1),
  default=bucket_size,
  help="gradient bucket size in elements (the defaults, 25 MiB of fp32 under no_shard and "
  "max(16M, 1M * dp) under the sharded strategies, would give this small model "
  "one bucket)",
)
parser.add_argument(
  "--eval-every",
  type=at_least(1),
  default=eval_every,
  help="steps between validation losses (also at step 0 and at the end)",
)
parser.add_argument(
  "--dropout",
  type=rate,
  default=dropout,
  help="embedding dropout rate; > 0 puts a key in the train state, from which "
  "each step and device draws its masks",
)
parser.add_argument(
  "--seed",
  type=at_least(0),
  default=seed,
  help="init and data seed (step k's batch depends on seed and k alone)",
)
parser.add_argument(
  "--out", default=out, help="output folder: metrics.jsonl, loss.png, checkpoints/"
)
parser.add_argument(
  "--cpu-devices",
  type=at_least(1),
  default=cpu_devices,
  help="simulated devices when JAX runs on the CPU (no effect on a GPU)",
)
parser.add_argument(
  "--save-every",
  type=at_least(0),
  default=save_every,
  help="steps between checkpoints in <out>/checkpoints (0: none)",
)
parser.add_argument(
  "--preemption-signal",
  type=signal_name,
  default=preemption_signal,
  help="with checkpoints (--save-every or --resume): on this signal, to any process or to "
  "the launcher, every process saves at the same next step boundary and exits with 128 + "
  "its number (SIGTERM: 143); none: the signal's own behaviour",
)
parser.add_argument(
  "--resume",
  action="store_true",
  help="continue from the latest checkpoint in <out>/checkpoints, on any device count and "
  "strategy, with the run's own learning-rate schedule (a larger --steps trains on at its "
  "final rate)",
)
parser.add_argument(
  "--optimizer-cpu-offload",
  action="store_true",
  default=optimizer_cpu_offload,
  help="sharded strategies: keep the fp32 master params and the optimizer state in the "
  "host's pinned memory between steps (DDPConfig.optimizer_cpu_offload)",
)
parser.add_argument(
  "--optimizer-offload-fraction",
  type=fraction,
  default=optimizer_offload_fraction,
  help="with --optimizer-cpu-offload, the fraction of them offloaded, whole buckets first "
  "(DDPConfig.optimizer_offload_fraction)",
)
parser.add_argument(
  "--skip-step-on-spikes",
  action="store_true",
  default=skip_step_on_spikes,
  help="skip the update of a step whose grad norm is more than 6 standard deviations above "
  "the mean of the last 128 steps' (DDPConfig.skip_step_on_spikes, MaxText's); metrics.jsonl "
  "says which steps were skipped",
)
parser.add_argument(
  "--grad-norm-skip-threshold",
  type=positive_float,
  default=grad_norm_skip_threshold,
  help="skip the update of a step whose grad norm is above this (DDPConfig."
  "grad_norm_skip_threshold, Megatron's)",
)
args = parser.parse_args()
# What no single flag's type can say, refused here too: before JAX is imported, in a second.
if args.d_model % args.n_head:
  parser.error(
    f"--n-head {args.n_head} does not divide --d-model {args.d_model}; "
    f"use a --n-head that divides it, or a --d-model that is a multiple of {args.n_head}"
  )
if args.optimizer_cpu_offload and args.strategy == "no_shard":
  parser.error(
    "--optimizer-cpu-offload offloads each device's shard of the optimizer state; "
    "--strategy no_shard keeps a whole copy on every device: use --strategy optim, "
    "optim_grads or optim_grads_params"
  )
if args.warmup_steps is not None and args.warmup_steps > args.steps // 2:
  parser.error(
    f"--warmup-steps {args.warmup_steps} is more than half of --steps {args.steps}; "
    f"use at most {args.steps // 2}, or more --steps"
  )

# JAX reads the CPU device count when it initialises, so set it before importing jax.
# Both settings only affect the CPU backend: on a GPU/TPU machine the accelerators are used.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.cpu_devices}"
)
# jaxdp first: it imports JAX without the CUDA plugin's "Could not find cuda drivers" lines
# on a machine without an NVIDIA driver (the [aot] extra installs the plugin).
import jaxdp  # noqa: E402
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", args.cpu_devices)

# Under `python -m jaxdp.launch` (or SLURM, Open MPI, ...) this joins the other processes and
# takes the launcher's devices per process; alone it does nothing.
jaxdp.initialize()
jax.devices()  # starts the backend, after initialize (as jax.distributed requires)
is_main = jax.process_index() == 0  # the process that writes metrics, the plot and reports
devices = jax.devices()
n_dev = len(devices)
if args.batch_size % n_dev:
  parser.error(
    f"--batch-size {args.batch_size} does not divide by the {n_dev} devices; "
    f"use a multiple of {n_dev}"
  )
mesh = jax.make_mesh((n_dev,), ("data",))


def say(*lines: str) -> None:
  """Prints on process 0 only: every process of a multi-process job would repeat it."""
  if is_main:
    print(*lines, sep="\n", flush=True)


import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root
from models.gpt import GPT, GPTConfig, gpt_loss  # noqa: E402

# ----------------------------------------------------------------------------- data


def stdlib_bytes() -> np.ndarray:
  """All `.py` sources of the standard library, sorted by path, as one uint8 array."""
  root = sysconfig.get_paths()["stdlib"]
  paths = []
  for folder, subfolders, files in os.walk(root):
    subfolders[:] = [
      d for d in subfolders if d not in ("site-packages", "dist-packages", "__pycache__")
    ]
    paths += [os.path.join(folder, f) for f in files if f.endswith(".py")]
  chunks = []
  for path in sorted(paths, key=lambda p: os.path.relpath(p, root)):
    with open(path, "rb") as f:
      chunks.append(f.read())
  return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


data = stdlib_bytes()
n_val = len(data) // 100
train_data, val_data = data[:-n_val], data[-n_val:]


def get_batch(split: np.ndarray, rng: np.random.Generator) -> dict:
  """`batch_size` random windows of `block_size + 1` bytes: inputs x, next-byte targets y.

  Training draws step k's batch from `default_rng([seed, k])`: it depends on the step
  alone, so the data order is the same however the run is split up.
  """
  starts = rng.integers(0, len(split) - args.block_size - 1, size=args.batch_size)
  windows = np.stack([split[s : s + args.block_size + 1] for s in starts]).astype(np.int32)
  return {"x": windows[:, :-1], "y": windows[:, 1:]}


# ----------------------------------------------------------------------------- model, mesh


def to_mesh(batch: dict) -> dict:
  """The global batch as arrays split over "data"; each process puts only its own rows."""
  rows = args.batch_size // jax.process_count()
  first = jax.process_index() * rows
  local = {k: v[first : first + rows] for k, v in batch.items()}
  return jaxdp.host_local_batch_to_global(local, mesh)


gpt_config = GPTConfig(
  block_size=args.block_size,
  n_layer=args.n_layer,
  n_head=args.n_head,
  d_model=args.d_model,
  param_dtype=jnp.dtype(args.dtype),
  scan_layers=args.scan_layers,
  dropout=args.dropout,
)
model = GPT(gpt_config, rngs=nnx.Rngs(args.seed))
params, loss_fn = jaxdp.nnx_split(model, gpt_loss)
model.eval()  # validation without dropout
_, eval_fn = jaxdp.nnx_split(model, gpt_loss)
n_params = sum(x.size for x in jax.tree.leaves(params))

# Checkpoints: topology-free, so --resume works with another strategy or device count.
mgr, resume_step = None, None
if args.save_every or args.resume:
  mgr = jaxdp.CheckpointManager(
    os.path.join(args.out, "checkpoints"),
    max_to_keep=3,
    save_interval_steps=max(args.save_every, 1),
    preemption_signal=args.preemption_signal,
  )
  resume_step = mgr.latest_step() if args.resume else None
  if args.resume and resume_step is None:
    say(f"--resume: no checkpoint in {args.out}/checkpoints; starting from step 0")
if resume_step is not None and resume_step >= args.steps:
  say(
    f"--resume: checkpoint {resume_step} is at --steps {args.steps} or past it: nothing to "
    "train; give a larger --steps to train on"
  )
  sys.exit(0)

# The learning-rate schedule: linear warmup, then cosine decay to lr / 10 at the last step.
# Each checkpoint stores it beside the data position, and a resumed run keeps it: the run
# goes on exactly as it started (a larger --steps trains on at the final rate, rather than
# stretching the curve and raising the rate mid-run).
run_schedule = {
  "peak_lr": lr if args.lr is None else args.lr,
  "warmup_steps": min(warmup_steps, args.steps // 2)
  if args.warmup_steps is None
  else args.warmup_steps,
  "decay_steps": args.steps,
}
if resume_step is not None:
  position = mgr.data_position()
  saved = position.get("schedule") if isinstance(position, dict) else None
  for flag, key, given in (
    ("--lr", "peak_lr", args.lr),
    ("--warmup-steps", "warmup_steps", args.warmup_steps),
  ):
    if saved is not None and given is not None and given != saved[key]:
      parser.error(
        f"{flag} {given:g}: the run in {args.out} was started with {flag} {saved[key]:g}, and "
        f"a resumed run keeps its learning-rate schedule; resume with {flag} {saved[key]:g} "
        f"(or without {flag}), or start a new run with another --out"
      )
  run_schedule = saved or run_schedule
peak_lr, end_lr = run_schedule["peak_lr"], run_schedule["peak_lr"] / 10
schedule = optax.warmup_cosine_decay_schedule(
  0.0,
  peak_lr,
  warmup_steps=run_schedule["warmup_steps"],
  decay_steps=run_schedule["decay_steps"],
  end_value=end_lr,
)
# Decay the matrices and embeddings, not the biases and LayerNorm params (as nanoGPT).
decay_mask = jax.tree_util.tree_map_with_path(
  lambda path, _: path[-1].key in ("kernel", "wte", "wpe"), params
)
tx = optax.chain(
  optax.clip_by_global_norm(grad_clip),
  optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask),
)

ddp_config = jaxdp.DDPConfig(
  data_parallel_sharding_strategy=args.strategy,
  bucket_size=args.bucket_size,
  optimizer_cpu_offload=args.optimizer_cpu_offload,
  optimizer_offload_fraction=args.optimizer_offload_fraction,
  skip_step_on_spikes=args.skip_step_on_spikes,
  grad_norm_skip_threshold=args.grad_norm_skip_threshold,
)
# FSDP's units: by default one per block; scanned blocks are one stacked subtree whose
# layers jaxdp gathers one per iteration of the model's scan over them.
fsdp = None
if args.strategy == "optim_grads_params" and args.scan_layers:
  fsdp = jaxdp.FSDPConfig(stacked=["blocks"])
# With dropout the state holds a key: each step's masks come from it, the step number and
# the device's data shard (the same masks again after --resume).
rng = jax.random.key(args.seed) if args.dropout else None
state = jaxdp.init_state(params, tx, mesh, ddp_config, fsdp=fsdp, rng=rng)
train_step = jaxdp.make_train_step(loss_fn, tx, mesh, ddp_config, fsdp=fsdp)


def eval_all(params, batch):
  """The mean loss over this device's rows of every validation batch (side by side)."""
  return eval_fn(params, {k: v.reshape(-1, v.shape[-1]) for k, v in batch.items()})


# The validation batches side by side, (batch, eval_batches, block), in one eval step: one
# program, not one per batch (in a multi-process job every program spans the processes, and
# fewer in flight is safer), run on the state where it lives (FSDP: unit by unit).
eval_step = jaxdp.make_eval_step(eval_all, mesh, ddp_config, fsdp=fsdp)

# Every process says it joined (a multi-process job names each); process 0 says the rest.
banner = f"devices: {n_dev} x {devices[0].platform}"
if jax.process_count() > 1:
  banner += (
    f" | process {jax.process_index()} of {jax.process_count()}, {jax.local_device_count()} local"
  )
if is_main:
  banner += (
    f" | strategy: {args.strategy} | params: {n_params:,} ({args.dtype}) | "
    f"corpus: {len(train_data):,} train bytes, {len(val_data):,} val bytes"
  )
print(banner, flush=True)
say(state.layout.summary())
capped = args.warmup_steps is None and warmup_steps > args.steps // 2 and resume_step is None
say(
  f"learning rate: warmup to {peak_lr:g} over {run_schedule['warmup_steps']} steps"
  + (f" (the default {warmup_steps}, capped at half of --steps)" if capped else "")
  + f", cosine decay to {end_lr:g} at step {run_schedule['decay_steps']}"
)

first_step = 1
if resume_step is not None:
  state = mgr.restore(state)  # `state` from init_state says the target layout
  first_step = int(state.step) + 1
  say(f"resumed from checkpoint {resume_step} (step {first_step - 1})")
  decay_steps = run_schedule["decay_steps"]
  if args.steps > decay_steps:
    say(
      f"--steps {args.steps}: the run's schedule reaches {end_lr:g} at step {decay_steps}; "
      f"steps {max(decay_steps + 1, first_step)}-{args.steps} train at {end_lr:g}"
    )
  elif args.steps < decay_steps:
    say(
      f"--steps {args.steps}: this run stops at step {args.steps} of a schedule that decays "
      f"until step {decay_steps}"
    )

val_rng = np.random.default_rng([args.seed, 0])  # the same validation windows every time
val_host = [get_batch(val_data, val_rng) for _ in range(eval_batches)]
val_batch = to_mesh({k: np.stack([b[k] for b in val_host], axis=1) for k in val_host[0]})


def val_loss() -> float:
  return float(eval_step(state, val_batch))


# ----------------------------------------------------------------------------- train

os.makedirs(args.out, exist_ok=True)
tokens_per_step = args.batch_size * args.block_size
history = {"step": [], "loss": [], "val_step": [], "val_loss": []}
kept = []  # on resume: the metrics up to the checkpoint (later ones are redone)
if first_step > 1 and os.path.exists(os.path.join(args.out, "metrics.jsonl")):
  with open(os.path.join(args.out, "metrics.jsonl")) as f:
    kept = [e for e in map(json.loads, f) if e["step"] < first_step]
  for e in kept:
    if "val_loss" in e:
      history["val_step"].append(e["step"])
      history["val_loss"].append(e["val_loss"])
    else:
      history["step"].append(e["step"])
      history["loss"].append(e["loss"])
log = open(os.path.join(args.out, "metrics.jsonl") if is_main else os.devnull, "w")
log.writelines(json.dumps(e) + "\n" for e in kept)


def record(**entry):
  log.write(json.dumps(entry) + "\n")
  log.flush()


if first_step == 1:
  v = val_loss()
  history["val_step"].append(0)
  history["val_loss"].append(v)
  record(step=0, val_loss=v)

start, start_cpu = time.perf_counter(), time.process_time()
tok_s = 0.0
first_step_cpu = 0.0
bar = tqdm(
  range(first_step, args.steps + 1), desc=args.strategy, dynamic_ncols=True, disable=not is_main
)
preempted = False
for step in bar:
  batch = to_mesh(get_batch(train_data, np.random.default_rng([args.seed, step])))
  t0 = time.perf_counter()
  state, metrics = train_step(state, batch)
  loss = float(metrics["loss"])  # waits for the step
  dt = time.perf_counter() - t0
  if step == first_step:
    first_step_cpu = time.process_time() - start_cpu  # mostly compilation
  else:
    tok_s = tokens_per_step / dt if tok_s == 0 else 0.9 * tok_s + 0.1 * tokens_per_step / dt
  if not math.isfinite(loss):
    sys.exit(f"step {step}: loss is {loss}; lower --lr")
  record(
    step=step,
    loss=loss,
    grad_norm=float(metrics["grad_norm"]),
    lr=float(schedule(step - 1)),
    tokens_per_s=round(tokens_per_step / dt, 1),
    time_s=round(time.perf_counter() - start, 3),
    **({"skipped": bool(metrics["skipped"])} if "skipped" in metrics else {}),
  )
  history["step"].append(step)
  history["loss"].append(loss)
  # Throughput from the second step on: the first one's time is mostly compilation.
  bar.set_postfix(loss=f"{loss:.3f}", **({"tok_s": f"{tok_s:,.0f}"} if tok_s else {}))
  if step % args.eval_every == 0 or step == args.steps:
    v = val_loss()
    history["val_step"].append(step)
    history["val_loss"].append(v)
    record(step=step, val_loss=v)
    if is_main:
      bar.write(f"step {step}: loss {loss:.3f} (this step), val loss {v:.3f}")
  # After a preemption signal every process answers True at the same step (with several
  # processes, JAX's preemption sync point): save it and stop.
  preempted = mgr is not None and mgr.reached_preemption(step)
  if mgr is not None and (args.save_every or preempted):  # async: overlaps the next steps
    mgr.save(
      step,
      state,
      data_position={"next_step": step + 1, "schedule": run_schedule},
      force=step == args.steps or preempted,
    )
  if preempted:
    break
bar.close()
log.close()
if mgr is not None:
  mgr.wait_until_finished()
  mgr.close()  # the preemption signal's previous handler back
if preempted:
  # Every process says it; a scheduler reads 128 + N as "stopped by signal N", not "done".
  print(
    f"preempted ({args.preemption_signal.name}): saved checkpoint {step} at step {step} in "
    f"{args.out}/checkpoints; continue with --resume",
    flush=True,
  )
  sys.exit(128 + args.preemption_signal)
elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu

# ----------------------------------------------------------------------------- report

fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(history["step"], history["loss"], lw=0.8, alpha=0.6, label="train")
ax.plot(history["val_step"], history["val_loss"], "o-", label="val")
ax.axhline(math.log(256), ls=":", c="gray", label="uniform (ln 256)")
ax.set_ylim(top=max(math.log(256), *history["loss"], *history["val_loss"]) + 0.3)
ax.set(
  xlabel="step",
  ylabel="cross entropy (nats/byte)",
  title=f"GPT {n_params / 1e6:.2f}M, {args.strategy}, {n_dev} devices, {args.dtype}",
)
ax.legend()
fig.tight_layout()
if is_main:
  fig.savefig(os.path.join(args.out, "loss.png"), dpi=100)

# The run's train loss (a resumed run's from its first step on, as metrics.jsonl has it):
# the mean of its first k and last k steps, k = 10, or half the steps of a short run.
steps_run = args.steps - first_step + 1
k = min(10, len(history["loss"]) // 2)
if k:
  train_loss = (
    f"train loss, mean of {k} steps: {np.mean(history['loss'][:k]):.3f} (steps "
    f"{history['step'][0]}-{history['step'][k - 1]}) -> {np.mean(history['loss'][-k:]):.3f} "
    f"(steps {history['step'][-k]}-{history['step'][-1]})"
  )
else:
  train_loss = f"train loss {history['loss'][-1]:.3f} (step {history['step'][-1]})"
say(
  (
    f"done: steps {first_step}-{args.steps} ({steps_run} steps)"
    if first_step > 1
    else f"done: {steps_run} steps"
  )
  + f" in {elapsed:.1f}s (cpu {elapsed_cpu:.1f}s) | {train_loss} | "
  f"val loss {history['val_loss'][0]:.3f} -> {history['val_loss'][-1]:.3f} | "
  + (f"{tok_s:,.0f} tokens/s | " if tok_s else "")
  + f"wrote {args.out}/",
  f"cpu seconds: first step (compile) {first_step_cpu:.1f}"
  + (
    f", then {(elapsed_cpu - first_step_cpu) / (steps_run - 1):.3f} per step"
    if steps_run > 1
    else ""
  ),
)
