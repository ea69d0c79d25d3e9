"""FSDP (`optim_grads_params`, ZeRO-3): params, grads and optimizer state sharded 1/dp.

A *unit* (Megatron-FSDP's unit module, torch FSDP2's `fully_shard` module) is a group of
params gathered by one collective. Its params are laid out like a bucket (`make_layout` with
`units=`: shard-major, per dtype), so that device `d` holds rows `[d r, (d+1) r)` of every
param of the unit, at rest, in three places of the `TrainState`:

* `master`: the optimizer's fp32 copy of each trainable param's rows, `(rows, ...)` sharded
  over "data" on dim 0 (`(layers, rows, ...)` on dim 1 for a stacked param);
* `opt_state`: built on `master`, sharded like it;
* `params`: frozen params' rows in their own dtype, sharded the same way; trainable leaves
  are None; integer leaves stay whole and replicated.

One step, per unit (`collectives.unit_gather_hook`, one `custom_vjp`): the forward
all-gathers the unit's shard in the param dtype right where the unit's params are first
used (one all-gather per unit and dtype), the backward reduce-scatters the unit's grads in
the grad dtype (one reduce-scatter; fp32 with `grad_reduce_in_fp32`) straight into the
shard the optimizer updates. Frozen params are gathered but get no grad, no collective and
no optimizer state. With `reshard_after_forward` (the default) the whole loss runs under
`jax.checkpoint` with a policy that saves every value except what a unit gather produced,
so the gathered params die after the forward and the backward gathers each unit again
right before the unit's backward. XLA places the collectives by data flow; on GPU its
latency hiding scheduler starts the next unit's all-gather while the current unit
computes (prefetch), and the collective pipeliner does the same across the iterations of
a scanned layer stack.

Units. By default one per layer: the subtree at the first sequence index of a leaf's path
(`['blocks'][3]`), else the top-level entry (`['wte']`). `FSDPConfig(units=...)` takes a
list of prefixes (leaves under none of them form the root unit) or a function from a leaf's
path to a unit name. A *stacked* subtree (`FSDPConfig(stacked=("blocks",))`: every leaf has
a leading layer axis and the model runs it with `jax.lax.scan`) is one unit per layer: its
shard is `(layers, rows / dp, ...)` and the model scans over the shards. The model marks
its scan body with `@scan_unit`: each iteration gathers its layer (`gather_unit`) and, with
`reshard_after_forward`, is rematerialized on its own, so that the backward loop gathers
and reduce-scatters each layer inside its iteration. Outside an FSDP step both are the
identity, so a model that uses them runs unchanged on one device and under every other
strategy (see `models/gpt.py`).

Not done: unrolled layers leave the placement of each unit's reduce-scatter to XLA, whose
latency hiding scheduler (which ignores memory far below the device limit) starts them all
after the whole backward, so every unit's full-size grads stay live until then; scanned
layers do not have this problem (scripts/fsdp_memory.py --unrolled shows it).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import primitives as core_primitives
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp._src import checks, collectives, loop
from jaxdp._src.buffer import pad_rows, unpad_rows
from jaxdp._src.collectives import DATA, GATHERED
from jaxdp._src.config import DDPConfig
from jaxdp._src.ddp import (TrainState, _check_batch, _check_mesh, _constrain, _data_axes, _dp,
                            _leaves, _master_dtype, _opt_params, _tree, finish_step, jit_step)
from jaxdp._src.distributed_optimizer import check_exact
from jaxdp._src.layout import Frozen, Layout, ParamSpec, make_layout

PyTree = Any
LossFn = Callable[[PyTree, PyTree], jax.Array]
Prefix = str | tuple
ROOT_UNIT = "<root>"
"""Unit of the leaves under none of the prefixes of `FSDPConfig(units=[...])`."""


@dataclasses.dataclass(frozen=True)
class FSDPConfig:
  """What the units of `optim_grads_params` are, and whether forward keeps them gathered.

  Pass the same config to `init_state(..., fsdp=)` and `make_train_step(..., fsdp=)`; the
  other strategies take none. Prefixes are key tuples (`("blocks", 3)`), a single top-level
  key (`"wte"`), or `jax.tree_util.keystr` strings (`"['blocks'][3]"`).

  Examples:
    >>> FSDPConfig(units=["blocks", ("head", 0)]).units
    ("['blocks']", "['head'][0]")
    >>> FSDPConfig(stacked=["blocks"], units=lambda path: "one")
    Traceback (most recent call last):
    ...
    ValueError: FSDPConfig: stacked= needs the default units or a list of prefixes; a units function must name the unit of every leaf itself, so put each stacked subtree in a unit of its own and leave stacked= out
  """

  units: Sequence[Prefix] | Callable[[str], str] | None = None
  """None: one unit per layer (the subtree at the first sequence index of a leaf's path,
  else the top-level entry); a list of prefixes (one unit each, the rest is one root unit);
  or `fn(path: str) -> unit name`."""
  stacked: Sequence[Prefix] = ()
  """Prefixes of subtrees whose leaves carry a leading layer axis (scanned layers): one unit
  per layer, gathered by `gather_unit` inside the model's scan body."""
  reshard_after_forward: bool = True
  """Free each unit's gathered params after its forward and gather again for its backward
  (torch FSDP2's default); False keeps them from forward to backward (no second gather)."""

  def __post_init__(self):
    if self.units is not None and not callable(self.units):
      if isinstance(self.units, (str, bytes)):
        raise ValueError(f"FSDPConfig: units={self.units!r} is one string; pass a list of "
                         "prefixes, e.g. units=['blocks']")
      object.__setattr__(self, "units", tuple(_prefix(u) for u in self.units))
    if isinstance(self.stacked, (str, bytes)):
      raise ValueError(f"FSDPConfig: stacked={self.stacked!r} is one string; pass a list of "
                       f"prefixes, e.g. stacked=[{self.stacked!r}]")
    object.__setattr__(self, "stacked", tuple(_prefix(s) for s in self.stacked))
    if self.stacked and callable(self.units):
      raise ValueError(
          "FSDPConfig: stacked= needs the default units or a list of prefixes; a units "
          "function must name the unit of every leaf itself, so put each stacked subtree in "
          "a unit of its own and leave stacked= out")
    if not isinstance(self.reshard_after_forward, bool):
      raise ValueError(f"FSDPConfig: reshard_after_forward={self.reshard_after_forward!r}: "
                       "must be True or False")


