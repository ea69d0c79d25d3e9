"""One process of the multi-process checkpoint test in test_meshes.py.

    python -m jaxdp.launch -n 2 -d 4 -- tests/mesh_worker.py CKPT_DIR

Trains mp_worker's model for `mp_worker.STEPS` steps under `optim` on the ("data",) mesh of
every process's devices, each process feeding its slice of every batch, then saves the state
(data position: the number of batches consumed) with `jaxdp.CheckpointManager`.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxdp  # before JAX: it imports JAX without the CUDA plugin's driver-probe lines
import jax

import mp_worker


def main(directory: str) -> None:
  # force: importing jaxdp imports orbax, whose absl logging already configured the root
  logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", force=True)
  jaxdp.initialize()
  me, n = jax.process_index(), jax.process_count()
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  config, tx = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim"), mp_worker.make_tx()
  state = jaxdp.init_state(mp_worker.init_params(), tx, mesh, config)
  step = jaxdp.make_train_step(mp_worker.loss_fn, tx, mesh, config)
  for batch in mp_worker.train_batches():
    state, _ = step(
      state, jaxdp.host_local_batch_to_global(mp_worker.local_slice(batch, me, n), mesh)
    )
  with jaxdp.CheckpointManager(directory) as mgr:
    mgr.save(mp_worker.STEPS, state, data_position=mp_worker.STEPS)
    mgr.wait_until_finished()
  print(f"process {me}/{n}: saved step {mp_worker.STEPS}", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
