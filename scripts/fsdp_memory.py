"""Peak GPU memory of one train step per strategy, compiled for 8 H100s without a GPU.

For a GPT (GPT-2 small width: d 768, 12 heads, vocab 50304; seq 128, one sequence per GPU,
fp32, AdamW) with 4, 8, 12 and 16 layers, the train step of each strategy is compiled for
an 8×H100 target (deviceless: `jax-cuda12-plugin` + the H100 target description; nothing
runs) and `compiled.memory_analysis()` gives the per-device peak (arguments + outputs +
temporaries − donated aliases). The table shows, per strategy and layer count, the peak
and the resident train state; then how much each peak grows per added layer, next to one
unit (one layer's params, gathered, in the param dtype).

Rows: DDP (no_shard), ZeRO-1 (optim) and FSDP (optim_grads_params) on the unrolled GPT,
and FSDP on the scanned GPT (`scan_layers=True`, `FSDPConfig(stacked=["blocks"])`).

What it shows: FSDP < ZeRO-1 < DDP at every depth. DDP's peak grows per layer by the
layer's params + grads + Adam moments (~4 units), ZeRO-1's by its params and grads
(~2 units) plus activations. Scanned FSDP's grows by the layer's 1/dp share of its state
plus its activations: about one unit, not the model. Unrolled FSDP grows by one unit
more: there XLA's latency hiding scheduler (which ignores memory far below the device's
80 GB) starts every unit's reduce-scatter after the whole backward, so each unit's
full-size fp32 grads stay live until then; in the scan each layer's reduce-scatter runs in
its own iteration of the backward loop.

Usage:
    python scripts/fsdp_memory.py                   # ~1 hour on 2 busy cores (unrolled)
    python scripts/fsdp_memory.py --layers 8 16 --d-model 256 --seq 32 --scan   # minutes
    python scripts/fsdp_memory.py --scan            # every strategy on the scanned GPT

With `--scan`, ZeRO-1 shards each stacked leaf on the dim after its layer axis (the one
that needs no padding), so any layer count works.
"""

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdp
from jaxdp._src import aot
from jaxdp import FSDPConfig
from models.gpt import GPT, GPTConfig, gpt_loss

STRATEGIES = ("no_shard", "optim", "optim_grads_params")
LAYERS = (4, 8, 12, 16)
VARIANTS = (  # (row label, strategy, scanned layers)
    ("no_shard", "no_shard", False),
    ("optim", "optim", False),
    ("optim_grads_params", "optim_grads_params", False),
    ("optim_grads_params scan", "optim_grads_params", True),
)
MiB = 2**20


def compile_step(n_layer, strategy, *, scan, d_model=768, n_head=12, seq=128, batch=8,
                 vocab=50304, dtype=jnp.float32):
  """The train step of `strategy` for an n_layer GPT, compiled for 8 H100s."""
  mesh = aot.gpu_mesh((8,), ("data",))
  config = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=n_layer, n_head=n_head,
                     d_model=d_model, scan_layers=scan, param_dtype=dtype)
  model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
  params, loss_fn = jaxdp.nnx_split(model, gpt_loss)
  tx = optax.adamw(1e-4)
  ddp = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  fsdp = FSDPConfig(stacked=["blocks"] if scan else []) \
      if strategy == "optim_grads_params" else None
  state = jax.eval_shape(lambda p: jaxdp.init_state(p, tx, mesh, ddp, fsdp=fsdp), params)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=NamedSharding(mesh, P("data")))
  step = jaxdp.make_train_step(loss_fn, tx, mesh, ddp, fsdp=fsdp)
  compiled = step.lower(state, {"x": tokens, "y": tokens}).compile()
  unit = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params["blocks"])) // n_layer
  return compiled, unit


def measure(layers=LAYERS, variants=VARIANTS, **kw):
  """`{(row label, n_layer): {"peak", "state", "temp"} bytes}` and one unit's bytes."""
  out, unit = {}, None
  for label, strategy, scan in variants:
    for n in layers:
      compiled, unit = compile_step(n, strategy, scan=scan, **kw)
      m = compiled.memory_analysis()
      out[label, n] = {
          "peak": m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                  - m.alias_size_in_bytes,
          "state": m.argument_size_in_bytes, "temp": m.temp_size_in_bytes}
      print(f"  compiled {label:<24} {n:>2} layers: peak "
            f"{out[label, n]['peak'] / MiB:9.1f} MiB", file=sys.stderr, flush=True)
  return out, unit


def growth(stats, label, layers):
  """Peak bytes added per added layer (least squares over the layer counts)."""
  xs = list(layers)
  ys = [stats[label, n]["peak"] for n in xs]
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def table(stats, unit, layers=LAYERS, labels=tuple(v[0] for v in VARIANTS)) -> str:
  lines = ["peak bytes per device (MiB), 8x H100, one train step; (st: resident state = "
           "params, master, optimizer state)",
           f"{'strategy':<25}" + "".join(f"{f'{n} layers':>22}" for n in layers)]
  for s in labels:
    lines.append(f"{s:<25}" + "".join(
        f"{stats[s, n]['peak'] / MiB:>11.1f} (st {stats[s, n]['state'] / MiB:>6.1f})"
        for n in layers))
  lines.append(f"one unit (a layer's params, gathered): {unit / MiB:.1f} MiB")
  for s in labels:
    g = growth(stats, s, layers)
    lines.append(f"  {s:<24} peak grows {g / MiB:7.1f} MiB per layer = {g / unit:5.2f} units")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, nargs="+", default=list(LAYERS))
  parser.add_argument("--d-model", type=int, default=768)
  parser.add_argument("--n-head", type=int, default=12)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--batch", type=int, default=8, help="global batch (1 per GPU)")
  parser.add_argument("--vocab", type=int, default=50304)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--scan", action="store_true", help="every strategy on scanned layers")
  args = parser.parse_args()
  reason = aot.gpu_compile_unavailable()
  if reason:
    sys.exit(f"cannot compile for GPU here: {reason}")
  kw = dict(d_model=args.d_model, n_head=args.n_head, seq=args.seq, batch=args.batch,
            vocab=args.vocab, dtype=jnp.dtype(args.dtype))
  variants = tuple((s, s, True) for s in STRATEGIES) if args.scan else VARIANTS
  stats, unit = measure(tuple(args.layers), variants, **kw)
  print(table(stats, unit, tuple(args.layers), tuple(v[0] for v in variants)))


if __name__ == "__main__":
  main()
