"""FSDP units: which params one all-gather carries, and where the model gathers them.

A *unit* (Megatron-FSDP's unit module, torch FSDP2's `fully_shard` module) is a group of
params gathered by one collective (`collectives.unit_collectives`).

By default there is one unit per layer: the subtree at the first sequence index of a leaf's path
(`['blocks'][3]`), else the top-level entry (`['wte']`). `FSDPConfig(units=...)` takes a
list of prefixes (leaves under none of them form the root unit) or a function from a leaf's
path to a unit name. A *stacked* subtree (`FSDPConfig(stacked=("blocks",))`: every leaf has
a leading layer axis and the model runs it with `jax.lax.scan`) is one unit per layer: its
shard is `(layers, rows / dp, ...)`, and `fsdp_program` finds the scan over it in the traced
loss and gathers one layer per iteration; the model needs no marker.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np

from jaxdp._src.config import FSDPConfig
from jaxdp._src.layout import Layout, ParamSpec, make_layout

PyTree = Any
ROOT_UNIT = "<root>"
"""Unit of the leaves under none of the prefixes of `FSDPConfig(units=[...])`."""


def _under(path: str, prefix: str) -> bool:
  # a prefix matches at key boundaries only: `['blocks'][1]` is not a prefix of
  # `['blocks'][10]`
  return path == prefix or (path.startswith(prefix) and path[len(prefix)] in "[.")


def _default_unit(keys) -> str:
  # the path up to its first sequence index (a layer of a list of layers, or of a dict keyed
  # by layer number), else its first key
  for n, k in enumerate(keys):
    if isinstance(k, jax.tree_util.SequenceKey) or (
      isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, int)
    ):
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
    # First match wins: a stacked prefix (the stack is the unit and its leaves carry a layer
    # axis), then `units=` (its function, or the longest prefix, else the root unit), then the
    # default unit of one layer.
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
  """The layout of every float param (frozen too), unit by unit: what the gathers carry.
  Expert params (trainable: FSDP refuses frozen ones) keep their buffers of one
  expert-parallel rank's slice."""
  # The grad layout's units, stacked leaves, shard dims and `outer`, with the frozen float
  # params too: a frozen param is gathered for the forward like any other, it only has no
  # grad to reduce.
  abstract = jax.tree.unflatten(
    layout.treedef, [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in layout.leaves]
  )
  experts = {p.path: p for buf in layout.buffers if buf.expert for p in buf.params}
  # the expert axis size: a whole expert param's leading dim over one rank's
  ep = [layout.leaves[p.index].shape[0] // p.shape[0] for p in experts.values()][:1] or [1]
  return make_layout(
    abstract,
    dp=layout.dp,
    units={leaf.path: leaf.unit for leaf in layout.leaves},
    stacked={leaf.path for leaf in layout.leaves if leaf.layers},
    shard_dims=dict(layout.shard_dims),
    outer=layout.outer,
    experts=lambda path, _: path in experts,
    expert_parallel=ep[0],
  )


def compute_dtype(dtype, param_dtype=None) -> np.dtype:
  """The dtype a param of `dtype` is gathered in and the loss receives it in:
  `param_dtype` (`FSDPConfig.param_dtype`) for a float param, else its own.

  Examples:
    >>> import jax.numpy as jnp
    >>> compute_dtype(jnp.float32, jnp.bfloat16), compute_dtype(jnp.int32, jnp.bfloat16)
    (dtype(bfloat16), dtype('int32'))
  """
  dtype = np.dtype(dtype)
  floating = jax.numpy.issubdtype(dtype, jax.numpy.floating)
  return np.dtype(param_dtype) if param_dtype is not None and floating else dtype


@functools.cache
def units_of(layout: Layout, param_dtype=None, keep_grad_dtype: bool = True) -> tuple[Unit, ...]:
  """The units of an FSDP layout, in backprop order.

  With `param_dtype` (`FSDPConfig.param_dtype`) every gather bucket is in it (each shard is
  cast before its all-gather), and so is every grad bucket unless `keep_grad_dtype`
  (`DDPConfig.grad_dtype` is set: fp32 or `grad_reduce_dtype`, which the layout's grad
  buffers hold already): torch FSDP2's `reduce_dtype=None`, Megatron's grads in the param
  dtype.
  """
  specs = {}
  gathers: dict[str, list] = {}
  grads: dict[str, list] = {}
  # Gathers from `gather_layout` (every float param), grads from `layout` (trainable ones):
  # a unit of frozen params only has gathers. Units come in the order their first bucket
  # appears, buffer by buffer.
  for buf in gather_layout(layout).buffers:
    for b in buf.buckets:
      gathers.setdefault(b.unit, []).append((b, compute_dtype(buf.param_dtype, param_dtype)))
      specs.update({p.index: p for p in b.params})
  for buf in layout.buffers:
    grad = buf.grad_dtype if keep_grad_dtype else compute_dtype(buf.grad_dtype, param_dtype)
    for b in buf.buckets:
      grads.setdefault(b.unit, []).append((b, grad))
  units = []
  for name, gather in gathers.items():
    leaves = [layout.leaves[i] for i in sorted(p.index for b, _ in gather for p in b.params)]
    units.append(
      Unit(
        name,
        # every leaf of a unit has the same layer count (`make_layout` checks): the first tells
        specs[leaves[0].index].layers,
        tuple(gather),
        tuple(grads.get(name, ())),
        tuple(leaf.index for leaf in leaves if leaf.trainable),
        tuple(leaf.index for leaf in leaves if not leaf.trainable),
      )
    )
  return tuple(units)


def chunked_leaves(layout: Layout, fsdp: FSDPConfig) -> dict[int, int]:
  """Leaf index -> the number of row blocks it is gathered in (`FSDPConfig(chunks=...)`), for
  the float leaves under a prefix of `fsdp.chunks` (the longest prefix decides), at most one
  block per row of a device's shard.

  Examples:
    >>> import jax.numpy as jnp, jaxdp
    >>> params = {"wte": jnp.zeros((300, 4)), "b": jnp.zeros(3)}
    >>> units = {"['wte']": "wte", "['b']": "b"}
    >>> layout = jaxdp.layout.make_layout(params, dp=8, units=units, stacked=set())
    >>> chunked_leaves(layout, FSDPConfig(chunks={"wte": 4}))  # 300 rows: 38 per device
    {1: 4}
  """
  if not fsdp.chunks:
    return {}
  specs = param_specs(layout)
  out = {}
  for leaf in layout.leaves:
    blocks = _chunks_of(leaf.path, fsdp)
    if blocks > 1 and leaf.index in specs:
      # a block is at least one of the `rows / dp` rows each device holds
      out[leaf.index] = min(blocks, specs[leaf.index].rows // layout.dp)
  return out


def chunked_paths(paths, fsdp: FSDPConfig) -> frozenset[str]:
  """The paths `FSDPConfig(chunks=...)` gathers by row blocks (where they are float): FSDP
  keeps their leading dim as their shard dim (`layout.unit_shard_dims(leading=)`), since
  a block is rows of it.

  Examples:
    >>> sorted(chunked_paths(["['wte']", "['b']"], FSDPConfig(chunks={"wte": 4})))
    ["['wte']"]
  """
  return frozenset(path for path in paths if _chunks_of(path, fsdp) > 1)


def lookup_paths(paths, fsdp: FSDPConfig) -> frozenset[str]:
  """The paths under `FSDPConfig(lookups=...)`: FSDP shards them by their columns (dim 1,
  `layout.unit_shard_dims(columns=)`).

  Examples:
    >>> sorted(lookup_paths(["['embed']", "['out']"], FSDPConfig(lookups=["embed"])))
    ["['embed']"]
  """
  return frozenset(path for path in paths if any(_under(path, p) for p in fsdp.lookups))


def _chunks_of(path: str, fsdp: FSDPConfig) -> int:
  """The row blocks `fsdp.chunks` asks for `path` (its longest prefix decides); 0: none."""
  under = [(len(p), n) for p, n in fsdp.chunks if _under(path, p)]
  return max(under)[1] if under else 0


def param_specs(layout: Layout) -> dict[int, ParamSpec]:
  """Leaf index -> its `ParamSpec` (one layer's, for stacked leaves), frozen ones included."""
  return {p.index: p for p in gather_layout(layout).params}


def sharded_paths() -> frozenset[str]:
  """Paths of leaves a loss_fn receives with other than their whole shapes: none (an FSDP
  step traces the loss with whole params), so shape checks inside a loss_fn need no
  exception.

  Examples:
    >>> sharded_paths()
    frozenset()
  """
  return frozenset()