def _prefix(p: Prefix) -> str:
  """A prefix as a keystr string: "blocks" -> "['blocks']", ("blocks", 3) -> "['blocks'][3]"."""
  if isinstance(p, str):
    return p if p.startswith(("[", ".")) else f"[{p!r}]"
  if isinstance(p, tuple) and p:
    return "".join(f"[{k!r}]" for k in p)
  raise ValueError(f"FSDPConfig: prefix {p!r}: use a key tuple like ('blocks', 3), a "
                   "top-level key like 'wte', or a keystr like \"['blocks'][3]\"")


def _under(path: str, prefix: str) -> bool:
  return path == prefix or (path.startswith(prefix) and path[len(prefix)] in "[.")


def _default_unit(keys) -> str:
  for n, k in enumerate(keys):
    if isinstance(k, jax.tree_util.SequenceKey) or (
        isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, int)):
      return jax.tree_util.keystr(tuple(keys[: n + 1]))
  return jax.tree_util.keystr(tuple(keys[:1]))


def assign_units(params: PyTree, fsdp: FSDPConfig) -> tuple[dict[str, str], set[str]]:
  """`({leaf path: unit name}, {paths of stacked leaves})` of a param tree.

  Examples:
    >>> import jax.numpy as jnp
    >>> params = {"blocks": [{"w": jnp.zeros(2)}, {"w": jnp.zeros(2)}], "head": jnp.zeros(2)}
    >>> sorted(set(assign_units(params, FSDPConfig())[0].values()))
    ["['blocks'][0]", "['blocks'][1]", "['head']"]
  """
  keyed = jax.tree_util.tree_flatten_with_path(params)[0]
  units, stacked = {}, set()
  for keys, _ in keyed:
    path = jax.tree_util.keystr(keys)
    layer_axis = [s for s in fsdp.stacked if _under(path, s)]
    if layer_axis:
      units[path] = max(layer_axis, key=len)
      stacked.add(path)
    elif callable(fsdp.units):
      units[path] = fsdp.units(path)
    elif fsdp.units is not None:
      under = [u for u in fsdp.units if _under(path, u)]
      units[path] = max(under, key=len) if under else ROOT_UNIT
    else:
      units[path] = _default_unit(keys)
  return units, stacked


