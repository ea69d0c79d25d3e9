"""Every test runs on JAX's CPU backend with 8 simulated devices."""

import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

# JAX's CUDA plugin (the [aot] extra) writes "Could not find cuda drivers" to fd 2 from C++
# when imported without a GPU (no log level silences it): keep those lines out of the
# test output, pass anything else on.
sys.stderr.flush()
_saved = os.dup(2)
with tempfile.TemporaryFile() as _tmp:
  os.dup2(_tmp.fileno(), 2)
  try:
    import jax
  finally:
    os.dup2(_saved, 2)
    os.close(_saved)
    _tmp.seek(0)
    for _line in _tmp.read().decode(errors="replace").splitlines(keepends=True):
      if "cudart_stub.cc" not in _line and "absl::InitializeLog()" not in _line:
        sys.stderr.write(_line)

jax.config.update("jax_num_cpu_devices", 8)
