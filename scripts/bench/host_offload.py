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
    python scripts/bench/host_offload.py --shape 70b --gpus 8 --programs  # + init, views, eval
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
import jax.numpy as jnp
import optax

from jax.sharding import NamedSharding

from jaxdp import inspect
from jaxdp._src import train
from jaxdp._src.aot import placed_abstract_state
from jaxdp._src.inspect import HOST_LINK_BYTES_PER_S
from fsdp_memory import SMALL, problem
from models.llama import LlamaConfig, init_params

SHAPES = {
  "8b": dict(d=4096, n_head=32, n_kv_head=8, ffn=14336, layers=32),
  "70b": dict(d=8192, n_head=64, n_kv_head=8, ffn=28672, layers=80),
}
TX = optax.adamw(1e-4)
GiB = 2**30


def job_config(offload: bool, grad_reduce_dtype=None) -> jaxdp.DDPConfig:
  return jaxdp.DDPConfig(
    data_parallel_sharding_strategy="optim_grads_params",
    optimizer_cpu_offload=offload,
    grad_reduce_dtype=grad_reduce_dtype,
  )


def measure(made, mesh, config: jaxdp.DDPConfig) -> dict:
  """One compile: its peak, host bytes and predicted times."""
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


def other_programs(made, mesh, shape: dict, layers: int, config: jaxdp.DDPConfig) -> dict:
  """Peak GiB per device of the job's other programs with offload: `init_state` from the
  model's init function, `get_params(state, sharded=True)` and the eval step. (A restore
  reads a group of leaves at a time, an eighth of the state, and moves each offloaded one
  to host memory as its group is read: no program of the whole state.)"""
  fsdp = jaxdp.FSDPConfig(stacked=["blocks"])
  sizes = {k: v for k, v in shape.items() if k in ("d", "n_head", "n_kv_head", "ffn", "vocab")}
  model = LlamaConfig(**sizes, n_layer=layers, scan_layers=True, remat=True)
  init_fn = lambda: init_params(model, jax.random.key(0))
  state = placed_abstract_state(made.params, TX, mesh, config, fsdp=fsdp)
  views = jax.jit(train.whole_params, static_argnums=(1, 2))
  eval_step = jaxdp.make_eval_step(made.make_loss(), mesh, config, fsdp=fsdp)
  batch_sharding = NamedSharding(mesh, jax.P("data"))
  batch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding), made.batch
  )
  programs = {
    "init": lambda: inspect.compile_for_gpu(
      lambda: train.init_state(init_fn, TX, mesh, config, fsdp=fsdp)
    ),
    "params": lambda: inspect.compile_for_gpu(views, state, mesh, True),
    "eval": lambda: inspect.compile_for_gpu(eval_step, state, batch),
  }
  out = {}
  for name, compile_it in programs.items():
    start = time.perf_counter()
    out[name] = inspect.memory_stats(compile_it()).peak_bytes / GiB
    print(f"  {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--shape", choices=list(SHAPES), default="8b")
  parser.add_argument("--layers", type=int, help="default: the model's (32 or 80)")
  parser.add_argument("--gpus", type=int, default=8, help="H100s, 8 per host")
  parser.add_argument("--quick", action="store_true", help="a 2-layer d 64 model (seconds)")
  parser.add_argument(
    "--grad-reduce-dtype",
    choices=["bfloat16"],
    help="DDPConfig(grad_reduce_dtype=): grads reduced and held in bf16 (half the bytes)",
  )
  parser.add_argument(
    "--programs", action="store_true", help="also the job's other programs with offload"
  )
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
  grads = jnp.bfloat16 if args.grad_reduce_dtype else None
  results = {}
  for offload in (False, True):
    results[offload] = measure(made, mesh, job_config(offload, grads))
    print(f"  offload={offload}: {results[offload]['compile s']:.0f} s", file=sys.stderr)
  per_host = min(args.gpus, 8)
  command = "python scripts/bench/host_offload.py" + "".join(f" {a}" for a in sys.argv[1:])
  print(
    f"Command: `{command}`\n\nllama {args.shape}, {layers} layers ({count / 1e9:.2f}B params), "
    f"FSDP on {args.gpus} x H100 ({hosts} host{'s' if hosts > 1 else ''}), 1 x "
    f"{made.batch['x'].shape[1]} tokens per GPU, AdamW, grads reduced in "
    f"{'bf16' if grads else 'fp32'}; host copies at "
    f"{HOST_LINK_BYTES_PER_S / 1e9:.0f} GB/s each way per GPU.\n"
  )
  columns = list(results[False])
  print("| | " + " | ".join(columns) + " | host GiB per 8-GPU host |")
  print("|---|" + "---:|" * (len(columns) + 1))
  for offload, numbers in results.items():
    cells = " | ".join(f"{numbers[c]:.2f}" for c in columns)
    print(f"| offload={offload} | {cells} | {numbers['host args GiB'] * per_host:.1f} |")
  dumped = {str(k): v for k, v in results.items()}
  if args.programs:
    sizes = SMALL["llama"] if args.quick else shape
    others = other_programs(made, mesh, sizes, layers, job_config(True, grads))
    others["step"] = results[True]["peak GiB"]
    print("\nWith offload, every program's peak GiB per device:\n")
    print("| " + " | ".join(others) + " |\n|" + "---:|" * len(others))
    print("| " + " | ".join(f"{v:.2f}" for v in others.values()) + " |")
    dumped["programs"] = others
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dumped, f, indent=1)


if __name__ == "__main__":
  main()