def layout_for(params: PyTree, mesh, config: DDPConfig, fsdp: FSDPConfig,
               frozen: Frozen = None) -> Layout:
  """The FSDP layout: one bucket per (unit, buffer) over the trainable params."""
  units, stacked = assign_units(params, fsdp)
  layout = make_layout(params, dp=mesh.shape[DATA],
                       grad_dtype=jnp.float32 if config.grad_reduce_in_fp32 else None,
                       frozen=frozen, units=units, stacked=stacked)
  if not layout.buffers:
    raise ValueError(
        "params have no trainable floating-point leaf (all are frozen or integer): there "
        "is nothing to train; pass float params, or unfreeze some")
  return layout


# ----------------------------------------------------------------------------- units

@dataclasses.dataclass(frozen=True)
class Unit:
  """One unit's static plan: what its gather and its reduce-scatter carry."""

  name: str
  layers: int
  """Stacked unit: layers per stack (the unit is one of them); 0 otherwise."""
  gather: tuple[tuple[Any, np.dtype], ...]
  """`(bucket, param dtype)` over all float params of the unit (frozen included)."""
  grad: tuple[tuple[Any, np.dtype], ...]
  """`(bucket, grad dtype)` over the trainable params of the unit."""
  trainable: tuple[int, ...]
  frozen: tuple[int, ...]

  @property
  def leaves(self) -> tuple[int, ...]:
    """The unit's leaves in tree order."""
    return tuple(sorted(self.trainable + self.frozen))


@functools.cache
def gather_layout(layout: Layout) -> Layout:
  """The layout of every float param (frozen too), unit by unit: what the gathers carry."""
  abstract = jax.tree.unflatten(layout.treedef, [
      jax.ShapeDtypeStruct(s, d) for s, d in zip(layout.shapes, layout.dtypes)])
  return make_layout(abstract, dp=layout.dp, units=dict(zip(layout.paths, layout.units)),
                     stacked={p for p, n in zip(layout.paths, layout.layers) if n})


@functools.cache
def units_of(layout: Layout) -> tuple[Unit, ...]:
  """The units of an FSDP layout, in backprop order."""
  specs = {}
  gathers: dict[str, list] = {}
  grads: dict[str, list] = {}
  for buf in gather_layout(layout).buffers:
    for b in buf.buckets:
      gathers.setdefault(b.unit, []).append((b, buf.param_dtype))
      specs.update({p.index: p for p in b.params})
  for buf in layout.buffers:
    for b in buf.buckets:
      grads.setdefault(b.unit, []).append((b, buf.grad_dtype))
  trainable = layout.trainable
  units = []
  for name, gather in gathers.items():
    leaves = sorted(p.index for b, _ in gather for p in b.params)
    units.append(Unit(name, specs[leaves[0]].layers, tuple(gather), tuple(grads.get(name, ())),
                      tuple(i for i in leaves if trainable[i]),
                      tuple(i for i in leaves if not trainable[i])))
  return tuple(units)


def param_specs(layout: Layout) -> dict[int, ParamSpec]:
  """Leaf index -> its `ParamSpec` (one layer's, for stacked leaves), frozen ones included."""
  return {p.index: p for p in gather_layout(layout).params}


def _shard_dim(spec: ParamSpec) -> int:
  return 1 if spec.layers else 0


