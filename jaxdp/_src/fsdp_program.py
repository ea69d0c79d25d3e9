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
  `custom_vjp` (`_scan_unit`) over the layer shards `(layers, rows / dp, ...)`: the forward
  loop gathers one layer per iteration and stacks that iteration's residuals (chosen as
  above); the backward loop gathers each layer again, runs its vjp and reduce-scatters its
  gradients in its own iteration. The consts and the shards are saved once, not per layer.
  Inside the loops a layer is gathered one all-gather per param, so each param's gather
  overlaps the compute of those before it (as GSPMD's scanned FSDP does); the reduce-scatter
  is one per layer.
* Live units are bounded by data dependencies, not left to the scheduler
  (`FSDPConfig(prefetch=k)`): before segment i runs, the shards of the op k places later go
  through one `optimization_barrier` with segment i's inputs, so their all-gather cannot start
  before segment i does; in the backward each segment passes a token (a zero that leaves its
  backward through an `optimization_barrier` with its incoming cotangents) k segments back,
  and a segment's backward all-gather waits for its token, i.e. for the backward of the
  segment k later to start; its recomputation waits for its own cotangents. A unit's
  reduce-scatter must finish before the segment two earlier gets its cotangents (a second
  token), so it overlaps the backward of the segment before and its full-size gradient dies
  there. Every tie uses all its barrier's results or is arithmetic (`x + zero token`): XLA
  drops barrier operands whose results are unused. Inside a scan, `prefetch >= 2` lets XLA's
  collective pipeliner gather the next layer one iteration ahead.

Why trace and replay, rather than the thread-local scope that `gather_unit` / `scan_unit`
used to read at trace time: nothing JAX caches may depend on state outside the values it
traces. `lax.scan` caches the trace of its body per (function, avals); a body that asked a
thread-local "am I under FSDP, which unit is this" was replayed from the cache on the next
build without asking, and skipped its gather. Here the user's function is traced
with whole params exactly as plain `jax.grad` traces it (so a cached trace is the right
trace), and everything FSDP adds is built by jaxdp from that jaxpr, per step build, from the
layout alone. It also needs nothing from the model: unrolled and scanned models, `nnx.scan`
ones included, are cut into units as they are.

* A *chunked* param (`FSDPConfig(chunks={"wte": C})`, a large embedding or output
  projection): its unit hands the segment this device's shard, and each matmul on it
  (`dot_general`) runs as one `custom_vjp` (`_chunked_dot`) over C row blocks: forward,
  gather one block, compute its share of the product; backward, gather it again (not at
  all when the other operand needs no cotangent, like a one-hot), compute its shares of the
  gradients and reduce-scatter the block's weight gradient at once. A row lookup on it
  (`w[ids]`) runs as `_chunked_take`: each block gathered once in the forward, nothing in
  the backward. Casts and transposes of it on the way (`w.astype(jnp.bfloat16).T`) are
  recomputed on the blocks. The param and its gradient are never whole (GPT-2's 147 MiB
  tied `wte`, a Llama's 2 GiB `embed` and `out`). A tied chunked param is so reduce-scattered
  once per use, block by block: summing its uses first would hold its whole gradient.

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

from jaxdp._src import collectives
from jaxdp._src.buffer import pad_dim
from jaxdp._src.mesh import DATA

PyTree = Any


@dataclasses.dataclass(frozen=True)
class UnitIO:
  """One unit as `run_loss` needs it: its leaves and its collectives."""

  name: str
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
  uses are summed (`_Ties`; missing: the cotangent's own dtype)."""

  @property
  def leaves(self) -> tuple[int, ...]:
    return tuple(sorted(self.trainable + self.frozen))

  @property
  def shard_keys(self) -> tuple[int, ...]:
    return self.trainable if self.shards is None else self.shards


def gather_units(units: Sequence[UnitIO], shards: dict) -> dict:
  """{leaf: whole param} of every leaf of `units` (a stacked unit: all its layers), outside
  any custom_vjp: for keeping units gathered across micro-batches."""
  return _gather(units, shards, layer_axis=True)


def scatter_units(units: Sequence[UnitIO], cts: dict) -> dict:
  """{leaf: shard grad} of the trainable leaves of `units` from whole-size gradients."""
  return _scatter(units, cts, layer_axis=True)


# ----------------------------------------------------------------------------- the program


@dataclasses.dataclass(frozen=True)
class _Units:
  """The units, looked up by leaf and by name."""

  of_leaf: Mapping[int, UnitIO]
  by_name: Mapping[str, UnitIO]


@dataclasses.dataclass(frozen=True)
class _Program:
  """The loss traced with whole params, its `jit`s inlined: what `run_loss` replays."""

  jaxpr: jcore.Jaxpr  # inputs: every leaf, then the leaves of `batch`
  consts: list  # the values of `jaxpr.constvars`
  n_leaves: int
  param_var: Mapping[jcore.Var, int]  # the input var of each leaf a unit holds -> the leaf
  out_tree: Any  # the loss's output structure


@dataclasses.dataclass(frozen=True)
class _Lazy:
  """The vars computed from params (and consts) alone: every op that reads one recomputes it
  from its gathered params instead of receiving it."""

  defs: Mapping[jcore.Var, jcore.JaxprEqn]  # lazy var -> the eqn that defines it
  units: Mapping[jcore.Var, set]  # a param's or a lazy var -> the names of its units


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
  prefetch: int = 1,
) -> PyTree:
  """`loss_fn(params, batch)` with every unit gathered where it is used (module docstring);
  its output may be any pytree (a loss, or a loss with aux and model state; an eval step's
  outputs), and `batch` any pytree of the other inputs (the batch, a key, model state).

  Five steps, defined below in this order: `_trace` the loss with whole params; `_find_lazy`
  the values computed from params alone (recomputed where used); `_cut` the program into
  pieces (segments, scans over stacked units); `_plan` each piece's units, inputs and
  outputs; `_execute` the pieces, each as one `custom_vjp` (`_unit_call`, `_scan_unit`).

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
    prefetch: how many units ahead an all-gather may start.
  """
  index = _Units({i: u for u in units for i in u.leaves}, {u.name: u for u in units})
  program = _trace(loss_fn, treedef, leaf_avals, values, index, batch, axes)
  lazy = _find_lazy(program, index)
  rules = _chunk_rules(program, lazy, index, treedef)
  ops = _plan(program, lazy, _cut(program, lazy, index), index)
  outs = _execute(
    program, ops, values, batch, index, rules, axes, reshard=reshard, prefetch=prefetch
  )
  return jax.tree.unflatten(program.out_tree, outs)


_TOKEN = jax.ShapeDtypeStruct((), jnp.float32)  # a token's type (a zero, see the docstring)


def _whole_stand_in(aval, axes):
  """Zeros of `aval` varying over `axes`: a whole-shape value to trace with (dead code once
  traced), or a token."""
  x = jnp.zeros(aval.shape, aval.dtype)
  return collectives.make_varying(x, tuple(axes)) if axes else x


def _trace(loss_fn, treedef, leaf_avals, values, units: _Units, batch, axes) -> _Program:
  """Step 1: `loss_fn` traced on whole-shape params, `jit`s inlined."""
  args = [
    _whole_stand_in(a, axes) if i in units.of_leaf else values[i] for i, a in enumerate(leaf_avals)
  ]
  closed, out_shape = jax.make_jaxpr(
    lambda leaves, b: loss_fn(jax.tree.unflatten(treedef, leaves), b), return_shape=True
  )(args, batch)
  flat = jax.make_jaxpr(lambda *a: _inline_jits(closed.jaxpr, closed.consts, a))(
    *args, *jax.tree.leaves(batch)
  )
  n_leaves = len(leaf_avals)
  param_var = {v: i for i, v in enumerate(flat.jaxpr.invars[:n_leaves]) if i in units.of_leaf}
  return _Program(flat.jaxpr, flat.consts, n_leaves, param_var, jax.tree.structure(out_shape))


def _find_lazy(program: _Program, units: _Units) -> _Lazy:
  """Step 2: which vars are computed from params (and consts) alone."""
  defs, var_units = {}, {v: {units.of_leaf[i].name} for v, i in program.param_var.items()}
  static = set(program.param_var) | set(program.jaxpr.constvars)
  for eqn in program.jaxpr.eqns:
    ins = [v for v in eqn.invars if isinstance(v, jcore.Var)]
    us = set().union(*[var_units.get(v, set()) for v in ins]) if ins else set()
    if us and all(v in static for v in ins) and not eqn.effects:
      defs.update((v, eqn) for v in eqn.outvars)
      static.update(eqn.outvars)
      for v in eqn.outvars:
        var_units[v] = us
  return _Lazy(defs, var_units)


@dataclasses.dataclass(frozen=True, eq=False)
class _ChunkRule:
  """An `_eval` rule: one matmul (`eqn`) on a leaf its unit gathers by row blocks, as
  `_chunked_dot`, or one row lookup (`w[ids]`), as `_chunked_take`."""

  eqn: jcore.JaxprEqn
  pos: int  # the leaf's operand position
  unit: UnitIO
  leaf: int
  size: int  # the leaf's rows
  x_grad: bool  # whether the other operand gets a cotangent (it depends on a float input)
  dtype: Any = None  # the operand's dtype where the loss casts the leaf first, else None
  perm: tuple[int, ...] | None = None  # the operand is the leaf transposed so (`w.T`)

  def __call__(self, invals):
    x, block = invals[1 - self.pos], invals[self.pos]
    if self.perm is not None:  # the block as the leaf holds it (`eqn` reads it so)
      block = jnp.transpose(block, tuple(int(k) for k in np.argsort(self.perm)))
    n = self.unit.chunks[self.leaf]
    if self.eqn.primitive is prims.gather_p:
      return [_chunked_take(self.eqn, self.unit, self.leaf, n, self.size, self.dtype, x, block)]
    return [
      _chunked_dot(
        self.eqn, self.pos, self.unit, self.leaf, n, self.size, self.x_grad, x, block, self.dtype
      )
    ]


def _is_row_lookup(eqn) -> bool:
  """Is `eqn` a `gather` of whole rows of its operand (`w[ids]`, `jnp.take(w, ids, 0)`,
  `nnx.Embed`): one index per row, every other dim taken whole, after the ids' dims?"""
  if eqn.primitive is not prims.gather_p:
    return False
  w, ids = (v.aval for v in eqn.invars)
  dims = eqn.params["dimension_numbers"]
  return (
    tuple(dims.collapsed_slice_dims) == (0,)
    and tuple(dims.start_index_map) == (0,)
    and not dims.operand_batching_dims
    and ids.shape[-1:] == (1,)
    and tuple(eqn.params["slice_sizes"]) == (1, *w.shape[1:])
    and tuple(dims.offset_dims) == tuple(range(ids.ndim - 1, ids.ndim - 2 + w.ndim))
  )


def _untransposed(eqn, pos: int, perm: tuple[int, ...]):
  """The `dot_general` `eqn` reading its operand `pos` untransposed (`x @ w.T` as a matmul
  that contracts `w`'s last dim), or None where that would order the product's dims
  otherwise (or `eqn` is no matmul). `perm`: the operand is the leaf transposed by it."""
  if eqn.primitive is not prims.dot_general_p:
    return None
  (contract, batch), ndim = eqn.params["dimension_numbers"], len(perm)
  to_leaf = lambda dims: tuple(perm[k] for k in dims)
  free = [k for k in range(ndim) if k not in contract[pos] and k not in batch[pos]]
  if [perm[k] for k in free] != sorted(perm[k] for k in free) or batch[pos]:
    return None
  contract = tuple(to_leaf(d) if j == pos else tuple(d) for j, d in enumerate(contract))
  return eqn.replace(params={**eqn.params, "dimension_numbers": (contract, batch)})


def _chunk_rules(program: _Program, lazy: _Lazy, units: _Units, treedef) -> dict:
  """`{id(eqn): rule}` for `_eval`: each matmul on a leaf a unit gathers by row blocks
  (`UnitIO.chunks`) runs as `_chunked_dot`, each row lookup on it as `_chunked_take`; a cast
  of the leaf (`w.astype(jnp.bfloat16)`) is the leaf's rows in that dtype, recomputed on
  the row blocks, which then move in it. Raises ValueError if such a leaf has another use
  (its value is never whole)."""
  jaxpr, unit_of = program.jaxpr, units.of_leaf
  chunked = {v: i for v, i in program.param_var.items() if i in unit_of[i].chunks}
  # Casts and transposes of chunked leaves (`w.astype(jnp.bfloat16).T`) are chunked views of
  # them: recomputed on the row blocks, then read by the matmul or lookup they feed.
  views, perms = set(), {v: None for v in chunked}
  for eqn in jaxpr.eqns:
    v = eqn.invars[0] if eqn.invars else None
    if not (isinstance(v, jcore.Var) and v in chunked):
      continue
    if eqn.primitive is prims.convert_element_type_p:
      perms[eqn.outvars[0]] = perms[v]
    elif eqn.primitive is prims.transpose_p:
      perm = tuple(eqn.params["permutation"])
      old = perms[v] or tuple(range(len(perm)))
      perms[eqn.outvars[0]] = tuple(old[k] for k in perm)
    else:
      continue
    chunked[eqn.outvars[0]] = chunked[v]
    views.add(id(eqn))
  # The vars a gradient flows to: those computed from a float input.
  floats = {v for v in jaxpr.invars if _is_float(v.aval)}
  for eqn in jaxpr.eqns:
    if any(isinstance(v, jcore.Var) and v in floats for v in eqn.invars):
      floats.update(v for v in eqn.outvars if _is_float(v.aval))
  rules = {}
  for eqn in jaxpr.eqns:
    if id(eqn) in views:
      continue
    for pos, v in enumerate(eqn.invars):
      if not (isinstance(v, jcore.Var) and v in chunked):
        continue
      i = chunked[v]
      perm = perms[v] if perms[v] != tuple(range(v.aval.ndim)) else None
      read = eqn if perm is None else _untransposed(eqn, pos, perm)  # as it reads the leaf
      matmul = (
        read is not None
        and read.primitive is prims.dot_general_p
        and eqn.invars[1 - pos] not in chunked
        and 0 not in read.params["dimension_numbers"][1][pos]
        and not any(w in lazy.defs for w in eqn.outvars)
      )
      lookup = pos == 0 and perm is None and _is_row_lookup(eqn)
      if not (matmul or lookup):
        paths = jax.tree_util.tree_flatten_with_path(
          jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
        )[0]
        path = jax.tree_util.keystr(paths[i][0])
        raise ValueError(
          f"FSDPConfig(chunks=...) names params{path}, but the loss uses it in "
          f"`{eqn.primitive.name}`, neither as one operand of a matmul whose other operand "
          "depends on the batch nor as the table of a row lookup; a param gathered by row "
          "blocks can only be cast, used by matmuls (x @ w.T, one_hot @ w, an einsum with "
          "it) and read by rows (w[ids], jnp.take(w, ids, axis=0)): leave it out of chunks="
        )
      x_var = eqn.invars[1 - pos]
      x_grad = isinstance(x_var, jcore.Var) and x_var in floats
      size = program.jaxpr.invars[i].aval.shape[0]
      cast = v.aval.dtype if v not in program.param_var else None
      rules[id(eqn)] = _ChunkRule(read, pos, unit_of[i], i, size, x_grad, cast, perm)
  if any(isinstance(v, jcore.Var) and v in chunked for v in jaxpr.outvars):
    raise ValueError(
      "FSDPConfig(chunks=...) names a param the loss returns; a param gathered by row "
      "blocks can only be used by matmuls and row lookups: leave it out of chunks="
    )
  return rules


def _scan_xs(eqn, program: _Program, units: _Units) -> dict[int, int] | None:
  """{xs position: leaf} of a scan whose xs are every leaf of some stacked units, each once
  (None: not such a scan)."""
  if eqn.primitive is not prims.scan_p:
    return None
  start = eqn.params["num_consts"] + eqn.params["num_carry"]
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


def _cut(program: _Program, lazy: _Lazy, units: _Units) -> list[_Piece]:
  """Step 3: the program's eqns (but the lazy ones) cut into pieces: each scan over stacked
  units alone; between them, a new segment wherever an eqn reads a unit the open segment
  does not (eqns that read no unit stay in the segment they fall in)."""
  pieces, eqns, names = [], None, set()  # the open segment's eqns and units
  for eqn in program.jaxpr.eqns:
    if eqn.outvars and all(v in lazy.defs for v in eqn.outvars):
      continue
    xs = _scan_xs(eqn, program, units)
    us = set().union(*[lazy.units.get(v, set()) for v in eqn.invars if isinstance(v, jcore.Var)])
    if eqns is not None and (xs is not None or (us and names and not us <= names)):
      pieces.append(_Piece(tuple(eqns), None))
      eqns = None
    if xs is not None:
      pieces.append(_Piece((eqn,), xs))
      continue
    if eqns is None:
      eqns, names = [], set()
    eqns.append(eqn)
    names |= us
  if eqns is not None:
    pieces.append(_Piece(tuple(eqns), None))
  return pieces


def _direct_reads(piece: _Piece) -> list:
  """The vars a piece's eqns read (a scan: its operands but the stacked xs)."""
  if piece.scan_xs is None:
    return [v for e in piece.eqns for v in e.invars if isinstance(v, jcore.Var)]
  (eqn,) = piece.eqns
  start = eqn.params["num_consts"] + eqn.params["num_carry"]
  return [
    v
    for j, v in enumerate(eqn.invars)
    if isinstance(v, jcore.Var) and j - start not in piece.scan_xs
  ]


def _plan(program: _Program, lazy: _Lazy, pieces: list[_Piece], units: _Units) -> list[_Op]:
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
        e = lazy.defs[v]
        need[id(e)] = e
        stack.extend(w for w in e.invars if isinstance(w, jcore.Var))
    lazy_eqns = tuple(sorted(need.values(), key=lambda e: order[id(e)]))
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
  program: _Program,
  ops: list[_Op],
  values: dict,
  batch,
  units: _Units,
  rules: dict,
  axes,
  *,
  reshard: bool,
  prefetch: int,
) -> list:
  """Step 5: the ops in order, each segment that reads a unit as one `_unit_call`, each
  scanned unit as one `_scan_unit`; returns the program's outputs."""
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
      acts, op_shards[ahead] = _together(acts, op_shards[ahead])
    if op.scan_xs is not None:
      outs, tokens = _run_scan(
        program, op, acts, op_shards[n], tokens, by_name, axes, ties, reshard=reshard
      )
    elif op.units:
      op_units = [by_name[u] for u in op.units]
      fn = _SegmentFn(program, op, rules)
      outs, tokens = _unit_call(fn, op_units, acts, op_shards[n], tokens, ties, reshard=reshard)
    else:  # a segment that reads no unit
      local = dict(zip(op.acts, acts))
      _eval(op.lazy + op.eqns, local)
      outs = [local[v] for v in op.outs]
    env.update(zip(op.outs, outs))
  return [_read(env, v) for v in jaxpr.outvars]


@dataclasses.dataclass(frozen=True, eq=False)
class _SegmentFn:
  """A segment as `fn(acts, full) -> outs` for `_unit_call`: its eqns on its inputs, the
  gathered params `full` ({leaf: whole param}) and the program's consts, its lazy vars
  recomputed."""

  program: _Program
  op: _Op
  rules: Mapping[int, Callable]

  def __call__(self, acts, full):
    local = dict(zip(self.op.acts, acts))
    local.update((v, full[i]) for v, i in self.program.param_var.items() if i in full)
    local.update((v, x) for v, x in zip(self.program.jaxpr.constvars, self.program.consts))
    _eval(self.op.lazy + self.op.eqns, local, self.rules)
    return [local[v] for v in self.op.outs]


def _run_scan(
  program: _Program, op: _Op, acts, shards, tokens, by_name, axes, ties: _Ties, *, reshard
):
  """A scanned unit's op: the units it reads as consts gathered whole, once; its lazy vars;
  then the scan as one `_scan_unit`. Returns `(outs, tokens)`."""
  (eqn,) = op.eqns
  local = dict(zip(op.acts, acts))
  local.update(zip(program.jaxpr.constvars, program.consts))
  whole = [by_name[u] for u in op.scan_consts]
  if whole:  # params the scan reads as consts or carry: gathered whole, once
    token = [_whole_stand_in(_TOKEN, axes)]
    full = _unit_call(
      lambda a, full: [full[i] for u in whole for i in u.leaves],
      whole,
      [],
      shards,
      token,
      ties,
      reshard=False,
    )[0]
    it = iter(full)
    local.update(
      (v, next(it)) for u in whole for i in u.leaves for v, j in program.param_var.items() if j == i
    )
  _eval(op.lazy, local)
  start = eqn.params["num_consts"] + eqn.params["num_carry"]
  operands = [
    None if j - start in op.scan_xs else _read(local, v) for j, v in enumerate(eqn.invars)
  ]
  outs, tokens = _scan_unit(
    eqn,
    [by_name[u] for u in op.units],
    operands,
    dict(op.scan_xs),
    shards,
    tokens,
    reshard=reshard,
  )
  defined = dict(zip(eqn.outvars, outs))
  return [defined[v] for v in op.outs], tokens


# ----------------------------------------------------------------------------- a tied unit


def _summed_leaves(unit: UnitIO) -> tuple[int, ...]:
  """The leaves of `unit` whose gradients a tied unit sums over its uses before its one
  reduce-scatter: its trainable leaves but the chunked ones (each row block of those is
  reduce-scattered where it is used, so that the leaf's gradient is never whole)."""
  return tuple(i for i in unit.trainable if i not in unit.chunks)


def _tied_units(ops: Sequence[_Op], units: _Units) -> frozenset[str]:
  """The units more than one op gathers (GPT-2's tied `wte`: the embedding at the start,
  the logits at the end) that have gradients to sum."""
  uses = [n for op in ops for n in (op.units if op.scan_xs is None else op.scan_consts)]
  return frozenset(n for n in set(uses) if uses.count(n) > 1 and _summed_leaves(units.by_name[n]))


class _Ties:
  """Each tied unit's gradient, reduce-scattered once per step: the sum over its uses, as
  torch FSDP2 and Megatron-FSDP reduce a param's gradient once (one reduce-scatter of the
  summed cotangent, not one per use), summed in the dtype the unit's bucket reduces in
  (fp32 with `grad_reduce_in_fp32`, as Megatron accumulates a param's gradient in its fp32
  `main_grad`).

  The first call that gathers a tied unit (`_unit_call`, first in the forward, so last in
  the backward) outputs a *link* per summed leaf: a zero stand-in of the whole param's type,
  which each later call of the unit takes as an input and never computes with (dead code in
  the forward). The cotangent of the link is what the later calls hand back for it, each its
  whole-size gradient of the unit, summed by autodiff; the first call's backward adds it to
  its own gradient and reduce-scatters the sum. The later calls reduce-scatter nothing of
  the unit (the chunked leaves aside): one whole-size gradient of the unit stays alive from
  the last use's backward to the first's."""

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
    for u in units:
      if u.name in self.tied and u.name not in self.links:
        self.links[u.name] = {i: links[i] for i in _summed_leaves(u)}


# ----------------------------------------------------------------------------- a segment


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
  module docstring). `tokens` (k + 1 zeros) carry the backward prefetch order; `ties` links
  the calls of a tied unit (`_Ties`). Returns `(outs, tokens for the next segment)`."""
  trainable = {i: shards[i] for u in units for i in u.shard_keys}
  frozen = {i: shards[i] for u in units for i in u.frozen}
  token_avals = _avals(tokens)
  act_avals = _avals(acts)

  # The gathered params' types (varying axes included), to trace the backward with when it
  # needs no param value (a unit whose grads need only the cotangent, like a bias or wpe).
  closed, shape = jax.make_jaxpr(
    lambda t, f: _gather(units, {**t, **f}, layer_axis=True), return_shape=True
  )(trainable, frozen)
  full_avals = jax.tree.unflatten(jax.tree.structure(shape), closed.out_avals)
  # What the forward saves (the residuals that depend on the activations; None: all) and
  # which residuals the params feed: one trace of the segment's vjp, for both passes.
  # Residuals computed from integer inputs alone (a one-hot of the token ids) are recomputed
  # in the backward from the integers, which are saved instead.
  ints = [jnp.issubdtype(a.dtype, jnp.integer) for a in act_avals]
  keep = of_params = None
  if reshard:
    of_floats, of_ints, of_params = _residual_masks(
      fn,
      (_stand_ins(act_avals), _stand_ins(full_avals)),
      ([not i for i in ints], False),
      (ints, False),
      (False, True),
    )
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


@dataclasses.dataclass(frozen=True, eq=False)
class _UnitCall:
  """A segment's `custom_vjp` (`_unit_call`): what its two passes need, fixed before they
  are traced, and the passes (FSDP2's unshard / reshard / post-backward of one unit)."""

  fn: Callable  # (acts, full) -> outs: the segment
  units: tuple[UnitIO, ...]
  reshard: bool  # gather again for the backward (else keep the forward's gather)
  token_avals: list  # k prefetch tokens, then the "reduce-scatter done" token
  act_avals: list
  full_avals: dict  # the gathered params' types
  ints: list[bool]  # the integer inputs the backward recomputes residuals from
  keep: list[bool] | None  # the residuals the forward saves (None: all)
  of_params: list[bool] | None  # the residuals the params feed
  links_out: tuple[int, ...] = ()  # tied leaves whose gradients this call sums and scatters
  links_in: tuple[int, ...] = ()  # tied leaves whose gradients it hands back (`_Ties`)
  link_avals: Mapping[int, Any] = dataclasses.field(default_factory=dict)  # their links' types

  @property
  def k(self) -> int:  # the prefetch depth
    return len(self.token_avals) - 1

  def full_of(self, t, f):
    return _gather(self.units, {**t, **f}, layer_axis=True)

  def links(self):
    return {i: _stand_in(self.link_avals[i]) for i in self.links_out}

  def link_ct(self, i, ct):
    """Tied leaf `i`'s cotangent as its link's type: summed over uses in the reduce dtype."""
    return _ct_or_none(self.link_avals[i], ct.astype(self.link_avals[i].dtype))

  def call(self, acts, t, f, tokens, links):
    return self.fn(acts, self.full_of(t, f)), _stand_ins(self.token_avals), self.links()

  def fwd(self, acts, t, f, tokens, links):
    # The gathered params through a barrier (with the inputs, which the forward waits for
    # anyway): the backward reads the saved residuals, never the gathered bucket. Else XLA
    # moves a cheap residual's computation (`x @ w + b`) into the backward's fusions, which
    # read `b` from the gathered bucket, alive from this forward to that backward.
    full, acts = _together(self.full_of(t, f), acts)
    outs, vjp = jax.vjp(self.fn, acts, full)
    leaves = jax.tree.leaves(vjp)
    saved = [x for x, s in zip(leaves, self.keep or [True] * len(leaves)) if s]
    zeros = _stand_ins(self.token_avals)
    int_acts = [a for a, i in zip(acts, self.ints) if i]
    return (outs, zeros, self.links()), (saved, int_acts, t, f, None if self.reshard else full)

  def bwd(self, res, cts):
    saved, int_acts, t, f, full = res
    ct_outs, ct_tokens, ct_links = cts
    k, keep, token_aval = self.k, self.keep, self.token_avals[0]
    acts0 = _stand_ins(self.act_avals)
    if int_acts:
      # The integers, recomputed from once this backward starts (plus a zero tied to its
      # cotangents): else XLA merges the recomputation with the forward's, alive until here.
      zero, ct_outs = _together(_stand_in(token_aval), ct_outs)
      it = iter(int_acts)
      acts0 = [_tie(next(it), zero) if i else x for i, x in zip(self.ints, acts0)]
    # This segment's backward has started: release the gather of the segment k earlier.
    fresh, ct_outs = _together(_stand_in(token_aval), ct_outs) if k else (None, ct_outs)
    if self.reshard and not any(p and not s for p, s in zip(self.of_params, keep)):
      # nothing to recompute from the params (wpe's grad needs only the cotangent): no gather
      full = _stand_ins(self.full_avals)
    elif self.reshard:
      # Gather once the backward of the segment k later has started (its token), or, with
      # k = 0, once this segment's own cotangents exist.
      if k:
        t, f = _after(t, ct_tokens[k - 1]), _after(f, ct_tokens[k - 1])
      else:
        (t, f), ct_outs = _together((t, f), ct_outs)
      # ... and recompute nothing from it before this segment's cotangents exist (else XLA
      # runs the recomputation of the segment k earlier as soon as its gather lands).
      full, ct_outs = _together(self.full_of(t, f), ct_outs)
    _, vjp = jax.vjp(self.fn, acts0, full)
    d_acts, d_full = _swap(vjp, saved, keep or [True] * len(saved))(ct_outs)
    # A tied unit's gradient: handed back to its first call, or summed with what its later
    # calls handed back, then reduce-scattered once (`_Ties`).
    d_links = {i: self.link_ct(i, d_full[i]) for i in self.links_in}
    d_full = {**d_full, **{i: self.link_ct(i, d_full[i]) + ct_links[i] for i in self.links_out}}
    handed = {u.name for u in self.units if set(_summed_leaves(u)) & set(self.links_in)}
    scattered = [u for u in self.units if u.name not in handed]
    # These gradients go into their buckets once the segment after this one has reduce-scattered
    # its own (the token it handed on): one unit's full-size gradient bucket alive at a time
    # (else XLA copies this unit's while the later unit's reduce-scatter is still in flight;
    # that reduce-scatter still overlaps this segment's backward matmuls).
    d_full = _bucket_after(scattered, d_full, ct_tokens[k])
    d_t = _scatter(scattered, d_full, layer_axis=True)
    # A handed-back unit's chunked leaves: reduce-scattered by row blocks already.
    d_t.update(
      (i, d_full[i]) for u in self.units if u.name in handed for i in u.trainable if i in u.chunks
    )
    d_t = {key: d_t.get(key) for key in t}  # None: a zero cotangent
    # This unit's gradients are reduce-scattered before the segment two earlier starts its
    # backward: the segment before gets a token that exists once they are, and adds it to the
    # cotangents it hands on (else XLA leaves every weight-gradient matmul and reduce-scatter
    # to the end of the backward, each unit's full-size gradient and activations live until
    # then; tying this segment's own cotangents to them would leave the reduce-scatter
    # nothing to overlap).
    done, d_t = _together(_stand_in(self.token_avals[-1]), d_t)
    d_acts = _after(dict(enumerate(d_acts)), ct_tokens[k])
    d_acts = [_ct_or_none(a, d_acts[n]) for n, a in enumerate(acts0)]
    d_tokens = ([fresh] + list(ct_tokens[: k - 1]) if k else []) + [done]
    return d_acts, d_t, None, d_tokens, d_links


def _tie(a, zero):
  """`a + zero`: `a` computed once `zero` exists (an input that varies over fewer axes than
  the zero is left as it is)."""
  ok = _varying(jax.typeof(a)) >= _varying(jax.typeof(zero))
  return a + zero.astype(a.dtype) if ok else a


# ----------------------------------------------------------------------------- a scanned unit


def _scan_unit(
  eqn,
  units: Sequence[UnitIO],
  ops: list,
  shard_pos: dict,
  shards: dict,
  tokens: list,
  *,
  reshard: bool,
):
  """A `lax.scan` over the layers of stacked `units`, as one `custom_vjp` over their layer
  shards (see the module docstring). `ops` are the scan's operands with the stacked params'
  `xs` left out (None); `shard_pos` maps an xs position to its leaf."""
  p = eqn.params
  n_c, n_carry = p["num_consts"], p["num_carry"]
  consts, init, xs = ops[:n_c], ops[n_c : n_c + n_carry], ops[n_c + n_carry :]
  other = [x for j, x in enumerate(xs) if j not in shard_pos]
  trainable = {i: shards[i] for u in units for i in u.trainable}
  frozen = {i: shards[i] for u in units for i in u.frozen}
  layer = _ScanLayer(p["jaxpr"], n_carry, len(xs), shard_pos, tuple(units))
  init_avals = _avals(init)
  other_avals = [jax.typeof(x).update(shape=jax.typeof(x).shape[1:]) for x in other]

  # What each iteration saves: the residuals that depend on the carry or the other xs
  # (None: all), from one trace of the body's vjp on one layer's types.
  keep = None
  if reshard:
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)
    closed, shape = jax.make_jaxpr(layer.gather, return_shape=True)(first(trainable), first(frozen))
    full = _stand_ins(jax.tree.unflatten(jax.tree.structure(shape), closed.out_avals))
    args = (consts, _stand_ins(init_avals), _stand_ins(other_avals), full)
    (keep,) = _residual_masks(layer, args, (False, True, True, False))

  scan = _ScanUnit(
    layer=layer,
    length=p["length"],
    reverse=p["reverse"],
    token_avals=_avals(tokens),
    init_avals=init_avals,
    other_avals=other_avals,
    keep=keep,
  )
  call = jax.custom_vjp(scan.call)
  call.defvjp(scan.fwd, scan.bwd)
  (carry, ys), tokens = call(consts, init, other, trainable, frozen, tokens)
  return list(carry) + list(ys), tokens


