"""Peak GPU memory of one train step: jaxdp's strategies beside plain GSPMD, 8 x H100.

Every program is compiled for an 8 x H100 target without a GPU (`jax-cuda12-plugin` + the
H100 target description; nothing runs) and `memory_analysis()` gives the per-device peak
(`jaxdp.inspect.memory_stats`). Adam, fp32 params.

Models (`--model`):

* `mlp`: a residual MLP, blocks `h + gelu(h @ W1) @ W2` (d 1024, ffn 4096; one
  layer's params = 32 MiB), loss `mean(h ** 2)`, global batch 64 x 256 tokens.
* `gpt`: `models/gpt.py` (d 768, 12 heads, vocab 50304, seq 128, one sequence per GPU);
  jaxdp's FSDP gathers its tied `wte` in `--wte-chunks` row blocks (default 16:
  `FSDPConfig(chunks={"wte": 16})`).
* `llama`: `models/llama.py` (Llama-3-8B's width: d 4096, GQA 32 / 8 heads, SwiGLU 14336,
  untied 128,256-token `embed` and `out`, f32 params cast to bf16 where used; 2 x 2048
  tokens per GPU); jaxdp's FSDP gathers `embed` and `out` in `--wte-chunks` row blocks.

each unrolled (a Python loop over the blocks) or scanned (`lax.scan` over stacked blocks),
with each block under the user's `jax.checkpoint` (`--remat`, the default) or not.

Rows: the GSPMD programs of scripts/bench/gspmd_baselines.py (`jax.jit` of `value_and_grad`
+ `tx.update`, `NamedSharding`s; what a MaxText user writes, the activations constrained
batch-sharded over "data" at the embedding output and every block's input and output): DDP =
everything replicated, ZeRO-1 = optimizer state sharded (MaxText's
`shard_optimizer_over_data`), FSDP = params and optimizer state sharded over "data" on each
weight's embed (d_model) dim (MaxText's `embed -> fsdp`); and, labelled, that FSDP without the
activation constraints. Then jaxdp's `no_shard` (DDP), `optim` (ZeRO-1;
`DDPConfig(stacked=["blocks"])` when scanned) and `optim_grads_params` (FSDP,
`FSDPConfig(stacked=["blocks"])` when scanned). Last: each row's growth per added layer
(least squares over the layer counts).

Usage:
    python scripts/bench/fsdp_memory.py --model mlp --layers 4 8              # ~10 min, 2 cores
    python scripts/bench/fsdp_memory.py --model gpt --layers 4 8 --scanned
    python scripts/bench/fsdp_memory.py --model mlp --layers 4 8 16 --both-forms --no-remat
    python scripts/bench/fsdp_memory.py --small ...   # d 64, ffn 256, batch 8 x 16: seconds
    python scripts/bench/fsdp_memory.py --both-forms --bucket-size 16000000 \
        --programs "jaxdp no_shard" "jaxdp optim"   # DDP / ZeRO-1 with smaller buckets
"""

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gspmd_baselines, when imported

import functools

import jaxdp  # before JAX: it imports JAX without the CUDA plugin's driver-probe lines
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdp import FSDPConfig
from jaxdp import inspect as jinspect
from gspmd_baselines import PROGRAMS as BASELINES, Problem, compile_step
from models.gpt import GPT, GPTConfig, gpt_loss
from models.llama import LlamaConfig, abstract_params, llama_loss

GSPMD = {p.label: p for p in BASELINES.values()}  # "GSPMD DDP", ..., by their table labels
JAXDP = {"jaxdp no_shard": "no_shard", "jaxdp optim": "optim", "jaxdp FSDP": "optim_grads_params"}
PROGRAMS = (*GSPMD, *JAXDP)
MiB = 2**20
DP = 8


# ----------------------------------------------------------------------------- models


def mlp_block(h, w):
  return h + jax.nn.gelu(h @ w["w1"]) @ w["w2"]


def mlp_problem(n_layer, *, scanned, remat, d=1024, ffn=4096, batch=64, seq=256, vocab=None):
  """The residual MLP: abstract params, its loss (the activations' hook on the input and on
  every block's input and output), abstract global batch."""
  f32 = jnp.float32
  if scanned:
    blocks = {
      "w1": jax.ShapeDtypeStruct((n_layer, d, ffn), f32),
      "w2": jax.ShapeDtypeStruct((n_layer, ffn, d), f32),
    }
  else:
    blocks = [
      {"w1": jax.ShapeDtypeStruct((d, ffn), f32), "w2": jax.ShapeDtypeStruct((ffn, d), f32)}
      for _ in range(n_layer)
    ]

  def make_loss(constrain=None):
    keep = constrain or (lambda h: h)
    block = lambda h, w: keep(mlp_block(keep(h), w))
    block = jax.checkpoint(block) if remat else block

    def loss_fn(params, batch):
      h = keep(batch["x"])
      if scanned:
        h, _ = jax.lax.scan(lambda h, w: (block(h, w), None), h, params["blocks"])
      else:
        for w in params["blocks"]:
          h = block(h, w)
      return jnp.mean(h**2)

    return loss_fn

  batch = {"x": jax.ShapeDtypeStruct((batch, seq, d), f32)}
  return Problem({"blocks": blocks}, batch, make_loss, d, ("blocks",) if scanned else ())


