"""The one train step every strategy runs, and the pieces of it they share.

A step, whatever the strategy (Megatron's `train_step`: forward-backward, finish the grad
sync, optimizer step):

1. check the state and the batch against the step (`StepStrategy.check_state`,
   `checks.check_batch`);
2. per device, inside `jax.shard_map` over the data axes, the strategy's `local_grads`:
   the micro-batches' forward and backward with its collectives, ending in a `LocalGrads`
   record (the reduced grads as the optimizer sees them, the global loss and grad norm,
   the aux, the model state). The specs `shard_map` assembles the record with are a
   `LocalGrads` too (`StepStrategy.out_specs`), and the inputs a `StepInputs`, so a value
   and its spec are paired by name, never by position;
3. in the global view, the strategy's `update`: the optax update and whatever the
   strategy does after it (gather the params back, HFSDP's gather across "replica");
4. with a guard (`DDPConfig.skips_steps`: the spike guards, the NaN check),
   `checks.guard_step`: on the device, the updated state or, where the grad norm says
   skip, the state before the step;
5. `checks.finish_step`: the new state placed as `init_state` placed it
   (`StepStrategy.state_specs`), the metrics.

What differs between strategies is a `StepStrategy`: `ddp.BucketedStep` (`no_shard`,
`optim`, `optim_grads`) and `fsdp.FSDPStep` (`optim_grads_params`).

The micro-batch loop is one function too (`accumulate`): every mode a strategy has
(accumulate local grads and reduce once, reduce every micro-batch, keep the units gathered)
is a choice of what one micro-batch's grads are and how they add up.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxdp._src import checks, collectives, loop
from jaxdp._src.config import DDPConfig
from jaxdp._src.mesh import constrain, data_axes, dp_size, run_manual
from jaxdp._src.state import TrainState

PyTree = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
  """What each device's `local_grads` receives: its blocks of the state's fields and of the
  batch (or, as `StepStrategy.in_specs`, the `shard_map` spec of each)."""

  params: PyTree
  master: PyTree
  batch: PyTree
  key: Any
  """The step's key data (`loop.step_key`), None without one."""
  model_state: PyTree


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LocalGrads:
  """What each device's `local_grads` hands back (or, as `StepStrategy.out_specs`, how
  `shard_map` assembles each field)."""

  grads: PyTree
  """The reduced grads, as the optimizer update takes them."""
  loss: Any
  """The global mean loss."""
  grad_norm: Any
  """The global norm of `grads`."""
  aux: PyTree
  """The aux averaged over the data axes (None without `has_aux`)."""
  model_state: PyTree
  tokens: Any = None
  """Per-token loss: the step's global token count (`GlobalScalars.tokens`); else None."""


class StepStrategy(Protocol):
  """What a strategy brings to `make_train_step`'s one step."""

  def check_state(self, state: TrainState) -> None:
    """Raises unless `state` was built for this step."""

  def state_specs(self, state: TrainState) -> TrainState:
    """Where `init_state` places each field of `state` (the step's output goes there too)."""

  def compiler_options(self) -> dict[str, Any]:
    """The XLA options the step is jitted with (`compiler.compiler_options` and the
    strategy's own)."""

  def in_specs(self, state: TrainState) -> StepInputs: ...

  def out_specs(self, state: TrainState) -> tuple[LocalGrads, LocalGrads | None]:
    """The `shard_map` specs of the output, and on a mesh that runs the step under
    `mesh.run_auto` (`runs_auto`) the output's full placement (else None)."""

  def local_grads(self, state: TrainState, inputs: StepInputs) -> LocalGrads:
    """Per device, inside the step's `shard_map`."""

  def call_with_params(self, state: TrainState, inputs: StepInputs, fn: Callable) -> Any:
    """Per device, inside a `shard_map` like the step's: `fn(params, batch, model_state)`
    with the params as the loss sees them (the eval step's forward)."""

  def update(self, tx, state: TrainState, out: LocalGrads) -> tuple[TrainState, PyTree]:
    """`state` (its step counted, its model state `out`'s) after the optimizer update, and
    the grads the NaN check reads (`DDPConfig.check_for_nan_in_grad`)."""


