#!/usr/bin/env bash
# One real GPU, one run (<= 6 minutes): the host link each way (scripts/bench/host_link.py)
# against the rate predict_step assumes, and the 2-layer Llama at 8B's width under jaxdp's
# ZeRO-2 and FSDP with and without optimizer_cpu_offload (scripts/bench/gpu_check.py
# --offload): step time, real and compiled peak, measured against predicted. FSDP over the
# scanned blocks needs the jax the project pins (a newer one's scan has other params).
# Output (to $OUT, else ./out/gpu_offload_check): host_link.jsonl, offload.jsonl,
# nvidia-smi.txt, versions.txt.
#
#   bash scripts/bench/gpu_offload_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-out/gpu_offload_check}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the peak counter then counts what XLA asks for
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python3 -c "import jax, jaxlib, flax, optax; print('jax', jax.__version__, 'jaxlib',
jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())" \
  > "$out/versions.txt" 2>&1
cat "$out/versions.txt"
timeout 120 python3 scripts/bench/host_link.py >> "$out/host_link.jsonl" 2>> "$out/errors.txt" \
  || echo "host_link failed: $?"
cat "$out/host_link.jsonl"
for variant in optim_grads optim_grads_params; do
  for offload in "" "--offload"; do
    echo "== llama $variant $offload"
    timeout 150 python3 scripts/bench/gpu_check.py --model llama --variant $variant \
      $offload --repeats 3 --steps 5 >> "$out/offload.jsonl" 2>> "$out/errors.txt" \
      || echo "   failed: $?"
    tail -n 1 "$out/offload.jsonl"
  done
done
tail -n 30 "$out/errors.txt"