@dataclasses.dataclass(frozen=True, eq=False)
class _ScanLayer:
  """One iteration of a scanned unit's scan as `(consts, carry, other xs, full) -> (carry,
  ys)`: the scan's body with the layer's params `full` ({leaf: whole param}) in place of the
  stacked xs; `gather` gathers them from the layer's shards."""

  body: jcore.ClosedJaxpr
  n_carry: int
  n_xs: int
  shard_pos: Mapping[int, int]  # xs position -> leaf
  units: tuple[UnitIO, ...]

  def __call__(self, consts, carry, x_other, full):
    it = iter(x_other)
    x = [full[self.shard_pos[j]] if j in self.shard_pos else next(it) for j in range(self.n_xs)]
    outs = jcore.jaxpr_as_fun(self.body)(*consts, *carry, *x)
    return outs[: self.n_carry], outs[self.n_carry :]

  def gather(self, t_i, f_i):
    return _gather(self.units, {**t_i, **f_i}, layer_axis=False, each=True)


@dataclasses.dataclass(frozen=True, eq=False)
class _ScanUnit:
  """A scanned unit's `custom_vjp` (`_scan_unit`): what its two loops need, fixed before
  they are traced, and the loops."""

  layer: _ScanLayer
  length: int
  reverse: bool
  token_avals: list  # k prefetch tokens, then the "reduce-scatter done" token
  init_avals: list
  other_avals: list  # one iteration's other xs
  keep: list[bool] | None  # the residuals each iteration saves (None: all)

  @property
  def k(self) -> int:  # the prefetch depth
    return len(self.token_avals) - 1

  def call(self, consts, init, other, t, f_, tokens):
    def step(carry, inp):
      x, t_i, f_i = inp
      return self.layer(consts, carry, x, self.layer.gather(t_i, f_i))

    carry, ys = jax.lax.scan(step, init, (other, t, f_), length=self.length, reverse=self.reverse)
    return (carry, ys), _stand_ins(self.token_avals)

  def fwd(self, consts, init, other, t, f_, tokens):
    def step(carry, inp):
      x, t_i, f_i = inp
      (carry, ys), vjp = jax.vjp(self.layer, consts, carry, x, self.layer.gather(t_i, f_i))
      leaves = jax.tree.leaves(vjp)
      saved = [r for r, s in zip(leaves, self.keep or [True] * len(leaves)) if s]
      return carry, (ys, saved)

    carry, (ys, saved) = jax.lax.scan(
      step, init, (other, t, f_), length=self.length, reverse=self.reverse
    )
    zeros = _stand_ins(self.token_avals)
    return ((carry, ys), zeros), (consts, saved, t, f_)

  def bwd(self, res, cts):
    consts, saved, t, f_ = res
    (d_carry, d_ys), ct_tokens = cts
    d_carry = [_ct_or_none(a, d) for a, d in zip(self.init_avals, d_carry)]
    d_consts0 = [jnp.zeros_like(c) if _is_float(c) else None for c in consts]

    def step(acc, inp):
      return self.bwd_layer(consts, acc, inp)

    (d_init, d_consts), (d_other, d_t) = jax.lax.scan(
      step,
      (d_carry, d_consts0),
      (t, f_, saved, d_ys),
      length=self.length,
      reverse=not self.reverse,
    )
    d_init = list(_after(dict(enumerate(d_init)), ct_tokens[self.k]).values())
    fresh, d_init = _together(_stand_in(self.token_avals[0]), d_init)
    return d_consts, d_init, d_other, d_t, None, [fresh] * (self.k + 1)

  def bwd_layer(self, consts, acc, inp):
    """One iteration of the backward loop: the layer gathered again, its vjp, its
    gradients reduce-scattered."""
    d_carry, d_consts = acc
    t_i, f_i, saved_i, d_ys_i = inp
    init0, other0 = _stand_ins(self.init_avals), _stand_ins(self.other_avals)
    _, vjp = jax.vjp(self.layer, consts, init0, other0, self.layer.gather(t_i, f_i))
    keep_i = self.keep or [True] * len(saved_i)
    dc, d_carry, d_x, d_full = _swap(vjp, saved_i, keep_i)((d_carry, d_ys_i))
    d_consts = [None if a is None else a + b for a, b in zip(d_consts, dc)]
    d_x = [_ct_or_none(a, d) for a, d in zip(other0, d_x)]
    d_carry = [_ct_or_none(a, d) for a, d in zip(init0, d_carry)]
    # One reduce-scatter per param, not the unit's bucket: its ravel would copy the
    # layer's whole-size grads (the backward's peak). The barrier with the carry's
    # cotangent keeps each layer's reduce-scatters in its own iteration: without it XLA's
    # collective pipeliner moves them into the next one, which then holds two layers'
    # whole-size grads (on the scanned GPT: 110 MiB with the pipelined per-param
    # reduce-scatters, 111 with the bucket, 94 with both changes). A barrier on the shards
    # alone made the iteration's last reduce-scatter synchronous.
    units = self.layer.units
    d_t = _scatter(units, d_full, layer_axis=False, each=True)
    if any(u.collectives.scatter_each for u in units):  # (DDP's stacked units scatter per layer)
      d_t, d_carry = _together(d_t, d_carry)
    return (d_carry, d_consts), (d_x, d_t)


