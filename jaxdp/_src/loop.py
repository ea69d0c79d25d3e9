"""What a real training loop carries besides params: a key, mutable model state, aux outputs.

Every strategy's step calls `loss_fn` through `call_loss`, which is where the three meet:

* **RNG.** A state built with `init_state(..., rng=key)` holds the key's raw data. Step `s`
  draws `fold_in(key, s)`; inside the step each device folds in its data-shard index
  (`collectives.data_index`: the shard of the batch it holds) and each micro-batch its
  index, and `loss_fn` gets the result as `rng=` (a typed key). So masks differ across
  steps, shards and micro-batches, and depend on nothing but the key, the step counter
  and the shard: a run resumed from a checkpoint (which stores both) draws the masks of
  the uninterrupted run.
* **Mutable model state** (`init_state(..., model_state=tree)`: BatchNorm running
  statistics, Linen's `batch_stats`, NNX `BatchStat`s): `loss_fn` gets it as
  `model_state=` and returns `(loss, new_model_state)`, as Flax's examples write it for
  `jax.value_and_grad(..., has_aux=True)`. After each micro-batch's forward the new state
  is made equal on every device by `collectives.sync_model_state`: a float leaf that
  differs across devices is
  averaged over them (what Flax's examples do with `pmean(batch_stats)`); a leaf the model
  already reduced itself (SyncBatchNorm: `nnx.BatchNorm(axis_name="data")`) is not varying
  over the data axes and is kept as it is, so its running statistics equal the
  single-device run's. torch DDP broadcasts rank 0's buffers instead: that keeps one
  shard's statistics and throws away the others', where the mean keeps every shard's (for
  a mean statistic, the mean over shards *is* the global batch's statistic; for a variance,
  it misses only the spread of the shard means). Non-float leaves that differ (counters)
  take the first shard's value, as torch does.
* **Aux.** With `has_aux=True`, `loss_fn` returns `(loss, aux)`; every leaf of `aux` is
  averaged over the micro-batches and then over the data axes (non-float leaves in
  float32), and returned as `metrics["aux"]`. Per-example outputs do not fit this (they
  would be averaged across shards): return them from `make_eval_step` instead.

With both, `loss_fn` returns `(loss, (aux, new_model_state))`: whatever the step carries,
`jax.value_and_grad(loss_fn, has_aux=True)` takes `loss_fn` as it is.

* **Per-token loss** (`make_train_step(per_token_loss=True)`): `(loss_sum, token_count)`
  stands where the loss does in each of these shapes. The step differentiates the sum; the
  count rides beside the aux (`Counted`) until the step's all-reduce divides by it
  ([Note: per-token loss] in step.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

PyTree = Any


# ----------------------------------------------------------------------------- init

# The state keeps a key as raw data, `uint32[2]`, not as a typed key: raw data is an
# ordinary array that checkpoints, shardings and `jax.tree` handle like any other leaf.
# Each step derives its keys from it, and no key is carried from step to step: step s's
# key is `fold_in(key, s)`, the same on every device (`step_key`); each device folds in its
# index over the data axes (`device_key`), so that devices draw different dropout masks for
# their different shards, and each micro-batch its number (`micro_key`). A step's keys
# depend on the state's key and step alone: a run resumed from a checkpoint draws what the
# uninterrupted run would have.


def key_data(rng) -> jax.Array | None:
  """The raw data (`uint32[2]`, threefry) of a key given as a typed key, raw key data or an
  int seed, for `TrainState.rng`; None stays None."""
  if rng is None:
    return None
  if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
    return jax.random.key_data(jax.random.key(int(rng)))
  x = jnp.asarray(rng) if not hasattr(rng, "dtype") else rng
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    impl = jax.random.key_impl(x)
    if x.shape or "threefry" not in str(impl):
      raise ValueError(
        f"rng: a key of shape {x.shape} and impl {impl}; pass one threefry "
        "key, e.g. jax.random.key(0)"
      )
    return jax.random.key_data(x)
  if x.shape != (2,) or x.dtype != jnp.uint32:
    raise ValueError(
      f"rng: {x.dtype}{list(x.shape)} is not a key; pass jax.random.key(seed), "
      "jax.random.PRNGKey(seed) or an int seed"
    )
  return x


def step_key(data: jax.Array | None, step: jax.Array) -> jax.Array | None:
  """Traced: the raw key of step `step` (the same on every device)."""
  if data is None:
    return None
  return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(data), step))


def device_key(data: jax.Array | None, index: jax.Array):
  """Inside the step: the typed key of this device's shard `index` (None without a key)."""
  if data is None:
    return None
  return jax.random.fold_in(jax.random.wrap_key_data(data), index)