@dataclasses.dataclass(frozen=True)
class _Step:
  """The step `make_train_step` jits: what it fixes, as fields (see the module docstring)."""

  strategy: StepStrategy
  tx: Any
  mesh: Any
  config: DDPConfig
  grad_accum_steps: int
  has_aux: bool

  # The skeleton's order. The checks run while tracing (once per compile), before anything
  # is built from the state. The step count and the model state are set before `update`,
  # so that a strategy's `update` replaces only the fields the optimizer changes; a guard
  # then picks between that state and the one before the step; `finish_step` comes last
  # because it places the state the step returns, as `init_state` placed it, for the next
  # call to hit the same compiled program.
  def __call__(self, state: TrainState, batch):
    strategy, config = self.strategy, self.config
    strategy.check_state(state)
    checks.check_batch(batch, dp_size(self.mesh) * self.grad_accum_steps)
    out = run_local_grads(strategy, self.mesh, state, batch)
    counted = dataclasses.replace(state, step=state.step + 1, model_state=out.model_state)
    new_state, checked = strategy.update(self.tx, counted, out)
    specs = strategy.state_specs(new_state)
    finite = checks.finite_leaves(checked) if config.check_for_nan_in_grad else None
    skipped = None
    if config.skips_steps:
      guarded = checks.guard_step(config, state, new_state, specs, self.mesh, out.grad_norm, finite)
      new_state, skipped = guarded.state, guarded.skipped
    return checks.finish_step(
      new_state,
      specs,
      self.mesh,
      config,
      out.loss,
      out.grad_norm,
      finite,
      out.aux if self.has_aux else None,
      skipped,
      out.tokens,
    )


def make_train_step(
  strategy: StepStrategy,
  tx,
  mesh,
  config: DDPConfig,
  *,
  grad_accum_steps: int,
  has_aux: bool,
) -> checks.TrainStep:
  """The jitted step of `strategy` (see the module docstring)."""
  run = _Step(strategy, tx, mesh, config, grad_accum_steps, has_aux)

  def step(state: TrainState, batch):  # named: the compiled program is "jit_step"
    return run(state, batch)

  return checks.jit_step(step, mesh, config, strategy.compiler_options())


def run_local_grads(strategy: StepStrategy, mesh, state: TrainState, batch) -> LocalGrads:
  """`strategy.local_grads` on every device (`shard_map` over the data axes), the batch
  split over them: the step's `LocalGrads` in the global view."""
  # The batch's leading dim split over every data axis at once ("replica", "expert", "data"
  # where present), the spec `in_specs` gives it inside the `shard_map`
  batch_spec = P(data_axes(mesh))
  batch = jax.tree.map(lambda x: constrain(x, mesh, batch_spec), batch)
  out_specs, placed = strategy.out_specs(state)
  inputs = StepInputs(
    state.params, state.master, batch, loop.step_key(state.rng, state.step), state.model_state
  )
  return run_manual(
    lambda inputs: strategy.local_grads(state, inputs),
    mesh,
    (strategy.in_specs(state),),
    out_specs,
    placed,
  )(inputs)


# ----------------------------------------------------------------------------- micro-batches


def micro_batches(batch: PyTree, k: int) -> PyTree:
  """`batch` with each leaf's leading dim split into `(k, rows / k)`."""
  return jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)


@dataclasses.dataclass(frozen=True)
class Accumulated:
  """What `accumulate` returns."""

  loss: jax.Array
  """The micro-batches' losses summed (each divided by k by its strategy)."""
  grads: PyTree
  """Their grads summed, in the dtypes of `accumulate`'s `zeros`."""
  auxs: PyTree
  """Their aux, stacked on a leading micro-batch dim (None without `has_aux`)."""
  model_state: PyTree
  """The model state the last one left, synced over the data axes."""


def accumulate(
  micro_grad: Callable, zeros: PyTree, micro: PyTree, model_state, axes
) -> Accumulated:
  """Runs `micro_grad` on every micro-batch of `micro` (leading dim: micro-batches, numbered
  from 0) in one `lax.scan`, adding up losses and grads to `zeros`.

  `micro_grad(micro_batch, number, model_state) -> ((loss, (aux, model_state)), grads)`, as
  `jax.value_and_grad(..., has_aux=True)` of `loop.call_loss` returns it: what one
  micro-batch's grads are (local, reduced, one device's shard) is the caller's. Each
  micro-batch sees the model state the one before it left, synced over `axes`
  (`collectives.sync_model_state`).
  """

  # One scan, whatever the mode: the carry holds the running sums and the model state, the
  # scanned output the aux, stacked. `xs` is (micro-batch, its number), the number feeding
  # the micro-batch's key (`loop.micro_key`).
  def body(carry, xs):
    loss_sum, grad_sum, state_before = carry
    (loss, (aux, state_after)), grads = micro_grad(*xs, state_before)
    grad_sum = jax.tree.map(lambda total, g: total + g.astype(total.dtype), grad_sum, grads)
    return (loss_sum + loss, grad_sum, collectives.sync_model_state(state_after, axes)), aux

  steps = jax.tree.leaves(micro)[0].shape[0]
  # a scan carry varying over the data axes, as the losses added to it are: See
  # [Note: varying values] in collectives.py
  loss_zero = collectives.make_varying(jnp.zeros((), jnp.float32), axes)
  (loss, grads, model_state), auxs = jax.lax.scan(
    body, (loss_zero, zeros, model_state), (micro, jnp.arange(steps))
  )
  return Accumulated(loss, grads, auxs, model_state)


