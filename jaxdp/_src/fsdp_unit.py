"""One FSDP unit as the program runs it, and the records the program's modules share.

`fsdp_program.run_loss` traces the loss with whole params and runs it unit by unit;
`fsdp_scan` runs a scanned unit, `fsdp_tables` the uses of a param read by rows. Each reads
what is here: a unit (`UnitIO`: its leaves, its collectives; `Units`: by leaf and by name),
the traced loss (`Program`, its `Lazy` values), a unit gathered and its gradients
reduce-scattered (`gather`, `scatter`; `gather_units` and `scatter_units` outside any
`custom_vjp`), and what a unit's `custom_vjp` is traced on and hands back: stand-ins
([Note: stand-ins]) and cotangents of its inputs' types (`ct_or_none`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxdp._src import collectives
from jaxdp._src.jaxprs import is_float, varying


@dataclasses.dataclass(frozen=True)
class UnitIO:
  """One unit as `run_loss` needs it: its leaves and its collectives."""

  name: str
  # Leaves with a gradient and leaves without: [Note: trainable and frozen shards].
  trainable: tuple[int, ...]
  frozen: tuple[int, ...]
  stacked: bool  # its leaves are stacked layers, sharded per layer: `(layers, rows / dp, ...)`
  collectives: collectives.UnitCollectives  # one layer's, for a stacked unit
  chunks: Mapping[int, int] = dataclasses.field(default_factory=dict)  # leaf -> row blocks
  shards: tuple[int, ...] | None = None
  """Keys of the unit's trainable shards in `run_loss`'s `values`, which `gather` takes and
  `scatter` returns: None = `trainable` (one block per leaf); a fused state's flat bucket
  shards (`fsdp.unit_collectives`; a fused state has no chunks)."""
  grad_dtypes: Mapping[int, Any] = dataclasses.field(default_factory=dict)
  """Trainable leaf -> the dtype `scatter` reduces its gradient in, where a tied unit's
  uses are summed ([Note: tied units]; missing: the cotangent's own dtype)."""
  casts: Mapping[int, Any] = dataclasses.field(default_factory=dict)
  """Leaf -> the narrower float dtype every use of it in the loss casts it to (`run_loss`
  finds them, see [Note: gathered in the dtype the loss casts to]): gathered in it."""
  tables: frozenset[int] = frozenset()
  """Leaves never gathered: each use computes with this device's rows and moves the
  activations instead (`run_loss` picks them, see [Note: a table computed by rows])."""
  shard_dims: Mapping[int, int] = dataclasses.field(default_factory=dict)
  """Leaf -> the dim its shards split (a table computed by rows: dim 0; a lookup table:
  dim 1)."""
  lookups: frozenset[int] = frozenset()
  """Leaves `FSDPConfig(lookups=)` names: split by their columns (dim 1), every use a row
  lookup, run on this device's columns (`fsdp_tables._ColumnTake`) where the unit's
  collectives can reduce a table (`table_rows`), else gathered."""

  @property
  def apart(self) -> frozenset[int]:
    """The leaves never gathered whole: by row blocks (`chunks`) or not at all (`tables`)."""
    return frozenset(self.chunks) | self.tables

  @property
  def leaves(self) -> tuple[int, ...]:
    return tuple(sorted(self.trainable + self.frozen))

  @property
  def shard_keys(self) -> tuple[int, ...]:
    return self.trainable if self.shards is None else self.shards


def gather_units(units: Sequence[UnitIO], shards: dict) -> dict:
  """{leaf: whole param} of every leaf of `units` (a stacked unit: all its layers), outside
  any custom_vjp: for keeping units gathered across micro-batches."""
  return gather(units, shards, layer_axis=True)


def scatter_units(units: Sequence[UnitIO], cts: dict) -> dict:
  """{leaf: shard grad} of the trainable leaves of `units` from whole-size gradients."""
  return scatter(units, cts, layer_axis=True)


# ----------------------------------------------------------------------------- the traced program


@dataclasses.dataclass(frozen=True)
class Units:
  """The units, looked up by leaf and by name."""

  of_leaf: Mapping[int, UnitIO]
  by_name: Mapping[str, UnitIO]


@dataclasses.dataclass(frozen=True)
class Program:
  """The loss traced with whole params, its `jit`s inlined: what `run_loss` replays."""

  jaxpr: jcore.Jaxpr  # inputs: every leaf, then the leaves of `batch`
  consts: list  # the values of `jaxpr.constvars`
  n_leaves: int
  param_var: Mapping[jcore.Var, int]  # the input var of each leaf a unit holds -> the leaf
  out_tree: Any  # the loss's output structure


@dataclasses.dataclass(frozen=True)
class Lazy:
  """The vars computed from params (and consts) alone: every op that reads one recomputes it
  from its gathered params instead of receiving it."""

  defs: Mapping[jcore.Var, jcore.JaxprEqn]  # lazy var -> the eqn that defines it
  units: Mapping[jcore.Var, set]  # a param's or a lazy var -> the names of its units


# ----------------------------------------------------------------------------- a unit's collectives


# [Note: trainable and frozen shards]
# A unit's `custom_vjp` takes its shards as two dicts, `trainable` and `frozen`, because the
# two get different cotangents: a trainable shard's is its reduce-scattered gradient, a
# frozen one's is None (a zero: nothing reduces it). A segment's `trainable` is keyed by
# `UnitIO.shard_keys` (a leaf, or a fused state's flat bucket shard), a scanned unit's and
# every `frozen` by leaf. A segment's shards are one block per leaf; a scanned unit's are
# stacked over the layers, `(layers, rows / dp, ...)`, and an iteration reads its layer's
# (`fsdp_scan._at`). `gather` takes the two merged, to gather the unit in one go.


def gather(
  units: Sequence[UnitIO], shards: dict, layer_axis: bool, each: bool = False, only=None
) -> dict:
  """{leaf: whole param} of `units` from their shards (stacked shards: every layer; `each`:
  one all-gather per param; `only`, with `each`: of those leaves alone)."""
  full = {}
  for unit in units:
    # [Note: trainable and frozen shards]
    trainable = {i: shards[i] for i in unit.shard_keys}
    frozen = {i: shards[i] for i in unit.frozen}
    gather = unit.collectives.gather_each if each else unit.collectives.gather
    skip = frozenset() if only is None else frozenset(unit.leaves) - only
    if unit.casts or unit.apart or skip:
      gather = functools.partial(gather, casts=unit.casts, apart=unit.apart | skip)
    # a stacked unit's shards outside a scan: every layer, one gather vmapped over them
    stacked = layer_axis and unit.stacked
    full.update(jax.vmap(gather)(trainable, frozen) if stacked else gather(trainable, frozen))
    # by row blocks, or by rows, where used ([Note: row blocks of a chunked param], [Note: a
    # table's uses on this device's rows])
    full.update((i, shards[i]) for i in unit.apart - skip)
  return full


def scatter(
  units: Sequence[UnitIO], cts: dict, layer_axis: bool, each: bool = False, only=None
) -> dict:
  """{leaf: shard grad} of the trainable leaves of `units` (`only`: of those leaves alone)
  from their whole-size cotangents `cts`; the leaves reduced where used (`UnitIO.apart`)
  pass as they are."""
  grads = {}
  for unit in units:
    leaves = [i for i in unit.trainable if only is None or i in only]
    if leaves:
      skip = unit.apart | frozenset(i for i in unit.trainable if i not in leaves)
      unit_cts = {i: cts[i] for i in leaves if i not in skip}
      collective = unit.collectives
      scatter = collective.scatter_each if each and collective.scatter_each else collective.scatter
      if skip:
        scatter = functools.partial(scatter, apart=skip)
      stacked = layer_axis and unit.stacked
      grads.update(jax.vmap(scatter)(unit_cts) if stacked else scatter(unit_cts))
      grads.update((i, cts[i]) for i in leaves if i in unit.apart)  # reduced already
  return grads


# ----------------------------------------------------------------------------- stand-ins


# [Note: stand-ins]
# A stand-in is zeros of a value's type, traced where the type matters and the value does
# not: the activations of a backward's replayed vjp (every residual they feed is replaced
# by a saved one: [Note: saved and replayed residuals]), the gathered params where no
# residual left to recompute reads them, the tied units' links ([Note: tied units]), the
# tokens of a forward ([Note: token list]), and the whole-shape params `fsdp_program` traces
# the loss on (its `_whole_stand_in`). What it feeds is dead code XLA removes, or a zero output
# nothing computes with. The type is the traced one (`traced_avals`, `avals`:
# `jax.typeof`), not a shape and a dtype, because inside `shard_map` a type includes the
# mesh axes a value varies over (a gathered param varies over the data axes): a stand-in
# that varied over other axes would trace another program, whose residuals and cotangents
# need not have the forward's types.


def stand_in(aval):
  """Zeros of `aval`'s shape, dtype and varying axes: traced in place of a value whose
  residuals are saved, so only dead code reads it ([Note: stand-ins])."""
  x = jnp.zeros(aval.shape, aval.dtype)
  vma = tuple(sorted(varying(aval)))
  return collectives.make_varying(x, vma) if vma else x


def stand_ins(avals):
  return jax.tree.map(stand_in, avals)


def ct_or_none(x, ct):
  """A custom_vjp cotangent for input `x` (a value or its type): None (zero) for integer
  inputs; summed over the mesh axes it varies over and `x` does not (an input replicated
  over "data", like a model state, used by every device: the transpose of its implicit
  `pvary`), so that it has `x`'s type."""
  if not is_float(x) or ct is None:
    return None
  aval = x.aval if hasattr(x, "aval") else jax.typeof(x) if isinstance(x, jax.Array) else x
  extra = varying(jax.typeof(ct)) - varying(aval)
  return collectives.sum_over(ct, tuple(sorted(extra))) if extra else ct
