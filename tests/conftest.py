"""Every test runs on JAX's CPU backend with 8 simulated devices."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import jaxdp  # noqa: F401  # first: it imports JAX without the CUDA plugin's driver-probe lines
import jax
from jax._src import compilation_cache

jax.config.update("jax_num_cpu_devices", 8)

# Many tests build the same program (one small model, config and shapes; the same
# single-device reference), and XLA's compile is most of their time. JAX's persistent
# compilation cache, in a directory of this process's own removed at exit, compiles each
# such program once: an executable is reused only for the same StableHLO, compile options
# and devices. Every test still traces and lowers its own programs, and each jitted
# function keeps its own in-memory cache (`_cache_size()` counts its compiles as before).
# Subprocesses (launcher jobs, scripts, notebook kernels) do not read this setting.
_xla_cache = tempfile.mkdtemp(prefix="jaxdp-tests-xla-cache-")
atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _xla_cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# CPU executables only: a program compiled for the GPU target without a GPU (jaxdp.aot)
# cannot be read back (no client to load it), so writing it would only cost time.
_is_cache_used = compilation_cache.is_cache_used


def _is_cache_used_on_cpu(backend) -> bool:
  return backend.platform == "cpu" and _is_cache_used(backend)


compilation_cache.is_cache_used = _is_cache_used_on_cpu
