"""HSDP with grad accumulation across hosts: what crosses "replica" per step, predicted.

One model, compiled for N H100s over N / 8 hosts without a GPU (nothing runs) on a
`("replica", "data")` mesh: "data" the 8 GPUs of a host (NVLink), "replica" across the hosts
(`jaxdp.inspect.gpu_mesh((N // 8, 8), ("replica", "data"), num_hosts=N // 8)`), with
`DDPConfig(num_distributed_optimizer_instances=N // 8)` and `grad_accum_steps=k`. For ZeRO-2
(`optim_grads`, `DDPConfig(stacked=["blocks"])`) and FSDP (`optim_grads_params`,
`FSDPConfig(stacked=["blocks"])`; `--unrolled`: the blocks a Python loop, no `stacked`),
each row reports: the ring bytes per device per step of
the collectives whose groups span hosts, read off the compiled program (every loop trip
counted), and how many of them run; `jaxdp.inspect.ring_formula`'s all-reduce bytes (on this
mesh, all of them across "replica"); the step, its communication and the exposed part of it
from `jaxdp.inspect.predict_step` (XLA's cost model replayed over the compiled schedule: an
estimate, not a measurement).

Before and after a change to jaxdp, the same script on each tree (`--save`, then
`--compare`), as scripts/tools/hlo_fingerprints.py does; the tree imported is the one first
on PYTHONPATH:

    git archive <commit before> jaxdp | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before python scripts/bench/hsdp_accumulation.py --save /tmp/before.json
    python scripts/bench/hsdp_accumulation.py --compare /tmp/before.json   # the table

Usage (one compile at a time, about a minute each for the 12-layer GPT on 64 GPUs, 2 cores):
    python scripts/bench/hsdp_accumulation.py                  # GPT-2 small, 64 GPUs, k = 4
    python scripts/bench/hsdp_accumulation.py --k 8 --gpus 128
    python scripts/bench/hsdp_accumulation.py --quick          # a 2-layer d 64 GPT: seconds
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The repository's models and the bench helpers; jaxdp from PYTHONPATH first (the tree measured)
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jaxdp  # before JAX: it imports JAX without the CUDA plugin's driver-probe lines
import jax
import optax

from jaxdp import inspect
from fsdp_memory import problem

TX = optax.adamw(1e-4)
MiB, MS = 2**20, 1e-3  # bytes, microseconds -> ms
STRATEGIES = {"ZeRO-2 (`optim_grads`)": "optim_grads", "FSDP (`optim_grads_params`)": "fsdp"}


def configs(strategy: str, replicas: int, scanned: bool):
  """`(DDPConfig, FSDPConfig or None)` of a row, HSDP over `replicas`; `scanned`: the
  blocks are stacked (`stacked=["blocks"]`)."""
  stacked = ["blocks"] if scanned else []
  if strategy == "fsdp":
    config = jaxdp.DDPConfig(
      data_parallel_sharding_strategy="optim_grads_params",
      num_distributed_optimizer_instances=replicas,
    )
    return config, jaxdp.FSDPConfig(stacked=stacked)
  config = jaxdp.DDPConfig(
    data_parallel_sharding_strategy=strategy,
    num_distributed_optimizer_instances=replicas,
    stacked=stacked,
  )
  return config, None


def across_hosts(schedule, per_host: int) -> list:
  """The collectives whose groups hold devices of more than one host (partition id //
  `per_host`: the mesh's devices are laid out host by host)."""
  return [
    c
    for c in schedule.collectives
    if any(len({device // per_host for device in g}) > 1 for g in c.replica_groups)
  ]


def measure(strategy: str, made, mesh, k: int, scanned: bool) -> dict:
  """One row compiled: bytes across hosts, the ring formula's all-reduce, predicted times."""
  replicas = mesh.shape["replica"]
  config, fsdp = configs(strategy, replicas, scanned)
  start = time.perf_counter()
  compiled = inspect.compile_train_step(
    made.make_loss(), TX, mesh, config, made.params, made.batch, fsdp=fsdp, grad_accum_steps=k
  )
  seconds = time.perf_counter() - start
  crossing = across_hosts(inspect.schedule(compiled), mesh.shape["data"])
  prediction = inspect.predict_step(compiled)
  extra = {"fsdp": fsdp} if fsdp is not None else {}
  state = jax.eval_shape(lambda p: jaxdp.init_state(p, TX, mesh, config, **extra), made.params)
  formula = inspect.ring_formula(state, grad_accum_steps=k, **extra)
  return {
    "replica MiB": sum(c.ring_bytes * c.trip_count for c in crossing) / MiB,
    "replica runs": sum(c.trip_count for c in crossing),
    "formula all-reduce MiB": formula.get("all-reduce", 0.0) / MiB,
    "step ms": prediction.step_us * MS,
    "comm ms": prediction.comm_us["total"] * MS,
    "exposed ms": prediction.exposed_us["total"] * MS,
    "compile s": seconds,
  }


COLUMNS = ("replica MiB", "replica runs", "formula all-reduce MiB", "step ms", "exposed ms")


def table(before: dict, after: dict) -> list:
  """Markdown lines: a row per strategy, each cell `before -> after`."""
  lines = [
    "| strategy | " + " | ".join(COLUMNS) + " | step saved |",
    "|---|" + "---:|" * (len(COLUMNS) + 1),
  ]
  for label, strategy in STRATEGIES.items():
    old, new = before[strategy], after[strategy]
    if "error" in old or "error" in new:
      print(f"{label}: before {old.get('error', 'compiled')}, after {new.get('error', 'compiled')}")
      old = {c: float("nan") for c in COLUMNS} if "error" in old else old
      new = {c: float("nan") for c in COLUMNS} if "error" in new else new
    cells = [
      f"{old[c]:.0f} → {new[c]:.0f}" if c == "replica runs" else f"{old[c]:.2f} → {new[c]:.2f}"
      for c in COLUMNS
    ]
    saved = old["step ms"] - new["step ms"]
    cells.append(f"{saved:.2f} ms ({100 * saved / old['step ms']:.0f}%)")
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  return lines


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gpus", type=int, default=64, help="H100s, 8 per host (a multiple of 16)")
  parser.add_argument("--k", type=int, default=4, help="grad_accum_steps")
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--seqs-per-gpu", type=int, default=1, help="per micro-batch")
  parser.add_argument("--unrolled", action="store_true", help="the blocks a Python loop")
  parser.add_argument("--quick", action="store_true", help="a 2-layer d 64 GPT (seconds)")
  parser.add_argument("--save", help="write the rows to this json")
  parser.add_argument("--compare", help="a json --save wrote on the tree before: the table")
  args = parser.parse_args()
  if args.gpus % 8 or args.gpus < 16:
    parser.error(f"--gpus {args.gpus}: use a multiple of 8 over two hosts or more")
  if args.k < 1:
    parser.error(f"--k {args.k}: use 1 or more micro-batches")
  reason = inspect.gpu_compile_unavailable()
  if reason:
    sys.exit(f"cannot compile for GPU here: {reason}")
  hosts = args.gpus // 8
  mesh = inspect.gpu_mesh((hosts, 8), ("replica", "data"), num_hosts=hosts)
  layers = 2 if args.quick else args.layers
  seq = {} if args.quick else {"seq": 1024}
  made = problem(
    "gpt",
    layers,
    scanned=not args.unrolled,
    remat=True,
    small=args.quick,
    batch=args.seqs_per_gpu * args.gpus * args.k,
    **seq,
  )
  rows = {}
  for label, strategy in STRATEGIES.items():
    try:
      rows[strategy] = measure(strategy, made, mesh, args.k, not args.unrolled)
    except (TypeError, ValueError) as error:  # a tree that cannot compile a row: the table says
      rows[strategy] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    print(f"  {label}: {rows[strategy]}", file=sys.stderr, flush=True)
  count = sum(x.size for x in jax.tree.leaves(made.params))
  command = "python scripts/bench/hsdp_accumulation.py" + "".join(f" {a}" for a in sys.argv[1:])
  record = {
    "command": command,
    "jaxdp": os.path.dirname(os.path.dirname(os.path.abspath(jaxdp.__file__))),
    "setup": f"GPT {layers} {'unrolled' if args.unrolled else 'scanned'} layers ({count / 1e6:.0f}M params, fp32, AdamW), "
    f"{args.gpus} x H100 over {hosts} hosts, mesh (replica={hosts}, data=8), "
    f"k={args.k} micro-batches of {args.seqs_per_gpu} x {made.batch['x'].shape[1]} tokens per GPU",
    "rows": rows,
  }
  if args.save:
    with open(args.save, "w") as f:
      json.dump(record, f, indent=1)
  if args.compare:
    with open(args.compare) as f:
      before = json.load(f)
    print(f"{record['setup']}; before → after (`{before['command']}` on the tree before):\n")
    print("\n".join(table(before["rows"], rows)))


if __name__ == "__main__":
  main()
