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

Non-param state takes one of two routes, depending on what the train state holds:

* `nnx.Rngs` streams (`nnx.RngState`): with `init_state(..., rng=key)` the step hands
  `loss_fn` a fresh key per step and per data shard (`rng=`), and every stream of the
  rebuilt model restarts from it (stream `j` in tree order from `fold_in(rng, j)`, count
  0): dropout draws new masks every step and on every device. Without a key a forward
  that draws (dropout in training mode) is refused: its streams would be frozen at split
  time, the same masks at every step and on every device.
* Everything else (`nnx.BatchStat` running statistics, any other non-`Param`
  `nnx.Variable`): with `init_state(..., model_state=jaxdp.nnx_model_state(model))` it is
  the train state's `model_state`: `loss_fn` gets it (`model_state=`), returns what the
  forward wrote (`(loss, new_model_state)`), and the step averages it over the data axes
  (see `make_train_step`); `nnx_merge(model, state)` writes it back. Without it, a forward
  that writes such a variable (BatchNorm in training mode) is refused, since what it wrote
  would be dropped; one that only reads it (BatchNorm in eval mode) runs as it is.

`jaxdp.NNXOptimizer` carries both. The refusals come when `loss_fn` is traced: at a train
step's first call, before it compiles.

With both::

  params, loss_fn = jaxdp.nnx_split(model, model_loss)
  state = jaxdp.init_state(params, tx, mesh, config, rng=jax.random.key(0),
                           model_state=jaxdp.nnx_model_state(model))
  ...
  jaxdp.nnx_merge(model, state)  # params and running statistics
"""

import dataclasses
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp._src.checks import NonFiniteGradError
from jaxdp._src.mesh import eager_program, on_auto_mesh
from jaxdp._src.state import TrainState
from jaxdp._src.train import get_params, init_state, make_train_step
from jaxdp._src.units import sharded_paths

PyTree = Any

# [Note: pure dicts by position]
# A pure dict (`nnx.to_pure_dict`) and the `nnx.State` it came from flatten to their leaves
# in the same order: both sort their keys, and a State's leaf is its Variable's `.value`
# (key path `...['kernel'].value` against `...['kernel']`). So a pure dict of the right
# structure becomes a State by `jax.tree.unflatten(state_treedef, jax.tree.leaves(pure))`,
# and back, with no key lookups; `_check_like` checks the structure first, so that a wrong
# tree is refused by name rather than matched to the wrong leaves.


def _check_like(
  params: PyTree,
  template: PyTree,
  what: str,
  check_dtype: bool = True,
  skip_shape: frozenset[str] = frozenset(),
  what_tree: str = "nnx.Param tree",
) -> None:
  """Raise ValueError naming the first leaf where `params` differs from `template`.

  Leaves whose path is in `skip_shape` (FSDP layer shards) are not shape-checked.
  """
  if jax.tree.structure(params) != jax.tree.structure(template):
    got = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    want = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(template)}
    missing, extra = sorted(want - got), sorted(got - want)
    raise ValueError(
      f"{what}: params do not match the model's {what_tree} "
      f"(missing {missing[:5]}, unexpected {extra[:5]}); pass the params that "
      "jaxdp.nnx_split returned (or jaxdp.get_params of their train state)"
    )
  for (path, p), t in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(template)):
    shape_differs = p.shape != t.shape and jax.tree_util.keystr(path) not in skip_shape
    if shape_differs or (check_dtype and p.dtype != t.dtype):
      raise ValueError(
        f"{what}: params{jax.tree_util.keystr(path)} is {p.dtype}{list(p.shape)}, "
        f"the model holds {t.dtype}{list(t.shape)}; pass params of the model's "
        "shapes and dtypes"
      )


def nnx_split(
  model: nnx.Module,
  model_loss: Callable[[nnx.Module, PyTree], jax.Array],
  *,
  per_token_loss: bool = False,
) -> tuple[PyTree, Callable[[PyTree, PyTree], jax.Array]]:
  """Split an NNX model into the `(params, loss_fn)` pair that jaxdp trains.

  Args:
    model: any `nnx.Module`. It is not modified.
    model_loss: `model_loss(model, batch) -> scalar`, the mean loss of `model`
      over `batch`.
    per_token_loss: `model_loss` returns `(loss_sum, token_count)` where the loss goes,
      as `make_train_step(per_token_loss=True)` takes it (`((loss_sum, token_count), aux)`
      with an aux): with `model_state`, `loss_fn` then returns
      `((loss_sum, token_count), new_model_state)`, the pair not taken for `(loss, aux)`.

  Returns:
    `(params, loss_fn)`: `params` is a nested `dict` of the model's
    `nnx.Param` arrays (`nnx.to_pure_dict` form: attribute names and list
    indices as keys; the arrays are the model's own, not copies), and
    `loss_fn(params, batch, *, rng=None, model_state=None)` rebuilds the model from
    `params` and returns `model_loss(model, batch)`: with `rng` its RNG streams restart
    from that key, with `model_state` (in `nnx_model_state` form) its other non-param
    variables are set from it and `loss_fn` returns `(loss, new_model_state)`, or
    `(loss, (aux, new_model_state))` when `model_loss` returns `(loss, aux)` (see the
    module docstring; `make_train_step` passes both when the state holds them).

  Raises:
    ValueError: from `loss_fn`, where the forward draws from the model's RNG streams and
      `loss_fn` got no `rng`, or writes a non-param variable (BatchNorm statistics) and
      got no `model_state`: the message names the variables and what to pass.

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
  # A Variable goes to the first filter it matches: the params, then the RNG streams, then
  # (`...`) everything else. The same filters split the rebuilt model in `_SplitLoss`.
  graphdef, param_state, rng_state, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
  params = nnx.to_pure_dict(param_state)
  rng_leaves, rng_def = jax.tree.flatten(rng_state)
  rest_leaves, rest_def = jax.tree.flatten(rest)
  loss_fn = _SplitLoss(
    model_loss=model_loss,
    per_token=per_token_loss,
    graphdef=graphdef,
    params=_Part(
      treedef=jax.tree.structure(param_state),
      leaves=(),  # `loss_fn`'s own params instead
      template=jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params),
    ),
    rngs=_Part(treedef=rng_def, leaves=tuple(rng_leaves), template=None),
    rest=_Part(
      treedef=rest_def, leaves=tuple(rest_leaves), template=_shapes(nnx.to_pure_dict(rest))
    ),
  )
  return params, loss_fn


