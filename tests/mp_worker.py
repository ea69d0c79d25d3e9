"""One process of a multi-process test job; run it through ``python -m jaxdp.launch``.

    python -m jaxdp.launch -n 2 -d 4 -- tests/mp_worker.py MODE OUT_DIR

Every process loads its slice of the global batch and builds the global arrays with
`host_local_batch_to_global`, on the 8-device ``("data",)`` mesh. MODE:

``psum``: runs `compute` (a shard_map with a psum over "data") and writes the result,
gathered to the host, to ``OUT_DIR/psum.p{I}.npz``.
``train``: trains `STEPS` steps with each of `STRATEGIES` (`train`) and writes the params
and losses to ``OUT_DIR/train.{strategy}.p{I}.npz``.
``crash``: after one collective, process 1 SIGKILLs itself while process 0 blocks in the
next collective, which can never finish. ``raise``: the same, but process 1 raises.
``hang``: the same, but process 1 waits forever (`wait_forever`), silent: nothing fails.
``checkpoint``: for each of `CHECKPOINT_STRATEGIES`, builds the state from an init function
(`checkpoint_params`), trains `STEPS` steps, saves it to ``OUT_DIR/ckpt.{strategy}``,
restores it into its `abstract_state` and writes the trained and restored params and optimizer
state, gathered, to ``OUT_DIR/ckpt.{strategy}.p{I}.npz``.

Everything but `main` is importable, so the tests compute their single-process
references with the same code.
"""

import logging
import os
import pathlib
import signal
import sys
import time

import jaxdp  # before JAX: it imports JAX without the CUDA plugin's driver-probe lines
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec as P


GLOBAL_BATCH = 16
FEATURES = 4


def global_batch() -> dict[str, np.ndarray]:
  rng = np.random.default_rng(0)
  return {
    "x": rng.standard_normal((GLOBAL_BATCH, FEATURES)).astype(np.float32),
    "y": np.arange(GLOBAL_BATCH, dtype=np.int32),
  }


def local_slice(batch, process_index: int, process_count: int):
  rows = GLOBAL_BATCH // process_count
  return jax.tree.map(lambda a: a[process_index * rows : (process_index + 1) * rows], batch)


def compute(batch, mesh):
  """Per-row features (sharded) and their sum over the whole batch (a psum over "data")."""
  w = jnp.linspace(-1.0, 1.0, FEATURES * 3, dtype=jnp.float32).reshape(FEATURES, 3)

  def per_shard(b):
    h = jnp.tanh(b["x"] @ w) * (b["y"][:, None] + 1).astype(jnp.float32)
    return h, jax.lax.psum(h.sum(0), "data")

  f = jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=(P("data"), P()))
  return jax.jit(f)(batch)


STRATEGIES = ("no_shard", "optim", "optim_grads_params")
STEPS = 3


def init_params() -> dict:
  rng = np.random.default_rng(1)
  return {
    "l0": {
      "w": 0.5 * rng.standard_normal((FEATURES, 16)).astype(np.float32),
      "b": np.zeros(16, np.float32),
    },
    "l1": {
      "w": 0.5 * rng.standard_normal((16, 2)).astype(np.float32),
      "b": np.zeros(2, np.float32),
    },
  }


def loss_fn(params, batch):
  h = jnp.tanh(batch["x"] @ params["l0"]["w"] + params["l0"]["b"])
  pred = h @ params["l1"]["w"] + params["l1"]["b"]
  target = jnp.stack([jnp.sin(batch["y"]), jnp.cos(batch["y"])], -1).astype(jnp.float32)
  return jnp.mean((pred - target) ** 2)


def make_tx():
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


def train_batches() -> list[dict[str, np.ndarray]]:
  """`STEPS` global batches, different per step."""
  base = global_batch()
  return [{"x": base["x"] * (1.0 + 0.5 * i), "y": base["y"] + i} for i in range(STEPS)]


def train(strategy: str, mesh, to_global) -> tuple[dict, list[float]]:
  """`STEPS` jaxdp steps; `to_global` turns a global batch into this process's input."""
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  tx = make_tx()
  state = jaxdp.init_state(init_params(), tx, mesh, config)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  losses = []
  for batch in train_batches():
    state, metrics = step(state, to_global(batch))
    losses.append(metrics["loss"])
  return jaxdp.get_params(state), losses


CHECKPOINT_STRATEGIES = ("optim", "optim_grads_params")


def checkpoint_params() -> dict:
  """A model whose arrays dominate the checkpoint's bytes (2 MiB of f32 params; odd widths
  padded at dp = 8)."""
  k1, k2 = jax.random.split(jax.random.key(2))
  return {
    "w": jax.random.normal(k1, (FEATURES * 128, 1000)) * 0.05,
    "b": jnp.zeros((1000,)),
    "out": jax.random.normal(k2, (1000, 2)) * 0.05,
  }


