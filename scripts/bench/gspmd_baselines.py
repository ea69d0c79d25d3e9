"""The GSPMD programs jaxdp's strategies are measured against: the `jax.jit` step a MaxText user writes.

Every bench script builds its GSPMD rows here, so that "GSPMD FSDP" is one program
everywhere. Each is `jax.jit` of `value_and_grad` + `tx.update` with `NamedSharding`s on its
arguments and results (params and optimizer state donated), the batch sharded `P("data")`
on its leading dim; XLA inserts every collective.

    gspmd          DDP: params and optimizer state replicated         (baseline of no_shard)
    gspmd_zero1    ZeRO-1, MaxText's `shard_optimizer_over_data`: params replicated, each
                   optimizer state leaf sharded over "data" on its first dim that dp divides
                   and "model" leaves whole (MaxText's `add_data_to_sharding`)
                                                                  (baseline of optim, optim_grads)
    gspmd_fsdp     FSDP, MaxText-style: params and optimizer state sharded over "data" on
                   each weight's embed (d_model) dim, MaxText's logical rule
                   `embed -> fsdp` (`embed_dim`); a stacked layer axis never
                                                                  (baseline of optim_grads_params)
    gspmd_fsdp_unconstrained
                   a GSPMD FSDP without MaxText's rules, shown only as a labelled extra row,
                   "GSPMD FSDP, no activation constraints": params and optimizer state
                   sharded over "data" on their first dim (past a stacked layer axis) that
                   dp divides and "model" leaves whole, the activations unconstrained

The first three constrain the activations batch-sharded over "data" (`P("data")`, the rest
of the dims replicated) at the embedding output and at every block's input and output,
through the model's `constrain` hook (`llama_loss(config, constrain=)`, `gpt_loss(model,
batch, constrain=)`, the bench MLPs' `make_loss(constrain)`): MaxText's model does so with
its logical rule `activation_batch -> (data, fsdp)`. Without them GSPMD is free to reshard
activations and weights as it likes (docs/bench.md and docs/memory.md show what that costs).
With the params replicated (DDP, ZeRO-1) the constraints say what GSPMD infers anyway: on
bench.py's GPT and MLP the compiled programs hold the same instructions with and without
them, a few in another order.

Optimizer state: a subtree shaped like the params (Adam's `mu` and `nu`) is placed like the
params (FSDP) or by the ZeRO-1 rule (ZeRO-1), every other leaf (Adam's count) replicated.

Import it after JAX's device count is set (it imports jax). Names:

    Problem, Program, PROGRAMS, TWIN   a model to train; the programs; jaxdp strategy -> baseline
    embed_dim, placement               where each leaf goes
    constrain_batch                    the activations' sharding constraint on a mesh
    train_step, jit_step, compile_step the step (phases named for profiles), jitted, compiled
    check_placement                    a step's results hold the placement and its bytes
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp import inspect

DATA, MODEL = "data", "model"


@dataclasses.dataclass(frozen=True)
class Problem:
  """A model to train: params, a global batch, and its loss with the activations' hook."""

  params: Any
  """Arrays (on the host) or `jax.ShapeDtypeStruct`s, unplaced."""
  batch: Any
  """The global batch (arrays or `jax.ShapeDtypeStruct`s), leading dim over "data"."""
  make_loss: Callable[..., Callable]
  """`make_loss(constrain=None) -> loss_fn(params, batch)`; `constrain(h)` is applied to the
  residual stream at the embedding output and at every block's input and output."""
  width: int
  """The model width (d_model): the size of a weight's embed dim."""
  stacked: tuple[str, ...] = ()
  """Top-level param keys whose leaves carry a leading layer axis (scanned blocks)."""
  model_specs: Any = None
  """Tensor-parallel `PartitionSpec`s over "model", a tree like `params`; None: no "model"."""


@dataclasses.dataclass(frozen=True)
class Program:
  """One GSPMD program: what it shards over "data", and whether it pins the activations."""

  name: str
  label: str
  shard_params: bool
  shard_optimizer: bool
  constrain_activations: bool
  param_dim: str = "embed"
  """Where a sharded param (and its optimizer state) takes "data": "embed" (`embed_dim`) or
  "first" (its first dim past a stacked layer axis that dp divides and "model" leaves whole)."""


PROGRAMS = {
  p.name: p
  for p in (
    Program(
      name="gspmd",
      label="GSPMD DDP",
      shard_params=False,
      shard_optimizer=False,
      constrain_activations=True,
    ),
    Program(
      name="gspmd_zero1",
      label="GSPMD ZeRO-1",
      shard_params=False,
      shard_optimizer=True,
      constrain_activations=True,
    ),
    Program(
      name="gspmd_fsdp",
      label="GSPMD FSDP",
      shard_params=True,
      shard_optimizer=True,
      constrain_activations=True,
    ),
    Program(
      name="gspmd_fsdp_unconstrained",
      label="GSPMD FSDP, no activation constraints",
      shard_params=True,
      shard_optimizer=True,
      constrain_activations=False,
      param_dim="first",
    ),
  )
}
TWIN = {
  "no_shard": "gspmd",
  "optim": "gspmd_zero1",
  "optim_grads": "gspmd_zero1",
  "optim_grads_params": "gspmd_fsdp",
}
"""jaxdp's strategy -> the GSPMD program that holds the same memory (its baseline)."""