def _local_shape(spec: ParamSpec, dp: int) -> tuple[int, ...]:
  return (spec.rows // dp, *spec.padded_shape[1:])


def _pad(x, spec: ParamSpec):
  return jax.vmap(lambda y: pad_rows(y, spec))(x) if spec.layers else pad_rows(x, spec)


def _unpad(x, spec: ParamSpec):
  return jax.vmap(lambda y: unpad_rows(y, spec))(x) if spec.layers else unpad_rows(x, spec)


def _spec(ndim: int, dim: int | None) -> P:
  """Full-length spec sharding `dim` over "data" (None: replicated)."""
  return P(*[DATA if d == dim else None for d in range(ndim)]) if ndim else P()


# ----------------------------------------------------------------------------- gather_unit

_scope = threading.local()


class _Scope:
  """The stacked units a loss_fn traced inside an FSDP step may gather with `gather_unit`."""

  def __init__(self, units: Sequence[tuple[Unit, Callable, list]], paths: frozenset[str],
               reshard: bool):
    self.units = units  # (unit, gather fn, [(local shape, dtype)] in tree order)
    self.paths = paths  # the stacked leaves, which loss_fn receives as layer shards
    self.reshard = reshard
    self.used: set[str] = set()

  def gather(self, leaves):
    sig = [(tuple(x.shape), np.dtype(x.dtype)) for x in leaves]
    for unit, fn, want in self.units:
      if sig == want:
        self.used.add(unit.name)
        order = unit.leaves
        local = dict(zip(order, leaves))
        full = fn({i: local[i] for i in unit.trainable}, {i: local[i] for i in unit.frozen})
        return [full[i] for i in order]
    return None


def gather_unit(layer_params: PyTree) -> PyTree:
  """All-gathers one layer of a stacked FSDP unit, where the model calls it.

  A model whose layers are stacked on a leading axis and run by `jax.lax.scan` (or
  `nnx.scan`) calls this on each layer's params inside the scan body. Under an
  `optim_grads_params` train step whose `FSDPConfig(stacked=...)` names that subtree, the
  scan runs over the layer shards and this is where a layer's shard is all-gathered (its
  grads are reduce-scattered at the same point of the backward loop). Everywhere else
  (one device, other strategies, unstacked layers) it returns `layer_params` unchanged.

  Args:
    layer_params: one layer's params: a pytree (dict, `nnx.State`) with the leaves of the
      stacked subtree in tree order, each without the layer axis.

  Returns:
    The layer's params, whole.

  Examples:
    >>> import jax.numpy as jnp
    >>> layer = {"w": jnp.ones((2, 3))}
    >>> gather_unit(layer)["w"].shape  # not inside an FSDP step: unchanged
    (2, 3)
  """
  scope = getattr(_scope, "current", None)
  if scope is None:
    return layer_params
  leaves, treedef = jax.tree.flatten(layer_params)
  full = scope.gather(leaves)
  return layer_params if full is None else jax.tree.unflatten(treedef, full)


def scan_unit(body: Callable) -> Callable:
  """Makes `body(carry, layer_params)`, the body of a scan over stacked layers, one FSDP unit.

  The decorated body passes `layer_params` (one layer's params: the scan's `xs`) through
  `gather_unit` before calling `body`, and under an FSDP step with `reshard_after_forward`
  runs each iteration under `jax.checkpoint` (saving everything but the gathered params), so
  that the backward loop gathers each layer again inside its own iteration instead of
  keeping every layer's params from the forward. Outside an FSDP step it calls `body`
  unchanged.

  Args:
    body: `body(carry, layer_params) -> (carry, y)`, as `jax.lax.scan` takes it.

  Returns:
    The body to give `jax.lax.scan`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> @scan_unit
    ... def layer(x, p):
    ...   return jnp.tanh(x @ p["w"]), None
    >>> stacked = {"w": jnp.stack([jnp.eye(2)] * 3)}
    >>> jax.lax.scan(layer, jnp.ones(2), stacked)[0].shape
    (2,)
  """
  @functools.wraps(body)
  def wrapped(carry, layer_params):
    scope = getattr(_scope, "current", None)
    if scope is None:
      return body(carry, layer_params)

    def unit(carry, layer_params):
      return body(carry, gather_unit(layer_params))

    if scope.reshard:
      unit = jax.checkpoint(unit, policy=_reshard_policy, prevent_cse=False)
    return unit(carry, layer_params)

  return wrapped


def sharded_paths() -> frozenset[str]:
  """Paths (`keystr`) of the leaves that the loss_fn being traced receives as layer shards
  `(layers, rows / dp, ...)` (the stacked units of an FSDP step); empty elsewhere. Shape
  checks on params inside a loss_fn (e.g. `nnx_split`'s) skip these.

  Examples:
    >>> sharded_paths()
    frozenset()
  """
  scope = getattr(_scope, "current", None)
  return scope.paths if scope is not None else frozenset()


def _reshard_policy(prim, *_, **params) -> bool:
  """`jax.checkpoint` policy: save everything except the outputs of a unit gather."""
  if prim is core_primitives.custom_vjp_call_p:
    return not any(e.primitive.name == "name" and e.params["name"] == GATHERED
                   for e in params["call_jaxpr"].jaxpr.eqns)
  return True


# ----------------------------------------------------------------------------- state

def _state_specs(state: TrainState) -> TrainState:
  layout = state.layout
  specs = param_specs(layout)
  params = [None if x is None else
            _spec(x.ndim, _shard_dim(specs[i]) if i in specs else None)
            for i, x in enumerate(_leaves(state.params))]
  master = [None if m is None else _spec(m.ndim, _shard_dim(specs[i]))
            for i, m in enumerate(_leaves(state.master))]
  by_shape = {}
  for i, m in enumerate(_leaves(state.master)):
    if m is not None:
      by_shape.setdefault(tuple(m.shape), _shard_dim(specs[i]))
  return dataclasses.replace(
      state, step=P(), params=_tree(layout, params), master=_tree(layout, master),
      opt_state=jax.tree.map(lambda x: _spec(x.ndim, by_shape.get(tuple(x.shape))),
                             state.opt_state), **loop.extra_specs(state))


def init_state(params: PyTree, tx: optax.GradientTransformation, mesh, config: DDPConfig,
               *, frozen: Frozen = None, fsdp: FSDPConfig | None = None) -> TrainState:
  """`jaxdp.init_state` for `optim_grads_params`: every float param sharded by unit."""
  fsdp = fsdp or FSDPConfig()
  _check_mesh(mesh, config)
  layout = layout_for(params, mesh, config, fsdp, frozen)
  check_exact(tx, layout)  # the optimizer sees padded leaves: refuse a tx that would differ
  specs, trainable = param_specs(layout), layout.trainable

  def build(params):
    leaves = _leaves(params)
    master = [_pad(x, specs[i]).astype(_master_dtype(x.dtype)) if trainable[i] else None
              for i, x in enumerate(leaves)]
    stored = [None if trainable[i] else _pad(x, specs[i]) if i in specs else x
              for i, x in enumerate(leaves)]
    state = TrainState(jnp.zeros((), jnp.int32), _tree(layout, stored), _tree(layout, master),
                       None, layout, config, tuple(mesh.shape.items()))
    return dataclasses.replace(state, opt_state=tx.init(_opt_params(layout, state.params,
                                                                    state.master)))

  params = jax.device_put(params, NamedSharding(mesh, P()), may_alias=False)
  abstract = jax.eval_shape(build, params)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), _state_specs(abstract))
  return jax.jit(build, out_shardings=shardings)(params)


