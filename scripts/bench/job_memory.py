"""Host memory of every phase of a real job, jaxdp against the GSPMD way, on 8 CPU devices.

    python scripts/bench/job_memory.py --mib 128 --repeat 3
    python scripts/bench/job_memory.py --mib 256 --variants gspmd fsdp
    python scripts/bench/job_memory.py --mib 128 --repeat 3 --save-concurrent-gb 0.05
    python scripts/bench/job_memory.py --mib 64 --variants fsdp fsdp+offload optim optim+offload
    python scripts/bench/job_memory.py --mib 256 --variants gspmd optim fsdp --restore-only

All 8 simulated devices live in one process, so a whole copy of the model on every device
shows as 8 x the model. Each variant runs in a fresh process: init (from the model's init
function, then again from host arrays), 2 train steps, a checkpoint save, and a restore
into a fresh state; then one more fresh process restores that checkpoint, the one thing it
does, as a resumed job meets it ("restore (fresh process)"; `--restore-only` measures only
that, its checkpoint written by the first process from init and 2 steps, unmeasured), and
again with glibc's mmap threshold fixed ("freed returned": `MALLOC_MMAP_THRESHOLD_=131072`),
so that a freed read buffer goes back to the system at once instead of staying in one of
glibc's arenas: what each way allocates, less what the allocator keeps. The restore in the
job's own process may reuse memory its earlier phases left resident, so its growth depends
on them and moves from run to run (the GSPMD way's measured 2.3-4.5 models at 256 MiB, at
the low end less than the 3-model state it allocates); the fresh process's starts from
none. Each phase's number is its peak host memory growth (VmHWM, reset before the phase,
less the resident memory at its start), in multiples of the model's f32 params. The model
is residual MLP blocks `h + gelu(h @ W1) @ W2` (d 1024, ffn 4096: 32 MiB a block), AdamW.

The GSPMD way is what a MaxText user writes instead: `jax.jit` of the init function and of
the step of scripts/bench/gspmd_baselines.py's GSPMD FSDP (params and optimizer state
sharded over "data" on each weight's d_model dim, the activations constrained batch-sharded
over "data" at every block's input and output), and orbax's `StandardCheckpointer`
(restored into `jax.ShapeDtypeStruct` targets with those shardings). jaxdp's variants:
`optim` (ZeRO-1), `optim_grads` (ZeRO-2), `fsdp` (`optim_grads_params`), each with
`init_state(init_fn)`, `init_state(host arrays)`, `CheckpointManager.save` and
`restore(abstract_state(init_fn))`; `optim+offload` and `fsdp+offload` with
`DDPConfig(optimizer_cpu_offload=True)` (on the CPU backend `pinned_host` is process memory
too: what these show is the copies' cost, not a saving); `--save-concurrent-gb` passes jaxdp's
`CheckpointManager(save_concurrent_gb=)`, the bound on bytes being written at once (the
GSPMD way keeps orbax's default). The host arrays are NumPy's own memory, as a loader reads
them. "ratio" is a phase's growth over the GSPMD way's, in
the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

FRESH = "restore (fresh process)"
# the same, glibc's mmap threshold fixed: a freed read buffer goes back to the system at once
LEAN = "restore (fresh process, freed returned)"
LEAN_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
PHASES = ("init (function)", "init (host arrays)", "2 train steps", "save", "restore", FRESH, LEAN)
VARIANTS = ("gspmd", "optim", "optim_grads", "fsdp", "optim+offload", "fsdp+offload")
MiB = 2**20
D, FFN = 1024, 4096


def _status(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise KeyError(field)


class Phase:
  """Peak host memory growth of the code inside `with Phase(...)`."""

  def __init__(self, name: str, out: dict):
    self.name, self.out = name, out

  def __enter__(self):
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # return freed heap to the system first
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")  # reset VmHWM to the current resident size
    self.start, self.t = _status("VmRSS"), time.time()
    return self

  def __exit__(self, *exc):
    if exc[0] is None:
      self.out[self.name] = {"grow": _status("VmHWM") - self.start, "s": time.time() - self.t}
      print(f"  {self.name}: {self.out[self.name]['grow'] / MiB:.0f} MiB", file=sys.stderr)


def worker(
  variant: str,
  layers: int,
  directory: str,
  save_gb: float | None = None,
  mode: str = "job",
) -> dict:
  """One job of `variant`, phase by phase: `{phase: {"grow": bytes, "s": seconds}}`.

  `mode`: "job" every phase but the fresh restore; "save" only what a checkpoint to restore
  takes (init from the function, the steps, the save); "restore" only the restore of the
  checkpoint in `directory`, the one thing this process does (a job resumed);
  "restore-lean" the same, named as run with `LEAN_ENV` set."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jaxdp  # before JAX: it imports JAX without the CUDA plugin's driver-probe lines
  import jax

  jax.config.update("jax_num_cpu_devices", 8)
  import jax.numpy as jnp
  import numpy as np
  import optax
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from gspmd_baselines import PROGRAMS, Problem, jit_step

  mesh = jax.make_mesh((8,), ("data",))
  tx = optax.adamw(1e-4, weight_decay=0.1)

  def init_fn():
    keys = jax.random.split(jax.random.key(0), 2 * layers)
    return {
      "blocks": [
        {
          "w1": jax.random.normal(keys[2 * i], (D, FFN)) * 0.02,
          "w2": jax.random.normal(keys[2 * i + 1], (FFN, D)) * 0.02,
        }
        for i in range(layers)
      ]
    }

  def make_loss(constrain=None):
    keep = constrain or (lambda h: h)

    def loss_fn(params, batch):
      h = keep(batch["x"])
      for w in params["blocks"]:
        h = keep(h + jax.nn.gelu(keep(h) @ w["w1"]) @ w["w2"])
      return jnp.mean(h**2)

    return loss_fn

  rng = np.random.default_rng(0)
  batch = jax.device_put(
    {"x": rng.standard_normal((16, 32, D), np.float32)}, NamedSharding(mesh, P("data"))
  )
  # a pretrained checkpoint read by a loader: NumPy's own memory (a view of an XLA:CPU
  # buffer instead would be device memory already, which the transfer aliases)
  host = jax.tree.map(np.array, jax.jit(init_fn)()) if mode == "job" else None
  out = {}
  if variant == "gspmd":
    # Auto axes, MaxText's default shard_mode: GSPMD places what the shardings leave open
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    abstract = jax.eval_shape(init_fn)
    problem = Problem(abstract, batch, make_loss, D)
    step, place = jit_step(PROGRAMS["gspmd_fsdp"], problem, tx, mesh)
    shard = lambda specs: jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    p_sh, o_sh = shard(place.params), shard(place.opt_state)
    opt_init = jax.jit(tx.init, out_shardings=o_sh)
    ckpt = ocp.StandardCheckpointer()
    path = os.path.join(directory, "gspmd")

    def restore(phase):
      with Phase(phase, out):
        target = jax.tree.map(
          lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
          {"params": abstract, "opt_state": jax.eval_shape(tx.init, abstract)},
          {"params": p_sh, "opt_state": o_sh},
        )
        restored = ckpt.restore(path, target)
        jax.block_until_ready(restored)

    if mode.startswith("restore"):
      restore(LEAN if mode == "restore-lean" else FRESH)
      ckpt.close()
      return out
    with Phase("init (function)", out):
      params = jax.jit(init_fn, out_shardings=p_sh)()
      opt_state = opt_init(params)
      jax.block_until_ready((params, opt_state))
    if mode == "job":
      del params, opt_state
      with Phase("init (host arrays)", out):
        params = jax.device_put(host, p_sh)
        opt_state = opt_init(params)
        jax.block_until_ready((params, opt_state))
    with Phase("2 train steps", out):
      for _ in range(2):
        params, opt_state, loss = step(params, opt_state, batch)
      jax.block_until_ready(loss)
    with Phase("save", out):
      ckpt.save(path, {"params": params, "opt_state": opt_state})
      ckpt.wait_until_finished()
    del params, opt_state
    if mode == "job":
      restore("restore")
    ckpt.close()
    return out

  name, offload = variant.removesuffix("+offload"), variant.endswith("+offload")
  strategy = {"fsdp": "optim_grads_params"}.get(name, name)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, optimizer_cpu_offload=offload)
  mgr = jaxdp.CheckpointManager(os.path.join(directory, variant), save_concurrent_gb=save_gb)

  def restore(phase):
    with Phase(phase, out):
      state = mgr.restore(jaxdp.abstract_state(init_fn, tx, mesh, config))
      jax.block_until_ready(state)

  if mode.startswith("restore"):
    restore(LEAN if mode == "restore-lean" else FRESH)
    mgr.close()
    return out
  train_step = jaxdp.make_train_step(make_loss(), tx, mesh, config)
  with Phase("init (function)", out):
    state = jaxdp.init_state(init_fn, tx, mesh, config)
    jax.block_until_ready(state)
  if mode == "job":
    del state
    with Phase("init (host arrays)", out):
      state = jaxdp.init_state(host, tx, mesh, config)
      jax.block_until_ready(state)
  with Phase("2 train steps", out):
    for _ in range(2):
      state, metrics = train_step(state, batch)
    jax.block_until_ready(metrics)
  with Phase("save", out):
    mgr.save(2, state)
    mgr.wait_until_finished()
  del state
  if mode == "job":
    restore("restore")
  mgr.close()
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--mib", type=int, default=128, help="f32 params, a multiple of 32")
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
  parser.add_argument(
    "--repeat",
    type=int,
    default=1,
    help="run each variant this many times (in turn) and keep each phase's least growth: "
    "a high-water mark depends on which of glibc's arenas serve each thread",
  )
  parser.add_argument(
    "--save-concurrent-gb",
    type=float,
    help="jaxdp's CheckpointManager(save_concurrent_gb=): GB being written at once",
  )
  parser.add_argument(
    "--restore-only",
    action="store_true",
    help="measure only the restores in fresh processes, with glibc's defaults and freed "
    "returned (each run saves the checkpoint first, from init and 2 steps, unmeasured)",
  )
  parser.add_argument("--json", help="also write each variant's phases (bytes) to this file")
  parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
  parser.add_argument("--mode", default="job", help=argparse.SUPPRESS)
  parser.add_argument("--dir", help=argparse.SUPPRESS)
  args = parser.parse_args()
  layers = max(1, args.mib // 32)
  if args.worker:
    print(json.dumps(worker(args.worker, layers, args.dir, args.save_concurrent_gb, args.mode)))
    return
  if "gspmd" not in args.variants:
    args.variants = ["gspmd", *args.variants]
  model = layers * 2 * D * FFN * 4
  phases = (FRESH, LEAN) if args.restore_only else PHASES
  results = {}
  runs = args.repeat * len(args.variants)
  print(
    f"{runs} runs ({len(args.variants)} variants x {args.repeat}), each a fresh process: "
    + (
      "init, 2 train steps, a save"
      if args.restore_only
      else "init twice, 2 train steps, a save, a restore"
    )
    + "; then one more, which restores that checkpoint (docs/sharded-job.md gives the "
    "command's time)",
    file=sys.stderr,
  )
  start = time.time()
  with tempfile.TemporaryDirectory() as directory:
    for run in range(args.repeat):
      for k, variant in enumerate(args.variants):
        done_runs = run * len(args.variants) + k
        left = ""
        if done_runs:
          per_run = (time.time() - start) / done_runs
          left = f"; about {per_run * (runs - done_runs) / 60:.0f} min left"
        print(
          f"{variant} ({layers} blocks, {model / MiB:.0f} MiB of params), run {run + 1} of "
          f"{args.repeat} ({done_runs + 1} of {runs}{left}) ...",
          file=sys.stderr,
          flush=True,
        )
        got = {}
        # the job (or only its save), then the restore of its checkpoint in a fresh process
        for mode in ("save" if args.restore_only else "job", "restore", "restore-lean"):
          print(f" {mode}:", file=sys.stderr, flush=True)
          done = subprocess.run(
            [
              sys.executable,
              __file__,
              "--worker",
              variant,
              "--mode",
              mode,
              "--mib",
              str(args.mib),
              "--dir",
              directory,
              *(
                ["--save-concurrent-gb", str(args.save_concurrent_gb)]
                if args.save_concurrent_gb
                else []
              ),
            ],
            stdout=subprocess.PIPE,
            text=True,
            check=True,
            env={**os.environ, **(LEAN_ENV if mode == "restore-lean" else {})},
          )
          got.update(json.loads(done.stdout.strip().splitlines()[-1]))
        shutil.rmtree(os.path.join(directory, variant))  # the next run saves afresh
        best = results.setdefault(variant, got)
        for phase in phases:
          best[phase]["grow"] = min(best[phase]["grow"], got[phase]["grow"])
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"model": model, "results": results}, f, indent=1)
  print(
    f"\nPeak host memory growth per phase, in multiples of the model ({model / MiB:.0f} MiB "
    "of f32 params), 8 CPU devices in one process; ratio: over the GSPMD way's same phase\n"
  )
  head = "| phase | GSPMD way |" + "".join(f" jaxdp {v} | ratio |" for v in args.variants[1:])
  print(head)
  print("|---|---:|" + "---:|---:|" * (len(args.variants) - 1))
  for phase in phases:
    base = results["gspmd"][phase]["grow"]
    row = f"| {phase} | {base / model:.2f} |"
    for v in args.variants[1:]:
      grow = results[v][phase]["grow"]
      row += f" {grow / model:.2f} | {grow / base:.2f} |"
    print(row)


if __name__ == "__main__":
  main()