class _Part(NamedTuple):
  """One part of the split model (its params, RNG streams or other variables): what
  `_SplitLoss` rebuilds it from."""

  treedef: Any  # the part's `nnx.State` structure
  leaves: tuple  # its arrays at split time, in tree order (empty for the params)
  template: PyTree  # shapes and dtypes its pure-dict form is checked against; None: unchecked


@dataclasses.dataclass(frozen=True, eq=False)
class _SplitLoss:
  """The `loss_fn` of `nnx_split`: rebuilds the model from `params` on every call and
  returns `model_loss(model, batch)` (with `model_state`: and what the forward wrote).
  `eq=False` keeps it hashed by identity, as the function it stands for."""

  model_loss: Callable[[nnx.Module, PyTree], Any]
  graphdef: Any
  params: _Part
  rngs: _Part
  rest: _Part  # the non-param, non-RNG variables (BatchNorm statistics, ...)
  per_token: bool = False  # the loss is a (sum, count) pair, not a scalar

  def __call__(self, params: PyTree, batch: PyTree, *, rng=None, model_state=None):
    _check_like(
      params,
      self.params.template,
      "loss_fn",
      check_dtype=False,  # trace time only
      skip_shape=sharded_paths(),
    )
    # Fresh Variables on every call, so whatever model_loss writes into the rebuilt
    # model (stats, RNG counts) dies with it and never leaks out, not even tracers.
    # [Note: pure dicts by position]
    state = jax.tree.unflatten(self.params.treedef, jax.tree.leaves(params))
    rng_leaves = self.rngs.leaves
    rngs = jax.tree.unflatten(
      self.rngs.treedef, rng_leaves if rng is None else _reseed(rng_leaves, rng)
    )
    if model_state is not None:
      _check_like(
        model_state,
        self.rest.template,
        "loss_fn's model_state",
        check_dtype=False,
        what_tree="non-param variables (jaxdp.nnx_model_state)",
      )
    rest = jax.tree.unflatten(
      self.rest.treedef,
      self.rest.leaves if model_state is None else jax.tree.leaves(model_state),
    )
    model = nnx.merge(self.graphdef, state, rngs, rest)
    out = self.model_loss(model, batch)
    # Split again after the forward: a stream the forward drew from, or a variable it wrote,
    # now holds another array than the one it was rebuilt with (`_refuse_frozen` compares
    # by identity). With `model_state`, what the forward left is returned as the new model
    # state, in the caller's pure-dict structure ([Note: pure dicts by position]).
    _, _, drawn, written = nnx.split(model, nnx.Param, nnx.RngState, ...)
    if rng is None:
      _refuse_frozen(drawn, rng_leaves, RNG_FROZEN)
    if model_state is None:
      _refuse_frozen(written, self.rest.leaves, MODEL_STATE_FROZEN)
      return out
    new = jax.tree.unflatten(jax.tree.structure(model_state), jax.tree.leaves(written))
    # (loss, aux): a pair, whose first item is itself a pair under `per_token`
    is_pair = lambda x: isinstance(x, (tuple, list)) and len(x) == 2
    if is_pair(out) and (not self.per_token or is_pair(out[0])):
      return out[0], (out[1], new)
    return out, new


