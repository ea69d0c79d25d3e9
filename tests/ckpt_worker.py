"""A small training process for the kill-and-resume tests in test_checkpoint.py.

    python tests/ckpt_worker.py DIR OUT --steps N --save-every K [--resume] [--hold-commit S]

Trains an MLP for N steps with dp=8 under `optim` (Adam), batch i drawn from a seed of i,
saving every K steps with the data position (the next batch index). Prints `step i` after
every step and `resumed <step>` when it resumes. At the end writes the params to OUT (.npz).
`--hold-commit S` holds the commit of checkpoint S (orbax's rename of its finished
temporary directory) after printing `committing S`, so that a test can kill the process in
the middle of that save.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import jaxdp  # before JAX: it imports JAX without the CUDA plugin's driver-probe lines
import jax
import jax.numpy as jnp
import numpy as np
import optax


jax.config.update("jax_num_cpu_devices", 8)


def params0():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "w1": jax.random.normal(k1, (12, 20)) * 0.3,
    "b1": jnp.zeros((20,)),
    "w2": jax.random.normal(k2, (20, 3)) * 0.3,
  }


def loss_fn(p, batch):
  h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)


def batch_at(i):
  rng = np.random.default_rng(i)
  return {
    "x": jnp.asarray(rng.normal(size=(32, 12)), jnp.float32),
    "y": jnp.asarray(rng.normal(size=(32, 3)), jnp.float32),
  }


def hold_commit(step):
  from orbax.checkpoint._src.path import atomicity

  finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def slow(self):
    if self.get_final().name == str(step):
      print(f"committing {step}", flush=True)
      time.sleep(600)
    return await finalize(self)

  atomicity.AtomicRenameTemporaryPath.finalize = slow


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("dir")
  ap.add_argument("out")
  ap.add_argument("--steps", type=int, required=True)
  ap.add_argument("--save-every", type=int, required=True)
  ap.add_argument("--resume", action="store_true")
  ap.add_argument("--hold-commit", type=int)
  args = ap.parse_args()
  if args.hold_commit is not None:
    hold_commit(args.hold_commit)

  mesh = jax.make_mesh((8,), ("data",))
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
  tx = optax.adam(1e-2)
  state = jaxdp.init_state(params0(), tx, mesh, config)
  train_step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  mgr = jaxdp.CheckpointManager(args.dir, save_interval_steps=args.save_every)
  position = 0
  if args.resume and mgr.latest_step() is not None:
    state = mgr.restore(state)
    position = mgr.data_position()
    print(f"resumed {mgr.latest_step()}", flush=True)
  while position < args.steps:
    state, _ = train_step(state, batch_at(position))
    position += 1
    mgr.save(position, state, data_position=position)
    print(f"step {position}", flush=True)
  mgr.wait_until_finished()
  np.savez(args.out, **{k: np.asarray(v) for k, v in jaxdp.get_params(state).items()})
  return 0


if __name__ == "__main__":
  sys.exit(main())