def get_params(state: TrainState) -> PyTree:
  """The whole param tree of an FSDP state, in the params' own dtypes."""
  layout = state.layout
  specs = param_specs(layout)

  def whole(i, x):
    x = jax.device_put(x, NamedSharding(x.sharding.mesh, P()))
    return _unpad(x, specs[i]).astype(layout.dtypes[i])

  return _tree(layout, [
      whole(i, m) if m is not None else whole(i, x) if i in specs else x
      for i, (x, m) in enumerate(zip(_leaves(state.params), _leaves(state.master)))])


# ----------------------------------------------------------------------------- step

def call_with_units(call: Callable, layout: Layout, stored: list, tmaster: dict, hooks: dict,
                    fsdp: FSDPConfig):
  """Inside the step: `call(params)` on the param tree whose units are gathered by `hooks`
  (unstacked units here, stacked ones by `gather_unit` inside the model's scan)."""
  units, specs, trainable = units_of(layout), param_specs(layout), layout.trainable
  stacked = [u for u in units if u.layers]

  def local_sig(i):
    dtype = _master_dtype(layout.dtypes[i]) if trainable[i] else layout.dtypes[i]
    return _local_shape(specs[i], layout.dp), np.dtype(dtype)

  leaves = list(stored)
  for i, x in tmaster.items():
    leaves[i] = x
  for u in units:  # stacked units are gathered by gather_unit inside the model's scan
    if not u.layers:
      full = hooks[u.name]({i: leaves[i] for i in u.trainable},
                           {i: leaves[i] for i in u.frozen})
      for i, x in full.items():
        leaves[i] = x
  scope = _Scope([(u, hooks[u.name], [local_sig(i) for i in u.leaves]) for u in stacked],
                 frozenset(layout.paths[i] for u in stacked for i in u.leaves),
                 fsdp.reshard_after_forward)
  previous, _scope.current = getattr(_scope, "current", None), scope
  try:
    out = call(_tree(layout, leaves))
  finally:
    _scope.current = previous
  for u in stacked:
    if u.name not in scope.used:
      raise ValueError(
          f"FSDPConfig(stacked=...) names params{u.name}, but loss_fn never passed a "
          "layer of it through jaxdp.gather_unit: decorate the body of the scan over "
          "its layers with @jaxdp.scan_unit (jaxdp then scans over the shards and "
          "gathers each layer in its iteration), or leave it out of stacked=")
  return out


