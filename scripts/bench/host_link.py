"""The host link of one real GPU, each way: `jax.device_put` of a pinned-host array to the
device and back, timed, against the rate `jaxdp.inspect.predict_step` assumes for the copies
of an offloaded state (`HOST_LINK_BYTES_PER_S`).

    python scripts/bench/host_link.py            # 4 GiB, median of 5; prints one JSON line
"""

import argparse
import json
import os
import statistics
import sys
import time

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--gib", type=float, default=4.0, help="bytes moved each way, GiB")
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxdp._src.inspect import HOST_LINK_BYTES_PER_S  # noqa: E402

device = jax.devices()[0]
on_device = jax.sharding.SingleDeviceSharding(device)
on_host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
n = int(args.gib * 2**30) // 4
x = jax.device_put(jnp.ones((n,), jnp.float32), on_host)
x.block_until_ready()
rates = {"host-to-device": [], "device-to-host": []}
for _ in range(args.repeats):
  t0 = time.perf_counter()
  y = jax.device_put(x, on_device).block_until_ready()
  rates["host-to-device"].append(4 * n / (time.perf_counter() - t0))
  t0 = time.perf_counter()
  x = jax.device_put(y, on_host).block_until_ready()
  rates["device-to-host"].append(4 * n / (time.perf_counter() - t0))
  del y
print(
  json.dumps(
    {
      "device": device.device_kind,
      "bytes": 4 * n,
      **{f"{k} GB/s": statistics.median(v) / 1e9 for k, v in rates.items()},
      "assumed GB/s": HOST_LINK_BYTES_PER_S / 1e9,
    }
  ),
  flush=True,
)
