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
  use runs on this device's rows (`_TableDot`, `_TableTake`).

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
  recomputed on the blocks. The param and its gradient are never whole (GPT-2's tied `wte`,
  a Llama's `embed` and `out`: [Note: row blocks of a chunked param]). A tied chunked param
  is so reduce-scattered once per use, block by block: summing its uses first would hold its
  whole gradient.

What falls back (correct, but gathers more at once): a stacked unit whose leaves reach
anything but the `xs` of one scan (e.g. `params["blocks"]["w"][3]`, a `fori_loop` indexing
them, a `jax.checkpoint` around the whole scan) is gathered whole, all layers, in the segment
that uses it; a param passed into a scan as a const is gathered once before it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.extend.core import primitives as prims

from jaxdp._src import collectives, fsdp_scan, fsdp_unit, ordering
from jaxdp._src.buffer import pad_dim
from jaxdp._src.fsdp_unit import Lazy, Program, UnitIO, Units, ct_or_none, stand_in, stand_ins
from jaxdp._src.jaxprs import (
  as_param,
  avals,
  bind,
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
from jaxdp._src.mesh import DATA

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
      [Note: a table computed by rows]; `_table_leaves` says which leaves may be).
  """
  index = Units({i: u for u in units for i in u.leaves}, {u.name: u for u in units})
  program = _trace(loss_fn, treedef, leaf_avals, values, index, batch, axes)
  casts = _cast_dtypes(program, index)
  units = [
    dataclasses.replace(u, casts={i: casts[i] for i in u.leaves if i in casts}) for u in units
  ]
  index = Units({i: u for u in units for i in u.leaves}, {u.name: u for u in units})
  lazy = _find_lazy(program, index)
  picked = _lookup_leaves(program, lazy, index, treedef)
  if tables:
    picked |= _table_leaves(program, lazy, index, casts)
  if picked:
    units = [dataclasses.replace(u, tables=frozenset(u.leaves) & picked) for u in units]
    index = Units({i: u for u in units for i in u.leaves}, {u.name: u for u in units})
  rules = {**_chunk_rules(program, lazy, index, treedef), **_table_rules(program, lazy, index)}
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


@dataclasses.dataclass(frozen=True, eq=False)
class _ChunkRule:
  """An `eval_eqns` rule: one matmul (`eqn`) on a leaf its unit gathers by row blocks, as
  `_chunked_dot`, or one row lookup (`w[ids]`), as `_chunked_take`."""

  eqn: jcore.JaxprEqn
  pos: int  # the leaf's operand position
  unit: UnitIO
  leaf: int
  size: int  # the leaf's rows
  x_grad: bool  # whether the other operand gets a cotangent (it depends on a float input)
  dtype: Any = None  # the operand's dtype where the loss casts the leaf first, else None
  perm: tuple[int, ...] | None = None  # the operand is the leaf transposed so (`w.T`)

  def __call__(self, invals, env):
    x, block = invals[1 - self.pos], invals[self.pos]
    if self.perm is not None:  # the block as the leaf holds it (`eqn` reads it so)
      block = jnp.transpose(block, tuple(int(k) for k in np.argsort(self.perm)))
    n_blocks = self.unit.chunks[self.leaf]
    if self.eqn.primitive is prims.gather_p:
      return [
        _chunked_take(self.eqn, self.unit, self.leaf, n_blocks, self.size, self.dtype, x, block)
      ]
    dot = _chunked_dot(
      self.eqn,
      w_pos=self.pos,
      unit=self.unit,
      leaf=self.leaf,
      n_blocks=n_blocks,
      size=self.size,
      x_grad=self.x_grad,
      x=x,
      block=block,
      dtype=self.dtype,
    )
    return [dot]


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


@dataclasses.dataclass(frozen=True, eq=False)
class _RowUse:
  """One use of a leaf that is read by rows where used (chunked, or a table): the eqn
  that reads it, through its casts and transposes."""

  eqn: jcore.JaxprEqn  # as the program has it
  pos: int  # the leaf's (view's) operand position
  var: jcore.Var  # the leaf's input var
  kind: str | None  # "matmul", "lookup", or None (another use)
  read: jcore.JaxprEqn | None  # `eqn` reading the leaf untransposed (a matmul), else `eqn`
  perm: tuple[int, ...] | None  # the operand is the leaf transposed so (`w.T`)
  cast: Any  # the operand's dtype where the loss casts the leaf first, else None
  x_grad: bool  # the other operand gets a cotangent (it depends on a float input)
  out_cast: Any = None  # a lookup: the dtype every use of its rows casts them to, or None

  @property
  def rows_free(self) -> bool:
    """A matmul whose product keeps the leaf's rows as a dim (`h @ w.T`: the logits)."""
    if self.kind != "matmul":
      return self.kind == "lookup"
    contract, batch = self.read.params["dimension_numbers"]
    x_contract, x_batch = contract[1 - self.pos], batch[1 - self.pos]
    x_ndim = self.eqn.invars[1 - self.pos].aval.ndim
    has_free = len(x_contract) + len(x_batch) < x_ndim
    return 0 not in contract[self.pos] and has_free


@dataclasses.dataclass(frozen=True)
class _RowUses:
  """The uses of the leaves read by rows where used (`_row_uses`)."""

  by_leaf: dict[int, list[_RowUse]]
  returned: set[int]  # the leaves the program outputs (a view of them included)


def _row_uses(program: Program, lazy: Lazy, leaves) -> _RowUses:
  """Every eqn of the top level that reads one of `leaves` or a cast or transpose of one
  (`w.astype(jnp.bfloat16).T`: a *view*, recomputed on the rows, not a use), by leaf; and
  the leaves the program outputs."""
  jaxpr = program.jaxpr
  of_var = {v: i for v, i in program.param_var.items() if i in leaves}
  param = {v: v for v in of_var}  # a view's leaf var
  # The views, in program order: a cast or a transpose of a leaf or of a view. `perms`
  # composes the transposes, so that each view knows which permutation of its leaf it is
  # (None: the leaf's own order).
  views, perms = set(), {v: None for v in of_var}
  for eqn in jaxpr.eqns:
    v = eqn.invars[0] if eqn.invars else None
    if not (isinstance(v, jcore.Var) and v in of_var):
      continue
    if eqn.primitive is prims.convert_element_type_p:
      perms[eqn.outvars[0]] = perms[v]
    elif eqn.primitive is prims.transpose_p:
      perm = tuple(eqn.params["permutation"])
      old = perms[v] or tuple(range(len(perm)))
      perms[eqn.outvars[0]] = tuple(old[k] for k in perm)
    else:
      continue
    of_var[eqn.outvars[0]] = of_var[v]
    param[eqn.outvars[0]] = param[v]
    views.add(id(eqn))
  # The vars a gradient flows to: those computed from a float input.
  floats = {v for v in jaxpr.invars if is_float(v.aval)}
  for eqn in jaxpr.eqns:
    if any(isinstance(v, jcore.Var) and v in floats for v in eqn.invars):
      floats.update(v for v in eqn.outvars if is_float(v.aval))
  # Every other eqn that reads a leaf or a view is a use: a matmul (its other operand no
  # leaf, the leaf's rows no batch dim, its product not a value of the params alone), a
  # row lookup, or another use (`kind` None, which rules the leaf out of being read by rows).
  uses: dict[int, list[_RowUse]] = {i: [] for i in set(of_var.values())}
  for eqn in jaxpr.eqns:
    if id(eqn) in views:
      continue
    for pos, v in enumerate(eqn.invars):
      if not (isinstance(v, jcore.Var) and v in of_var):
        continue
      perm = perms[v] if perms[v] != tuple(range(v.aval.ndim)) else None
      read = eqn if perm is None else _untransposed(eqn, pos, perm)  # as it reads the leaf
      matmul = (
        read is not None
        and read.primitive is prims.dot_general_p
        and eqn.invars[1 - pos] not in of_var
        and 0 not in read.params["dimension_numbers"][1][pos]
        and not any(w in lazy.defs for w in eqn.outvars)
      )
      lookup = pos == 0 and perm is None and _is_row_lookup(eqn)
      x_var = eqn.invars[1 - pos] if len(eqn.invars) == 2 else None
      out_casts = use_casts(jaxpr, eqn.outvars[0]) if lookup else None
      out_cast = None
      if out_casts is not None and len(out_casts) == 1:
        (dtype,) = out_casts
        narrower = jnp.finfo(dtype).bits < jnp.finfo(eqn.outvars[0].aval.dtype).bits
        out_cast = dtype if narrower else None
      uses[of_var[v]].append(
        _RowUse(
          eqn=eqn,
          pos=pos,
          var=param[v],
          kind="matmul" if matmul else "lookup" if lookup else None,
          read=read if matmul else eqn,
          perm=perm,
          cast=v.aval.dtype if v not in program.param_var else None,
          x_grad=isinstance(x_var, jcore.Var) and x_var in floats,
          out_cast=out_cast,
        )
      )
  returned = {of_var[v] for v in jaxpr.outvars if isinstance(v, jcore.Var) and v in of_var}
  return _RowUses(uses, returned)


def _chunk_rules(program: Program, lazy: Lazy, units: Units, treedef) -> dict:
  """`{id(eqn): rule}` for `eval_eqns`: each matmul on a leaf a unit gathers by row blocks
  (`UnitIO.chunks`) runs as `_chunked_dot`, each row lookup on it as `_chunked_take`; a cast
  of the leaf (`w.astype(jnp.bfloat16)`) is the leaf's rows in that dtype, recomputed on
  the row blocks, which then move in it. Raises ValueError if such a leaf has another use
  (its value is never whole)."""
  unit_of = units.of_leaf
  chunked = {i for i in program.param_var.values() if i in unit_of[i].chunks}
  found = _row_uses(program, lazy, chunked)
  if found.returned:
    raise ValueError(
      "FSDPConfig(chunks=...) names a param the loss returns; a param gathered by row "
      "blocks can only be used by matmuls and row lookups: leave it out of chunks="
    )
  rules = {}
  for i, leaf_uses in found.by_leaf.items():
    for use in leaf_uses:
      if use.kind is None:
        path = _leaf_path(treedef, i)
        raise ValueError(
          f"FSDPConfig(chunks=...) names params{path}, but the loss uses it in "
          f"`{use.eqn.primitive.name}`, neither as one operand of a matmul whose other operand "
          "depends on the batch nor as the table of a row lookup; a param gathered by row "
          "blocks can only be cast, used by matmuls (x @ w.T, one_hot @ w, an einsum with "
          "it) and read by rows (w[ids], jnp.take(w, ids, axis=0)): leave it out of chunks="
        )
      size = program.jaxpr.invars[i].aval.shape[0]
      rules[id(use.eqn)] = _ChunkRule(
        use.read, use.pos, unit_of[i], i, size, use.x_grad, use.cast, use.perm
      )
  return rules


def _table_leaves(program: Program, lazy: Lazy, units: Units, casts: Mapping) -> frozenset:
  """The leaves to compute by rows (see [Note: a table computed by rows]): float leaves of
  units that are not stacked, not chunked, split by their rows, whose collectives can
  reduce a table's rows,
  each of whose uses is a row lookup or a matmul that keeps the leaf's rows in its product,
  and for which that moves fewer bytes than gathering the leaf (twice where the backward
  needs its value) and reduce-scattering its gradient."""
  dp = jax.lax.axis_size(DATA)
  candidates = {
    i
    for v, i in program.param_var.items()
    if not units.of_leaf[i].stacked
    and i not in units.of_leaf[i].apart
    and units.of_leaf[i].shard_dims.get(i) == 0
    and units.of_leaf[i].collectives.table_rows is not None
    and is_float(v.aval)
    and v.aval.ndim >= 2
  }
  found = _row_uses(program, lazy, candidates)
  picked = set()
  for i, leaf_uses in found.by_leaf.items():
    if i in found.returned or not leaf_uses or not all(u.rows_free for u in leaf_uses):
      continue
    unit = units.of_leaf[i]
    trainable = i in unit.trainable
    aval = program.jaxpr.invars[i].aval
    moved = np.dtype(casts.get(i, aval.dtype)).itemsize
    grad = np.dtype(unit.grad_dtypes.get(i, aval.dtype)).itemsize if trainable else 0
    gathers = 1 + any(u.kind == "matmul" and u.x_grad for u in leaf_uses)
    param_bytes = (dp - 1) / dp * aval.size * (moved * gathers + grad)
    if sum(_activation_bytes(u, dp, trainable) for u in leaf_uses) < param_bytes:
      picked.add(i)
  return frozenset(picked)


def _lookup_leaves(program: Program, lazy: Lazy, units: Units, treedef) -> frozenset:
  """The leaves `FSDPConfig(lookups=)` names (`UnitIO.lookups`) whose units can reduce a
  table (`table_rows`) and that the loss looks up: computed by columns ([Note: a table
  looked up by columns]). Raises ValueError if the loss uses one otherwise."""
  named = {i for i in program.param_var.values() if i in units.of_leaf[i].lookups}
  found = _row_uses(program, lazy, named)
  for i, leaf_uses in found.by_leaf.items():
    other = [u for u in leaf_uses if u.kind != "lookup"]
    if other or i in found.returned:
      use = f"`{other[0].eqn.primitive.name}`" if other else "its output"
      raise ValueError(
        f"FSDPConfig(lookups=...) names params{_leaf_path(treedef, i)}, but the loss uses "
        f"it in {use}, not as the table of a row lookup (w[ids], jnp.take(w, ids, axis=0)); "
        "a param sharded by its columns is only looked up: leave it out of lookups= (a "
        "vocabulary table the logits read too is computed by rows: vocab_parallel=)"
      )
  return frozenset(
    i
    for i, leaf_uses in found.by_leaf.items()
    if leaf_uses and units.of_leaf[i].collectives.table_rows is not None
  )


def _leaf_path(treedef, i: int) -> str:
  """The keystr path of leaf `i` of `treedef`."""
  paths = jax.tree_util.tree_flatten_with_path(
    jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
  )[0]
  return jax.tree_util.keystr(paths[i][0])


def _activation_bytes(use: _RowUse, dp: int, trainable: bool) -> float:
  """Bytes a device sends for one use of a table computed by rows (`_TableDot`,
  `_TableTake`), ring algorithms: the other operand gathered (again in the backward) and
  its cotangent reduce-scattered, the product exchanged both ways; a lookup's rows summed
  into their devices and their cotangents gathered."""
  nbytes = lambda aval: aval.size * np.dtype(aval.dtype).itemsize
  if use.kind == "lookup":
    out = use.eqn.outvars[0].aval
    moved = out if use.out_cast is None else out.update(dtype=use.out_cast)
    return (dp - 1) * nbytes(moved) * (1 + trainable)
  x = use.eqn.invars[1 - use.pos].aval
  gathers = 1 + (trainable or use.x_grad) + use.x_grad
  return (dp - 1) * nbytes(x) * gathers + 2 * (dp - 1) / dp * nbytes(use.eqn.outvars[0].aval)


def _table_rules(program: Program, lazy: Lazy, units: Units) -> dict:
  """`{id(eqn): rule}` for `eval_eqns`: each use of a table (`UnitIO.tables`) as `_TableDot`
  or `_TableTake`."""
  tables = {i for i in program.param_var.values() if i in units.of_leaf[i].tables}
  found = _row_uses(program, lazy, tables)
  return {
    id(use.eqn): _TableRule(use, units.of_leaf[i], i, program.jaxpr.invars[i].aval.shape[0])
    for i, leaf_uses in found.by_leaf.items()
    for use in leaf_uses
  }


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


# ----------------------------------------------------------------------------- a chunked matmul

# [Note: row blocks of a chunked param]
# A chunked param (`UnitIO.chunks`) is gathered and reduce-scattered n row blocks at a time,
# inside each use, and is never whole. Each device holds r of the padded param's rows (rows
# `d * r + [0, r)` on device d); row block c is rows `[lo, hi)` of every device's rows
# (`lo = c * r // n`, `_row_blocks`), i.e. rows `d * r + [lo, hi)` of the padded param for
# every d. So a block's all-gather (`gather_rows`) is one collective of `block[lo:hi]` from
# every device, and the reduce-scatter of its gradient (`scatter_rows`) lands on this
# device's rows `[lo, hi)`, where its shard keeps them: the blocks' gradients concatenated in
# order are the shard's gradient. Block c's rows of the gathered block are not contiguous
# in the param: `rows_of` and `_ChunkedTake.where` map them. A block is gathered one block
# ahead: block c's gather waits for block c - 2's result, through a barrier
# ([Note: orderings are data dependencies]), so about two blocks and two block gradients
# are alive at a time.


def _chunked_dot(
  eqn,
  w_pos: int,
  unit: UnitIO,
  leaf: int,
  n_blocks: int,
  size: int,
  x_grad: bool,
  x,
  block,
  dtype,
):
  """`eqn` (a `dot_general` with the chunked `leaf` as operand `w_pos`) on this device's
  `block` of the leaf's padded rows, the leaf gathered `n_blocks` row blocks at a time, as one
  `custom_vjp`.

  Row blocks as [Note: row blocks of a chunked param]. Where the leaf's rows are a free
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
  # Where the param's rows go: contracted with `x`'s dim `x_dim` (`one_hot @ wte`), or a
  # dim of the product, `out_dim` (`dot_general`'s product dims: the batch dims, then the
  # lhs's free dims, the rhs's).
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
    bounds=_row_blocks(r, n_blocks),
    x_dim=x_dim,
    out_dim=out_dim,
    dtype=dtype,
  )
  dot = jax.custom_vjp(matmul.dot)
  dot.defvjp(matmul.fwd, matmul.bwd)
  return dot(x, block)


def _row_blocks(r: int, n: int) -> tuple[tuple[int, int], ...]:
  """`[lo, hi)` of each of `n` row blocks of a device's `r` rows of a chunked param ([Note:
  row blocks of a chunked param])."""
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
    return bind(self.eqn, [x_c, w_c] if self.w_pos else [w_c, x_c])[0]

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
        (rows, x_c), _ = ordering.together(own, x if self.x_dim is None else own[1])
      else:  # ... and once block c - 2 is computed: one block ahead
        (rows, x_c), pieces[c - 2] = ordering.together(own, pieces[c - 2])
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
        (rows, x_c), d_c = ordering.together((block[lo:hi], x_c), d_out)
      else:  # ... and once block c + 2 is done: its share of d_x, its reduce-scatter
        prev = order[k - 2]
        (rows, x_c, d_c), (d_xs[prev], grads[prev]) = ordering.together(
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
    return ct_or_none(x, d_x), jnp.concatenate([grads[c] for c in range(len(self.bounds))])


# ----------------------------------------------------------------------------- a chunked lookup


def _lookup_ids(eqn, size: int, ids):
  """The row each output row of the lookup `eqn` reads from a table of `size` rows, and
  where it reads none (`mode`'s out-of-range ids; None: nowhere)."""
  row_ids = ids[..., 0]
  mode = eqn.params["mode"]
  if mode == jax.lax.GatherScatterMode.CLIP:
    return jnp.clip(row_ids, 0, size - 1), None
  outside = (row_ids < 0) | (row_ids >= size)
  if mode == jax.lax.GatherScatterMode.FILL_OR_DROP:
    return jnp.where(outside, 0, row_ids), outside
  return row_ids, None  # PROMISE_IN_BOUNDS: the caller's promise


def _fill(eqn, out, outside):
  """`out` with the rows of out-of-range ids (`outside`) set to the lookup's fill value."""
  fill = eqn.params["fill_value"]
  fill = jnp.nan if fill is None and jnp.issubdtype(out.dtype, jnp.inexact) else fill or 0
  return jnp.where(_expand(outside, out.ndim), jnp.asarray(fill, out.dtype), out)


def _expand(mask, ndim):
  """`mask` with trailing dims of size 1 up to `ndim`, to select rows of an array."""
  return mask.reshape(mask.shape + (1,) * (ndim - mask.ndim))


def _chunked_take(eqn, unit: UnitIO, leaf: int, n_blocks: int, size: int, dtype, ids, block):
  """`eqn` (a row lookup `w[ids]` of the chunked `leaf`, `_is_row_lookup`) on this device's
  `block` of the leaf's padded rows, the leaf gathered `n_blocks` row blocks at a time, as one
  `custom_vjp` (`_ChunkedTake`)."""
  r = block.shape[0]
  take = _ChunkedTake(
    eqn=eqn,
    unit=unit,
    leaf=leaf,
    size=size,
    dp=jax.lax.axis_size(DATA),
    r=r,
    bounds=_row_blocks(r, n_blocks),
    dtype=dtype,
  )
  lookup = jax.custom_vjp(take.take)
  lookup.defvjp(take.fwd, take.bwd)
  return lookup(ids, block)


@dataclasses.dataclass(frozen=True, eq=False)
class _ChunkedTake:
  """A chunked row lookup's `custom_vjp`: row block c holds rows `d * r + [lo, hi)` of the
  padded param for every device d ([Note: row blocks of a chunked param]), so id `g` is in
  it where `lo <= g % r < hi`, at row `(g // r) * (hi - lo) + g % r - lo` of the gathered block. Forward: gather
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

  def where(self, g, lo, hi):
    j = g % self.r
    inside = (j >= lo) & (j < hi)
    return inside, jnp.where(inside, (g // self.r) * (hi - lo) + j - lo, 0)

  def take(self, ids, block):
    g, outside = _lookup_ids(self.eqn, self.size, ids)
    out, outs = None, []
    for c, (lo, hi) in enumerate(self.bounds):
      own = block[lo:hi]
      if c >= 2:  # gathered once block c - 2's rows are selected: one block ahead
        own, outs[c - 2] = ordering.together(own, outs[c - 2])
      rows = self.unit.collectives.gather_rows(self.leaf, own, self.dtype)
      inside, local = self.where(g, lo, hi)
      got = jnp.take(rows, local, axis=0)
      out = got if out is None else jnp.where(_expand(inside, got.ndim), got, out)
      outs.append(out)
    if outside is not None:  # FILL_OR_DROP: an id out of range reads the fill value
      out = _fill(self.eqn, out, outside)
    return out

  def fwd(self, ids, block):
    return self.take(ids, block), (ids, block)

  def bwd(self, res, d_out):
    ids, block = res
    g, outside = _lookup_ids(self.eqn, self.size, ids)
    if outside is not None:
      d_out = jnp.where(_expand(outside, d_out.ndim), 0, d_out)
    grads = {}
    for k, c in enumerate(reversed(range(len(self.bounds)))):
      lo, hi = self.bounds[c]
      d_c = d_out
      if k >= 2:  # once block c + 2's gradient is reduce-scattered
        d_c, grads[c + 2] = ordering.together(d_out, grads[c + 2])
      inside, local = self.where(g, lo, hi)
      rows = jnp.zeros((self.dp * (hi - lo), *block.shape[1:]), d_out.dtype)
      d_rows = rows.at[local].add(jnp.where(_expand(inside, d_c.ndim), d_c, 0))
      if self.leaf in self.unit.trainable:  # reduced in the grad dtype, then the block's
        grads[c] = self.unit.collectives.scatter_rows(self.leaf, d_rows).astype(block.dtype)
      else:
        grads[c] = jnp.zeros((hi - lo, *block.shape[1:]), block.dtype)
    return None, jnp.concatenate([grads[c] for c in range(len(self.bounds))])


# ----------------------------------------------------------------------------- a table by rows

# [Note: a table's uses on this device's rows]
# The program's side of [Note: a table computed by rows] (in `collectives`). `_table_leaves`
# picks the leaves: every use a row lookup or a matmul that keeps the leaf's rows in its
# product, and fewer bytes to move that way than to gather the leaf. `_table_rules` makes
# each use an `eval_eqns` rule (`_TableRule`) that the segment runs in place of the eqn. Its
# unit never gathers such a leaf (`UnitIO.tables`, part of `apart`): `fsdp_unit.gather` hands the
# segment this device's shard, and `fsdp_unit.scatter` passes its gradient on as it is, reduced
# already by the rule's backward (`table_rows`). The rule reads that shard, not the view
# the eqn reads (a cast, a transpose: recomputed on the rows, the transpose folded into the
# matmul's dimension numbers), so that the gradient reaches the shard in its own dtype.
# The table's rows are padded to `dp * r`, r rows per device: device d holds rows
# `d * r + [0, r)`. A product's dim over the rows is cut back to the table's rows, its
# cotangent padded again; a lookup's id is here where `0 <= id - d * r < r`.


@dataclasses.dataclass(frozen=True, eq=False)
class _TableRule:
  """An `eval_eqns` rule: one use of a table (`UnitIO.tables`) on this device's rows of it, as
  `_TableDot` (a matmul) or `_TableTake` (a row lookup): see [Note: a table computed by
  rows] and [Note: a table's uses on this device's rows]. The rule reads the leaf's rows from the segment's values (`use.var`), not the view
  the eqn reads, so that its gradient reaches them in the master's dtype."""

  use: _RowUse
  unit: UnitIO
  leaf: int
  size: int  # the leaf's rows

  def __call__(self, invals, env):
    use = self.use
    x, rows = invals[1 - use.pos], env[use.var]
    dp = jax.lax.axis_size(DATA)
    if use.kind == "lookup":
      common = dict(
        eqn=use.eqn,
        unit=self.unit,
        leaf=self.leaf,
        size=self.size,
        cast=use.cast,
        moved=use.out_cast,
      )
      if self.leaf in self.unit.lookups:  # [Note: a table looked up by columns]
        take = _ColumnTake(**common, width=use.var.aval.shape[1])
      else:
        take = _TableTake(**common, dp=dp, r=rows.shape[0])
      lookup = jax.custom_vjp(take.take)
      lookup.defvjp(take.fwd, take.bwd)
      return [lookup(x, rows)]
    contract, batch = use.read.params["dimension_numbers"]
    w_pos = use.pos
    free = lambda ndim, j: [d for d in range(ndim) if d not in contract[j] and d not in batch[j]]
    x_free, w_free = free(x.ndim, 1 - w_pos), free(rows.ndim, w_pos)
    # `dot_general`'s product dims: the batch dims, then the lhs's free dims, the rhs's
    n_batch = len(batch[0])
    y_x = n_batch + (0 if w_pos else len(w_free))  # the product's dim over `x_free[0]`
    y_w = n_batch + (len(x_free) if w_pos else 0) + w_free.index(0)  # ... over the rows
    dot = _TableDot(
      eqn=use.read,
      w_pos=w_pos,
      unit=self.unit,
      leaf=self.leaf,
      size=self.size,
      x_grad=use.x_grad,
      cast=use.cast,
      dp=dp,
      r=rows.shape[0],
      x_dim=x_free[0],
      y_x=y_x,
      y_w=y_w,
      pieces=_table_pieces(rows.shape[0]),
    )
    matmul = jax.custom_vjp(dot.dot)
    matmul.defvjp(dot.fwd, dot.bwd)
    return [matmul(x, rows)]


TABLE_PIECES = 4
"""The most row blocks a table's matmul sends its cotangent back in (`_TableDot.bwd`)."""


def _table_pieces(r: int) -> int:
  """The most row blocks, up to `TABLE_PIECES`, that cut `r` rows into equal blocks."""
  return max(c for c in range(1, TABLE_PIECES + 1) if r % c == 0)


@dataclasses.dataclass(frozen=True, eq=False)
class _TableDot:
  """A matmul on a table's rows (`x @ w.T`, the logits): every device's `x` gathered along
  one of its free dims (`x_dim`), its product with this device's rows computed here, then
  each device's part of it exchanged for its share of every device's rows (`exchange_batch`
  along `y_x`, then the received parts laid along `y_w`). Backward: the cotangent exchanged
  back, `x` gathered again; this device's rows' gradient over every device's batch (the
  reduced gradient: no reduce-scatter) and the partial cotangents of every device's `x`,
  summed into their devices (`scatter_batch`). Neither the table nor its gradient is ever
  whole; the forward saves `x`, not its gather.

  The backward runs in `pieces` blocks of this device's rows, each block's exchange a
  collective of its own, so that the scheduler runs one block's exchange under another
  block's matmuls (one exchange of the whole cotangent would wait for all of them); the
  cotangent of `x` sums the blocks' parts in float32, rounded once. The forward exchanges
  its product whole: the blocks' parts would be joined into the logits by a copy of them,
  where the one exchange's layout change fuses into the loss's kernels."""

  eqn: jcore.JaxprEqn  # the `dot_general`, reading the table as the leaf holds it
  w_pos: int  # the table's operand position
  unit: UnitIO
  leaf: int
  size: int  # the table's rows
  x_grad: bool  # the other operand gets a cotangent
  cast: Any  # the dtype the loss casts the table to, or None
  dp: int
  r: int  # the table's rows per device (padded)
  x_dim: int  # the free dim of `x` gathered
  y_x: int  # the product's dim over `x_dim`
  y_w: int  # the product's dim over the table's rows
  pieces: int  # the backward's row blocks (`_table_pieces`)

  def rows(self, block):
    return block.astype(self.cast) if self.cast is not None else block

  def piece(self, x, w):
    return bind(self.eqn, [x, w] if self.w_pos else [w, x])[0]

  def by_rows(self, exchanged):
    """The product exchanged along `y_x` (every device's rows for this device's `x`, device
    by device along `y_x`) with those devices laid along `y_w` instead."""
    y_x, y_w, shape = self.y_x, self.y_w, exchanged.shape
    split = exchanged.reshape(shape[:y_x] + (self.dp, -1) + shape[y_x + 1 :])
    moved = jnp.moveaxis(split, y_x, y_w)  # (device, row) at `y_w`
    return moved.reshape(moved.shape[:y_w] + (-1,) + moved.shape[y_w + 2 :])

  def blocks_of(self, d_y) -> list:
    """A cotangent over every device's rows as `pieces` parts, part j every device's block
    j of rows laid device by device along `y_x` (`by_rows`' inverse, per block)."""
    y_x, y_w, shape = self.y_x, self.y_w, d_y.shape
    split = d_y.reshape(shape[:y_w] + (self.dp, self.pieces, -1) + shape[y_w + 1 :])
    parts = []
    for j in range(self.pieces):
      block = jnp.moveaxis(jax.lax.index_in_dim(split, j, y_w + 1, keepdims=False), y_w, y_x)
      parts.append(block.reshape(block.shape[:y_x] + (-1,) + block.shape[y_x + 2 :]))
    return parts

  def dot(self, x, block):
    every = collectives.gather_batch(x, self.x_dim)
    product = self.by_rows(
      collectives.exchange_batch(self.piece(every, self.rows(block)), self.y_x)
    )
    return jax.lax.slice_in_dim(product, 0, self.size, axis=self.y_w)  # the padding cut

  def fwd(self, x, block):
    return self.dot(x, block), (x, block)

  def bwd(self, res, d_y):
    x, block = res
    d_y = pad_dim(d_y, d_y.shape, self.y_w, self.dp * self.r)
    every, w = collectives.gather_batch(x, self.x_dim), self.rows(block)
    n = self.r // self.pieces
    w_blocks = [jax.lax.slice_in_dim(w, j * n, (j + 1) * n, axis=0) for j in range(self.pieces)]
    d_pieces = [collectives.exchange_batch(d, self.y_x) for d in self.blocks_of(d_y)]
    # linear in each operand: neither cotangent needs the other operand's value
    d_ws = [
      jax.linear_transpose(lambda w_j: self.piece(every, w_j), w_j)(d_piece)[0]
      for w_j, d_piece in zip(w_blocks, d_pieces)
    ]
    d_w = jnp.concatenate(d_ws, axis=0) if len(d_ws) > 1 else d_ws[0]
    d_x = None
    if self.x_grad:
      d_every = [
        jax.linear_transpose(lambda e, w_j=w_j: self.piece(e, w_j), every)(d_piece)[0]
        for w_j, d_piece in zip(w_blocks, d_pieces)
      ]
      total = d_every[0]
      if len(d_every) > 1:  # summed in float32, rounded once
        f32 = jnp.promote_types(every.dtype, jnp.float32)
        total = sum((d.astype(f32) for d in d_every[1:]), d_every[0].astype(f32))
      d_x = collectives.scatter_batch(total.astype(every.dtype), self.x_dim)
    return ct_or_none(x, d_x), _table_grad(self.unit, self.leaf, d_w, block)


def _table_grad(unit: UnitIO, leaf: int, grad, block):
  """A table's gradient on this device's `block`, summed over every device's batch already:
  scaled as a reduce-scatter would (`table_rows`), or zeros for a frozen leaf."""
  if leaf in unit.trainable:
    return unit.collectives.table_rows(leaf, grad).astype(block.dtype)
  return jnp.zeros_like(block)


def _filled(eqn, size: int, ids, out):
  """A lookup's output `out` with the rows of this device's out-of-range `ids` filled as
  the lookup `eqn`'s mode says (`_lookup_ids`, `_fill`)."""
  _, outside = _lookup_ids(eqn, size, ids)
  return out if outside is None else _fill(eqn, out, outside)


class _IdsHere(NamedTuple):
  """Every device's ids of a lookup, as this device's rows of the table read them
  (`_TableTake.where`)."""

  local: jax.Array  # the row of this device's block each id reads (0 where not here)
  here: jax.Array  # whether this device holds the id's row
  outside: jax.Array | None  # where an id reads no row (`mode`'s out-of-range ids), or None


@dataclasses.dataclass(frozen=True, eq=False)
class _TableTake:
  """A row lookup on a table's rows (`w[ids]`): every device's ids gathered (along their
  first dim), the rows this device holds read here (zeros for the others) and summed into
  the devices the ids came from (`scatter_batch`: each output row is one device's row plus
  zeros, the row itself). Backward: every device's cotangent gathered, the rows of this
  device's ids added into its rows' gradient (`.at[].add`, as the lookup's own transpose
  does): the reduced gradient, no reduce-scatter. The rows move in the dtype the lookup's
  output is cast to where every use of it casts it (exact: the sum adds zeros)."""

  eqn: jcore.JaxprEqn  # the `gather`
  unit: UnitIO
  leaf: int
  size: int  # the table's rows
  dp: int
  r: int  # the table's rows per device (padded)
  cast: Any  # the dtype the loss casts the table to before the lookup, or None
  moved: Any = None  # the dtype every use of the rows read casts them to, or None

  def where(self, ids) -> _IdsHere:
    """Every device's ids, as this device's block of the table reads them."""
    row_ids, outside = _lookup_ids(self.eqn, self.size, collectives.gather_batch(ids, 0))
    # device d holds the padded table's rows d * r + [0, r): [Note: a table's uses on
    # this device's rows]
    local = row_ids - collectives.data_index((DATA,)) * self.r
    here = (local >= 0) & (local < self.r)
    if outside is not None:
      here = here & ~outside
    return _IdsHere(local=jnp.where(here, local, 0), here=here, outside=outside)

  def take(self, ids, block):
    ids_here = self.where(ids)
    rows = block.astype(self.cast) if self.cast is not None else block
    got = jnp.take(rows, ids_here.local, axis=0)
    got = jnp.where(_expand(ids_here.here, got.ndim), got, jnp.zeros((), got.dtype))
    # Summed in the dtype the loss casts the rows to (each sum is one row and zeros: the
    # row's cast, exactly), handed on in their own dtype, which the loss's cast undoes.
    out = collectives.scatter_batch(got.astype(self.moved or got.dtype), 0).astype(got.dtype)
    return _filled(self.eqn, self.size, ids, out)

  def fwd(self, ids, block):
    return self.take(ids, block), (ids, block)

  def bwd(self, res, d_out):
    ids, block = res
    ids_here = self.where(ids)
    # The cotangent of rows cast by every use is the cast's (the loss's dtype), exactly.
    every = collectives.gather_batch(d_out.astype(self.moved or d_out.dtype), 0)
    every = jnp.where(_expand(ids_here.here, every.ndim), every, 0).astype(block.dtype)
    grad = jnp.zeros_like(block).at[ids_here.local].add(every)
    return None, _table_grad(self.unit, self.leaf, grad, block)


# [Note: a table looked up by columns]
# A param the loss only looks up by rows (an untied input embedding), named in
# `FSDPConfig(lookups=)`, is sharded by its columns: device d holds columns d * c + [0, c)
# of every row (the columns padded to dp * c). A lookup gathers every device's ids, reads
# their rows' columns here, and one all-to-all (`exchange_batch`) hands device j the
# columns of its own ids' rows from every device, which it lays side by side: the lookup's
# output crosses the network once. Its backward sends the cotangent back the same way and
# adds every device's rows into this device's columns: the gradient summed over every
# device's batch, no reduce-scatter. Sharded by rows instead ([Note: a table's uses on this
# device's rows]) a lookup sums dp devices' zero-padded rows into each device, dp times
# the bytes (Megatron's vocab-parallel embedding does the same over tensor parallelism);
# gathered, the whole table moves. Sharded by its columns a table cannot serve the logits
# (`h @ w.T` would need its rows), so only a table that is only looked up may be.


@dataclasses.dataclass(frozen=True, eq=False)
class _ColumnTake:
  """A row lookup (`w[ids]`) on a table sharded by its columns ([Note: a table looked up by
  columns]); the moved rows in the dtype every use of them casts them to (exact: a cast)."""

  eqn: jcore.JaxprEqn  # the `gather`
  unit: UnitIO
  leaf: int
  size: int  # the table's rows
  width: int  # its columns (dim 1), unpadded
  cast: Any  # the dtype the loss casts the table to before the lookup, or None
  moved: Any = None  # the dtype every use of the rows read casts them to, or None

  def side_by_side(self, exchanged, k: int):
    """Every device's columns of this device's rows (stacked along dim 0 in device order)
    laid along the columns' dim `k`, the padding cut."""
    dp = jax.lax.axis_size(DATA)
    split = exchanged.reshape((dp, -1, *exchanged.shape[1:]))
    moved = jnp.moveaxis(split, 0, k)  # (device, column) at k
    joined = moved.reshape(moved.shape[:k] + (-1,) + moved.shape[k + 2 :])
    return jax.lax.slice_in_dim(joined, 0, self.width, axis=k)

  def by_device(self, d_out, k: int, c: int):
    """`side_by_side`'s inverse: this device's rows' cotangent, its columns padded to `c`
    per device and cut into every device's, stacked along dim 0 in device order."""
    dp = jax.lax.axis_size(DATA)
    padded = pad_dim(d_out, d_out.shape, k, dp * c)
    split = padded.reshape(padded.shape[:k] + (dp, -1) + padded.shape[k + 1 :])
    moved = jnp.moveaxis(split, k, 0)
    return moved.reshape((-1, *moved.shape[2:]))

  def every_row(self, ids):
    """The rows every device's `ids` read, and where they read none (`_lookup_ids`)."""
    return _lookup_ids(self.eqn, self.size, collectives.gather_batch(ids, 0))

  def take(self, ids, block):
    row_ids, _ = self.every_row(ids)
    rows = block.astype(self.cast) if self.cast is not None else block
    got = jnp.take(rows, row_ids, axis=0)  # every device's ids, this device's columns
    moved = collectives.exchange_batch(got.astype(self.moved or got.dtype), 0)
    out = self.side_by_side(moved, row_ids.ndim).astype(got.dtype)
    return _filled(self.eqn, self.size, ids, out)

  def fwd(self, ids, block):
    return self.take(ids, block), (ids, block)

  def bwd(self, res, d_out):
    ids, block = res
    row_ids, outside = self.every_row(ids)
    # The cotangent of rows cast by every use is the cast's (the loss's dtype), exactly.
    d_out = d_out.astype(self.moved or d_out.dtype)
    every = collectives.exchange_batch(self.by_device(d_out, row_ids.ndim, block.shape[1]), 0)
    if outside is not None:  # an out-of-range id's row reads nothing, gets nothing
      every = jnp.where(_expand(outside, every.ndim), jnp.zeros((), every.dtype), every)
    grad = jnp.zeros_like(block).at[row_ids].add(every.astype(block.dtype))
    return None, _table_grad(self.unit, self.leaf, grad, block)


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
