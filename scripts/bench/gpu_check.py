"""One measurement on one real GPU: a jaxdp strategy at dp = 1 against plain `jax.jit`.

`scripts/bench/gpu_check.sh` runs this once per (model, variant), each in a fresh process so that
the device's peak-memory counter belongs to that variant alone, and gathers the JSON lines.

    python scripts/bench/gpu_check.py --model medium --variant jit
    python scripts/bench/gpu_check.py --model 350m --variant optim_grads_params
    python scripts/bench/gpu_check.py --model llama --variant optim_grads_params

Variants: `jit` is the program a JAX user writes on one device (`jax.jit` of
`value_and_grad` + clip + AdamW, state donated); the others are jaxdp's train step for
that strategy on a 1-device mesh. At dp = 1 every collective is a no-op, so what a jaxdp
step costs over `jit` is jaxdp's own machinery (bucket ravel/unravel, hooks, master copies).

`llama` is models/llama.py at Llama-3-8B's width (d 4096, GQA 32 / 8, SwiGLU 14336, untied
128,256-token embed and out, f32 params cast to bf16, blocks scanned under remat) with 2
layers and 1 x 2048 tokens: the shape scripts/bench/fsdp_overlap.py compares with the
MaxText-style GSPMD program, whose compute on one device is `jit`'s. Its measured against
predicted step says how far that bench's cost-model numbers are from a real GPU; its FSDP
variant uses the bench's `FSDPConfig(stacked=["blocks"])`.

Prints one JSON line: median step time over `--repeats` timed blocks of `--steps` steps,
compile time, the compiled program's memory analysis (`peak_memory_in_bytes` and parts),
the device's real `peak_bytes_in_use` after the steps, and the step time XLA's cost model
predicts for that very program (`jaxdp.inspect.predict_step`; the program is compiled with
`COST_MODEL_OPTIONS`, which leave its schedule as it is), so that the run measures the
estimate's error. Where the option or the estimate fails, the line says why and the step is
compiled and timed without it.
"""

import argparse
import json
import os
import statistics
import sys
import time

MODELS = {  # GPT sizes, vocabulary 256 bytes
  "medium": dict(n_layer=4, n_head=8, d_model=256, block_size=256, batch=32),  # 3.2M
  "350m": dict(n_layer=28, n_head=16, d_model=1024, block_size=512, batch=8),  # 352M
  "llama": dict(n_layer=2, block_size=2048, batch=1),  # 1.5B: models/llama.py, 8B's width
}
VARIANTS = ("jit", "no_shard", "optim", "optim_grads", "optim_grads_params")

parser = argparse.ArgumentParser(
  description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
)
parser.add_argument("--model", choices=list(MODELS), default="medium", help="GPT size")
parser.add_argument("--variant", choices=VARIANTS, default="jit", help="program to time")
parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
parser.add_argument("--repeats", type=int, default=5, help="timed blocks (median reported)")
parser.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
parser.add_argument(
  "--offload",
  action="store_true",
  help="jaxdp variants: DDPConfig(optimizer_cpu_offload=True), the optimizer state in host memory",
)
args = parser.parse_args()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)  # the repo root
import jaxdp  # noqa: E402
from jaxdp import inspect  # noqa: E402
from models import llama  # noqa: E402
from models.gpt import GPT, GPTConfig, gpt_loss  # noqa: E402

spec = dict(MODELS[args.model])
batch_size, seq = spec.pop("batch"), spec.pop("block_size")
fsdp = None
if args.model == "llama":
  config = llama.LlamaConfig.llama3_8b(**spec)
  vocab, loss_fn = config.vocab, llama.llama_loss(config)
  params = jax.tree.map(np.asarray, llama.init_params(config, jax.random.key(0)))
  fsdp = jaxdp.FSDPConfig(stacked=["blocks"]) if args.variant == "optim_grads_params" else None