# ----------------------------------------------------------------------------- a chunked matmul


def _chunked_dot(
  eqn, w_pos: int, unit: UnitIO, leaf: int, n: int, size: int, x_grad: bool, x, block, dtype
):
  """`eqn` (a `dot_general` with the chunked `leaf` as operand `w_pos`) on this device's
  `block` of the leaf's padded rows, the leaf gathered `n` row blocks at a time, as one
  `custom_vjp`.

  Row block c is rows `[lo, hi)` of every device's block (`lo = c * r // n` for `r` rows
  per device), i.e. rows `d * r + [lo, hi)` of the padded param for every device d: its
  `gather_rows` is one all-gather of `block[lo:hi]`, and the reduce-scatter of its gradient
  (`scatter_rows`) lands on this device's rows `[lo, hi)`. Where the leaf's rows are a free
  dim of the product (logits `h @ wte.T`), block c computes the output's columns of those
  rows; where they are contracted (`one_hot @ wte`) it computes a partial sum over them.
  Forward: block c's gather waits for block c - 2's product (one block gathered ahead);
  backward: gather block c again, its share of `x`'s cotangent, its weight gradient,
  reduce-scatter; block c's gather waits for block c + 2's share of `x`'s cotangent and its
  reduce-scatter. About two blocks and two block gradients are alive, never the whole param
  or its whole gradient; the forward saves `x`.
  Without `x_grad` (`x` is computed from integers alone, like a one-hot of the token ids) the
  backward computes no cotangent for `x` and so gathers nothing: the weight gradient needs
  no value of the param.
  """
  (contract, batch) = eqn.params["dimension_numbers"]
  if 0 in batch[w_pos]:
    raise AssertionError("jaxdp FSDP: a chunked param used with its rows as a batch dim")
  r = block.shape[0]
  x_dim = contract[1 - w_pos][list(contract[w_pos]).index(0)] if 0 in contract[w_pos] else None
  w_free = [d for d in range(block.ndim) if d not in contract[w_pos] and d not in batch[w_pos]]
  x_free = x.ndim - len(contract[1 - w_pos]) - len(batch[1 - w_pos])
  out_dim = (
    None if x_dim is not None else len(batch[0]) + (x_free if w_pos else 0) + w_free.index(0)
  )
  matmul = _ChunkedDot(
    eqn=eqn,
    w_pos=w_pos,
    unit=unit,
    leaf=leaf,
    size=size,
    x_grad=x_grad,
    dp=jax.lax.axis_size(DATA),
    r=r,
    bounds=_row_blocks(r, n),
    x_dim=x_dim,
    out_dim=out_dim,
    dtype=dtype,
  )
  dot = jax.custom_vjp(matmul.dot)
  dot.defvjp(matmul.fwd, matmul.bwd)
  return dot(x, block)