def gpt_problem(n_layer, *, scanned, remat, d=768, n_head=12, vocab=50304, seq=128, batch=8):
  config = GPTConfig(
    vocab_size=vocab,
    block_size=seq,
    n_layer=n_layer,
    n_head=n_head,
    d_model=d,
    scan_layers=scanned,
    remat=remat,
  )
  model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
  params, _ = jaxdp.nnx_split(model, gpt_loss)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  make_loss = lambda constrain=None: jaxdp.nnx_split(
    model, functools.partial(gpt_loss, constrain=constrain)
  )[1]
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  stacked = ("blocks",) if scanned else ()
  return Problem(params, {"x": tokens, "y": tokens}, make_loss, d, stacked)


def llama_problem(
  n_layer,
  *,
  scanned,
  remat,
  d=4096,
  n_head=32,
  n_kv_head=8,
  ffn=14336,
  vocab=128256,
  seq=2048,
  batch=16,
):
  config = LlamaConfig(
    vocab=vocab,
    d=d,
    n_layer=n_layer,
    n_head=n_head,
    n_kv_head=n_kv_head,
    ffn=ffn,
    scan_layers=scanned,
    remat=remat,
  )
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  make_loss = functools.partial(llama_loss, config)
  stacked = ("blocks",) if scanned else ()
  return Problem(abstract_params(config), {"x": tokens, "y": tokens}, make_loss, d, stacked)


SMALL = {
  "mlp": dict(d=64, ffn=256, batch=8, seq=16),
  "gpt": dict(d=64, n_head=4, vocab=256, seq=16, batch=8),
  "llama": dict(d=64, n_head=4, n_kv_head=2, ffn=128, vocab=256, seq=16, batch=8),
}


def problem(model, n_layer, *, scanned, remat, small=False, **kw):
  make = {"mlp": mlp_problem, "gpt": gpt_problem, "llama": llama_problem}[model]
  return make(n_layer, scanned=scanned, remat=remat, **{**(SMALL[model] if small else {}), **kw})


# ----------------------------------------------------------------------------- programs


def compile_program(
  program,
  model,
  n_layer,
  *,
  scanned,
  remat,
  small=False,
  fsdp=None,
  prefetch=1,
  bucket_size=None,
  wte_chunks=0,
  grad_reduce_dtype=None,
  **kw,
):
  """One program compiled for 8 x H100 (`kw`: the model's sizes; `bucket_size`: the
  `DDPConfig(bucket_size=)` of jaxdp's `no_shard` / `optim` rows, None: the strategy's
  default; `wte_chunks`: the GPT's jaxdp FSDP gathers `wte` in that many row blocks, 0:
  whole; `grad_reduce_dtype`: jaxdp's `DDPConfig(grad_reduce_dtype=)`)."""
  made = problem(model, n_layer, scanned=scanned, remat=remat, small=small, **kw)
  tx = optax.adam(1e-4)
  mesh = jinspect.gpu_mesh((DP,), ("data",))
  if program in GSPMD:
    return compile_step(GSPMD[program], made, tx, mesh)
  strategy = JAXDP[program]
  stacked = ["blocks"] if scanned and strategy in ("optim", "optim_grads") else []
  config = jaxdp.DDPConfig(
    data_parallel_sharding_strategy=strategy,
    bucket_size=bucket_size,
    stacked=stacked,
    grad_reduce_dtype=grad_reduce_dtype,
  )
  if strategy == "optim_grads_params":
    tables = {"gpt": ["wte"], "llama": ["embed", "out"]}.get(model, [])
    chunks = {name: wte_chunks for name in tables} if wte_chunks else {}
    fsdp = fsdp or FSDPConfig(
      stacked=["blocks"] if scanned else [], prefetch=prefetch, chunks=chunks
    )
  return jinspect.compile_train_step(
    made.make_loss(), tx, mesh, config, made.params, made.batch, fsdp=fsdp
  )


