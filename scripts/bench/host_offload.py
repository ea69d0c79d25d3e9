"""Host offload of the master params and optimizer state, compiled for H100s without a GPU.

For `models/llama.py` at a given shape on N H100s (8 per host), jaxdp's FSDP
(`FSDPConfig(stacked=["blocks"])`, AdamW, fp32 params cast to bf16 where used, 1 x 2048
tokens per GPU) with and without `DDPConfig(optimizer_cpu_offload=True)`: the per-device peak
of the compiled step (`memory_analysis()`), the bytes each device keeps in host memory (the
program's host arguments, and `memory_ledger`'s `host`), the host memory of one 8-GPU host,
and the step time XLA's cost model predicts (`jaxdp.inspect.predict_step`), its host copies
timed at `jaxdp._src.inspect.HOST_LINK_BYTES_PER_S` each way (the cost model gives copies no
time).

Shapes (`--shape`): `8b` (Llama-3-8B: d 4096, GQA 32/8, SwiGLU 14336), `70b` (Llama-3-70B:
d 8192, GQA 64/8, SwiGLU 28672); vocabulary 128,256 both; `--layers` (default: the model's,
32 or 80).

Usage:
    python scripts/bench/host_offload.py --shape 8b --gpus 8        # two compiles, minutes
    python scripts/bench/host_offload.py --shape 70b --gpus 8
    python scripts/bench/host_offload.py --shape 70b --gpus 64
    python scripts/bench/host_offload.py --quick                    # a d 64 model, seconds
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxdp  # before JAX: it imports JAX without the CUDA plugin's driver-probe lines
import jax
import optax

from jaxdp import inspect
from jaxdp._src.inspect import HOST_LINK_BYTES_PER_S
from fsdp_memory import problem

SHAPES = {
  "8b": dict(d=4096, n_head=32, n_kv_head=8, ffn=14336, layers=32),
  "70b": dict(d=8192, n_head=64, n_kv_head=8, ffn=28672, layers=80),
}
TX = optax.adamw(1e-4)
GiB = 2**30


def measure(made, mesh, offload: bool) -> dict:
  """One compile: its peak, host bytes and predicted times."""
  config = jaxdp.DDPConfig(
    data_parallel_sharding_strategy="optim_grads_params", optimizer_cpu_offload=offload
  )
  fsdp = jaxdp.FSDPConfig(stacked=["blocks"])
  start = time.perf_counter()
  compiled = inspect.compile_train_step(
    made.make_loss(), TX, mesh, config, made.params, made.batch, fsdp=fsdp
  )
  seconds = time.perf_counter() - start
  analysis = compiled.memory_analysis()
  prediction = inspect.predict_step(compiled)
  ledger = inspect.memory_ledger(made.params, TX, mesh.shape["data"], config, fsdp=fsdp)
  host = prediction.host_us
  return {
    "peak GiB": inspect.memory_stats(compiled).peak_bytes / GiB,
    "host args GiB": analysis.host_argument_size_in_bytes / GiB,
    "ledger host GiB": ledger.host / GiB,
    "ledger device state GiB": (ledger.params + ledger.master + ledger.opt_state) / GiB,
    "step ms": prediction.step_us / 1e3,
    "compute ms": prediction.compute_us / 1e3,
    "comm ms": prediction.comm_us["total"] / 1e3,
    "exposed comm ms": prediction.exposed_us["total"] / 1e3,
    "host copies ms": host.get("total", 0.0) / 1e3,
    "exposed host ms": prediction.host_exposed_us.get("total", 0.0) / 1e3,
    "compile s": seconds,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", choices=list(SHAPES), default="8b")
  parser.add_argument("--layers", type=int, help="default: the model's (32 or 80)")
  parser.add_argument("--gpus", type=int, default=8, help="H100s, 8 per host")
  parser.add_argument("--quick", action="store_true", help="a 2-layer d 64 model (seconds)")
  parser.add_argument("--json", help="also write every number to this file")
  args = parser.parse_args()
  if args.gpus < 1 or (args.gpus > 8 and args.gpus % 8):
    parser.error(f"--gpus {args.gpus}: use 1 to 8, or a multiple of 8 (8 per host)")
  reason = inspect.gpu_compile_unavailable()
  if reason:
    sys.exit(f"cannot compile for GPU here: {reason}")
  shape = dict(SHAPES[args.shape])
  layers = args.layers or shape.pop("layers")
  shape.pop("layers", None)
  if args.quick:
    shape, layers = {}, args.layers or 2
  made = problem(
    "llama", layers, scanned=True, remat=True, small=args.quick, batch=args.gpus, **shape
  )
  hosts = max(1, args.gpus // 8)
  mesh = inspect.gpu_mesh((args.gpus,), ("data",), num_hosts=hosts)
  count = sum(x.size for x in jax.tree.leaves(made.params))
  results = {}
  for offload in (False, True):
    results[offload] = measure(made, mesh, offload)
    print(f"  offload={offload}: {results[offload]['compile s']:.0f} s", file=sys.stderr)
  per_host = min(args.gpus, 8)
  command = "python scripts/bench/host_offload.py" + "".join(f" {a}" for a in sys.argv[1:])
  print(
    f"Command: `{command}`\n\nllama {args.shape}, {layers} layers ({count / 1e9:.2f}B params), "
    f"FSDP on {args.gpus} x H100 ({hosts} host{'s' if hosts > 1 else ''}), 1 x "
    f"{made.batch['x'].shape[1]} tokens per GPU, AdamW; host copies at "
    f"{HOST_LINK_BYTES_PER_S / 1e9:.0f} GB/s each way per GPU.\n"
  )
  columns = list(results[False])
  print("| | " + " | ".join(columns) + " | host GiB per 8-GPU host |")
  print("|---|" + "---:|" * (len(columns) + 1))
  for offload, numbers in results.items():
    cells = " | ".join(f"{numbers[c]:.2f}" for c in columns)
    print(f"| offload={offload} | {cells} | {numbers['host args GiB'] * per_host:.1f} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({str(k): v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
  main()