# Weights whose embed dim is their *last* dim of the model's width: those that write the
# residual stream (MaxText's ("heads", "kv", "embed") and ("mlp", "embed") kernels:
# models/llama.py's wo and w_down, models/gpt.py's c_proj, the residual MLP's w2) and the
# (vocab or positions, embed) tables. Every other weight's is its first dim of that size
# (("embed", "heads"), ("embed", "mlp") kernels, norms, the tanh MLP's square layers). The
# name decides only where a weight has two dims of the model's width (Llama-3-8B's wq and
# wo are both 4096 x 4096).
WRITES_RESIDUAL = frozenset({"wo", "w_down", "c_proj", "w2", "embed", "out", "wte", "wpe"})


def _names(path) -> set:
  return {getattr(k, "key", getattr(k, "name", None)) for k in path}


def embed_dim(path, shape, problem: Problem) -> int | None:
  """The dim of a param that MaxText's `embed -> fsdp` rule shards, or None (replicated:
  a bias of a heads or mlp dim has no embed dim, so MaxText leaves it whole).

  The dims of the model's width past a stacked layer axis; of two, the last for a weight in
  `WRITES_RESIDUAL`, else the first.
  """
  first = 1 if path and getattr(path[0], "key", None) in problem.stacked else 0
  dims = [d for d in range(first, len(shape)) if shape[d] == problem.width]
  if not dims:
    return None
  return dims[-1] if _names(path) & WRITES_RESIDUAL else dims[0]


def _axes(entry) -> tuple:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _full(spec: P, ndim: int) -> list:
  return list(spec) + [None] * (ndim - len(spec))


def _first_dim(path, x, model_spec: P, problem: Problem, dp: int) -> int | None:
  entries = _full(model_spec, x.ndim)
  first = 1 if path and getattr(path[0], "key", None) in problem.stacked else 0
  dims = [d for d in range(first, x.ndim) if entries[d] is None and x.shape[d] % dp == 0]
  return dims[0] if dims else None


def _fsdp_spec(path, x, model_spec: P, problem: Problem, dp: int, rule: str) -> P:
  entries = _full(model_spec, x.ndim)
  if rule == "first":
    dim = _first_dim(path, x, model_spec, problem, dp)
  else:
    dim = embed_dim(path, x.shape, problem)
  if dim is None or dp == 1:
    return P(*entries)
  where = f"params{jax.tree_util.keystr(path)} {tuple(x.shape)}"
  if entries[dim] is not None:
    raise ValueError(f"{where}: its embed dim {dim} is split over {entries[dim]!r} already")
  if x.shape[dim] % dp:
    raise ValueError(
      f"{where}: embed dim {dim} of size {x.shape[dim]} does not divide over data={dp}; use a "
      "model width that dp divides"
    )
  entries[dim] = DATA
  return P(*entries)