def micro_key(key, j):
  """The key of micro-batch `j` of a device's shard (None without a key)."""
  return None if key is None else jax.random.fold_in(key, j)


# ----------------------------------------------------------------------------- the call


def describe_value(x) -> str:
  """What a user's function returned, in the user's terms: "a scalar float32 array", "a
  float32[16, 4] array", "a tuple of length 3", "a dict" (a traced array reads as the array
  it stands for, never as a tracer).

  Examples:
    >>> import jax.numpy as jnp
    >>> describe_value(jnp.float32(1.0)), describe_value((1, 2, 3))
    ('a scalar float32 array', 'a tuple of length 3')
    >>> describe_value(jnp.zeros((16, 4), jnp.int32)), describe_value(None)
    ('an int32[16, 4] array', 'None')
  """
  if x is None:
    return "None"
  if isinstance(x, (tuple, list)):
    return f"a {type(x).__name__} of length {len(x)}"
  # an array, a tracer or a ShapeDtypeStruct: described by its type alone
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    dtype = np.dtype(x.dtype).name
    article = "an" if dtype[0] in "aeiou" else "a"
    if not x.shape:
      return f"a scalar {dtype} array"
    return f"{article} {dtype}{list(x.shape)} array"
  if isinstance(x, (int, float, complex)):
    return f"a Python {type(x).__name__}"
  return f"a {type(x).__name__}"


def _pair(out, what: str):
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    alone = (
      " (a loss alone? then leave has_aux out)"
      if "aux" in what and getattr(out, "shape", None) == ()
      else ""
    )
    raise TypeError(f"loss_fn must return {what}; it returned {describe_value(out)}{alone}")
  return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Counted:
  """A per-token loss's aux as the step carries it (`call_loss(per_token=True)`): the
  caller's aux and the micro-batch's token count, which ride together through the
  micro-batch loop (both averaged over the micro-batches) until the step takes the count
  out for its all-reduce (`take_count`)."""

  aux: PyTree
  """The aux `loss_fn` returned (None without `has_aux`)."""
  count: jax.Array
  """The token count `loss_fn` returned, as a float32 scalar."""


def take_count(aux: PyTree, per_token: bool) -> tuple[PyTree, jax.Array | None]:
  """`(aux, count)` from the aux of the micro-batch loop: the `Counted` record split under
  `per_token`, else `(aux, None)`."""
  return (aux.aux, aux.count) if per_token else (aux, None)


def _per_token(out, has_aux: bool):
  """`(loss_sum, count)` from what a per-token `loss_fn` returned in the loss's place,
  checked: two scalars, the sum a float, the count a real number (float32 from here)."""
  fix = (
    "with per_token_loss=True, loss_fn returns (loss_sum, token_count) in the loss's place"
    + (", and ((loss_sum, token_count), aux) with has_aux=True" if has_aux else "")
    + ": the sum of the per-token losses of the batch it is given and how many tokens they "
    "are, e.g. (jnp.sum(token_losses * mask), jnp.sum(mask))"
  )
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise TypeError(f"{fix}; it returned {describe_value(out)}")
  loss_sum, count = out
  if isinstance(loss_sum, (tuple, list)) or jnp.shape(loss_sum) != ():
    raise TypeError(f"{fix}; its loss_sum is {describe_value(loss_sum)}, not a scalar")
  if isinstance(count, (tuple, list)) or jnp.shape(count) != ():
    raise TypeError(
      f"{fix}; its token_count is {describe_value(count)}, not a scalar: sum the mask, "
      "e.g. jnp.sum(mask)"
    )
  if not jnp.issubdtype(jnp.result_type(count), jnp.number) or jnp.iscomplexobj(count):
    raise TypeError(f"{fix}; its token_count is {describe_value(count)}, not a real number")
  return loss_sum, jnp.asarray(count, jnp.float32)