else:
  config, vocab = GPTConfig(vocab_size=256, block_size=seq, **spec), 256
  params, loss_fn = jaxdp.nnx_split(GPT(config, rngs=nnx.Rngs(0)), gpt_loss)
  params = jax.tree.map(np.asarray, params)  # on the host; each variant places its own
n_params = sum(x.size for x in jax.tree.leaves(params))
tokens = np.random.default_rng(0).integers(0, vocab, (batch_size, seq + 1), dtype=np.int32)
batch = {"x": jnp.asarray(tokens[:, :-1]), "y": jnp.asarray(tokens[:, 1:])}
tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4))
device = jax.devices()[0]
mesh = jax.make_mesh((1,), ("data",), devices=[device])

if args.variant == "jit":

  def step(carry, batch):
    params, opt_state = carry
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  params = jax.device_put(params, device)
  carry = (params, jax.jit(tx.init)(params))
  fn = jax.jit(step, donate_argnums=0)
else:
  ddp = jaxdp.DDPConfig(
    data_parallel_sharding_strategy=args.variant, optimizer_cpu_offload=args.offload
  )
  carry = jaxdp.init_state(params, tx, mesh, ddp, fsdp=fsdp)
  fn = jaxdp.make_train_step(loss_fn, tx, mesh, ddp, fsdp=fsdp)
  batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.P("data")))

t0 = time.perf_counter()
lowered = fn.lower(carry, batch)
try:  # the prediction's estimates ride along in the compiled program
  compiled = lowered.compile(compiler_options=inspect.COST_MODEL_OPTIONS)
  compile_s = time.perf_counter() - t0
  prediction = inspect.predict_step(compiled)
  predicted = dict(
    predicted_ms=prediction.step_us / 1e3,
    predicted_compute_ms=prediction.compute_us / 1e3,
    predicted_exposed_ms=prediction.exposed_us["total"] / 1e3,
    predicted_host_ms=prediction.host_us.get("total", 0.0) / 1e3,
    predicted_host_exposed_ms=prediction.host_exposed_us.get("total", 0.0) / 1e3,
    predicted_unestimated=len(prediction.unestimated),
  )
except Exception as e:  # noqa: BLE001 - any failure: time the step as compiled without them
  t0 = time.perf_counter()
  lowered = fn.lower(carry, batch)
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  predicted = dict(predicted_ms=None, predicted_error=f"{type(e).__name__}: {e}"[:500])
analysis = compiled.memory_analysis()
in_use_before = (device.memory_stats() or {}).get("bytes_in_use", 0)


def run(carry, n):
  for _ in range(n):
    carry, _ = compiled(carry, batch)
  jax.block_until_ready(carry)
  return carry


carry = run(carry, args.warmup)
times = []
for _ in range(args.repeats):
  t0 = time.perf_counter()
  carry = run(carry, args.steps)
  times.append((time.perf_counter() - t0) / args.steps)
stats = device.memory_stats() or {}
print(
  json.dumps(
    dict(
      model=args.model,
      variant=args.variant,
      offload=args.offload,
      params=int(n_params),
      batch=batch_size,
      seq=seq,
      device=device.device_kind,
      jax=jax.__version__,
      step_ms=1e3 * statistics.median(times),
      step_ms_all=[1e3 * t for t in times],
      compile_s=compile_s,
      compiled_peak=int(getattr(analysis, "peak_memory_in_bytes", 0)),
      compiled_temp=int(analysis.temp_size_in_bytes),
      compiled_args=int(analysis.argument_size_in_bytes),
      compiled_out=int(analysis.output_size_in_bytes),
      compiled_alias=int(analysis.alias_size_in_bytes),
      compiled_device_peak=int(inspect.memory_stats(compiled).peak_bytes),  # host apart
      compiled_host=int(inspect.memory_stats(compiled).host_bytes),
      in_use_before=int(in_use_before),
      real_peak=int(stats.get("peak_bytes_in_use", 0)),
      **predicted,
    )
  ),
  flush=True,
)
