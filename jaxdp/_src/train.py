"""The front door: `init_state`, `make_train_step` and `get_params`, dispatched by strategy.

Each strategy is a module of its own that knows nothing of the others: `ddp.py` runs the
bucketed step (`no_shard`, and the distributed optimizer's `optim`, `optim_grads`),
`fsdp.py` runs `optim_grads_params`. This module checks what every strategy needs and hands
the call to the one `config` names; a step is `step.make_train_step` over the strategy's
`step.StepStrategy` (`step_strategy`), the same one skeleton for all.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import optax

from jaxdp._src import checks, ddp, fsdp as fsdp_lib, loop, state as state_lib
from jaxdp._src import step as step_lib
from jaxdp._src.config import DDPConfig, FSDPConfig
from jaxdp._src.layout import Frozen, is_function
from jaxdp._src.mesh import eager_program
from jaxdp._src.state import TrainState

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]


def _fsdp_branch(config: DDPConfig, fsdp) -> bool:
  """True for `optim_grads_params` (implemented in fsdp.py); refuses `fsdp=` elsewhere."""
  if config.shards_params:
    return True
  if fsdp is not None:
    raise ValueError(
      f"fsdp={fsdp} is for data_parallel_sharding_strategy="
      "'optim_grads_params'; leave it out for "
      f"{config.data_parallel_sharding_strategy!r}"
    )
  return False


def init_state(
  params: PyTree,
  tx: optax.GradientTransformation,
  mesh,
  config: DDPConfig,
  *,
  frozen: Frozen = None,
  fsdp: FSDPConfig | None = None,
  rng=None,
  model_state: PyTree = None,
) -> TrainState:
  """Places params on the mesh and builds the optimizer state for `config`'s strategy.

  The caller's arrays are copied, never donated.

  Args:
    params: the model params: any pytree of arrays, as `jax.grad` and optax take it (a
      Flax params dict, an `eqx.Module` from `eqx.partition(model, eqx.is_inexact_array)`,
      None for an empty subtree); or the model's init as a function of no arguments that
      returns them, run under `jit` so that each device computes only its shards. A
      function is a `functools.partial` or a callable JAX sees as one leaf (a `def`,
      `lambda`, bound method, jitted function); a pytree node is params even when callable
      (an `eqx.Module` is never called), and a callable pytree node without array leaves
      is refused as ambiguous.
    tx: any optax `GradientTransformation`. It sees the param tree with frozen and
      non-float leaves replaced by None (masks given as pytrees may keep any value there).
    mesh: a mesh with a "data" axis (and a "replica" axis for
      `num_distributed_optimizer_instances > 1`, an "expert" axis for expert parallelism).
      jaxdp runs its step manual over "replica", "expert" and "data" and leaves every
      other axis (e.g. "model") to the compiler. Params placed with a `NamedSharding` on
      this mesh keep their sharding over the other axes (tensor-parallel weights, e.g.
      `P(None, "model")`), in `params`, master params and optimizer state alike, on a mesh
      with Auto or Explicit axes (where params are sharded over Explicit ones the step
      runs with them Auto: the loss is written as for an Auto mesh, with no sharding
      annotations). Params sharded `P("expert", ...)` are expert params: dense params
      are data parallel over "expert" too, expert params get buffers of their own reduced
      over the expert-data-parallel group ("replica" and "data") only (FSDP: sharded over
      "data" on a dim of their own besides "expert", and gathered over "data" alone), and
      `loss_fn` sees this rank's experts (the model exchanges tokens over "expert" itself).
    config: the `DDPConfig`.
    frozen: params to leave untrained: a boolean pytree (True = frozen) or a function
      `(path, leaf) -> bool`. They get no grads, no optimizer state, no collective.
    fsdp: `optim_grads_params` only: its `FSDPConfig` (units); None for the default.
    rng: a key (`jax.random.key(seed)`, raw `PRNGKey` data or an int seed): each step
      derives its keys from it, the step counter and the device's data shard, and
      `loss_fn` gets them as `rng=` (dropout; see `make_train_step`). None: no key.
    model_state: mutable non-trainable model state (BatchNorm running statistics: Linen's
      `{"batch_stats": variables["batch_stats"]}`, `jaxdp.nnx_model_state(model)`), a pytree
      of arrays kept replicated: `loss_fn` gets it as `model_state=` and returns the updated
      one.

  Returns:
    A `TrainState` for `make_train_step(loss_fn, tx, mesh, config)`.

  Raises:
    TypeError: an init function that takes arguments or returns no pytree of arrays, or
      a callable pytree node without array leaves (an init function or params?).
    ValueError: the mesh has no "data" axis, params have no trainable float leaf,
      `frozen` does not match params, a param is placed over a data axis, on another mesh
      or over axes that do not divide its dim, or (sharded strategies) an expert param's
      experts per rank, or the rows of a dim that both its caller and jaxdp split, do not
      divide by the axis sizes; under `optim_grads_params`, a tensor-parallel param split
      over its layer axis (`FSDPConfig(stacked=)`), a tensor- or expert-parallel param
      gathered by row blocks (`chunks=`), an expert param under `stacked=`, or a frozen one.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> state = jaxdp.init_state({"w": jnp.ones((4, 2))}, optax.sgd(0.1), mesh, jaxdp.DDPConfig())
    >>> int(state.step), state.layout.num_buckets
    (0, 1)
  """
  checks.check_mesh(mesh, config)
  if _fsdp_branch(config, fsdp):
    state = fsdp_lib.init_state(params, tx, mesh, config, frozen=frozen, fsdp=fsdp)
  else:
    state = ddp.init_state(params, tx, mesh, config, frozen=frozen)
  return checks.with_spike_window(loop.with_extras(state, mesh, rng, model_state), mesh)


def abstract_state(
  params: PyTree,
  tx: optax.GradientTransformation,
  mesh,
  config: DDPConfig,
  **kwargs,
) -> TrainState:
  """The state `init_state` would build, as `jax.ShapeDtypeStruct`s with their shardings:
  nothing is computed, allocated or transferred.

  What a restore at scale reads into (`CheckpointManager.restore(abstract_state(...))`):
  the checkpoint's arrays are allocated as they are read, so the restore holds one state,
  never a state to overwrite as well.

  Args:
    params: as `init_state` takes it: an init function, arrays or their
      `jax.ShapeDtypeStruct`s (only shapes, dtypes and placements, a tensor-parallel
      split, are read).
    tx: the optax transformation, as `init_state` takes it.
    mesh: the mesh, as `init_state` takes it.
    config: the `DDPConfig`, as `init_state` takes it.
    **kwargs: `init_state`'s keyword arguments (`frozen`, `fsdp`, `rng`, `model_state`).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
    >>> like = jaxdp.abstract_state(lambda: {"w": jnp.ones((16, 4))}, optax.sgd(0.1), mesh, config)
    >>> flat = jax.tree.leaves(like.master)[0]
    >>> type(flat).__name__, flat.shape, flat.sharding.spec
    ('ShapeDtypeStruct', (128,), P('data',))
  """
  if is_function(params):
    state = jax.eval_shape(lambda: init_state(params, tx, mesh, config, **kwargs))
  else:  # traced, so only shapes, dtypes and placements (a tensor-parallel split) are read
    state = jax.eval_shape(lambda p: init_state(p, tx, mesh, config, **kwargs), params)
  # On the mesh's devices (a restore needs them; eval_shape places on the abstract mesh),
  # with eval_shape's specs, or where `init_state` places each leaf (`state_specs`) for a
  # `jax.sharding.Mesh` built by hand, whose leaves eval_shape leaves unplaced.
  # ... and in the memory `init_state` puts it in (`DDPConfig.optimizer_cpu_offload`)
  return jax.tree.map(
    lambda x, spec, kind: (
      None
      if x is None
      else jax.ShapeDtypeStruct(
        x.shape,
        x.dtype,
        sharding=jax.sharding.NamedSharding(
          mesh, spec if x.sharding is None else x.sharding.spec, memory_kind=kind
        ),
      )
    ),
    state,
    state_specs(state),
    state_lib.memory_kinds(state),
    is_leaf=lambda x: x is None,
  )


def get_params(state: TrainState, *, sharded: bool = False) -> PyTree:
  """The model param tree of a state, every leaf in its own shape and dtype.

  Fresh arrays: they stay valid after the state is donated to the next train step. The
  unpadding and copy of every leaf are one compiled program (with several processes, eager
  per-leaf ops would each run a program of their own, which can hang a job). They are
  arrays for your own code, on the mesh you gave (its axis types included), as if you had
  placed them there with `jax.device_put`: your own `jax.jit` takes them beside a batch
  placed on that mesh. On a mesh with Explicit axes (`jax.make_mesh`'s default) JAX
  refuses some eager ops outside `jax.set_mesh(mesh)` (`x.imag` inside
  `optax.tree.norm`, an attention mask broadcast against a param): run those under it, or
  use `jaxdp.nnx_merge`, whose model is for eager calls.

  Args:
    state: a `TrainState` of any strategy.
    sharded: False: every leaf whole on every device (over the data axes; a
      tensor-parallel leaf keeps its own sharding), what a small model's export or eval
      wants. True: every leaf also sharded over "data" on a dim that dp divides (replicated
      if none does), so that no device holds the whole of a big model: for export
      (`orbax` writes it shard by shard), evaluation and sampling under `jax.jit`. A leaf
      that a sharded strategy padded moves to that dim by an all-to-all; nothing is
      gathered whole.

  Raises:
    ValueError: the state was donated to a train step (use the state the step returned).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
    >>> state = jaxdp.init_state({"w": jnp.ones((3, 2))}, optax.sgd(0.1), mesh, config)
    >>> params = jaxdp.get_params(state)
    >>> params["w"].sharding.mesh == mesh  # the mesh you gave
    True
    >>> with jax.set_mesh(mesh):  # eager ops on a mesh with Explicit axes
    ...   print(params["w"].shape, float(optax.tree.norm(params)))
    (3, 2) 2.449489...
    >>> state = jaxdp.init_state({"w": jnp.ones((3, 16))}, optax.sgd(0.1), mesh, config)
    >>> jaxdp.get_params(state, sharded=True)["w"].sharding.spec  # 3 rows: on the 16
    P(None, 'data')
  """
  checks.check_not_donated(state, "jaxdp.get_params(state)")
  # One jit over the whole tree, never eager per-leaf `device_put`s and slices: with several
  # processes each eager op on a global array is a program of its own, and dozens of them
  # in flight hung 2-process jobs on a busy machine. The copy inside it also keeps the
  # result alive when the next step donates `state` (under `no_shard` the params *are* the
  # state's buffers).
  return _params_program(state, state.step.sharding.mesh, bool(sharded))


@eager_program
def _params_program(state: TrainState, mesh, sharded: bool) -> PyTree:
  return whole_params(state, mesh, sharded)


def whole_params(state: TrainState, mesh, sharded: bool = False) -> PyTree:
  """Traced `get_params`, for a program that does more (the eval step)."""
  # an offloaded master (`DDPConfig.optimizer_cpu_offload`) is read on the device
  state = dataclasses.replace(state, master=state_lib.to_device(state.master))
  if _fsdp_branch(state.config, None):
    return fsdp_lib.whole_params(state, mesh, sharded)
  return ddp.whole_params(state, mesh, sharded)


def make_train_step(
  loss_fn: LossFn,
  tx: optax.GradientTransformation,
  mesh,
  config: DDPConfig,
  *,
  grad_accum_steps: int = 1,
  fsdp: FSDPConfig | None = None,
  has_aux: bool = False,
  per_token_loss: bool = False,
) -> checks.TrainStep:
  """Builds the jitted train step of `config`'s strategy.

  Args:
    loss_fn: `loss_fn(params, batch) -> loss`, a float scalar: the mean loss over the
      batch it is given (one device's shard of one micro-batch), or with `per_token_loss`
      its sum and token count. What the state carries adds to its signature:

      - with `init_state(..., rng=key)` it is also given `rng=`, a fresh key for every
        step, data shard and micro-batch (for dropout); a resumed run gets the same keys.
      - with `init_state(..., model_state=...)` it is also given `model_state=` and
        returns `(loss, new_model_state)`. The step averages the new model state over
        the data axes (Flax's `pmean(batch_stats)`), keeps a model state the model
        already synchronized (SyncBatchNorm), and takes the first shard's value of an
        integer leaf.
      - with `has_aux=True` it returns `(loss, aux)`, or `(loss, (aux, new_model_state))`
        with a model state.

      docs/loops.md lists the loops this covers (Linen, NNX, optax's wrappers).
    tx: the optax transformation `init_state` was given (checked when the step is first
      traced: a transformation whose state differs from the state's is refused). Its
      update runs with the mesh's Explicit axes made Auto, so shape-dependent
      transformations (`optax.contrib.muon`) run on sharded leaves as on an Auto mesh.
    mesh: the mesh `init_state` was given.
    config: the `DDPConfig` `init_state` was given.
    grad_accum_steps: micro-batches per step; gradients are communicated once per step
      (every micro-batch under `optim_grads`, which keeps only its shard).
    fsdp: `optim_grads_params` only: the `FSDPConfig` given to `init_state`.
    has_aux: `loss_fn` returns `(loss, aux)`; every leaf of `aux` is averaged over the
      micro-batches and the data axes (a per-shard mean becomes the global mean; non-float
      leaves in float32) and returned as `metrics["aux"]`. Per-example outputs belong in
      `make_eval_step(per_example=True)`.
    per_token_loss: `loss_fn` returns `(loss_sum, token_count)` where the loss goes
      (`((loss_sum, token_count), aux)` with `has_aux`): the sum of the per-token losses of
      the batch it is given and how many tokens they are (or the sum of their weights), two
      scalars. The step trains on the sum over every data rank and micro-batch divided by
      the count over them all (Megatron's `calculate_per_token_loss`), so padding that
      differs between ranks and micro-batches weighs every real token the same, as one
      device on the whole batch does; the counts ride in the loss's all-reduce, and
      `metrics["loss"]` and `grad_norm` are the per-token loss's, and `metrics["tokens"]`
      the step's global token count. Without it every
      shard's mean loss weighs the same, however many tokens it holds.

  Returns:
    `train_step(state, batch) -> (state, metrics)`: a `jax.jit` function that donates
    `state` (`.lower`, `.trace` are the jitted function's), wrapped in host-side checks.
    Donating means the step reuses the state's buffers for the new state: the state passed
    in is deleted, so always continue with the one returned (`state, metrics =
    train_step(state, batch)`); passing a donated state again raises.
    `batch` is a pytree of global arrays whose leading dim (the same for every leaf,
    divisible by data-parallel size × `grad_accum_steps`) is split over the data axes.
    `metrics` holds the global mean `loss` and the global `grad_norm` (before any
    clipping), and `aux` with `has_aux`. With a spike guard (`config.grad_norm_skip_threshold`,
    `config.skip_step_on_spikes`) a step whose grad norm it judges a spike, or not finite,
    skips its update on the device (the state as before, its step counted) and
    `metrics["skipped"]` says whether it did. With `config.check_for_nan_in_grad` each
    step waits for its grads to be checked, and a NaN/Inf skips the update and raises
    `NonFiniteGradError` naming the params and the step; the state passed in is donated
    all the same, and the error's `state` is that state unchanged, to continue with (the
    jitted function then also returns one "finite" flag per trainable leaf).

  Raises:
    ValueError: `grad_accum_steps` below 1 or `per_token_loss` not a bool; (when called) a
      batch whose leading dims differ or do not divide; a state built for another mesh,
      config, `fsdp` or optimizer, whose params changed after `init_state`, or that was
      donated to an earlier step.
    TypeError: (when called) `loss_fn` returns other than described above, or a loss that
      is not a float scalar (an integer loss has no gradient); with `per_token_loss`, no
      `(loss_sum, token_count)` pair of scalars.
    NonFiniteGradError: (when called, `check_for_nan_in_grad`) a reduced grad is NaN/Inf;
      `e.state` is the state to continue with.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> n = jax.device_count()  # 8 with the docs' simulated CPU devices; 1 on a laptop
    >>> mesh = jax.make_mesh((n,), ("data",))
    >>> config, tx = jaxdp.DDPConfig(), optax.sgd(0.1)
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
    >>> state = jaxdp.init_state({"w": jnp.zeros((3, 1))}, tx, mesh, config)
    >>> step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
    >>> batch = {"x": jnp.ones((2 * n, 3)), "y": jnp.ones((2 * n, 1))}
    >>> state, metrics = step(state, batch)  # always continue with the returned state
    >>> float(metrics["loss"])
    1.0
  """
  checks.check_mesh(mesh, config)
  if (
    isinstance(grad_accum_steps, bool)
    or not isinstance(grad_accum_steps, int)
    or grad_accum_steps < 1
  ):
    raise ValueError(f"grad_accum_steps={grad_accum_steps!r}: must be an integer >= 1")
  if not isinstance(per_token_loss, bool):
    raise ValueError(f"per_token_loss={per_token_loss!r}: must be True or False")
  strategy = step_strategy(
    loss_fn,
    mesh,
    config,
    grad_accum_steps=grad_accum_steps,
    fsdp=fsdp,
    has_aux=has_aux,
    per_token_loss=per_token_loss,
  )
  return step_lib.make_train_step(
    strategy, tx, mesh, config, grad_accum_steps=grad_accum_steps, has_aux=has_aux
  )


def step_strategy(
  loss_fn: Callable,
  mesh,
  config: DDPConfig,
  *,
  grad_accum_steps: int = 1,
  fsdp: FSDPConfig | None = None,
  has_aux: bool = False,
  per_token_loss: bool = False,
) -> step_lib.StepStrategy:
  """The `step.StepStrategy` of `config`'s strategy, chosen here once: `fsdp.FSDPStep` for
  `optim_grads_params`, `ddp.BucketedStep` for the others."""
  if _fsdp_branch(config, fsdp):
    return fsdp_lib.FSDPStep(
      loss_fn, mesh, config, fsdp or FSDPConfig(), grad_accum_steps, has_aux, per_token_loss
    )
  return ddp.bucketed_step(loss_fn, mesh, config, grad_accum_steps, has_aux, per_token_loss)


def state_specs(state: TrainState) -> TrainState:
  """The PartitionSpec of every leaf of a state, as `init_state` and the step place it.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
    >>> state = jaxdp.init_state({"w": jnp.ones((12, 4))}, optax.adam(1e-3), mesh, config)
    >>> state_specs(state).master  # the fused update: one flat array per bucket
    {'float32/bucket0': P('data',)}
  """
  if _fsdp_branch(state.config, None):
    return fsdp_lib.state_specs(state)
  return state_lib.state_specs(state)
