"""The eval step: a jitted forward of the train state's params on a sharded batch."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp._src import checks, collectives, loop
from jaxdp._src.step import StepInputs
from jaxdp._src.train import step_strategy
from jaxdp._src.compiler import compiler_options
from jaxdp._src.config import DDPConfig
from jaxdp._src.mesh import (
  constrain,
  explicit_axes,
  data_axes,
  dp_size,
  run_manual,
  runs_auto,
)
from jaxdp._src.state import TrainState

PyTree = Any


def _call_eval_fn(fn, params, batch, model_state):
  """`fn(params, batch)`, or with the state's model state `fn(..., model_state=)`, whose
  first output is the eval's."""
  if model_state is None:
    return fn(params, batch)
  out = fn(params, batch, model_state=model_state)
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise TypeError(
      "eval fn must return (outputs, new_model_state) when the state holds "
      "model_state (the train step's convention); it returned "
      f"{loop.describe_value(out)}"
    )
  return out[0]


def make_eval_step(fn: Callable, mesh, config: DDPConfig, *, fsdp=None, per_example: bool = False):
  """Builds `eval_step(state, batch) -> outputs`: `fn` on the state's params, jitted, on a
  batch split over the data axes like the train step's. No grads, no update, no donation.

  The params are used where they live: `no_shard` reads the replicated params, the other
  sharded strategies all-gather each bucket from the master shards inside the step (as the
  train step does with `overlap_param_gather`), and `optim_grads_params` gathers unit by unit
  with the train step's unit gathers (stacked units inside the model's scan; under HFSDP from the
  compute rows the state keeps), so the whole model is never held gathered at once.

  Args:
    fn: `fn(params, batch) -> outputs` (a pytree of arrays). When the state holds
      `model_state` (BatchNorm statistics) it is called as `fn(params, batch,
      model_state=...)` and returns `(outputs, new_model_state)`, the train step's
      convention (an `nnx_split` function does); the new model state is dropped: an eval
      does not update the state. `fn` should run the model in eval mode (running averages,
      no dropout): it gets no key.
    mesh: the mesh of `init_state` and `make_train_step`.
    config: the `DDPConfig` of `init_state` and `make_train_step`.
    fsdp: the `FSDPConfig` of `init_state` and `make_train_step`.
    per_example: False: every leaf of `outputs` is averaged over the data shards (each
      shard's `fn` returns its own means: accuracy, loss) and returned replicated, non-float
      leaves in float32. True: every leaf has the batch's leading dim and comes back as one
      global array sharded over the data axes (logits, predictions).

  Returns:
    `eval_step(state, batch) -> outputs`, a `jax.jit` function (`.lower`, `.trace` are its
    own) wrapped in a host-side check that the state was not donated to a train step.

  Raises:
    ValueError: (when called) a batch whose leading dims differ or do not divide, a state
      built for another mesh, config or `fsdp`, or one donated to a train step.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
    >>> state = jaxdp.init_state({"w": jnp.ones((3, 2))}, optax.sgd(0.1), mesh, config)
    >>> batch = {"x": jnp.ones((16, 3)), "y": jnp.zeros((16,), jnp.int32)}
    >>> def accuracy(params, batch):
    ...   return {"acc": jnp.mean(jnp.argmax(batch["x"] @ params["w"], -1) == batch["y"])}
    >>> float(jaxdp.make_eval_step(accuracy, mesh, config)(state, batch)["acc"])
    1.0
    >>> logits = jaxdp.make_eval_step(lambda p, b: b["x"] @ p["w"], mesh, config,
    ...                               per_example=True)(state, batch)
    >>> logits.shape, logits.sharding.spec
    ((16, 2), P('data',))
  """
  checks.check_mesh(mesh, config)
  strategy = step_strategy(None, mesh, config, fsdp=fsdp)
  batch_spec = P(data_axes(mesh))
  call = functools.partial(_call_eval_fn, fn)

  def step(state, batch):
    if not isinstance(state, TrainState):
      raise TypeError(
        f"eval_step expects the TrainState from jaxdp.init_state, got {type(state).__name__}"
      )
    strategy.check_state(state)
    checks.check_batch(batch, dp_size(mesh))
    batch = jax.tree.map(lambda x: constrain(x, mesh, batch_spec), batch)
    out_spec = batch_spec if per_example else P()
    # the step's own input specs, less the key (an eval step draws none)
    in_specs = dataclasses.replace(strategy.in_specs(state), key=None)

    def local(inputs):
      out = strategy.call_with_params(state, inputs, call)
      return out if per_example else collectives.average_aux(out, data_axes(mesh))

    return run_manual(
      local,
      mesh,
      (in_specs,),
      out_spec,
      out_spec if runs_auto(mesh, state.model_specs) else None,
    )(StepInputs(state.params, state.master, batch, None, state.model_state))

  # On a mesh with Explicit axes, the outputs on that mesh, for the caller's code
  # (`mesh.EagerProgram`); elsewhere where the compiler puts them.
  placed = {}
  if explicit_axes(mesh):
    spec = batch_spec if per_example else P()
    placed["out_shardings"] = NamedSharding(mesh, spec)
  return checks.EvalStep(
    jax.jit(
      step,
      compiler_options=compiler_options(mesh.devices.flat[0].platform),
      **placed,
    )
  )