def unit_hooks(layout: Layout, mesh, config: DDPConfig) -> dict:
  """Inside the step: each unit's gather hook (forward all-gather, backward reduce-scatter)."""
  return {u.name: collectives.unit_gather_hook(
      u.gather, u.grad, {i: _master_dtype(layout.dtypes[i]) for i in u.trainable},
      dp=_dp(mesh), axes=_data_axes(mesh), average=config.average_in_collective)
      for u in units_of(layout)}


def make_grad_fn(loss_fn: LossFn, mesh, config: DDPConfig, *, grad_accum_steps: int = 1,
                 fsdp: FSDPConfig | None = None, has_aux: bool = False):
  """`grad_fn(state, batch) -> (grads, loss, grad_norm, aux, model_state)`: what an FSDP step
  hands the optimizer.

  `grads` is a tree like `state.master`: each trainable param's reduced (mean over the
  global batch) gradient, padded like the master and sharded over "data" like it, so every
  device holds 1/dp of it; `loss` is the global mean and `grad_norm` the global norm of
  `grads`, both from one scalar all-reduce; `aux` (None without `has_aux`) and the new
  `model_state` (None when the state holds none) are as `jaxdp.make_train_step` describes.
  Traceable; `make_train_step` calls it inside its jitted step.
  """
  fsdp = fsdp or FSDPConfig()
  axes, dp, k = _data_axes(mesh), _dp(mesh), grad_accum_steps

  def local_grads(master, params, batch, key, model_state, layout: Layout):
    """Per device: this device's rows of every trainable param's grad, the loss, the aux and
    the new model state."""
    key = loop.device_key(key, collectives.data_index(axes))
    stored, trainable = _leaves(params), layout.trainable
    hooks = unit_hooks(layout, mesh, config)
    def loss_of(tmaster, mb, j, ms):
      loss, extra = call_with_units(
          lambda tree: loop.call_loss(loss_fn, has_aux, tree, mb, loop.micro_key(key, j), ms),
          layout, stored, tmaster, hooks, fsdp)
      return loss / k, extra

    if fsdp.reshard_after_forward:
      loss_of = jax.checkpoint(loss_of, policy=_reshard_policy)
    grad_fn = jax.value_and_grad(loss_of, has_aux=True)
    sync = lambda ms: collectives.sync_model_state(ms, axes)  # noqa: E731
    tmaster = {i: m for i, m in enumerate(_leaves(master)) if m is not None}
    if k == 1:
      (loss, (aux, model_state)), grads = grad_fn(tmaster, batch, 0, model_state)
      model_state, aux = sync(model_state), loop.mean_micro(None, aux, 1)
    else:  # every micro-batch gathers and reduce-scatters; the shards add up
      micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)

      def body(carry, xs):
        loss_sum, grad_sum, ms = carry
        (loss, (aux, ms)), grads = grad_fn(tmaster, *xs, ms)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads), sync(ms)), aux

      zero = (collectives.make_varying(jnp.zeros((), jnp.float32), axes),
              jax.tree.map(jnp.zeros_like, tmaster), model_state)
      (loss, grads, model_state), auxs = jax.lax.scan(body, zero, (micro, jnp.arange(k)))
      aux = loop.mean_micro(auxs, None, k)
    aux = collectives.mean_over(aux, axes)
    # The global mean loss and grad norm in one collective: every device holds a distinct
    # 1/dp of each reduced grad (zero padding) and the replicas hold the same shards, so the
    # norm² of the local shards summed over all devices counts each element `replicas` times.
    replicas = dp // mesh.shape[DATA]
    sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads.values())
    if replicas > 1:
      sq = collectives.make_varying(sq, [a for a in axes if a != DATA])
    loss, sq = collectives.sum_over(jnp.stack([loss, sq]), axes)
    return (_tree(layout, [grads.get(i) for i in range(len(trainable))]), loss / dp,
            jnp.sqrt(sq / replicas), aux, model_state)

  def grad_fn(state: TrainState, batch):
    specs = _state_specs(state)
    batch_spec = P(axes)
    batch = jax.tree.map(lambda x: _constrain(x, mesh, batch_spec), batch)
    return jax.shard_map(
        functools.partial(local_grads, layout=state.layout), mesh=mesh,
        in_specs=(specs.master, specs.params, batch_spec, specs.rng, specs.model_state),
        out_specs=(specs.master, P(), P(), P(), specs.model_state),
        axis_names=set(axes))(state.master, state.params, batch,
                              loop.step_key(state.rng, state.step), state.model_state)

  return grad_fn


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation, mesh,
                    config: DDPConfig, *, grad_accum_steps: int = 1,
                    fsdp: FSDPConfig | None = None, has_aux: bool = False):
  """`jaxdp.make_train_step` for `optim_grads_params`, after its argument checks (see the
  module docstring)."""
  fsdp = fsdp or FSDPConfig()
  k = grad_accum_steps
  grad_fn = make_grad_fn(loss_fn, mesh, config, grad_accum_steps=k, fsdp=fsdp,
                         has_aux=has_aux)

  def step(state: TrainState, batch):
    layout = state.layout
    _check_state(state, mesh, config, fsdp)
    _check_batch(batch, _dp(mesh) * k)
    grads, loss, grad_norm, aux, model_state = grad_fn(state, batch)
    opt_params = _opt_params(layout, state.params, state.master)
    updates, opt_state = loop.tx_update(tx, grads, state.opt_state, opt_params, mesh)
    master = optax.apply_updates(opt_params, updates)
    new_state = dataclasses.replace(state, step=state.step + 1, master=master,
                                    opt_state=opt_state, model_state=model_state)
    return finish_step(new_state, _state_specs(new_state), mesh, config, loss, grad_norm,
                       grads, aux if has_aux else None)

  return jit_step(step, mesh, config, compiler_options(mesh.devices.flat[0].platform))


