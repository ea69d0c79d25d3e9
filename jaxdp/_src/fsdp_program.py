"""How an FSDP step runs the user's loss: traced once, cut into units, one `custom_vjp` each.

`run_loss` traces `loss_fn` on whole-shape params (what plain `jax.grad` would trace: a shape
check in the model, `nnx_split`'s included, sees the shapes it expects), then replays the
traced program (its jaxpr) in pieces:

* A *segment*: consecutive equations that use the params of one unit (one unrolled layer; the
  equations that use no param join the segment they fall in). It runs as one `custom_vjp`
  (`_unit_call`) whose inputs are the activations it reads and its unit's *shards*. Forward:
  all-gather the unit, run the equations, keep as residuals what `jax.vjp` of the segment
  keeps, except the values computed from the params alone (the gathered params themselves,
  `W.T`, a bf16 cast of `W`, ...) and those computed from integer inputs alone (a one-hot
  of the token ids: the integers are saved instead). Backward: all-gather the unit again
  (only if one of those is needed: wpe's grad needs no value of wpe), recompute them from
  the re-gathered params and the integers (everything else the backward reads is a saved
  residual), run the segment's vjp and reduce-scatter the unit's weight gradients right
  there. Which activations are saved is therefore the user's decision: a `jax.checkpoint`
  (or `nnx.remat`) in the model saves its inputs only, exactly as under `jax.grad`; without
  one, the segment saves what `jax.grad` saves, less the gathered params and what the
  integers give. A unit that two segments use (a tied embedding) is gathered in each and
  reduce-scattered once, by the first: the later one hands its whole-size gradient back to
  it, which adds it to its own (`_Ties`).
* A *scanned unit*: a `lax.scan` whose `xs` are the leaves of a stacked unit
  (`FSDPConfig(stacked=...)`), whatever made it (`jax.lax.scan`, `nnx.scan`, with or without
  `jaxdp.scan_unit`, with the user's remat inside its body or around it). It runs as one
  `custom_vjp` (`fsdp_scan.scan_unit`) over the layer shards `(layers, rows / dp, ...)`: the
  forward loop runs one layer per iteration and stacks that iteration's residuals (chosen
  as above); the backward loop gathers each layer again, runs its vjp and reduce-scatters its
  gradients. Both loops run one layer ahead ([Note: a layer gathered one iteration
  ahead]): an iteration gathers the next layer while it computes its own, and the backward
  reduce-scatters the gradients a layer computes last in the next iteration. The consts
  and the shards are saved once, not per layer.
* Live units are bounded by data dependencies, not left to the scheduler
  (`FSDPConfig(prefetch=k)`): before segment i runs, the shards of the op k places later go
  through one `optimization_barrier` with segment i's inputs, so their all-gather cannot start
  before segment i does; in the backward each segment passes a token (a zero that leaves its
  backward through an `optimization_barrier` with its incoming cotangents) k segments back,
  and a segment's backward all-gather waits for its token, i.e. for the backward of the
  segment k later to start; its recomputation waits for its own cotangents. A unit's
  reduce-scatter must finish before the segment two earlier gets its cotangents (a second
  token), so it overlaps the backward of the segment before and its full-size gradient dies
  there ([Note: token list]). Every tie uses all its barrier's results or is arithmetic
  (`x + zero token`): XLA drops barrier operands whose results are unused ([Note: orderings
  are data dependencies]).
* What moves is what the loss reads: a param every use of which the loss casts to a
  narrower dtype (`w.astype(jnp.bfloat16)`) is gathered cast ([Note: gathered in the dtype
  the loss casts to]), and a vocabulary table the loss only reads by rows (`embed[ids]`,
  `h @ out.T`) is not gathered at all where moving the activations costs fewer bytes
  (`FSDPConfig(vocab_parallel=)`, [Note: a table computed by rows] in `collectives`): each
  use runs on this device's rows (`fsdp_tables`).

Why trace and replay, rather than the thread-local scope that `gather_unit` / `scan_unit`
used to read at trace time: nothing JAX caches may depend on state outside the values it
traces. `lax.scan` caches the trace of its body per (function, avals); a body that asked a
thread-local "am I under FSDP, which unit is this" was replayed from the cache on the next
build without asking, and skipped its gather. Here the user's function is traced
with whole params exactly as plain `jax.grad` traces it (so a cached trace is the right
trace), and everything FSDP adds is built by jaxdp from that jaxpr, per step build, from the
layout alone. It also needs nothing from the model: unrolled and scanned models, `nnx.scan`
ones included, are cut into units as they are.

A *chunked* param (`FSDPConfig(chunks={"wte": C})`) is never whole: each of its uses gathers
it and reduce-scatters its gradient C row blocks at a time (`fsdp_tables`, [Note: row blocks
of a chunked param]).

What falls back (correct, but gathers more at once): a stacked unit whose leaves reach
anything but the `xs` of one scan (e.g. `params["blocks"]["w"][3]`, a `fori_loop` indexing
them, a `jax.checkpoint` around the whole scan) is gathered whole, all layers, in the segment
that uses it; a param passed into a scan as a const is gathered once before it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.extend.core import primitives as prims

from jaxdp._src import collectives, fsdp_scan, fsdp_tables, fsdp_unit, ordering
from jaxdp._src.fsdp_unit import Lazy, Program, UnitIO, Units, ct_or_none, stand_in, stand_ins
from jaxdp._src.jaxprs import (
  as_param,
  avals,
  eval_eqns,
  inline_jits,
  is_float,
  read,
  residual_masks,
  scan_params,
  swap,
  traced_avals,
  use_casts,
)

PyTree = Any


# ----------------------------------------------------------------------------- the program


@dataclasses.dataclass(frozen=True)
class _Piece:
  """Consecutive eqns of the program that run as one op."""

  eqns: tuple[jcore.JaxprEqn, ...]  # a segment's eqns, or the one scan
  scan_xs: Mapping[int, int] | None  # a scanned unit: {xs position: leaf}; None: a segment


@dataclasses.dataclass(frozen=True)
class _Op:
  """A piece, planned: what it gathers, recomputes, reads and hands on."""

  eqns: tuple[jcore.JaxprEqn, ...]
  scan_xs: Mapping[int, int] | None  # as `_Piece.scan_xs`
  units: tuple[str, ...]  # a segment: every unit it reads; a scan: the units its xs are
  scan_consts: tuple[str, ...]  # a scan: units read as consts or carry, gathered whole once
  lazy: tuple[jcore.JaxprEqn, ...]  # the lazy eqns it recomputes, in program order
  acts: tuple[jcore.Var, ...]  # the vars it reads from earlier ops or the inputs
  outs: tuple[jcore.Var, ...]  # the vars it defines that later ops or the output read


def run_loss(
  loss_fn: Callable,
  treedef,
  leaf_avals: Sequence[jax.ShapeDtypeStruct],
  values: dict,
  units: Sequence[UnitIO],
  batch: PyTree,
  axes: Sequence[str],
  *,
  reshard: bool = True,
  keep_last: bool = True,
  prefetch: int = 1,
  tables: bool = False,
) -> PyTree:
  """`loss_fn(params, batch)` with every unit gathered where it is used (module docstring);
  its output may be any pytree (a loss, or a loss with aux and model state; an eval step's
  outputs), and `batch` any pytree of the other inputs (the batch, a key, model state).

  Five steps, defined below in this order: `_trace` the loss with whole params; `_find_lazy`
  the values computed from params alone (recomputed where used); `_cut` the program into
  pieces (segments, scans over stacked units); `_plan` each piece's units, inputs and
  outputs; `_execute` the pieces, each as one `custom_vjp` (`_unit_call`,
  `fsdp_scan.scan_unit`).

  Args:
    loss_fn: the user's loss.
    treedef: the params' tree structure.
    leaf_avals: every leaf's whole shape and param dtype.
    values: leaf index -> this device's shard (float leaves of a unit: the trainable ones'
      masters, the frozen ones as stored) or the whole value (integer leaves); a unit's
      `UnitIO.shards` -> its flat master shards (fused state).
    units: every unit.
    batch: this device's batch.
    axes: the data-parallel axes (the gathered params vary over them).
    reshard: gather each unit again for its backward (else keep the forward's gather).
    keep_last: with `reshard`, a scanned unit's last layer keeps the forward's gather for
      its backward, which runs it first ([Note: a layer gathered one iteration ahead]).
    prefetch: how many units ahead an all-gather may start.
    tables: compute a leaf by rows where that moves fewer bytes than gathering it (see
      [Note: a table computed by rows]; `fsdp_tables.table_leaves` says which leaves may be).
  """
  index = Units({i: u for u in units for i in u.leaves}, {u.name: u for u in units})
  program = _trace(loss_fn, treedef, leaf_avals, values, index, batch, axes)
  casts = _cast_dtypes(program, index)
  units = [
    dataclasses.replace(u, casts={i: casts[i] for i in u.leaves if i in casts}) for u in units
  ]
  index = Units({i: u for u in units for i in u.leaves}, {u.name: u for u in units})
  lazy = _find_lazy(program, index)
  picked = fsdp_tables.lookup_leaves(program, lazy, index, treedef)
  if tables:
    picked |= fsdp_tables.table_leaves(program, lazy, index, casts)
  if picked:
    units = [dataclasses.replace(u, tables=frozenset(u.leaves) & picked) for u in units]
    index = Units({i: u for u in units for i in u.leaves}, {u.name: u for u in units})
  rules = {
    **fsdp_tables.chunk_rules(program, lazy, index, treedef),
    **fsdp_tables.table_rules(program, lazy, index),
  }
  ops = _plan(program, lazy, _cut(program, lazy, index), index)
  outs = _execute(
    program,
    ops,
    values,
    batch,
    index,
    rules,
    axes,
    reshard=reshard,
    keep_last=keep_last,
    prefetch=prefetch,
  )
  return jax.tree.unflatten(program.out_tree, outs)


_TOKEN = jax.ShapeDtypeStruct((), jnp.float32)  # a token's type: [Note: token list]


def _whole_stand_in(aval, axes):
  """Zeros of `aval` varying over `axes`: a whole-shape value to trace with (dead code once
  traced), or a token ([Note: stand-ins])."""
  zeros = jnp.zeros(aval.shape, aval.dtype)
  return collectives.make_varying(zeros, tuple(axes)) if axes else zeros


def _trace(loss_fn, treedef, leaf_avals, values, units: Units, batch, axes) -> Program:
  """Step 1: `loss_fn` traced on whole-shape params, `jit`s inlined."""
  # A unit's leaves are stand-ins of their whole shape ([Note: stand-ins]); the others (the
  # integer leaves) their values.
  args = [
    _whole_stand_in(a, axes) if i in units.of_leaf else values[i] for i, a in enumerate(leaf_avals)
  ]
  closed, out_shape = jax.make_jaxpr(
    lambda leaves, batch: loss_fn(jax.tree.unflatten(treedef, leaves), batch), return_shape=True
  )(args, batch)
  # Traced again with its `jit`s inlined, so that `_cut` sees their equations one by one.
  flat = jax.make_jaxpr(lambda *flat_args: inline_jits(closed.jaxpr, closed.consts, flat_args))(
    *args, *jax.tree.leaves(batch)
  )
  n_leaves = len(leaf_avals)
  param_var = {v: i for i, v in enumerate(flat.jaxpr.invars[:n_leaves]) if i in units.of_leaf}
  return Program(flat.jaxpr, flat.consts, n_leaves, param_var, jax.tree.structure(out_shape))


# [Note: gathered in the dtype the loss casts to]
# A mixed-precision loss keeps fp32 params and casts each where it is used
# (`w.astype(jnp.bfloat16)`, flax's `dtype=` with `param_dtype=float32`). Where every use of a
# param is such a cast, to one narrower float dtype, the cast commutes with the all-gather:
# the unit gathers the shard cast to it (fewer bytes to move) and the program reads
# `gathered.astype(param dtype)`, whose cast back XLA folds into the loss's own (a widening
# cast is exact, so `convert(convert(x, f32), bf16)` is `x`). The loss computes on the same
# values bit for bit, and the cotangent reaching the reduce-scatter is the same, in the grad
# dtype. A param used once in its own dtype (a norm's scale multiplied in fp32) keeps it.
# Uses are followed into the jaxprs of calls, `jax.checkpoint` and `lax.scan` (a stacked
# param's slice in the body), where the operands map one to one to the inner inputs.


def _cast_dtypes(program: Program, units: Units) -> dict[int, np.dtype]:
  """{leaf: dtype} of the units' float leaves that every use casts to one narrower float
  dtype (see the note above; chunked leaves keep their own rule)."""
  out = {}
  for v, i in program.param_var.items():
    if i in units.of_leaf[i].apart or not is_float(v.aval):
      continue
    dtypes = use_casts(program.jaxpr, v)
    if dtypes is not None and len(dtypes) == 1:
      (dtype,) = dtypes
      if jnp.finfo(dtype).bits < jnp.finfo(v.aval.dtype).bits:
        out[i] = np.dtype(dtype)
  return out


def _find_lazy(program: Program, units: Units) -> Lazy:
  """Step 2: which vars are computed from params (and consts) alone."""
  defs, var_units = {}, {v: {units.of_leaf[i].name} for v, i in program.param_var.items()}
  static = set(program.param_var) | set(program.jaxpr.constvars)
  for eqn in program.jaxpr.eqns:
    ins = [v for v in eqn.invars if isinstance(v, jcore.Var)]
    names = set().union(*[var_units.get(v, set()) for v in ins]) if ins else set()
    # computed from params and consts alone (and read by no effect): a lazy value
    if names and all(v in static for v in ins) and not eqn.effects:
      defs.update((v, eqn) for v in eqn.outvars)
      static.update(eqn.outvars)
      for v in eqn.outvars:
        var_units[v] = names
  return Lazy(defs, var_units)


def _scan_xs(eqn, program: Program, units: Units) -> dict[int, int] | None:
  """{xs position: leaf} of a scan whose xs are every leaf of some stacked units, each once
  (None: not such a scan)."""
  if eqn.primitive is not prims.scan_p:
    return None
  start = scan_params(eqn).xs_start
  param_var = program.param_var
  pos = {
    j: param_var[v]
    for j, v in enumerate(eqn.invars[start:])
    if isinstance(v, jcore.Var) and v in param_var and units.of_leaf[param_var[v]].stacked
  }
  names = {units.of_leaf[i].name for i in pos.values()}
  if (
    not pos
    or any(set(units.by_name[n].leaves) - set(pos.values()) for n in names)
    or len(set(pos.values())) != len(pos)
  ):
    return None
  return pos


def _cut(program: Program, lazy: Lazy, units: Units) -> list[_Piece]:
  """Step 3: the program's eqns (but the lazy ones) cut into pieces: each scan over stacked
  units alone; between them, a new segment wherever an eqn reads a unit the open segment
  does not (eqns that read no unit stay in the segment they fall in)."""
  pieces, eqns, names = [], None, set()  # the open segment's eqns and units
  for eqn in program.jaxpr.eqns:
    if eqn.outvars and all(v in lazy.defs for v in eqn.outvars):
      continue
    xs = _scan_xs(eqn, program, units)
    reads = set().union(
      *[lazy.units.get(v, set()) for v in eqn.invars if isinstance(v, jcore.Var)]
    )  # the units the eqn reads, itself or through lazy values
    if eqns is not None and (xs is not None or (reads and names and not reads <= names)):
      pieces.append(_Piece(tuple(eqns), None))
      eqns = None
    if xs is not None:
      pieces.append(_Piece((eqn,), xs))
      continue
    if eqns is None:
      eqns, names = [], set()
    eqns.append(eqn)
    names |= reads
  if eqns is not None:
    pieces.append(_Piece(tuple(eqns), None))
  return pieces


def _direct_reads(piece: _Piece) -> list:
  """The vars a piece's eqns read (a scan: its operands but the stacked xs)."""
  if piece.scan_xs is None:
    return [v for e in piece.eqns for v in e.invars if isinstance(v, jcore.Var)]
  (eqn,) = piece.eqns
  start = scan_params(eqn).xs_start
  return [
    v
    for j, v in enumerate(eqn.invars)
    if isinstance(v, jcore.Var) and j - start not in piece.scan_xs
  ]


def _plan(program: Program, lazy: Lazy, pieces: list[_Piece], units: Units) -> list[_Op]:
  """Step 4: each piece's lazy eqns, inputs, outputs and units."""
  order = {id(e): n for n, e in enumerate(program.jaxpr.eqns)}
  param_var = program.param_var
  planned = []
  for piece in pieces:
    direct = _direct_reads(piece)
    need, stack = {}, list(direct)
    while stack:
      v = stack.pop()
      if v in lazy.defs and id(lazy.defs[v]) not in need:
        defining = lazy.defs[v]
        need[id(defining)] = defining
        stack.extend(w for w in defining.invars if isinstance(w, jcore.Var))
    lazy_eqns = tuple(sorted(need.values(), key=lambda eqn: order[id(eqn)]))
    defined = {v for e in lazy_eqns + piece.eqns for v in e.outvars}
    lazy_reads = [v for e in lazy_eqns for v in e.invars if isinstance(v, jcore.Var)]
    reads = direct + lazy_reads if piece.scan_xs is not None else lazy_reads + direct
    acts = tuple(
      dict.fromkeys(
        v for v in reads if v not in defined and v not in param_var and v not in lazy.defs
      )
    )
    # Units the piece reads directly or through lazy vars.
    used = {units.of_leaf[param_var[v]].name for v in reads if v in param_var}
    if piece.scan_xs is None:
      names, consts = tuple(sorted(used)), ()
    else:
      names = tuple(sorted({units.of_leaf[i].name for i in piece.scan_xs.values()}))
      consts = tuple(sorted(used - set(names)))
    planned.append(
      _Op(
        eqns=piece.eqns,
        scan_xs=piece.scan_xs,
        units=names,
        scan_consts=consts,
        lazy=lazy_eqns,
        acts=acts,
        outs=(),
      )
    )
  # Each op's outputs: what it defines that a later op or the program's output reads.
  ops = []
  later_reads = {v for v in program.jaxpr.outvars if isinstance(v, jcore.Var)}
  for op in reversed(planned):
    outs = tuple(v for e in op.eqns for v in e.outvars if v in later_reads)
    later_reads.update(op.acts)
    ops.append(dataclasses.replace(op, outs=outs))
  return ops[::-1]


def _execute(
  program: Program,
  ops: list[_Op],
  values: dict,
  batch,
  units: Units,
  rules: dict,
  axes,
  *,
  reshard: bool,
  keep_last: bool,
  prefetch: int,
) -> list:
  """Step 5: the ops in order, each segment that reads a unit as one `_unit_call`, each
  scanned unit as one `fsdp_scan.scan_unit`; returns the program's outputs."""
  jaxpr, n_leaves, by_name = program.jaxpr, program.n_leaves, units.by_name
  env = dict(zip(jaxpr.constvars, program.consts))
  env.update(
    (v, values[i]) for i, v in enumerate(jaxpr.invars[:n_leaves]) if v not in program.param_var
  )
  env.update(zip(jaxpr.invars[n_leaves:], jax.tree.leaves(batch)))
  op_shards = [
    {
      i: values[i]
      for n in op.units + op.scan_consts
      for i in by_name[n].shard_keys + by_name[n].frozen
    }
    for op in ops
  ]
  tokens = [_whole_stand_in(_TOKEN, axes) for _ in range(prefetch + 1)]
  ties = _Ties(_tied_units(ops, units))
  for n, op in enumerate(ops):
    acts = [env[v] for v in op.acts]
    ahead = n + prefetch
    if reshard and ahead < len(ops):  # its gather may start once this op's inputs exist
      acts, op_shards[ahead] = ordering.together(acts, op_shards[ahead])
    if op.scan_xs is not None:
      outs, tokens = _run_scan(
        program,
        op,
        acts,
        op_shards[n],
        tokens,
        by_name,
        axes,
        ties,
        reshard=reshard,
        keep_last=keep_last,
      )
    elif op.units:
      op_units = [by_name[u] for u in op.units]
      segment = _SegmentFn(program, op, rules)
      outs, tokens = _unit_call(
        segment, op_units, acts, op_shards[n], tokens, ties, reshard=reshard
      )
    else:  # a segment that reads no unit
      local = dict(zip(op.acts, acts))
      eval_eqns(op.lazy + op.eqns, local)
      outs = [local[v] for v in op.outs]
    env.update(zip(op.outs, outs))
  return [read(env, v) for v in jaxpr.outvars]


@dataclasses.dataclass(frozen=True, eq=False)
class _SegmentFn:
  """A segment as `fn(acts, full) -> outs` for `_unit_call`: its eqns on its inputs, the
  gathered params `full` ({leaf: whole param}) and the program's consts, its lazy vars
  recomputed."""

  program: Program
  op: _Op
  rules: Mapping[int, Callable]

  def __call__(self, acts, full):
    local = dict(zip(self.op.acts, acts))
    params = {v: full[i] for v, i in self.program.param_var.items() if i in full}
    local.update(params)
    local.update((v, x) for v, x in zip(self.program.jaxpr.constvars, self.program.consts))
    narrowed = {v for v, x in params.items() if x.dtype != v.aval.dtype}
    eval_eqns(self.op.lazy + self.op.eqns, local, self.rules, narrowed)
    return [local[v] for v in self.op.outs]


def _run_scan(
  program: Program,
  op: _Op,
  acts,
  shards,
  tokens,
  by_name,
  axes,
  ties: _Ties,
  *,
  reshard: bool,
  keep_last: bool,
):
  """A scanned unit's op: the units it reads as consts gathered whole, once; its lazy vars;
  then the scan as one `fsdp_scan.scan_unit`. Returns `(outs, tokens)`."""
  (eqn,) = op.eqns
  local = dict(zip(op.acts, acts))
  local.update(zip(program.jaxpr.constvars, program.consts))
  whole = [by_name[u] for u in op.scan_consts]
  if whole:  # params the scan reads as consts or carry: gathered whole, once
    # A token list of its own, k = 0 ([Note: token list]): this gather is outside the
    # prefetch chain, and its backward waits for its own cotangents only.
    token = [_whole_stand_in(_TOKEN, axes)]
    full = _unit_call(
      lambda _acts, full: [full[i] for u in whole for i in u.leaves],  # no activations
      whole,
      [],
      shards,
      token,
      ties,
      reshard=False,
    )[0]
    gathered = iter(full)
    local.update(
      (v, as_param(next(gathered), v.aval))
      for u in whole
      for i in u.leaves
      for v, j in program.param_var.items()
      if j == i
    )
  eval_eqns(op.lazy, local)
  start = scan_params(eqn).xs_start
  operands = [None if j - start in op.scan_xs else read(local, v) for j, v in enumerate(eqn.invars)]
  outs, tokens = fsdp_scan.scan_unit(
    eqn,
    [by_name[u] for u in op.units],
    operands,
    dict(op.scan_xs),
    shards,
    tokens,
    reshard=reshard,
    keep_last=keep_last,
  )
  defined = dict(zip(eqn.outvars, outs))
  return [defined[v] for v in op.outs], tokens


# ----------------------------------------------------------------------------- a tied unit


# [Note: tied units]
# A unit that more than one op gathers (GPT-2's `wte`: the embedding at the start, the logits
# at the end) has its gradient reduce-scattered once per step: the sum over its uses, as
# torch FSDP2 and Megatron-FSDP reduce a param's gradient once (one reduce-scatter of the
# summed cotangent, not one per use), summed in the dtype the unit's bucket reduces in
# (`UnitIO.grad_dtypes`: fp32 with `grad_reduce_in_fp32`, as Megatron accumulates a param's
# gradient in its fp32 `main_grad`).
#
# Autodiff does the summing, through *links*. The first call that gathers a tied unit (first
# in the forward, so last in the backward) outputs a link per summed leaf: a zero stand-in of
# the whole param's type ([Note: stand-ins]). Each later call of the unit takes the links as
# inputs (`links_in`) and never computes with them: dead code in the forward. In the
# backward, the cotangent of a link is what the later calls hand back for it (each its
# whole-size gradient of the unit, cast to the link's dtype), summed by autodiff where the
# link fans out; the first call (`links_out`) adds it to its own gradient and
# reduce-scatters the sum. The later calls reduce-scatter nothing of the unit, so one
# whole-size gradient of the unit stays alive from the last use's backward to the first's.
# Chunked and table leaves are left out (`_summed_leaves`): each use reduces them by row
# blocks or by rows where it runs, so that their gradient is never whole.


def _summed_leaves(unit: UnitIO) -> tuple[int, ...]:
  """The leaves of `unit` whose gradients a tied unit sums over its uses before its one
  reduce-scatter ([Note: tied units]): its trainable leaves but those reduced where used
  (chunked ones, each row block reduce-scattered in its matmul, and tables)."""
  return tuple(i for i in unit.trainable if i not in unit.apart)


def _tied_units(ops: Sequence[_Op], units: Units) -> frozenset[str]:
  """The units more than one op gathers (GPT-2's tied `wte`: the embedding at the start,
  the logits at the end) that have gradients to sum."""
  uses = [n for op in ops for n in (op.units if op.scan_xs is None else op.scan_consts)]
  return frozenset(n for n in set(uses) if uses.count(n) > 1 and _summed_leaves(units.by_name[n]))


class _Ties:
  """The links of the tied units while `_execute` builds the forward: each tied unit's
  gradient is reduce-scattered once per step, by its first call ([Note: tied units])."""

  def __init__(self, tied: frozenset[str]):
    self.tied = tied
    self.links: dict[str, dict] = {}  # a tied unit -> {leaf: link}, from its first call

  def first(self, units: Sequence[UnitIO]) -> tuple[int, ...]:
    """The summed leaves of the tied `units` this call is the first to gather."""
    new = [u for u in units if u.name in self.tied and u.name not in self.links]
    return tuple(i for u in new for i in _summed_leaves(u))

  def later(self, units: Sequence[UnitIO]) -> dict:
    """{leaf: link} of the tied `units` an earlier call gathered (and reduce-scatters)."""
    return {i: x for u in units for i, x in self.links.get(u.name, {}).items()}

  def add(self, units: Sequence[UnitIO], links: dict):
    """Records the `links` of the summed leaves `first(units)` named."""
    for unit in units:
      if unit.name in self.tied and unit.name not in self.links:
        self.links[unit.name] = {i: links[i] for i in _summed_leaves(unit)}


# ----------------------------------------------------------------------------- a segment


# [Note: token list]
# The order between the backwards of different ops is carried by zeros, *tokens*, that each
# op's backward hands to the op before it as cotangents: the one channel from a segment's
# backward to an earlier one's that XLA keeps (a data dependency). Every op takes and
# returns a list of k + 1 tokens (k = `FSDPConfig(prefetch=)`). In the forward they are
# stand-ins nothing computes with; in the backward (`ct_tokens`, what an op's backward
# receives, and the list it returns):
# * positions 0 .. k - 1, prefetch tokens: a backward makes a fresh zero once its
#   cotangents exist (it has started) and hands it on at position 0, and passes the token
#   it received at j on at j + 1. So the token at k - 1 was made by the backward of the
#   segment k later, and a segment's backward all-gather waits for it: the gather starts
#   k segments ahead of the compute that reads it, not earlier.
# * position k, the last, "reduce-scatter done": a zero made once the segment after has
#   reduce-scattered its gradients. A segment's gradient buckets are assembled after it
#   (`_bucket_after`), and the cotangents it hands on wait for it, so each unit's
#   reduce-scatter finishes before the segment two earlier starts its backward: it overlaps
#   the backward of the segment before, and one full-size gradient bucket is in flight.
# With k = 0 the list is the done token alone, and a backward gathers once its own
# cotangents exist. A scanned unit returns its own fresh token in every position, made once
# its backward loop is done (its layers' reduce-scatters run inside the loop). How the zeros
# order anything: [Note: orderings are data dependencies].

# [Note: saved and replayed residuals]
# A unit's backward is not written by hand: both passes of its `custom_vjp` trace `jax.vjp`
# of the same function (`_UnitCall.fn`, a scanned unit's `fsdp_scan._ScanLayer`) on values of
# the same types, so the residuals (the leaves of the vjp function, a pytree) come in the same
# order in both. The forward runs `jax.vjp` on the activations and the gathered params and
# saves the leaves marked in `keep`. The backward traces `jax.vjp` again, on stand-ins for
# the activations ([Note: stand-ins]) and the params gathered again, and `swap`s the
# saved leaves in: what remains of its own trace are the residuals not saved, computed
# from the params and consts alone, or from integer inputs that were saved instead (a
# one-hot of the token ids), which it so recomputes. Whatever the stand-ins feed is
# replaced by a saved residual: dead code. `keep` comes from one trace of the vjp before
# either pass (`residual_masks`): a segment saves a residual that depends on a float
# activation, or on an integer input and a param both; a scanned layer, one that depends
# on the carry or the other xs. Where no residual left to recompute reads a param, the
# backward gathers nothing and traces on stand-ins for the params too. Without `reshard`
# every residual is saved, the gathered params included.


def _unit_call(
  fn,
  units: Sequence[UnitIO],
  acts: list,
  shards: dict,
  tokens: list,
  ties: _Ties,
  *,
  reshard: bool,
):
  """`fn(acts, full) -> outs` on `units` gathered from `shards`, as one `custom_vjp` (see the
  module docstring). `tokens` (k + 1 zeros) carry the backward prefetch order ([Note: token
  list]); `ties` links the calls of a tied unit ([Note: tied units]). Returns `(outs, tokens
  for the next segment)`."""
  trainable = {i: shards[i] for u in units for i in u.shard_keys}
  frozen = {i: shards[i] for u in units for i in u.frozen}
  token_avals = avals(tokens)
  act_avals = avals(acts)

  # The gathered params' types (varying axes included), to trace the backward with when it
  # needs no param value (a unit whose grads need only the cotangent, like a bias or wpe).
  full_avals = traced_avals(
    lambda trainable, frozen: fsdp_unit.gather(units, {**trainable, **frozen}, layer_axis=True),
    trainable,
    frozen,
  )
  # What the forward saves (the residuals that depend on the activations; None: all) and
  # which residuals the params feed: one trace of the segment's vjp, for both passes ([Note:
  # saved and replayed residuals]). Residuals computed from integer inputs alone (a one-hot
  # of the token ids) are recomputed in the backward from the integers, saved instead.
  ints = [jnp.issubdtype(a.dtype, jnp.integer) for a in act_avals]
  keep = of_params = None
  if reshard:
    # one flag per arg of `fn` (a list: one per activation): which inputs taint a residual
    of_floats, of_ints, of_params = residual_masks(
      fn,
      (stand_ins(act_avals), stand_ins(full_avals)),
      ([not is_int for is_int in ints], False),
      (ints, False),
      (False, True),
    )
    # Saved: what depends on a float activation, or on the integers and the params together
    # (`w[ids]`: an activation); recomputed: what the params alone or the integers alone give.
    keep = [a or (i and p) for a, i, p in zip(of_floats, of_ints, of_params)]
    if not any(i and not k for i, k in zip(of_ints, keep)):
      ints = [False] * len(ints)  # nothing to recompute from them

  links_out, links_in = ties.first(units), ties.later(units)
  link_avals = {  # a tied leaf's whole gradient, in the dtype its bucket reduces in
    i: full_avals[i].update(dtype=u.grad_dtypes.get(i, full_avals[i].dtype))
    for u in units
    for i in u.trainable
    if i in links_out or i in links_in
  }
  unit = _UnitCall(
    fn=fn,
    units=tuple(units),
    reshard=reshard,
    token_avals=token_avals,
    act_avals=act_avals,
    full_avals=full_avals,
    ints=ints,
    keep=keep,
    of_params=of_params,
    links_out=links_out,
    links_in=tuple(links_in),
    link_avals=link_avals,
  )
  call = jax.custom_vjp(unit.call)
  call.defvjp(unit.fwd, unit.bwd)
  outs, tokens, links_out = call(acts, trainable, frozen, tokens, links_in)
  ties.add(units, links_out)
  return outs, tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _UnitResiduals:
  """What a segment's forward saves for its backward ([Note: saved and replayed
  residuals])."""

  saved: list  # the vjp's residuals marked in `keep`
  int_acts: list  # the integer activations the backward recomputes residuals from
  trainable: dict  # the unit's shards, to gather it again ([Note: trainable and frozen shards])
  frozen: dict
  full: dict | None  # without `reshard`: the forward's gathered params, else None


@dataclasses.dataclass(frozen=True, eq=False)
class _UnitCall:
  """A segment's `custom_vjp` (`_unit_call`): what its two passes need, fixed before they
  are traced, and the passes (FSDP2's unshard / reshard / post-backward of one unit)."""

  fn: Callable  # (acts, full) -> outs: the segment
  units: tuple[UnitIO, ...]
  reshard: bool  # gather again for the backward (else keep the forward's gather)
  token_avals: list  # k prefetch tokens, then the "reduce-scatter done" token ([Note: token list])
  act_avals: list
  full_avals: dict  # the gathered params' types
  ints: list[bool]  # the integer inputs the backward recomputes residuals from
  keep: list[bool] | None  # the residuals the forward saves (None: all)
  of_params: list[bool] | None  # the residuals the params feed
  # [Note: tied units]
  links_out: tuple[int, ...] = ()  # tied leaves whose gradients this call sums and scatters
  links_in: tuple[int, ...] = ()  # tied leaves whose gradients it hands back
  link_avals: Mapping[int, Any] = dataclasses.field(default_factory=dict)  # their links' types

  @property
  def k(self) -> int:  # the prefetch depth
    return len(self.token_avals) - 1

  def full_of(self, trainable, frozen):
    return fsdp_unit.gather(self.units, {**trainable, **frozen}, layer_axis=True)

  def links(self):
    return {i: stand_in(self.link_avals[i]) for i in self.links_out}

  def link_ct(self, leaf, cotangent):
    """Tied `leaf`'s cotangent as its link's type: summed over uses in the reduce dtype."""
    return ct_or_none(self.link_avals[leaf], cotangent.astype(self.link_avals[leaf].dtype))

  def call(self, acts, trainable, frozen, tokens, links):
    outs = self.fn(acts, self.full_of(trainable, frozen))
    return outs, stand_ins(self.token_avals), self.links()

  def fwd(self, acts, trainable, frozen, tokens, links):
    # The gathered params through a barrier (with the inputs, which the forward waits for
    # anyway): the backward reads the saved residuals, never the gathered bucket. Else XLA
    # moves a cheap residual's computation (`x @ w + b`) into the backward's fusions, which
    # read `b` from the gathered bucket, alive from this forward to that backward.
    full, acts = ordering.together(self.full_of(trainable, frozen), acts)
    outs, vjp = jax.vjp(self.fn, acts, full)
    leaves = jax.tree.leaves(vjp)
    saved = [x for x, s in zip(leaves, self.keep or [True] * len(leaves)) if s]
    zeros = stand_ins(self.token_avals)
    int_acts = [a for a, is_int in zip(acts, self.ints) if is_int]
    residuals = _UnitResiduals(saved, int_acts, trainable, frozen, None if self.reshard else full)
    return (outs, zeros, self.links()), residuals

  def bwd(self, res: _UnitResiduals, cts):
    saved, trainable, frozen, full = res.saved, res.trainable, res.frozen, res.full
    ct_outs, ct_tokens, ct_links = cts
    k, keep, token_aval = self.k, self.keep, self.token_avals[0]
    # The vjp is traced again on stand-ins for the activations: every residual they feed is
    # replaced by a saved one ([Note: saved and replayed residuals]).
    acts0 = stand_ins(self.act_avals)
    if res.int_acts:
      # The integers, recomputed from once this backward starts (plus a zero tied to its
      # cotangents): else XLA merges the recomputation with the forward's, alive until here.
      zero, ct_outs = ordering.together(stand_in(token_aval), ct_outs)
      int_acts = iter(res.int_acts)
      acts0 = [
        ordering.tie(next(int_acts), zero) if is_int else x for is_int, x in zip(self.ints, acts0)
      ]
    # This segment's backward has started: release the gather of the segment k earlier.
    fresh, ct_outs = ordering.together(stand_in(token_aval), ct_outs) if k else (None, ct_outs)
    if self.reshard and not any(p and not s for p, s in zip(self.of_params, keep)):
      # nothing to recompute from the params (wpe's grad needs only the cotangent): no gather
      full = stand_ins(self.full_avals)
    elif self.reshard:
      # Gather once the backward of the segment k later has started (its token), or, with
      # k = 0, once this segment's own cotangents exist.
      if k:
        trainable = ordering.after(trainable, ct_tokens[k - 1])
        frozen = ordering.after(frozen, ct_tokens[k - 1])
      else:
        (trainable, frozen), ct_outs = ordering.together((trainable, frozen), ct_outs)
      # ... and recompute nothing from it before this segment's cotangents exist (else XLA
      # runs the recomputation of the segment k earlier as soon as its gather lands).
      full, ct_outs = ordering.together(self.full_of(trainable, frozen), ct_outs)
    _, vjp = jax.vjp(self.fn, acts0, full)
    d_acts, d_full = swap(vjp, saved, keep or [True] * len(saved))(ct_outs)
    # A tied unit's gradient: handed back to its first call, or summed with what its later
    # calls handed back, then reduce-scattered once ([Note: tied units]).
    d_links = {i: self.link_ct(i, d_full[i]) for i in self.links_in}
    d_full = {**d_full, **{i: self.link_ct(i, d_full[i]) + ct_links[i] for i in self.links_out}}
    handed = {u.name for u in self.units if set(_summed_leaves(u)) & set(self.links_in)}
    scattered = [u for u in self.units if u.name not in handed]
    # These gradients go into their buckets once the segment after this one has reduce-scattered
    # its own (the token it handed on): one unit's full-size gradient bucket alive at a time
    # (else XLA copies this unit's while the later unit's reduce-scatter is still in flight;
    # that reduce-scatter still overlaps this segment's backward matmuls).
    d_full = _bucket_after(scattered, d_full, ct_tokens[k])
    d_trainable = fsdp_unit.scatter(scattered, d_full, layer_axis=True)
    # A handed-back unit's chunked leaves: reduce-scattered by row blocks already.
    d_trainable.update(
      (i, d_full[i]) for u in self.units if u.name in handed for i in u.trainable if i in u.apart
    )
    d_trainable = {key: d_trainable.get(key) for key in trainable}  # None: a zero cotangent
    # This unit's gradients are reduce-scattered before the segment two earlier starts its
    # backward: the segment before gets a token that exists once they are, and adds it to the
    # cotangents it hands on (else XLA leaves every weight-gradient matmul and reduce-scatter
    # to the end of the backward, each unit's full-size gradient and activations live until
    # then; tying this segment's own cotangents to them would leave the reduce-scatter
    # nothing to overlap).
    done, d_trainable = ordering.together(stand_in(self.token_avals[-1]), d_trainable)
    d_acts = ordering.after(dict(enumerate(d_acts)), ct_tokens[k])
    d_acts = [ct_or_none(a, d_acts[n]) for n, a in enumerate(acts0)]
    # [Note: token list]: a fresh prefetch token first, the received ones one place on, and
    # this unit's "reduce-scatter done" last.
    d_tokens = ([fresh] + list(ct_tokens[: k - 1]) if k else []) + [done]
    # cotangents of (acts, trainable, frozen, tokens, links): a frozen shard gets none
    return d_acts, d_trainable, None, d_tokens, d_links


# ----------------------------------------------------------------------------- gradient buckets


def _bucket_after(units: Sequence[UnitIO], cts: dict, token) -> dict:
  """`cts` with each gradient bucket's ravel held back until `token` exists: the smallest
  float cotangent of each (unit, dtype) gets the (zero) token added, so the bucket's
  concatenation, which reads it, waits for it (adding it to every cotangent costs a pass
  over each on XLA:CPU, where the add does not fuse into the concatenation)."""
  picks = {}
  for unit in units:
    for i in unit.trainable:
      cotangent = cts.get(i)
      if cotangent is not None and is_float(cotangent) and i not in unit.apart:
        key = (unit.name, jnp.dtype(cotangent.dtype))
        if key not in picks or cotangent.size < cts[picks[key]].size:
          picks[key] = i
  return {**cts, **ordering.after({i: cts[i] for i in picks.values()}, token)}
