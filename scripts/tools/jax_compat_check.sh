#!/usr/bin/env bash
# The suite on the JAX a machine already has, without installing JAX: for a release this
# project's machines cannot install (a GPU image's jax, a newer one on another Python).
#
#   bash scripts/tools/jax_compat_check.sh            # the fast tier, then FSDP's scan tests
#   WORKERS=8 bash scripts/tools/jax_compat_check.sh  # more pytest workers
#
# jaxdp is installed editable without its dependencies (so pip leaves the JAX there as it
# is); pytest, pytest-xdist, flax, optax and orbax-checkpoint must be present. Prints the
# versions, then each run's summary; where $OUT is set (the device tool), the logs go there.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-$(mktemp -d)}"
python - <<'PY' | tee "$out/versions.txt"
import platform, jax, jaxlib, flax, optax
print(f"python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
      f"flax {flax.__version__}, optax {optax.__version__}, devices {jax.devices()}")
PY
pip install --quiet --no-deps -e .
status=0
python -m pytest -q -n "${WORKERS:-2}" -m "not slow" -p no:cacheprovider \
  > "$out/fast.log" 2>&1 || status=$?
tail -n 3 "$out/fast.log"
# FSDP over scanned layers reads lax.scan's params (jaxdp/_src/jaxprs.py): the slow ones too
python -m pytest -q -n "${WORKERS:-2}" -p no:cacheprovider tests/test_jaxprs.py \
  tests/test_fsdp_units.py tests/test_fsdp_overlap.py -k "jaxprs or scan" \
  > "$out/scan.log" 2>&1 || status=$?
tail -n 3 "$out/scan.log"
echo "logs in $out"
exit "$status"