def compiler_options(platform: str) -> dict[str, Any]:
  """jaxdp's options (buckets stay separate collectives), plus, on GPU, the collective
  pipeliner, which starts a scanned unit's all-gather one iteration ahead (prefetch)."""
  from jaxdp._src.aot import compiler_options as base  # noqa: PLC0415

  options = base(platform)
  if platform in ("cuda", "gpu", "rocm"):
    options.update(xla_gpu_enable_pipelined_all_gather=True,
                   xla_gpu_enable_pipelined_reduce_scatter=True)
  return options


def _check_state(state, mesh, config: DDPConfig, fsdp: FSDPConfig):
  if not isinstance(state, TrainState):
    raise TypeError(f"train_step expects the TrainState from jaxdp.init_state, got "
                    f"{type(state).__name__}")
  if state.config != config:
    raise ValueError(f"the state was built for {state.config}, but this step is for {config}; "
                     "build the state with init_state(params, tx, mesh, config) for the same "
                     "config")
  if state.mesh_shape != tuple(mesh.shape.items()):
    raise ValueError(f"the state was built for a mesh of shape {dict(state.mesh_shape)}, but "
                     f"this step runs on {dict(mesh.shape)}; build the state (or restore the "
                     "checkpoint) with init_state on this mesh")
  layout = state.layout
  abstract = jax.tree.unflatten(layout.treedef, [
      jax.ShapeDtypeStruct(s, d) for s, d in zip(layout.shapes, layout.dtypes)])
  units, stacked = assign_units(abstract, fsdp)
  if layout.units is None or tuple(units[p] for p in layout.paths) != layout.units or \
      tuple(bool(n) for n in layout.layers) != tuple(p in stacked for p in layout.paths):
    raise ValueError(
        f"the state's units were made by another FSDPConfig than this step's {fsdp}; pass "
        "the same fsdp= to init_state and make_train_step")
  checks.check_state_structure(state, _leaves)
