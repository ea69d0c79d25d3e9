"""FSDP units: which params one all-gather carries, and where the model gathers them.

A *unit* (Megatron-FSDP's unit module, torch FSDP2's `fully_shard` module) is a group of
params gathered by one collective (`collectives.unit_gather_hook`).

By default there is one unit per layer: the subtree at the first sequence index of a leaf's path
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
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend.core import primitives as core_primitives

from jaxdp._src.collectives import GATHERED
from jaxdp._src.config import FSDPConfig
from jaxdp._src.layout import Layout, ParamSpec, make_layout

PyTree = Any
ROOT_UNIT = "<root>"
"""Unit of the leaves under none of the prefixes of `FSDPConfig(units=[...])`."""


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


# ----------------------------------------------------------------------------- gather_unit

active = threading.local()
"""`active.current`: the `Scope` of the FSDP step being traced, if any."""


class Scope:
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
  scope = getattr(active, "current", None)
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
    scope = getattr(active, "current", None)
    if scope is None:
      return body(carry, layer_params)

    def unit(carry, layer_params):
      return body(carry, gather_unit(layer_params))

    if scope.reshard:
      unit = jax.checkpoint(unit, policy=reshard_policy, prevent_cse=False)
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
  scope = getattr(active, "current", None)
  return scope.paths if scope is not None else frozenset()


def reshard_policy(prim, *_, **params) -> bool:
  """`jax.checkpoint` policy: save everything except the outputs of a unit gather."""
  if prim is core_primitives.custom_vjp_call_p:
    return not any(e.primitive.name == "name" and e.params["name"] == GATHERED
                   for e in params["call_jaxpr"].jaxpr.eqns)
  return True
