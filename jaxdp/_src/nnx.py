"""Flax NNX adapter: an NNX model becomes the `(params, loss_fn)` pair jaxdp trains.

jaxdp trains a plain pytree of arrays with a pure `loss_fn(params, batch)`. An NNX
model is a mutable object graph; `nnx_split` cuts it into its trainable
`nnx.Param` values (a nested `dict` of arrays, as `nnx.to_pure_dict` returns it)
and a pure loss over them, and `nnx_merge` writes trained params back into the
model:

  params, loss_fn = jaxdp.nnx_split(model, model_loss)
  state = jaxdp.init_state(params, tx, mesh, config)
  train_step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  for batch in batches:
    state, metrics = train_step(state, batch)
  jaxdp.nnx_merge(model, jaxdp.get_params(state))

Non-param state (`nnx.Rngs` streams, `nnx.BatchStat` running statistics, any other
`nnx.Variable` that is not an `nnx.Param`) is *frozen at split time*: `loss_fn`
reads the values the model held when `nnx_split` was called and never updates
them (`loss_fn` is pure, so it cannot). That is exact for models without such state
(the GPT and MLP in `models/`) and for BatchNorm/Dropout in eval mode; a model that
must advance RNG streams or running statistics while training does not fit this
adapter.
"""

from typing import Any, Callable

import jax
from flax import nnx

from jaxdp._src.units import sharded_paths

PyTree = Any


def _check_like(params: PyTree, template: PyTree, what: str, check_dtype: bool = True,
                skip_shape: frozenset[str] = frozenset()) -> None:
  """Raise ValueError naming the first leaf where `params` differs from `template`.

  Leaves whose path is in `skip_shape` (FSDP layer shards) are not shape-checked.
  """
  if jax.tree.structure(params) != jax.tree.structure(template):
    got = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    want = {jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_leaves_with_path(template)}
    missing, extra = sorted(want - got), sorted(got - want)
    raise ValueError(
        f"{what}: params do not match the model's nnx.Param tree "
        f"(missing {missing[:5]}, unexpected {extra[:5]}); pass the params that "
        "jaxdp.nnx_split returned (or jaxdp.get_params of their train state)")
  for (path, p), t in zip(jax.tree_util.tree_leaves_with_path(params),
                          jax.tree.leaves(template)):
    shape_differs = p.shape != t.shape and jax.tree_util.keystr(path) not in skip_shape
    if shape_differs or (check_dtype and p.dtype != t.dtype):
      raise ValueError(
          f"{what}: params{jax.tree_util.keystr(path)} is {p.dtype}{list(p.shape)}, "
          f"the model holds {t.dtype}{list(t.shape)}; pass params of the model's "
          "shapes and dtypes")


def nnx_split(model: nnx.Module,
              model_loss: Callable[[nnx.Module, PyTree], jax.Array],
              ) -> tuple[PyTree, Callable[[PyTree, PyTree], jax.Array]]:
  """Split an NNX model into the `(params, loss_fn)` pair that jaxdp trains.

  Args:
    model: any `nnx.Module`. It is not modified.
    model_loss: `model_loss(model, batch) -> scalar`, the mean loss of `model`
      over `batch`.

  Returns:
    `(params, loss_fn)`: `params` is a nested `dict` of the model's
    `nnx.Param` arrays (`nnx.to_pure_dict` form: attribute names and list
    indices as keys; the arrays are the model's own, not copies), and
    `loss_fn(params, batch)` rebuilds the model from `params` and returns
    `model_loss(model, batch)`. Non-param state is frozen at split time (see the
    module docstring).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import jaxdp
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> def model_loss(model, batch):
    ...     return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    >>> params, loss_fn = jaxdp.nnx_split(model, model_loss)
    >>> jax.tree.map(jnp.shape, params)
    {'bias': (1,), 'kernel': (2, 1)}
    >>> batch = {"x": jnp.ones((4, 2)), "y": jnp.zeros((4, 1))}
    >>> bool(loss_fn(params, batch) == model_loss(model, batch))
    True
  """
  graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
  params = nnx.to_pure_dict(param_state)
  state_def = jax.tree.structure(param_state)
  template = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)

  rest_leaves, rest_def = jax.tree.flatten(rest)

  def loss_fn(params: PyTree, batch: PyTree) -> jax.Array:
    _check_like(params, template, "loss_fn", check_dtype=False,  # trace time only
                skip_shape=sharded_paths())
    # Fresh Variables on every call, so whatever model_loss writes into the rebuilt
    # model (stats, RNG counts) dies with it and never leaks out, not even tracers.
    state = jax.tree.unflatten(state_def, jax.tree.leaves(params))
    frozen = jax.tree.unflatten(rest_def, rest_leaves)
    return model_loss(nnx.merge(graphdef, state, frozen), batch)

  return params, loss_fn


def nnx_merge(model: nnx.Module, params: PyTree) -> nnx.Module:
  """Write trained `params` back into `model` (in place) and return it.

  Args:
    model: the `nnx.Module` that `params` were split from (or one of the same
      structure).
    params: a nested dict of arrays in `nnx_split` form, e.g.
      `jaxdp.get_params(state)`.

  Returns:
    `model`, its `nnx.Param` values replaced by `params`. Non-param state is
    left as it was.

  Raises:
    ValueError: if `params` is missing a param, has an extra one, or a leaf's
      shape or dtype differs from the model's.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import jaxdp
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> params, _ = jaxdp.nnx_split(model, lambda m, b: 0.0)
    >>> params = jax.tree.map(jnp.zeros_like, params)
    >>> model = jaxdp.nnx_merge(model, params)
    >>> model.kernel[...].tolist()
    [[0.0], [0.0]]
  """
  param_state = nnx.state(model, nnx.Param)
  _check_like(params, nnx.to_pure_dict(param_state), "nnx_merge")
  state = jax.tree.unflatten(jax.tree.structure(param_state), jax.tree.leaves(params))
  nnx.update(model, state)
  return model