RNG_FROZEN = (
  "the forward drew from the model's RNG streams {paths} (dropout, say), but loss_fn got no "
  "rng=, so it would draw the same numbers at every step and on every device: build the "
  "state with init_state(..., rng=jax.random.key(0)) (the step then passes a key per step "
  "and device), or train with jaxdp.NNXOptimizer, which carries it; calling loss_fn "
  "yourself, pass rng=key; for a forward that draws nothing, use model.eval()"
)
MODEL_STATE_FROZEN = (
  "the forward wrote the model's non-param variables {paths} (BatchNorm running "
  "statistics, say), but loss_fn got no model_state=, so they would stay as they were at "
  "split time: build the state with init_state(..., "
  "model_state=jaxdp.nnx_model_state(model)) (the step then carries them and "
  "jaxdp.nnx_merge(model, state) writes them back), or train with jaxdp.NNXOptimizer, "
  "which carries them; for a forward that writes nothing, use model.eval()"
)


def _refuse_frozen(variables: nnx.State, before: Sequence, message: str) -> None:
  """Raise ValueError if the forward wrote any of `variables` (a leaf is no longer the array
  the model was rebuilt with): what it wrote would be dropped, the state frozen."""
  after = jax.tree_util.tree_leaves_with_path(variables)
  # `before` holds the leaves the model was rebuilt with, in the same tree order; a Variable
  # the forward assigned holds a new array object, one it only read holds the same one
  paths = [
    jax.tree_util.keystr(p).removesuffix(".value") for (p, x), b in zip(after, before) if x is not b
  ]
  if paths:
    raise ValueError("loss_fn: " + message.format(paths=paths[:4]))


@eager_program
def _copied(tree: PyTree, mesh) -> PyTree:
  """Fresh copies of `tree`'s arrays (on `mesh`), in one program (not one eager op per
  leaf), placed as `get_params` places the params."""
  del mesh  # where the outputs go (`eager_program`)
  return jax.tree.map(jnp.copy, tree)


def _shapes(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), tree)


def _reseed(leaves: Sequence, rng) -> list:
  """RNG stream leaves (keys and counts, in tree order) restarted from `rng`: stream `j`'s
  key is `fold_in(rng, j)` (split to the stream's shape for batched keys), counts 0."""
  # `j` numbers the key leaves only, so a stream's key does not depend on how many count
  # leaves come before it; a batched stream (keys of shape `x.shape`) gets one key each
  out, j = [], 0
  for x in leaves:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      key = jax.random.fold_in(rng, j)
      out.append(jax.random.split(key, x.shape) if x.shape else key)
      j += 1
    else:
      out.append(jnp.zeros_like(x))
  return out


def nnx_model_state(model: nnx.Module) -> PyTree:
  """The model's non-param, non-RNG variables (`nnx.BatchStat` running statistics, ...) as a
  nested dict of arrays: the `model_state` to give `init_state` for an `nnx_split` loss.

  Examples:
    >>> from flax import nnx
    >>> import jaxdp
    >>> model = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    >>> jaxdp.nnx_model_state(model)
    {'mean': Array([0., 0., 0.], dtype=float32), 'var': Array([1., 1., 1.], dtype=float32)}
  """
  return nnx.to_pure_dict(nnx.split(model, nnx.Param, nnx.RngState, ...)[3])


