"""Fingerprints of the compiled train steps of a set of configurations, to show that a
refactor leaves the programs as they were.

    python scripts/tools/hlo_fingerprints.py --save before.json    # on the old code
    python scripts/tools/hlo_fingerprints.py --compare before.json # on the new code

Each configuration's step is compiled for the 8 CPU devices; its fingerprint is a hash of
the optimized HLO without its source tables and metadata and with XLA's names renumbered,
so that only what runs and in which order counts. A changed
fingerprint is not a bug by itself: it says which program to read (`--dump DIR` writes
the texts).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import argparse
import hashlib
import json
import pathlib
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jaxdp

VOCAB, WIDTH, HIDDEN, LAYERS, TOKENS = 40, 12, 20, 3, 16


def init_params(seed: int = 0) -> dict:
  """An embedding read by indexing, scanned blocks, an output layer: widths 8 does not
  divide, so the sharded strategies pad."""
  keys = iter(jax.random.split(jax.random.key(seed), 6))
  normal = lambda shape: 0.2 * jax.random.normal(next(keys), shape, jnp.float32)
  return {
    "embed": normal((VOCAB, WIDTH)),
    "blocks": {"w_in": normal((LAYERS, WIDTH, HIDDEN)), "w_out": normal((LAYERS, HIDDEN, WIDTH))},
    "norm": jnp.ones((WIDTH,), jnp.float32),
    "out": normal((WIDTH, VOCAB)),
  }


def loss_fn(params, batch):
  x = params["embed"][batch["tokens"]]

  def block(x, layer):
    return x + jax.nn.gelu(x @ layer["w_in"]) @ layer["w_out"], None

  x, _ = jax.lax.scan(jax.checkpoint(block), x, params["blocks"])
  logits = (x * params["norm"]) @ params["out"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def loss_with_aux(params, batch):
  loss = loss_fn(params, batch)
  return loss, {"loss": loss}


class Case(NamedTuple):
  name: str
  config: jaxdp.DDPConfig
  fsdp: jaxdp.FSDPConfig | None = None
  grad_accum_steps: int = 1
  mesh: tuple[tuple[str, int], ...] = (("data", 8),)
  tx: str = "adamw"
  has_aux: bool = False
  model_specs: tuple[tuple[str, P], ...] = ()
  """`(param path prefix, its PartitionSpec)` for tensor-parallel params."""


def cases() -> list[Case]:
  ddp = jaxdp.DDPConfig
  tp = (("data", 4), ("model", 2))
  tp_specs = (("blocks']['w_in", P(None, None, "model")), ("blocks']['w_out", P(None, "model")))
  return [
    Case("no_shard", ddp()),
    Case("no_shard k=2", ddp(), grad_accum_steps=2),
    Case("no_shard fused", ddp(fused_update=True)),
    Case("no_shard aux", ddp(), has_aux=True),
    Case("no_shard hsdp", ddp(), mesh=(("replica", 2), ("data", 4))),
    Case("optim", ddp(data_parallel_sharding_strategy="optim")),
    Case("optim k=2", ddp(data_parallel_sharding_strategy="optim"), grad_accum_steps=2),
    Case(
      "optim after-update gather",
      ddp(data_parallel_sharding_strategy="optim", overlap_param_gather=False),
    ),
    Case("optim per-leaf", ddp(data_parallel_sharding_strategy="optim", fused_update=False)),
    Case("optim stacked", ddp(data_parallel_sharding_strategy="optim", stacked=("blocks",))),
    Case("optim tp", ddp(data_parallel_sharding_strategy="optim"), mesh=tp, model_specs=tp_specs),
    Case("optim_grads k=2", ddp(data_parallel_sharding_strategy="optim_grads"), grad_accum_steps=2),
    Case(
      "optim_grads stacked k=2",
      ddp(data_parallel_sharding_strategy="optim_grads", stacked=("blocks",)),
      grad_accum_steps=2,
    ),
    Case("fsdp", ddp(data_parallel_sharding_strategy="optim_grads_params")),
    Case(
      "fsdp aux sgd",
      ddp(data_parallel_sharding_strategy="optim_grads_params"),
      tx="sgd",
      has_aux=True,
    ),
    Case("fsdp k=2", ddp(data_parallel_sharding_strategy="optim_grads_params"), grad_accum_steps=2),
    Case(
      "fsdp k=2 gathered once",
      ddp(data_parallel_sharding_strategy="optim_grads_params"),
      jaxdp.FSDPConfig(reshard_after_backward=False),
      grad_accum_steps=2,
    ),
    Case(
      "fsdp stacked bf16",
      ddp(data_parallel_sharding_strategy="optim_grads_params"),
      jaxdp.FSDPConfig(stacked=("blocks",), param_dtype=jnp.bfloat16),
    ),
    Case(
      "fsdp per-leaf",
      ddp(data_parallel_sharding_strategy="optim_grads_params", fused_update=False),
    ),
    Case(
      "hfsdp",
      ddp(
        data_parallel_sharding_strategy="optim_grads_params",
        outer_dp_sharding_strategy="optim",
        num_distributed_optimizer_instances=2,
      ),
      mesh=(("replica", 2), ("data", 4)),
    ),
    Case(
      "fsdp tp",
      ddp(data_parallel_sharding_strategy="optim_grads_params"),
      mesh=tp,
      model_specs=tp_specs,
    ),
  ]


def _place(params, mesh, model_specs):
  def spec(path, _):
    key = jax.tree_util.keystr(path)
    for prefix, s in model_specs:
      if prefix in key:
        return jax.sharding.NamedSharding(mesh, s)
    return jax.sharding.NamedSharding(mesh, P())

  return jax.device_put(params, jax.tree_util.tree_map_with_path(spec, params))


def compiled_text(case: Case) -> str:
  names, sizes = zip(*case.mesh)
  mesh = jax.make_mesh(sizes, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
  tx = {"adamw": optax.adamw(1e-2), "sgd": optax.sgd(1e-2)}[case.tx]
  params = _place(init_params(), mesh, case.model_specs)
  state = jaxdp.init_state(params, tx, mesh, case.config, fsdp=case.fsdp)
  step = jaxdp.make_train_step(
    loss_with_aux if case.has_aux else loss_fn,
    tx,
    mesh,
    case.config,
    grad_accum_steps=case.grad_accum_steps,
    fsdp=case.fsdp,
    has_aux=case.has_aux,
  )
  rows = 8 * case.grad_accum_steps
  rng = np.random.default_rng(0)
  batch = {
    "tokens": jnp.asarray(rng.integers(0, VOCAB, (rows, TOKENS)), jnp.int32),
    "labels": jnp.asarray(rng.integers(0, VOCAB, (rows, TOKENS)), jnp.int32),
  }
  return step.lower(state, batch).compile().as_text()


def canonical(text: str) -> str:
  """The program alone: no source tables, metadata or XLA's numbering of names (each name
  renamed by its first appearance, so that what ran before in the process does not count)."""
  module = re.match(r"HloModule ([\w.-]+)", text).group(1)  # the program's name counts
  body = module + "\n" + re.search(r"^(%|ENTRY).*", text, re.S | re.M).group(0)
  body = re.sub(r", metadata=\{[^}]*\}", "", body)
  names: dict[str, str] = {}
  body = re.sub(r"%[\w.-]+", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), body)
  return re.sub(r"\b(param_\d+)\.\d+", r"\1", body)  # a fusion's parameter names


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--save", type=pathlib.Path)
  parser.add_argument("--compare", type=pathlib.Path)
  parser.add_argument("--dump", type=pathlib.Path, help="write each program's text here")
  parser.add_argument("-k", default="", help="only the cases whose name contains this")
  args = parser.parse_args()
  before = json.loads(args.compare.read_text()) if args.compare else {}
  prints, changed = {}, []
  for case in cases():
    if args.k not in case.name:
      continue
    text = canonical(compiled_text(case))
    prints[case.name] = hashlib.sha256(text.encode()).hexdigest()[:16]
    if args.dump:
      args.dump.mkdir(parents=True, exist_ok=True)
      (args.dump / f"{case.name.replace(' ', '_')}.hlo").write_text(text)
    same = (
      ""
      if case.name not in before
      else ("same" if before[case.name] == prints[case.name] else "CHANGED")
    )
    if same == "CHANGED":
      changed.append(case.name)
    print(f"{case.name:28s} {prints[case.name]} {same}", flush=True)
  if args.save:
    args.save.write_text(json.dumps(prints, indent=1))
  if args.compare:
    print(
      f"{len(changed)} of {len(prints)} changed" + (f": {', '.join(changed)}" if changed else "")
    )


if __name__ == "__main__":
  main()