def measure(model, layers, *, scanned, remat, programs=PROGRAMS, small=False, log=True, **kw):
  """`{(program, n_layer): peak bytes}`."""
  out = {}
  for program in programs:
    for n in layers:
      t = time.time()
      compiled = compile_program(program, model, n, scanned=scanned, remat=remat, small=small, **kw)
      out[program, n] = jinspect.memory_stats(compiled).peak_bytes
      if log:
        print(
          f"  {model} {'scanned' if scanned else 'unrolled'} remat={remat} {program:<15}"
          f" L={n:>2}: {out[program, n] / MiB:8.1f} MiB ({time.time() - t:.0f} s)",
          file=sys.stderr,
          flush=True,
        )
  return out


def growth(stats, program, layers):
  """Peak bytes added per added layer (least squares over the layer counts; nan for one)."""
  xs = list(layers)
  if len(set(xs)) < 2:
    return float("nan")
  ys = [stats[program, n] for n in xs]
  mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
  return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def table(stats, layers, programs=PROGRAMS, title="") -> str:
  digits = 0 if min(stats.values()) > 50 * MiB else 2
  lines = [
    title,
    "| program | " + " | ".join(f"L = {n}" for n in layers) + " | MiB per added layer |",
    "|---|" + "---:|" * (len(layers) + 1),
  ]
  for p in programs:
    lines.append(
      f"| {p} | "
      + " | ".join(f"{stats[p, n] / MiB:.{digits}f}" for n in layers)
      + f" | {growth(stats, p, layers) / MiB:.1f} |"
    )
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=["mlp", "gpt", "llama"], default="mlp")
  parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
  form = parser.add_mutually_exclusive_group()
  form.add_argument("--scanned", action="store_true", help="scanned only")
  form.add_argument("--both-forms", action="store_true", help="unrolled and scanned")
  parser.add_argument("--no-remat", action="store_true", help="blocks without jax.checkpoint")
  parser.add_argument("--both-remat", action="store_true", help="with and without remat")
  parser.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=PROGRAMS)
  parser.add_argument("--small", action="store_true", help="a tiny model (seconds)")
  parser.add_argument("--vocab", type=int, default=50304, help="GPT vocabulary (256: bytes)")
  parser.add_argument("--prefetch", type=int, default=1, help="jaxdp FSDP's FSDPConfig(prefetch=)")
  parser.add_argument(
    "--wte-chunks",
    type=int,
    default=16,
    help="GPT and Llama, jaxdp FSDP: FSDPConfig(chunks={table: N}) for the vocabulary "
    "tables (GPT's wte; Llama's embed and out), gathered and reduce-scattered in N row "
    "blocks where they are used (0: gathered whole)",
  )
  parser.add_argument(
    "--bucket-size",
    type=int,
    default=None,
    help="DDPConfig(bucket_size=) in elements for the jaxdp no_shard / optim rows "
    "(default: the strategy's, no_shard 25 MiB of fp32, optim max(16M, 1M * dp))",
  )
  parser.add_argument(
    "--grad-reduce-dtype",
    default=None,
    help="DDPConfig(grad_reduce_dtype=) of the jaxdp rows, e.g. bfloat16: grads reduced "
    "and held in it (default: fp32, Megatron's grad_reduce_in_fp32)",
  )
  args = parser.parse_args()
  reason = jinspect.gpu_compile_unavailable()
  if reason:
    sys.exit(f"cannot compile for GPU here: {reason}")
  forms = [False, True] if args.both_forms else [args.scanned]
  remats = [True, False] if args.both_remat else [not args.no_remat]
  for scanned in forms:
    for remat in remats:
      kw = {"vocab": args.vocab} if args.model == "gpt" and not args.small else {}
      kw["prefetch"] = args.prefetch
      kw["bucket_size"] = args.bucket_size
      kw["wte_chunks"] = args.wte_chunks
      kw["grad_reduce_dtype"] = args.grad_reduce_dtype
      stats = measure(
        args.model,
        args.layers,
        scanned=scanned,
        remat=remat,
        programs=args.programs,
        small=args.small,
        **kw,
      )
      vocab = f" (vocab {args.vocab})" if "vocab" in kw else ""
      title = (
        f"\n{args.model}{vocab}, "
        f"{'scanned' if scanned else 'unrolled'}, "
        f"{'each block under jax.checkpoint' if remat else 'no remat'}: peak MiB per "
        "device, 8 x H100, Adam, fp32"
        + (f", jaxdp's grads reduced in {args.grad_reduce_dtype}" if args.grad_reduce_dtype else "")
      )
      print(table(stats, args.layers, args.programs, title), flush=True)


if __name__ == "__main__":
  main()
