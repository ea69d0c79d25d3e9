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
    python -m jaxdp.launch -n 2 -d 4 -- scripts/train.py  # 2 processes x 4 CPU devices

Strategies (Megatron's `data_parallel_sharding_strategy`): no_shard (DDP), optim
(ZeRO-1), optim_grads (ZeRO-2), optim_grads_params (FSDP).

Writes to `--out`: `metrics.jsonl` (one JSON object per step: step, loss, grad_norm, lr,
tokens_per_s, time_s; plus one {"step", "val_loss"} object per evaluation) and
`loss.png` (the loss curves). Prints the gradient-buffer layout (buffers, buckets,
padding) at start. With `--save-every N`, `checkpoints/` holds a checkpoint every N steps
(and at the end); `--resume` continues from the latest one, on any device count and
strategy, exactly where the data left off (step k's batch depends on seed and k alone).
"""

import argparse
import contextlib
import glob
import importlib.util
import json
import math
import os
import shutil
import sys
import sysconfig
import tempfile
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
# -----------------------------------------------------------------------------

parser = argparse.ArgumentParser(
  description=__doc__.split("\n\n")[0],
  epilog="Writes to --out: metrics.jsonl (one JSON object per step: step, loss, grad_norm, "
  "lr, tokens_per_s, time_s; and {step, val_loss} per evaluation), loss.png (the "
  "loss curves) and, with --save-every, checkpoints/. Runs on every device present; "
  "without a GPU on --cpu-devices simulated CPU devices.",
  formatter_class=argparse.ArgumentDefaultsHelpFormatter,
)
parser.add_argument(
  "--strategy",
  default=strategy,
  choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
  help="Megatron's data_parallel_sharding_strategy: no_shard (DDP), optim "
  "(ZeRO-1), optim_grads (ZeRO-2), optim_grads_params (FSDP)",
)
parser.add_argument("--steps", type=int, default=steps, help="training steps")
parser.add_argument(
  "--batch-size",
  type=int,
  default=batch_size,
  help="global batch in sequences per step; must divide by the device count",
)
parser.add_argument(
  "--block-size", type=int, default=block_size, help="sequence length in bytes (tokens)"
)
parser.add_argument("--n-layer", type=int, default=n_layer, help="transformer blocks")
parser.add_argument(
  "--scan-layers",
  action=argparse.BooleanOptionalAction,
  default=scan_layers,
  help="stack the blocks and run them with lax.scan (FSDP: one unit per layer)",
)
parser.add_argument("--n-head", type=int, default=n_head, help="attention heads")
parser.add_argument("--d-model", type=int, default=d_model, help="model width")
parser.add_argument(
  "--dtype",
  default=dtype,
  choices=["float32", "bfloat16"],
  help="param dtype; bfloat16 keeps fp32 master params and reduces grads in fp32",
)
parser.add_argument(
  "--lr",
  type=float,
  default=lr,
  help="peak learning rate (AdamW; linear warmup, cosine decay to lr/10)",
)
parser.add_argument(
  "--warmup-steps",
  type=int,
  default=warmup_steps,
  help="linear warmup steps (at most half of --steps)",
)
parser.add_argument(
  "--bucket-size",
  type=int,
  default=bucket_size,
  help="gradient bucket size in elements (the defaults, 25 MiB of fp32 under no_shard and "
  "max(16M, 1M * dp) under the sharded strategies, would give this small model "
  "one bucket)",
)
parser.add_argument(
  "--eval-every",
  type=int,
  default=eval_every,
  help="steps between validation losses (also at step 0 and at the end)",
)
parser.add_argument(
  "--dropout",
  type=float,
  default=dropout,
  help="embedding dropout rate; > 0 puts a key in the train state, from which "
  "each step and device draws its masks",
)
parser.add_argument(
  "--seed",
  type=int,
  default=seed,
  help="init and data seed (step k's batch depends on seed and k alone)",
)
parser.add_argument(
  "--out", default=out, help="output folder: metrics.jsonl, loss.png, checkpoints/"
)
parser.add_argument(
  "--cpu-devices",
  type=int,
  default=cpu_devices,
  help="simulated devices when JAX runs on the CPU (no effect on a GPU)",
)
parser.add_argument(
  "--save-every",
  type=int,
  default=save_every,
  help="steps between checkpoints in <out>/checkpoints (0: none)",
)
parser.add_argument(
  "--resume",
  action="store_true",
  help="continue from the latest checkpoint in <out>/checkpoints, on any device count and strategy",
)
args = parser.parse_args()

# JAX's CUDA plugin (the [aot] or [gpu] extra) on a machine without an NVIDIA GPU prints a
# traceback ("Unable to load CUDA") when JAX picks a backend, and its C++ stub a "Could not
# find cuda drivers" line: there, ask for the CPU (before jax is imported), and drop the
# stub's lines. With a GPU, or JAX_PLATFORMS set, nothing changes.
# Any sign of a GPU (a device file, WSL's /dev/dxg, nvidia-smi) or a TPU keeps JAX's choice.
gpu_signs = glob.glob("/dev/nvidia[0-9]*") + glob.glob("/dev/dxg") + glob.glob("/dev/accel*")
no_gpu = (
  not gpu_signs
  and shutil.which("nvidia-smi") is None
  and importlib.util.find_spec("jax_cuda12_plugin") is not None
)
if no_gpu and "JAX_PLATFORMS" not in os.environ:
  os.environ["JAX_PLATFORMS"] = "cpu"


@contextlib.contextmanager
def without_cuda_stub_lines():
  """Filters the CUDA stub's lines out of what C++ writes to stderr (fd 2) meanwhile."""
  if not no_gpu:
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      tmp.seek(0)
      for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
        if "cudart_stub.cc" not in line and "absl::InitializeLog()" not in line:
          sys.stderr.write(line)


# JAX reads the CPU device count when it initialises, so set it before importing jax.
# Both settings only affect the CPU backend: on a GPU/TPU machine the accelerators are used.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.cpu_devices}"
)
with without_cuda_stub_lines():
  import jax

jax.config.update("jax_num_cpu_devices", args.cpu_devices)
import jaxdp  # noqa: E402

# Under `python -m jaxdp.launch` (or SLURM, Open MPI, ...) this joins the other processes and
# takes the launcher's devices per process; alone it does nothing.
jaxdp.initialize()
with without_cuda_stub_lines():
  jax.devices()  # starts the backend, after initialize (as jax.distributed requires)
is_main = jax.process_index() == 0  # the process that writes metrics and the plot

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

devices = jax.devices()
n_dev = len(devices)
if args.batch_size % n_dev:
  sys.exit(
    f"--batch-size {args.batch_size} does not divide by the {n_dev} devices; "
    f"use a multiple of {n_dev}"
  )
mesh = jax.make_mesh((n_dev,), ("data",))


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

schedule = optax.warmup_cosine_decay_schedule(
  0.0,
  args.lr,
  warmup_steps=min(args.warmup_steps, args.steps // 2),
  decay_steps=args.steps,
  end_value=args.lr / 10,
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
  data_parallel_sharding_strategy=args.strategy, bucket_size=args.bucket_size
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

print(
  f"devices: {n_dev} x {devices[0].platform} | strategy: {args.strategy} | "
  f"params: {n_params:,} ({args.dtype}) | corpus: {len(train_data):,} train bytes, "
  f"{len(val_data):,} val bytes"
)
print(state.layout.summary())

# Checkpoints: topology-free, so --resume works with another strategy or device count.
mgr, first_step = None, 1
if args.save_every or args.resume:
  mgr = jaxdp.CheckpointManager(
    os.path.join(args.out, "checkpoints"),
    max_to_keep=3,
    save_interval_steps=max(args.save_every, 1),
  )
  if args.resume and mgr.latest_step() is not None:
    state = mgr.restore(state)  # `state` from init_state says the target layout
    first_step = int(state.step) + 1
    print(f"resumed from checkpoint {mgr.latest_step()} (step {first_step - 1})")
  elif args.resume:
    print(f"--resume: no checkpoint in {args.out}/checkpoints; starting from step 0")

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
  )
  history["step"].append(step)
  history["loss"].append(loss)
  bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
  if step % args.eval_every == 0 or step == args.steps:
    v = val_loss()
    history["val_step"].append(step)
    history["val_loss"].append(v)
    record(step=step, val_loss=v)
    bar.write(f"step {step}: loss {loss:.3f} (this step), val loss {v:.3f}")
  if mgr is not None and args.save_every:  # async: the write overlaps the next steps
    mgr.save(step, state, data_position={"next_step": step + 1}, force=step == args.steps)
bar.close()
log.close()
if mgr is not None:
  mgr.wait_until_finished()
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

first = np.mean(history["loss"][:10])
last = np.mean(history["loss"][-10:])
print(
  f"done: {args.steps} steps in {elapsed:.1f}s (cpu {elapsed_cpu:.1f}s) | "
  f"train loss, mean of 10 steps: {first:.3f} (first 10) -> {last:.3f} (last 10) | "
  f"val loss {history['val_loss'][0]:.3f} -> {history['val_loss'][-1]:.3f} | "
  f"{tok_s:,.0f} tokens/s | wrote {args.out}/"
)
print(
  f"cpu seconds: first step (compile) {first_step_cpu:.1f}, "
  f"then {(elapsed_cpu - first_step_cpu) / max(args.steps - first_step, 1):.3f} per step"
)