def nnx_merge(model: nnx.Module, params: PyTree, model_state: PyTree = None) -> nnx.Module:
  """Write trained `params` (and `model_state`) back into `model` (in place) and return it.

  Args:
    model: the `nnx.Module` that `params` were split from (or one of the same
      structure).
    params: a nested dict of arrays in `nnx_split` form, e.g.
      `jaxdp.get_params(state)`; or a `TrainState`, for its params and its
      `model_state`.
    model_state: the non-param variables in `nnx_model_state` form (e.g.
      `state.model_state`); None leaves them as they are.

  Returns:
    `model`, its `nnx.Param` values replaced by `params` (and its other non-RNG
    variables by `model_state`). RNG streams are left as they were.

  Raises:
    ValueError: if `params` (`model_state`) is missing a leaf, has an extra one, or a
      leaf's shape or dtype differs from the model's.

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
  if isinstance(params, TrainState):  # fresh copies: the next step donates the state
    state = params
    # A model is called eagerly (`model(x)`), where JAX refuses a Flax attention layer's
    # mask on arrays of a mesh with Explicit axes outside `jax.set_mesh`: its variables go
    # on the mesh's Auto twin (`on_auto_mesh`: the same buffers, no copy).
    params = on_auto_mesh(get_params(state))  # first: it refuses a donated state
    if model_state is None and state.model_state is not None:
      model_state = on_auto_mesh(_copied(state.model_state, state.step.sharding.mesh))
  # The model's Variables are updated in place from States built by position ([Note: pure
  # dicts by position]); `_check_like` first, against the model's own shapes and dtypes
  param_state = nnx.state(model, nnx.Param)
  _check_like(params, nnx.to_pure_dict(param_state), "nnx_merge")
  state = jax.tree.unflatten(jax.tree.structure(param_state), jax.tree.leaves(params))
  nnx.update(model, state)
  if model_state is not None:
    rest = nnx.split(model, nnx.Param, nnx.RngState, ...)[3]
    _check_like(
      model_state,
      nnx.to_pure_dict(rest),
      "nnx_merge's model_state",
      what_tree="non-param variables (jaxdp.nnx_model_state)",
    )
    nnx.update(model, jax.tree.unflatten(jax.tree.structure(rest), jax.tree.leaves(model_state)))
  return model


# ----------------------------------------------------------------------------- the NNX loop


def _model_key(model: nnx.Module):
  """The key of the model's first RNG stream (None without streams): the default train key."""
  keys = [
    x
    for x in jax.tree.leaves(nnx.state(model, nnx.RngKey))
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
  ]
  return keys[0] if keys and not keys[0].shape else None


class NNXOptimizer:
  """`nnx.Optimizer` for jaxdp: holds the `TrainState` of an NNX model on a mesh.

  Built like `nnx.Optimizer(model, tx)` plus the mesh and config; `nnx_train_step` makes
  the step that trains the model with it and writes the result back into the model
  (model in, model out), so an NNX loop changes a few lines (docs/guide.md, "The NNX
  loop"). After training the model is evaluated as on one device: `model.eval();
  model(x_test)` (docs/guide.md, "Evaluate after training").

  The state holds the model's `nnx.Param`s (trained), its other non-RNG variables as
  `model_state` (BatchNorm statistics: averaged over the data axes each step, see
  `make_train_step`) and a key (`rng`; default: the key of the model's first RNG stream),
  from which every step's dropout keys are derived per step and per data shard.

  Args:
    model: the `nnx.Module` to train (its arrays are copied, not donated), or a function of
      no arguments that builds it (`lambda: Model(cfg, rngs=nnx.Rngs(0))`), for a model too
      big for one device: it runs under `jit`, each device computing only its shards of the
      params (Flax's sharded init with `nnx.jit`). Train it with `nnx_train_step(...,
      update_model=False)` on `nnx.eval_shape(build)` (the model's structure) and read the
      params with `jaxdp.get_params(optimizer.state, sharded=True)`.
    tx: the optax transformation.
    mesh: the mesh, as `init_state` takes it.
    config: the `DDPConfig`, as `init_state` takes it.
    rng: the key of the train state (see `init_state`); None: the model's first stream's.
    frozen: as `init_state` takes it.
    fsdp: as `init_state` takes it.

  Attributes:
    state: the `TrainState` (checkpoint it with `CheckpointManager`).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> mesh, config = jax.make_mesh((8,), ("data",)), jaxdp.DDPConfig()
    >>> optimizer = jaxdp.NNXOptimizer(model, optax.sgd(0.1), mesh, config)
    >>> def loss_fn(model, batch):
    ...   return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    >>> train_step = jaxdp.nnx_train_step(loss_fn)
    >>> batch = {"x": jnp.ones((16, 3)), "y": jnp.zeros((16, 1))}
    >>> metrics = train_step(model, optimizer, batch)  # model now holds the new params
    >>> int(optimizer.step), bool(metrics["loss"] > loss_fn(model, batch))
    (1, True)
  """

  def __init__(self, model, tx, mesh, config, *, rng=None, frozen=None, fsdp=None):
    self.tx, self.mesh, self.config, self.fsdp = tx, mesh, config, fsdp
    if isinstance(model, nnx.Module):
      params, model_state = nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx_model_state(model)
      key = _model_key(model)
    elif callable(model):  # builds the model: its params are computed shard by shard
      build = model
      params = lambda: nnx.to_pure_dict(nnx.state(build(), nnx.Param))
      # the model state and key alone (XLA drops the rest of the model's init)
      model_state = jax.jit(lambda: nnx_model_state(build()))()
      key = jax.jit(lambda: _model_key(build()))() if rng is None else None
    else:
      raise TypeError(
        f"NNXOptimizer(model=...): got {type(model).__name__}; pass an nnx.Module, or a "
        "function of no arguments that builds one (for a model too big for one device)"
      )
    self.state = init_state(
      params,
      tx,
      mesh,
      config,
      frozen=frozen,
      fsdp=fsdp,
      rng=key if rng is None else rng,
      model_state=model_state,
    )

  @property
  def step(self) -> jax.Array:
    """Number of steps taken."""
    return self.state.step

  def update_model(self, model: nnx.Module) -> nnx.Module:
    """Writes the state's params and model state into `model` (copies: they outlive the
    next step, which donates the state)."""
    return nnx_merge(model, self.state)


