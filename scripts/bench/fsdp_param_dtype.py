"""FSDP on fp32 params that the loss casts to bf16, with and without
`FSDPConfig(param_dtype=jnp.bfloat16)`, compiled for 8 x H100 without a GPU.

    python scripts/bench/fsdp_param_dtype.py --layers 2

The model is `models/llama.py` (Llama-3-shaped, f32 params cast to bf16 where the loss uses
them, scanned blocks under remat, 2 sequences of 2048 tokens per GPU). For each setting
the step's all-gather bytes per device (loop trip counts included), its largest
all-gather (a gathered layer's biggest param, or the embedding) and its peak bytes per
device (`memory_analysis()`), each as a ratio to `param_dtype=None` in the same run.
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import jaxdp  # before JAX: it imports JAX without the CUDA plugin's driver-probe lines
import jax
import jax.numpy as jnp
import optax

from jaxdp import inspect as jinspect
from models.llama import LlamaConfig, abstract_params, llama_loss

MiB = 2**20
DP = 8


def measure(n_layer, param_dtype):
  config = LlamaConfig.llama3_8b(n_layer=n_layer)
  params = abstract_params(config)
  tokens = jax.ShapeDtypeStruct((2 * DP, 2048), jnp.int32)
  ddp = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
  fsdp = jaxdp.FSDPConfig(stacked=["blocks"], param_dtype=param_dtype)
  compiled = jinspect.compile_train_step(
    llama_loss(config), optax.adamw(1e-4), DP, ddp, params, {"x": tokens, "y": tokens}, fsdp=fsdp
  )
  gathers = [c for c in jinspect.schedule(compiled).collectives if c.kind == "all-gather"]
  return {
    "all-gather bytes": sum(c.result_bytes * c.trip_count for c in gathers),
    "largest all-gather": max(c.result_bytes for c in gathers),
    "peak": jinspect.memory_stats(compiled).peak_bytes,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=2)
  args = parser.parse_args()
  base = measure(args.layers, None)
  mixed = measure(args.layers, jnp.bfloat16)
  print(f"\nLlama-3 shape, {args.layers} layers, FSDP on 8 x H100, MiB per device\n")
  print("| | param_dtype=None | param_dtype=bf16 | ratio |")
  print("|---|---:|---:|---:|")
  for k in base:
    print(f"| {k} | {base[k] / MiB:.0f} | {mixed[k] / MiB:.0f} | {mixed[k] / base[k]:.2f} |")


if __name__ == "__main__":
  main()