def checkpoint_loss(params, batch):
  x = jnp.tile(batch["x"], (1, 128))
  pred = jnp.tanh(x @ params["w"] + params["b"]) @ params["out"]
  target = jnp.stack([jnp.sin(batch["y"]), jnp.cos(batch["y"])], -1).astype(jnp.float32)
  return jnp.mean((pred - target) ** 2)


def save_and_restore(strategy: str, mesh, to_global, directory) -> tuple[dict, dict]:
  """Trains from `checkpoint_params` (as an init function), saves, restores into its
  `abstract_state` (each process reading its own shards into fresh arrays): `(trained,
  restored)`, each `{"params": ..., "opt": ...}` as views."""
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  tx = make_tx()
  state = jaxdp.init_state(checkpoint_params, tx, mesh, config)
  step = jaxdp.make_train_step(checkpoint_loss, tx, mesh, config)
  for batch in train_batches():
    state, _ = step(state, to_global(batch))
  views = lambda s: {"params": jaxdp.get_params(s), "opt": jaxdp.get_opt_state(s)}
  trained = views(state)
  with jaxdp.CheckpointManager(directory) as mgr:
    mgr.save(STEPS, state)
    mgr.wait_until_finished()
    restored = mgr.restore(jaxdp.abstract_state(checkpoint_params, tx, mesh, config))
  return trained, views(restored)


def wait_forever() -> None:
  """What a process stuck elsewhere looks like: alive, silent, never reaching the collective."""
  while True:
    time.sleep(3600)


def single_device_reference(bound=None) -> dict:
  """Plain `jax.grad` + optax on each whole global batch, on one device; each step's
  gradients go to `bound` (an AdamBound, tests/tolerances.py)."""
  params, tx = init_params(), make_tx()
  opt_state = tx.init(params)
  for batch in train_batches():
    grads = jax.grad(loss_fn)(params, batch)
    if bound is not None:
      bound.add(grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


def main(mode: str, out_dir: str) -> None:
  # force: importing jaxdp imports orbax, whose absl logging already configured the root
  logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", force=True)
  jaxdp.initialize()
  me, n = jax.process_index(), jax.process_count()
  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  batch = jaxdp.host_local_batch_to_global(local_slice(global_batch(), me, n), mesh)
  rows, total = compute(batch, mesh)
  gather = lambda x: multihost_utils.process_allgather(x, tiled=True)  # Global -> NumPy.
  rows, total = gather(rows), gather(total)
  if mode == "train":
    to_global = lambda b: jaxdp.host_local_batch_to_global(local_slice(b, me, n), mesh)
    for strategy in STRATEGIES:
      params, losses = train(strategy, mesh, to_global)
      flat = {
        jax.tree_util.keystr(path): gather(x)
        for path, x in jax.tree_util.tree_leaves_with_path(params)
      }
      np.savez(
        pathlib.Path(out_dir) / f"train.{strategy}.p{me}.npz",
        losses=np.array([gather(l) for l in losses]),
        **flat,
      )
      print(
        f"process {me}/{n}: {strategy}: losses {[float(gather(l)) for l in losses]}", flush=True
      )
  elif mode == "checkpoint":
    to_global = lambda b: jaxdp.host_local_batch_to_global(local_slice(b, me, n), mesh)
    for strategy in CHECKPOINT_STRATEGIES:
      directory = pathlib.Path(out_dir) / f"ckpt.{strategy}"
      trained, restored = save_and_restore(strategy, mesh, to_global, directory)
      flat = {}
      for name, tree in (("trained", trained), ("restored", restored)):
        for path, x in jax.tree_util.tree_leaves_with_path(tree):
          flat[f"{name}{jax.tree_util.keystr(path)}"] = gather(x)
      np.savez(pathlib.Path(out_dir) / f"ckpt.{strategy}.p{me}.npz", **flat)
      print(f"process {me}/{n}: {strategy}: saved and restored", flush=True)
  elif mode == "psum":
    np.savez(
      pathlib.Path(out_dir) / f"psum.p{me}.npz",
      rows=rows,
      total=total,
      process_count=n,
      device_count=jax.device_count(),
    )
    print(f"process {me}/{n}: wrote psum.p{me}.npz", flush=True)
  elif mode in ("crash", "raise", "hang"):
    print(f"process {me}/{n}: first collective done", flush=True)
    if me == 1 and mode == "hang":
      print("process 1: wait forever", flush=True)
      wait_forever()
    if me == 1:
      time.sleep(0.5)  # Let process 0 enter the collective below first.
      if mode == "raise":
        print("process 1: raise", flush=True)
        raise RuntimeError("process 1 fails on purpose")
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