def _zero1_spec(x, model_spec: P, mesh) -> P:
  """MaxText's `add_data_to_sharding`: "data" on the first dim whose shard dp divides and
  that "model" leaves whole."""
  entries = _full(model_spec, x.ndim)
  dp = mesh.shape[DATA]
  for dim, entry in enumerate(entries):
    split = math.prod(mesh.shape[a] for a in _axes(entry))
    if MODEL not in _axes(entry) and (x.shape[dim] // split) % dp == 0:
      entries[dim] = (DATA, *_axes(entry)) if entry is not None else DATA
      return P(*entries)
  return P(*entries)


@dataclasses.dataclass(frozen=True)
class Placement:
  """The `PartitionSpec` of every leaf of the params and of the optimizer state."""

  params: Any
  opt_state: Any


def _like_params(opt_state, params, per_param):
  """A tree like `opt_state`: `per_param` (a tree like `params`) for every subtree shaped like
  the params (Adam's mu, nu), P() for every other leaf."""
  treedef = jax.tree.structure(params)
  is_params = lambda x: jax.tree.structure(x) == treedef
  return jax.tree.map(lambda x: per_param if is_params(x) else P(), opt_state, is_leaf=is_params)


def placement(program: Program, problem: Problem, tx, mesh) -> Placement:
  """Where `program` puts each leaf of the params and of `tx`'s state on `mesh`."""
  params = problem.params
  model = problem.model_specs or jax.tree.map(lambda _: P(), params)
  dp = mesh.shape[DATA]
  fsdp = jax.tree_util.tree_map_with_path(
    lambda path, x, spec: _fsdp_spec(path, x, spec, problem, dp, program.param_dim),
    params,
    model,
  )
  opt_state = jax.eval_shape(tx.init, params)
  if program.shard_params:
    return Placement(fsdp, _like_params(opt_state, params, fsdp))
  if program.shard_optimizer:
    zero1 = jax.tree.map(lambda x, spec: _zero1_spec(x, spec, mesh), params, model)
    return Placement(model, _like_params(opt_state, params, zero1))
  return Placement(model, _like_params(opt_state, params, model))


def constrain_batch(mesh) -> Callable:
  """`h -> h` constrained batch-sharded over "data" (`P("data")`): MaxText's
  `activation_batch` rule, for the model's `constrain` hook. `mesh` has Auto axes (MaxText's
  default `shard_mode`): the programs leave the rest of the placement to GSPMD."""
  sharding = NamedSharding(mesh, P(DATA))
  return lambda h: jax.lax.with_sharding_constraint(h, sharding)


def train_step(forward_backward: Callable, tx) -> Callable:
  """`step(params, opt_state, batch) -> (params, opt_state, loss)`; `forward_backward(params,
  batch) -> (loss, grads)`. The update is a function named `optimizer_update`, so that a
  profile finds it (scripts/bench/step_breakdown.py)."""

  def optimizer_update(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def step(params, opt_state, batch):
    loss, grads = forward_backward(params, batch)
    params, opt_state = optimizer_update(grads, opt_state, params)
    return params, opt_state, loss

  return step


def _named(mesh, specs):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def jit_step(program: Program, problem: Problem, tx, mesh):
  """`(fn, placement)`: `program`'s jitted step, params and optimizer state donated."""
  place = placement(program, problem, tx, mesh)
  constrain = constrain_batch(mesh) if program.constrain_activations else None
  step = train_step(jax.value_and_grad(problem.make_loss(constrain)), tx)
  state = (_named(mesh, place.params), _named(mesh, place.opt_state))
  batch = jax.tree.map(lambda _: NamedSharding(mesh, P(DATA)), problem.batch)
  fn = jax.jit(
    step,
    in_shardings=(*state, batch),
    out_shardings=(*state, NamedSharding(mesh, P())),
    donate_argnums=(0, 1),
  )
  return fn, place


def compile_step(program: Program, problem: Problem, tx, mesh):
  """`program`'s step compiled from shapes alone (for a `jaxdp.inspect.gpu_mesh`: no GPU
  needed), with `COST_MODEL_OPTIONS` for `jaxdp.inspect.predict_step` (the same schedule)."""
  fn, _ = jit_step(program, problem, tx, mesh)
  shapes = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  opt_state = jax.eval_shape(tx.init, problem.params)
  lowered = fn.lower(shapes(problem.params), opt_state, shapes(problem.batch))
  return lowered.compile(compiler_options=inspect.COST_MODEL_OPTIONS)


def device0_bytes(tree) -> int:
  """Bytes of the arrays of `tree` that device 0 holds."""
  device = jax.devices()[0]
  return sum(
    s.data.nbytes
    for x in jax.tree.leaves(tree)
    if isinstance(x, jax.Array)
    for s in x.addressable_shards
    if s.device == device
  )


def check_placement(program: Program, place: Placement, params, opt_state, mesh) -> str:
  """Checks that a step's results hold `place`: every leaf carries its sharding (the jit's
  out_shardings pin them), and device 0 holds exactly the bytes of the formula (a leaf's
  bytes over the devices its spec splits it across). Returns a one-line summary; raises
  `RuntimeError` naming the first leaf that differs."""
  summary = []
  for name, tree, specs in (
    ("params", params, place.params),
    ("opt state", opt_state, place.opt_state),
  ):
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    n_sharded, formula = 0, 0
    for (path, x), spec in zip(leaves, jax.tree.leaves(specs), strict=True):
      want = NamedSharding(mesh, spec)
      if not x.sharding.is_equivalent_to(want, x.ndim):
        raise RuntimeError(
          f"{program.name}: {name}{jax.tree_util.keystr(path)} is {x.sharding}, not {want}"
        )
      axes = [a for entry in spec for a in _axes(entry)]
      n_sharded += DATA in axes and mesh.shape[DATA] > 1
      formula += x.nbytes // math.prod(mesh.shape[a] for a in axes)
    held = device0_bytes(tree)
    if held != formula:
      raise RuntimeError(
        f"{program.name}: device 0 holds {held} bytes of {name}, formula {formula}"
      )
    summary.append(
      f"{name} {n_sharded}/{len(leaves)} leaves sharded over data, {held / 2**20:.2f} MiB/dev"
    )
  return f"{program.name}: " + "; ".join(summary) + " (= the formula)"