@dataclasses.dataclass(frozen=True)
class GlobalScalars:
  """What `global_loss_and_norm` returns: the step's scalars, from one all-reduce."""

  loss: jax.Array
  """The global mean loss (per token: the global loss sum over the global token count)."""
  grad_norm: jax.Array
  """The global norm of the grads the optimizer gets (per token: the reduced grads divided
  by `count`, `divide_by_count`)."""
  count: jax.Array | None = None
  """Per token: what the reduced grads are divided by (see [Note: per-token loss]); None
  otherwise."""
  tokens: jax.Array | None = None
  """Per token: the global token count, over every device and micro-batch; None
  otherwise."""


# [Note: per-token loss]
# With `per_token_loss=True` each micro-batch's `loss_fn` returns its loss *sum* and its
# token count (Megatron's `calculate_per_token_loss`), and the step trains on the global
# sum over the global count, whatever the padding on each rank and micro-batch. The step
# runs exactly as for a mean loss, on the sums: each micro-batch's sum is divided by k and
# the grads are scaled by 1/dp and summed over the data axes as they are for a mean loss,
# so the reduced grads are the mean over the dp * k micro-batch shards of each one's sum.
# The counts take the same path (divided by k in the micro-batch loop, averaged over the
# data axes in the loss's all-reduce), so the reduced grads, the loss and the grad norm
# divided by that mean count are the global sum over the global count. Megatron instead
# reduces plain sums and divides by the global count; the ratio is the same, and keeping
# the 1/dp and 1/k scaling leaves the reductions and their dtypes those of a mean loss.
# The division comes after the reduction, in float32 (`divide_by_count`): before it, a
# rank knows only its own count, and dividing by that would weigh the ranks' tokens
# unequally. The sums a grad_reduce_dtype of bfloat16 carries are a micro-batch shard's
# tokens times a mean grad: bfloat16 has float32's exponent range, so they do not
# overflow, and its relative rounding does not depend on their size.


def global_loss_and_norm(
  loss, squares, axes, dp: int, copies: int = 1, count=None, micro_batches: int = 1
) -> GlobalScalars:
  """The loss and grad norm from every device's share in one scalar all-reduce: the mean of
  the `dp` devices' losses, and the root of the summed `squares` (each device's part of the
  grads' norm²) divided by how many `copies` of each grad element the devices hold.

  `count` (per-token loss): this device's token count, scaled as its loss is (its
  `micro_batches`' mean); averaged over the devices in the same all-reduce, it divides the
  loss and the norm ([Note: per-token loss]). A step with no token at all keeps its zero sums (Megatron's
  choice) rather than dividing zero by zero.
  """
  # Stacked into one array so that all ride one all-reduce (a psum of a scalar costs its
  # latency, not its bytes); the squares are divided by `copies` after the sum.
  if count is None:
    loss, squares = collectives.sum_over(jnp.stack([loss, squares]), axes)
    return GlobalScalars(loss / dp, jnp.sqrt(squares / copies))
  loss, squares, total = collectives.sum_over(jnp.stack([loss, squares, count]), axes)
  count = jnp.where(total > 0, total / dp, 1.0)
  norm = jnp.sqrt(squares / copies) / count
  return GlobalScalars(loss / dp / count, norm, count, total * micro_batches)


def divide_by_count(grads: PyTree, count) -> PyTree:
  """The reduced `grads` divided by `count` (`GlobalScalars.count`) in float32, each back in
  its dtype; `grads` itself where `count` is None (a mean loss)."""
  if count is None:
    return grads
  return jax.tree.map(lambda g: (g.astype(jnp.float32) / count).astype(g.dtype), grads)
