"""One process of a multi-process test job; run it through ``python -m jaxdp.launch``.

    python -m jaxdp.launch -n 2 -d 4 -- tests/mp_worker.py psum OUT_DIR
    python -m jaxdp.launch -n 2 -d 4 -- tests/mp_worker.py crash OUT_DIR

``psum``: every process loads its slice of `global_batch()`, builds the global batch with
`jaxdp.host_local_batch_to_global`, runs `compute` (a shard_map with a psum over the
8-device ``("data",)`` mesh) and writes the result, gathered to the host, to
``OUT_DIR/psum.p{I}.npz``. ``crash``: after one collective, process 1 SIGKILLs itself while
process 0 blocks in the next collective, which can never finish.

`global_batch` and `compute` are importable, so the test computes its single-process
reference with the same code.
"""

import logging
import os
import pathlib
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

# Until jaxdp/__init__.py re-exports them; then jaxdp.initialize, jaxdp.host_local_batch_to_global.
from jaxdp._src.distributed import host_local_batch_to_global, initialize

GLOBAL_BATCH = 16
FEATURES = 4


def global_batch() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {"x": rng.standard_normal((GLOBAL_BATCH, FEATURES)).astype(np.float32),
          "y": np.arange(GLOBAL_BATCH, dtype=np.int32)}


def local_slice(batch, process_index: int, process_count: int):
  rows = GLOBAL_BATCH // process_count
  return jax.tree.map(lambda a: a[process_index * rows:(process_index + 1) * rows], batch)


def compute(batch, mesh):
  """Per-row features (sharded) and their sum over the whole batch (a psum over "data")."""
  w = jnp.linspace(-1.0, 1.0, FEATURES * 3, dtype=jnp.float32).reshape(FEATURES, 3)

  def per_shard(b):
    h = jnp.tanh(b["x"] @ w) * (b["y"][:, None] + 1).astype(jnp.float32)
    return h, jax.lax.psum(h.sum(0), "data")

  f = jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P()))
  return jax.jit(f)(batch)


def main(mode: str, out_dir: str) -> None:
  logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
  initialize()
  me, n = jax.process_index(), jax.process_count()
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  batch = host_local_batch_to_global(local_slice(global_batch(), me, n), mesh)
  rows, total = compute(batch, mesh)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  rows = multihost_utils.process_allgather(rows, tiled=True)
  total = multihost_utils.process_allgather(total, tiled=True)
  if mode == "psum":
    np.savez(pathlib.Path(out_dir) / f"psum.p{me}.npz", rows=rows, total=total,
             process_count=n, device_count=jax.device_count())
    print(f"process {me}/{n}: wrote psum.p{me}.npz", flush=True)
  elif mode == "crash":
    print(f"process {me}/{n}: first collective done", flush=True)
    if me == 1:
      time.sleep(0.5)  # Let process 0 enter the collective below first.
      print("process 1: SIGKILL myself", flush=True)
      os.kill(os.getpid(), signal.SIGKILL)
    print(f"process {me}: entering a collective that cannot finish", flush=True)
    multihost_utils.sync_global_devices("never")  # Blocks: process 1 is gone.
    compute(batch, mesh)[1].block_until_ready()
    print(f"process {me}: unreachable", flush=True)
  else:
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
  main(*sys.argv[1:])