def call_loss(
  loss_fn: Callable,
  has_aux: bool,
  params: PyTree,
  batch: PyTree,
  rng,
  model_state: PyTree,
  per_token: bool = False,
) -> tuple[jax.Array, tuple[PyTree, PyTree]]:
  """`loss_fn` called the way the step was made: `(loss, (aux, new_model_state))`, with None
  for what the step does not carry (a `jax.value_and_grad(..., has_aux=True)` function).

  `per_token`: `loss_fn` returns `(loss_sum, token_count)` where the loss goes; the loss
  returned here is the sum, and the aux a `Counted` record that holds the count."""
  kwargs = {}
  if rng is not None:
    kwargs["rng"] = rng
  if model_state is not None:
    kwargs["model_state"] = model_state
  out = loss_fn(params, batch, **kwargs)
  aux = new_state = None
  if model_state is not None:
    what = (
      "(loss, (aux, new_model_state)) with has_aux=True" if has_aux else "(loss, new_model_state)"
    )
    out, new_state = _pair(
      out, what + " when the state holds model_state (init_state(..., model_state=))"
    )
    if has_aux:
      aux, new_state = _pair(new_state, what)
    if jax.tree.structure(new_state) != jax.tree.structure(model_state):
      raise ValueError(
        f"loss_fn returned a new model_state with the structure "
        f"{jax.tree.structure(new_state)}, but the state holds "
        f"{jax.tree.structure(model_state)}; return the whole model state, updated"
      )
    new_state = jax.tree.map(lambda n, o: n.astype(o.dtype), new_state, model_state)
  elif has_aux:
    out, aux = _pair(out, "(loss, aux) with has_aux=True")
  count = None
  if per_token:
    out, count = _per_token(out, has_aux)
  if isinstance(out, (tuple, list)) or jnp.shape(out) != ():
    got = f"a {type(out).__name__}" if isinstance(out, (tuple, list)) else f"shape {jnp.shape(out)}"
    raise TypeError(
      f"loss_fn must return a scalar loss, got {got}"
      + ("; with has_aux=True return (loss, aux)" if not has_aux else "")
    )
  dtype = np.dtype(jnp.result_type(out))
  if not jnp.issubdtype(dtype, jnp.floating):
    article = "an" if dtype.name[0] in "aeiou" else "a"
    raise TypeError(
      f"loss_fn returned {article} {dtype.name} loss: the gradient needs a real floating-point "
      "loss (jax.grad refuses an integer or complex one; an integer loss has no gradient, "
      "it would train nothing); compute the loss in floating point, e.g. "
      "jnp.mean(errors.astype(jnp.float32))"
    )
  if per_token:
    aux = Counted(aux, count)
  return out, (aux, new_state)


def mean_micro(stacked: PyTree, last: PyTree, k: int) -> PyTree:
  """The mean over k micro-batches of aux leaves: `stacked` holds the first k-1 on a leading
  axis and `last` the last one; or `stacked` all k and `last` is None; or (k = 1) `stacked`
  is None."""

  # integer aux (a count of tokens) is averaged as a float: its mean need not be whole
  def f32(x):
    return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)

  if stacked is None:
    return jax.tree.map(f32, last)
  if last is None:
    return jax.tree.map(lambda s: jnp.sum(f32(s), 0) / k, stacked)
  return jax.tree.map(lambda s, x: (jnp.sum(f32(s), 0) + f32(x)) / k, stacked, last)


# ----------------------------------------------------------------------------- state


def with_extras(state, mesh, rng, model_state):
  """`state` (from `init_state`) holding the key data of `rng` and a replicated copy of
  `model_state` (the caller's arrays are copied, never donated)."""
  if rng is None and model_state is None:
    return state
  data = key_data(rng)
  if model_state is not None:
    for path, x in jax.tree_util.tree_flatten_with_path(model_state)[0]:
      if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(
          f"model_state{jax.tree_util.keystr(path)}: {type(x).__name__} is "
          "not an array; pass a pytree of arrays (e.g. Linen's "
          "{'batch_stats': variables['batch_stats']}, or jaxdp.nnx_model_state(model))"
        )
      if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        raise ValueError(
          f"model_state{jax.tree_util.keystr(path)} is a PRNG key: keys go "
          "in init_state(..., rng=), which derives one per step and device"
        )
  replicated = NamedSharding(mesh, P())
  extras = jax.device_put((data, model_state), replicated, may_alias=False)
  explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  # placed the way the step places its output state, so step 2 reuses step 1's program
  constrain = jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint
  data, model_state = jax.jit(lambda t: jax.tree.map(lambda x: constrain(x, replicated), t))(extras)
  return dataclasses.replace(state, rng=data, model_state=model_state)


# ----------------------------------------------------------------------------- the update


