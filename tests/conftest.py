"""Every test runs on JAX's CPU backend with 8 simulated devices."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import jaxdp  # noqa: F401  # first: it imports JAX without the CUDA plugin's driver-probe lines
import jax

jax.config.update("jax_num_cpu_devices", 8)