def nnx_train_step(
  model_loss: Callable,
  *,
  has_aux: bool = False,
  grad_accum_steps: int = 1,
  update_model: bool = True,
  per_token_loss: bool = False,
) -> Callable:
  """The NNX train step: `train_step(model, optimizer, batch) -> metrics`.

  Replaces an `@nnx.jit` function that calls `nnx.value_and_grad(loss_fn)(model)` and
  `optimizer.update(model, grads)`: it runs the jaxdp step of `optimizer`'s strategy
  (`make_train_step`, built at the first call from the model's structure) and, with
  `update_model`, writes the new params and BatchNorm statistics back into `model` so that
  it is current after every step (under the sharded strategies that gathers the params:
  pass False and call `optimizer.update_model(model)` when you need it).

  Args:
    model_loss: `model_loss(model, batch) -> loss`, or `(loss, aux)` with `has_aux`
      (`aux` averaged over the data axes into `metrics["aux"]`). The model it gets is in
      the mode the model passed in was (`model.train()`): dropout draws from keys the step
      derives per step and per data shard.
    has_aux: as `make_train_step` takes it.
    grad_accum_steps: as `make_train_step` takes it.
    per_token_loss: as `make_train_step` takes it: `model_loss` returns
      `(loss_sum, token_count)` (`((loss_sum, token_count), aux)` with `has_aux`).
    update_model: write the trained state back into the model after each step.

  Returns:
    `train_step(model, optimizer, batch) -> metrics` (see `make_train_step`). The model
    is for eager calls: its variables and the metrics sit on the mesh's devices with every
    axis Auto (`jax.make_mesh`'s Explicit axes make JAX refuse a Flax attention layer's
    eager mask); `jaxdp.get_params(optimizer.state)` gives the params on your mesh, for
    your own `jax.jit` beside a batch placed there.
  """
  # The compiled steps of each optimizer, by the model's graphdef. Keyed on the optimizer
  # object itself (weakly: a step lives as long as its optimizer), never on `id(optimizer)`,
  # which a new optimizer may reuse once the old one is gone.
  cache: weakref.WeakKeyDictionary[NNXOptimizer, dict[Any, Any]] = weakref.WeakKeyDictionary()

  def train_step(model: nnx.Module, optimizer: NNXOptimizer, batch: PyTree):
    graphdef = nnx.graphdef(model)
    steps = cache.setdefault(optimizer, {})
    # One step per model structure: the split loss closes over the graphdef, so a model
    # whose graphdef differs (other submodules, or a static attribute such as a layer's
    # `deterministic`) needs a step of its own
    if graphdef not in steps:
      _, loss_fn = nnx_split(model, model_loss, per_token_loss=per_token_loss)
      steps[graphdef] = make_train_step(
        loss_fn,
        optimizer.tx,
        optimizer.mesh,
        optimizer.config,
        grad_accum_steps=grad_accum_steps,
        fsdp=optimizer.fsdp,
        has_aux=has_aux,
        per_token_loss=per_token_loss,
      )
    try:
      optimizer.state, metrics = steps[graphdef](optimizer.state, batch)
    except NonFiniteGradError as e:
      # The step consumed the optimizer's state (donated) and skipped its update: the
      # error holds that state unchanged, which the optimizer keeps, usable after the raise
      optimizer.state = e.state
      raise
    if update_model:
      optimizer.update_model(model)
    # with the model's variables (`nnx_merge`), for eager code beside the model's outputs
    return on_auto_mesh(metrics)

  return train_step