def _row_blocks(r: int, n: int) -> tuple[tuple[int, int], ...]:
  """`[lo, hi)` of each of `n` row blocks of a device's `r` rows of a chunked param."""
  return tuple((c * r // n, (c + 1) * r // n) for c in range(n))


@dataclasses.dataclass(frozen=True, eq=False)
class _ChunkedDot:
  """A chunked matmul's `custom_vjp` (`_chunked_dot`): the matmul, the param's row blocks,
  where its rows go in the operands and the product, and the two passes."""

  eqn: jcore.JaxprEqn  # the `dot_general`
  w_pos: int  # the param's operand position
  unit: UnitIO
  leaf: int
  size: int  # the param's rows
  x_grad: bool  # the other operand gets a cotangent
  dp: int
  r: int  # the param's rows per device (padded)
  bounds: tuple[tuple[int, int], ...]  # each block's rows [lo, hi) of a device's rows
  x_dim: int | None  # the other operand's dim contracted with the param's rows (or None)
  out_dim: int | None  # the product's dim over the param's rows (None: they are contracted)
  dtype: Any = None  # the dtype the rows move in where the loss casts the param, else None

  def rows_of(self, a, dim, lo, hi):
    """The rows `d * r + [lo, hi)` (for every d) of `a`'s dim `dim`, which runs over the
    param's rows (zeros for the padding)."""
    dp, r = self.dp, self.r
    a = pad_dim(a, a.shape, dim, dp * r)
    a = a.reshape(*a.shape[:dim], dp, r, *a.shape[dim + 1 :])
    a = jax.lax.slice_in_dim(a, lo, hi, axis=dim + 1)
    return a.reshape(*a.shape[:dim], dp * (hi - lo), *a.shape[dim + 2 :])

  def take(self, x, lo, hi):
    """Block [lo, hi)'s share of `x`: all of it, or its rows if they are contracted."""
    return x if self.x_dim is None else self.rows_of(x, self.x_dim, lo, hi)

  def piece(self, x_c, w_c):
    return _bind(self.eqn, [x_c, w_c] if self.w_pos else [w_c, x_c])[0]

  def gather_rows(self, rows):
    return self.unit.collectives.gather_rows(self.leaf, rows, self.dtype)

  def combine(self, pieces):
    if self.x_dim is not None:
      return sum(pieces[1:], pieces[0])
    out_dim, shape = self.out_dim, pieces[0].shape
    parts = [p.reshape(*shape[:out_dim], self.dp, -1, *shape[out_dim + 1 :]) for p in pieces]
    out = jnp.concatenate(parts, axis=out_dim + 1)
    out = out.reshape(*shape[:out_dim], self.dp * self.r, *shape[out_dim + 1 :])
    return jax.lax.slice_in_dim(out, 0, self.size, axis=out_dim)

  # Each block's operands leave a barrier of their own: XLA merges matmuls that share an
  # operand (`x`, or the cotangent) into one whole-size matmul on the concatenated blocks.
  def forward(self, x, block):
    pieces = []
    for c, (lo, hi) in enumerate(self.bounds):
      own = (block[lo:hi], self.take(x, lo, hi))
      if c < 2:  # gathered once the input exists
        (rows, x_c), _ = _together(own, x if self.x_dim is None else own[1])
      else:  # ... and once block c - 2 is computed: one block ahead
        (rows, x_c), pieces[c - 2] = _together(own, pieces[c - 2])
      pieces.append(self.piece(x_c, self.gather_rows(rows)))
    return self.combine(pieces)

  def dot(self, x, block):
    return self.forward(x, block)

  def fwd(self, x, block):
    return self.forward(x, block), (x, block)

  def bwd(self, res, d_out):
    x, block = res
    d_xs, grads = {}, {}
    order = list(reversed(range(len(self.bounds))))
    for k, c in enumerate(order):
      lo, hi = self.bounds[c]
      x_c, take_vjp = jax.vjp(lambda x: self.take(x, lo, hi), x)
      if k < 2:  # gathered once the cotangent exists (not hoisted into the forward)
        (rows, x_c), d_c = _together((block[lo:hi], x_c), d_out)
      else:  # ... and once block c + 2 is done: its share of d_x, its reduce-scatter
        prev = order[k - 2]
        (rows, x_c, d_c), (d_xs[prev], grads[prev]) = _together(
          (block[lo:hi], x_c, d_out), (d_xs.get(prev), grads[prev])
        )
      d_piece = d_c if self.x_dim is not None else self.rows_of(d_c, self.out_dim, lo, hi)
      if self.x_grad:
        _, vjp = jax.vjp(self.piece, x_c, self.gather_rows(rows))
        d_x_c, dw = vjp(d_piece)
        (d_xs[c],) = take_vjp(d_x_c)
      else:  # linear in the param: its gradient needs no value of it
        w_aval = jax.eval_shape(self.gather_rows, rows)
        (dw,) = jax.linear_transpose(lambda w: self.piece(x_c, w), w_aval)(d_piece)
      if self.leaf in self.unit.trainable:  # reduced in the grad dtype, then the block's
        grads[c] = self.unit.collectives.scatter_rows(self.leaf, dw).astype(rows.dtype)
      else:
        grads[c] = jnp.zeros_like(rows)
    d_x = sum((d_xs[c] for c in order[1:]), d_xs[order[0]]) if self.x_grad else None
    return _ct_or_none(x, d_x), jnp.concatenate([grads[c] for c in range(len(self.bounds))])


# ----------------------------------------------------------------------------- a chunked lookup


def _chunked_take(eqn, unit: UnitIO, leaf: int, n: int, size: int, dtype, ids, block):
  """`eqn` (a row lookup `w[ids]` of the chunked `leaf`, `_is_row_lookup`) on this device's
  `block` of the leaf's padded rows, the leaf gathered `n` row blocks at a time, as one
  `custom_vjp` (`_ChunkedTake`)."""
  r = block.shape[0]
  take = _ChunkedTake(
    eqn=eqn,
    unit=unit,
    leaf=leaf,
    size=size,
    dp=jax.lax.axis_size(DATA),
    r=r,
    bounds=_row_blocks(r, n),
    dtype=dtype,
  )
  lookup = jax.custom_vjp(take.take)
  lookup.defvjp(take.fwd, take.bwd)
  return lookup(ids, block)


@dataclasses.dataclass(frozen=True, eq=False)
class _ChunkedTake:
  """A chunked row lookup's `custom_vjp`: row block c holds rows `d * r + [lo, hi)` of the
  padded param for every device d (`_chunked_dot`), so id `g` is in it where `lo <= g % r <
  hi`, at row `(g // r) * (hi - lo) + g % r - lo` of the gathered block. Forward: gather
  each block (one block ahead) and select the rows of the ids it holds; each output row is
  one row of the param, as the lookup reads it, bit for bit. Backward: nothing to gather
  (the lookup is linear in the param); each block's gradient is the cotangent rows of its
  ids added into the block's rows (`.at[].add`, as the lookup's own transpose does),
  reduce-scattered at once. About two blocks are alive, never the whole table or its
  gradient."""

  eqn: jcore.JaxprEqn  # the `gather`
  unit: UnitIO
  leaf: int
  size: int  # the param's rows
  dp: int
  r: int  # the param's rows per device (padded)
  bounds: tuple[tuple[int, int], ...]  # each block's rows [lo, hi) of a device's rows
  dtype: Any = None  # the dtype the rows move in where the loss casts the param, else None

  def ids_of(self, ids):
    """The row each output row reads, and where it reads none (`mode`'s out-of-range ids)."""
    g = ids[..., 0]
    mode = self.eqn.params["mode"]
    if mode == jax.lax.GatherScatterMode.CLIP:
      return jnp.clip(g, 0, self.size - 1), None
    outside = (g < 0) | (g >= self.size)
    if mode == jax.lax.GatherScatterMode.FILL_OR_DROP:
      return jnp.where(outside, 0, g), outside
    return g, None  # PROMISE_IN_BOUNDS: the caller's promise

  def where(self, g, lo, hi):
    j = g % self.r
    inside = (j >= lo) & (j < hi)
    return inside, jnp.where(inside, (g // self.r) * (hi - lo) + j - lo, 0)

  def expand(self, mask, ndim):
    return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))

  def take(self, ids, block):
    g, outside = self.ids_of(ids)
    out, outs = None, []
    for c, (lo, hi) in enumerate(self.bounds):
      own = block[lo:hi]
      if c >= 2:  # gathered once block c - 2's rows are selected: one block ahead
        own, outs[c - 2] = _together(own, outs[c - 2])
      rows = self.unit.collectives.gather_rows(self.leaf, own, self.dtype)
      inside, local = self.where(g, lo, hi)
      got = jnp.take(rows, local, axis=0)
      out = got if out is None else jnp.where(self.expand(inside, got.ndim), got, out)
      outs.append(out)
    if outside is not None:  # FILL_OR_DROP: an id out of range reads the fill value
      fill = self.eqn.params["fill_value"]
      fill = jnp.nan if fill is None and jnp.issubdtype(out.dtype, jnp.inexact) else fill or 0
      out = jnp.where(self.expand(outside, out.ndim), jnp.asarray(fill, out.dtype), out)
    return out

  def fwd(self, ids, block):
    return self.take(ids, block), (ids, block)

  def bwd(self, res, d_out):
    ids, block = res
    g, outside = self.ids_of(ids)
    if outside is not None:
      d_out = jnp.where(self.expand(outside, d_out.ndim), 0, d_out)
    grads = {}
    for k, c in enumerate(reversed(range(len(self.bounds)))):
      lo, hi = self.bounds[c]
      d_c = d_out
      if k >= 2:  # once block c + 2's gradient is reduce-scattered
        d_c, grads[c + 2] = _together(d_out, grads[c + 2])
      inside, local = self.where(g, lo, hi)
      rows = jnp.zeros((self.dp * (hi - lo), *block.shape[1:]), d_out.dtype)
      d_rows = rows.at[local].add(jnp.where(self.expand(inside, d_c.ndim), d_c, 0))
      if self.leaf in self.unit.trainable:  # reduced in the grad dtype, then the block's
        grads[c] = self.unit.collectives.scatter_rows(self.leaf, d_rows).astype(block.dtype)
      else:
        grads[c] = jnp.zeros((hi - lo, *block.shape[1:]), block.dtype)
    return None, jnp.concatenate([grads[c] for c in range(len(self.bounds))])


# ----------------------------------------------------------------------------- a unit's collectives


def _gather(units: Sequence[UnitIO], shards: dict, layer_axis: bool, each: bool = False) -> dict:
  """{leaf: whole param} of `units` from their shards (stacked shards: every layer; `each`:
  one all-gather per param)."""
  full = {}
  for u in units:
    t = {i: shards[i] for i in u.shard_keys}
    f = {i: shards[i] for i in u.frozen}
    gather = u.collectives.gather_each if each else u.collectives.gather
    full.update(jax.vmap(gather)(t, f) if layer_axis and u.stacked else gather(t, f))
    full.update((i, shards[i]) for i in u.chunks)  # gathered by row blocks where used
  return full


def _scatter(units: Sequence[UnitIO], cts: dict, layer_axis: bool, each: bool = False) -> dict:
  grads = {}
  for u in units:
    if u.trainable:
      c = {i: cts[i] for i in u.trainable if i not in u.chunks}
      scatter = (
        u.collectives.scatter_each if each and u.collectives.scatter_each else u.collectives.scatter
      )
      grads.update(jax.vmap(scatter)(c) if layer_axis and u.stacked else scatter(c))
      grads.update((i, cts[i]) for i in u.trainable if i in u.chunks)  # reduced already
  return grads


def _bucket_after(units: Sequence[UnitIO], cts: dict, token) -> dict:
  """`cts` with each gradient bucket's ravel held back until `token` exists: the smallest
  float cotangent of each (unit, dtype) gets the (zero) token added, so the bucket's
  concatenation, which reads it, waits for it (adding it to every cotangent costs a pass
  over each on XLA:CPU, where the add does not fuse into the concatenation)."""
  picks = {}
  for u in units:
    for i in u.trainable:
      x = cts.get(i)
      if x is not None and _is_float(x) and i not in u.chunks:
        key = (u.name, jnp.dtype(x.dtype))
        if key not in picks or x.size < cts[picks[key]].size:
          picks[key] = i
  return {**cts, **_after({i: cts[i] for i in picks.values()}, token)}


# ----------------------------------------------------------------------------- ordering


def _together(a, b):
  """`(a, b)` through one `optimization_barrier`: XLA computes nothing from either result
  before both of `a` and `b` exist. The caller must use both results (XLA drops the operands
  of a barrier whose results are unused, and with them the ordering). Integer leaves pass
  outside the barrier, and so do leaves that vary over fewer mesh axes than the others (the
  barrier's results vary over every axis any operand varies over: a replicated model state
  would come out varying).

  Differentiated, it is the identity on the cotangents (JAX's own rule for the barrier would
  put them through one too, with zeros materialized for unused results)."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  vma = lambda x: _varying(jax.typeof(x))
  every = frozenset().union(*[vma(x) for x in la + lb if _is_float(x)])
  ia = [n for n, x in enumerate(la) if _is_float(x) and vma(x) == every]
  ib = [n for n, x in enumerate(lb) if _is_float(x) and vma(x) == every]
  if not ia or not ib:
    return a, b
  xa, xb = _barrier_vjp([la[n] for n in ia], [lb[n] for n in ib])
  for n, x in zip(ia, xa):
    la[n] = x
  for n, x in zip(ib, xb):
    lb[n] = x
  return jax.tree.unflatten(ta, la), jax.tree.unflatten(tb, lb)


@jax.custom_vjp
def _barrier_vjp(a, b):
  return jax.lax.optimization_barrier((a, b))


def _barrier_fwd(a, b):
  return _barrier_vjp(a, b), None


def _barrier_bwd(_, ct):
  return ct


_barrier_vjp.defvjp(_barrier_fwd, _barrier_bwd)


def _after(shards: dict, token) -> dict:
  """`shards` plus the (zero) `token`: a data dependency XLA keeps, so the gather of these
  shards cannot start before `token` exists."""
  return {
    i: x + token.astype(x.dtype) if x is not None and _is_float(x) else x for i, x in shards.items()
  }


# ----------------------------------------------------------------------------- jaxpr helpers


def _read(env, v):
  return v.val if isinstance(v, jcore.Literal) else env[v]


def _bind(eqn, invals):
  params = eqn.primitive.get_bind_params(eqn.params)
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*invals, **params)
  return out if eqn.primitive.multiple_results else [out]


def _eval(eqns, env, rules=None):
  """Runs `eqns` on `env`; `rules` maps `id(eqn)` to a function run instead of binding it."""
  for eqn in eqns:
    invals = [_read(env, v) for v in eqn.invars]
    rule = rules.get(id(eqn)) if rules else None
    for v, x in zip(eqn.outvars, rule(invals) if rule else _bind(eqn, invals)):
      env[v] = x


def _inline_jits(jaxpr, consts, args):
  """Evaluates `jaxpr`, inlining `jit` calls (so a jitted block, or a scan inside one, is
  seen equation by equation)."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    invals = [_read(env, v) for v in eqn.invars]
    if eqn.primitive is prims.jit_p:
      inner = eqn.params["jaxpr"]
      outs = _inline_jits(inner.jaxpr, inner.consts, invals)
    else:
      outs = _bind(eqn, invals)
    for v, x in zip(eqn.outvars, outs):
      env[v] = x
  return [_read(env, v) for v in jaxpr.outvars]


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def _residual_masks(f, args, *taints: Sequence[bool]) -> list[list[bool]]:
  """For each of `taints` (a flag per arg): which leaves of `jax.vjp(f, *args)`'s residuals
  depend on the tainted args, from one trace of the vjp.

  A residual computed from untainted args alone (params, consts) is one a unit's backward
  recomputes instead of saving.
  """
  closed = jax.make_jaxpr(lambda *a: jax.tree.leaves(jax.vjp(f, *a)[1]))(*args)
  sizes = [len(jax.tree.leaves(a)) for a in args]
  masks = []
  for tainted in taints:
    flat_taint = [
      x for n, t in zip(sizes, tainted) for x in (t if isinstance(t, list) else [t] * n)
    ]
    marked = {v for v, t in zip(closed.jaxpr.invars, flat_taint) if t}
    for eqn in closed.jaxpr.eqns:
      if any(isinstance(v, jcore.Var) and v in marked for v in eqn.invars):
        marked.update(eqn.outvars)
    masks.append([isinstance(v, jcore.Var) and v in marked for v in closed.jaxpr.outvars])
  return masks


def _ct_or_none(x, ct):
  """A custom_vjp cotangent for input `x` (a value or its type): None (zero) for integer
  inputs; summed over the mesh axes it varies over and `x` does not (an input replicated
  over "data", like a model state, used by every device: the transpose of its implicit
  `pvary`), so that it has `x`'s type."""
  if not _is_float(x) or ct is None:
    return None
  aval = x.aval if hasattr(x, "aval") else jax.typeof(x) if isinstance(x, jax.Array) else x
  extra = _varying(jax.typeof(ct)) - _varying(aval)
  return collectives.sum_over(ct, tuple(sorted(extra))) if extra else ct


def _avals(tree):
  return jax.tree.map(jax.typeof, tree)


def _varying(aval) -> frozenset:
  """The mesh axes a value of type `aval` varies over (inside `shard_map`)."""
  return frozenset(getattr(getattr(aval, "mat", None), "varying", ()) or ())


def _stand_in(aval):
  """Zeros of `aval`'s shape, dtype and varying axes: traced in place of a value whose
  residuals are saved, so only dead code reads it."""
  x = jnp.zeros(aval.shape, aval.dtype)
  vma = tuple(sorted(_varying(aval)))
  return collectives.make_varying(x, vma) if vma else x


def _stand_ins(avals):
  return jax.tree.map(_stand_in, avals)


def _swap(vjp, saved, keep):
  """`vjp` with the residual leaves marked in `keep` replaced by `saved`."""
  leaves, tree = jax.tree.flatten(vjp)
  if len(leaves) != len(keep) or sum(keep) != len(saved):
    raise AssertionError(
      f"jaxdp FSDP: a unit's backward traced {len(leaves)} residuals, its "
      f"forward {len(keep)}; please report this with the model"
    )
  it = iter(saved)
  return jax.tree.unflatten(tree, [next(it) if s else x for x, s in zip(leaves, keep)])