def call_update(tx, grads: PyTree, opt_state: PyTree, params: PyTree):
  """`tx.update(grads, opt_state, params)`, the only way jaxdp calls it: no extra arguments.

  Raises:
    ValueError: `tx` needs an extra argument (`reduce_on_plateau`'s `value=`), naming the
      host-side way to drive it.
  """
  try:
    return tx.update(grads, opt_state, params)
  except TypeError as e:
    if "required keyword-only argument" not in str(e):
      raise
    raise ValueError(
      f"the optimizer's update needs an extra argument ({e}); jaxdp's step calls "
      "tx.update(grads, opt_state, params) and nothing more. For a transformation driven "
      "by a value such as the loss (optax.contrib.reduce_on_plateau), run it on the host "
      "between steps and set what it decides through optax.inject_hyperparams: "
      "state.opt_state = optax.tree_utils.tree_set(state.opt_state, learning_rate=lr)"
    ) from None


def _state_types(tree) -> str:
  """The optax state's types in order ("ScaleByAdamState, EmptyState"): which
  transformation built it, for a message."""
  names = []

  def visit(node):
    if hasattr(node, "_fields"):  # an optax NamedTuple state
      names.append(type(node).__name__)
    if isinstance(node, (tuple, list)):
      for child in node:
        visit(child)

  visit(tree)
  return ", ".join(names) or str(jax.tree.structure(tree))


def check_optimizer(tx, opt_state: PyTree, opt_params: PyTree) -> None:
  """Raises unless `opt_state` has the structure and leaf shapes `tx.init(opt_params)`
  gives: the state was built for this optimizer. Traced (`jax.eval_shape`, nothing
  computed), so it runs once per compile of a step, not per step.

  Raises:
    ValueError: another optimizer built the state (an Adam state stepped with `sgd` would
      otherwise train silently, or fail deep inside optax), naming both.
  """
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), opt_params)
  want = jax.eval_shape(tx.init, shapes)
  fix = (
    "pass make_train_step (and the NNX step) the optax transformation that init_state "
    "was given, or build the state again with init_state(params, tx, ...) for this one"
  )
  if jax.tree.structure(want) != jax.tree.structure(opt_state):
    raise ValueError(
      f"the state's optimizer state ({_state_types(opt_state)}) was built by another "
      f"optax transformation than this step's, whose init gives ({_state_types(want)}); " + fix
    )
  for (path, w), x in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(opt_state)):
    if tuple(w.shape) != tuple(x.shape):
      raise ValueError(
        f"state.opt_state{jax.tree_util.keystr(path)} has shape {tuple(x.shape)}, but this "
        f"step's optimizer makes it {tuple(w.shape)}: the state was built by another "
        f"optax transformation; " + fix
      )


def tx_update(tx, grads: PyTree, opt_state: PyTree, opt_params: PyTree, mesh):
  """`tx.update(grads, opt_state, opt_params)`, in the global view, on any mesh.

  On a mesh with Explicit axes (`jax.make_mesh`'s default) every operation of `tx` must
  type-check its shardings: a shape-dependent transformation (muon's Newton-Schulz
  `x @ x.T` of a leaf sharded on its rows) would raise a `ShardingTypeError`. The update
  therefore runs with those axes Automatic (`jax.sharding.auto_axes`), the compiler
  choosing the collectives, exactly as on a mesh with Auto axes; its outputs come back
  sharded like its inputs (updates like the grads, the state like the old state).

  Each grad reaches `tx` in the dtype of the param it updates (the fp32 master; Megatron's
  optimizer casts its main grads to fp32 too): grads reduced in bf16
  (`DDPConfig(grad_reduce_dtype=)`) are cast back here, where the compiler fuses the cast
  into the update. First `tx` is checked against the state it updates (`check_optimizer`).
  """
  check_optimizer(tx, opt_state, opt_params)
  grads = grads_as_params(grads, opt_params)
  update = lambda g, s, p: call_update(tx, g, s, p)
  return on_auto_axes(mesh, update, (grads, opt_state, opt_params), like=(grads, opt_state))


def grads_as_params(grads: PyTree, opt_params: PyTree) -> PyTree:
  """Each grad in the dtype of the param it updates (see `tx_update`)."""
  return jax.tree.map(
    lambda g, p: g if g is None or p is None else g.astype(p.dtype),
    grads,
    opt_params,
    is_leaf=lambda x: x is None,
  )


def on_auto_axes(mesh, fn: Callable, args: tuple, like: PyTree):
  """`fn(*args)` with the mesh's Explicit axes Automatic (see `tx_update`), its outputs
  placed like the leaves of `like`."""
  explicit = tuple(
    a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit
  )
  if not explicit:
    return fn(*args)
  shardings = jax.tree.map(lambda x: jax.typeof(x).sharding, like)
  return jax.sharding.auto_axes(fn, axes=explicit, out_sharding=shardings)(*args)
