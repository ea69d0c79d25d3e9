#!/usr/bin/env bash
# One real GPU, one run (<= 8 minutes): jaxdp's dp = 1 overhead against plain jax.jit on a
# GPT of 3.2M and of 352M params and on a 2-layer Llama at 8B's width (1.5B), the real peak
# memory against the compiled estimate, the measured step against the one XLA's cost model predicts (jaxdp.inspect.predict_step), and
# the device's target description. Output (to $OUT, else ./out/gpu_check): gpu_check.jsonl
# (one line per model x variant, from scripts/bench/gpu_check.py), gpu_check.md (the table),
# <device>_target_config.txtpb, nvidia-smi.txt, versions.txt.
#
#   bash scripts/bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-out/gpu_check}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the peak counter then counts what XLA asks for
budget=${GPU_CHECK_BUDGET_S:-450}           # stop starting new runs after this many seconds
start=$SECONDS
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python3 -c "import jax, jaxlib, flax, optax; print('jax', jax.__version__, 'jaxlib',
jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())" \
  > "$out/versions.txt" 2>&1
cat "$out/versions.txt"
python3 scripts/bench/gpu_target_config.py > "$out/target_config.txtpb" 2> "$out/target_config.err"
# The Llama (2 layers at 8B's width) only as jit and FSDP: the pair scripts/bench/fsdp_overlap.py
# compares on 8 GPUs, here at dp = 1, so its measured / predicted says how far that bench's
# cost-model numbers are from the GPU.
runs="medium:jit medium:no_shard medium:optim medium:optim_grads_params medium:optim_grads
      llama:jit llama:optim_grads_params
      350m:jit 350m:no_shard 350m:optim 350m:optim_grads_params 350m:optim_grads"
for run in $runs; do
  model=${run%%:*} variant=${run#*:}
  if (( SECONDS - start > budget )); then echo "skip $model $variant: budget"; continue; fi
  echo "== $model $variant ($((SECONDS - start)) s)"
  timeout 240 python3 scripts/bench/gpu_check.py --model "$model" --variant "$variant" \
    >> "$out/gpu_check.jsonl" 2>> "$out/gpu_check.err" || echo "   failed: $?"
  tail -n 1 "$out/gpu_check.jsonl"
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
rows = [json.loads(l) for l in open(f"{out}/gpu_check.jsonl") if l.startswith("{")]
base = {r["model"]: r for r in rows if r["variant"] == "jit"}
lines = ["| model | params | variant | step ms | / jit | predicted ms | measured / predicted "
         "| compile s | compiled peak MiB | real peak MiB | real / compiled |",
         "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
for r in rows:
  b = base.get(r["model"])
  ratio = f"{r['step_ms'] / b['step_ms']:.3f}" if b else "-"
  peak = r["compiled_peak"] or r["compiled_temp"] + r["compiled_args"]
  pred = r.get("predicted_ms")
  vs = f"{pred:.2f} | {r['step_ms'] / pred:.3f}" if pred else "- | -"
  lines.append(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['variant']} | "
               f"{r['step_ms']:.2f} | {ratio} | {vs} | {r['compile_s']:.1f} | "
               f"{peak / 2**20:.0f} | {r['real_peak'] / 2**20:.0f} | "
               f"{r['real_peak'] / max(peak, 1):.3f} |")
open(f"{out}/gpu_check.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
echo "total $((SECONDS - start)) s"
