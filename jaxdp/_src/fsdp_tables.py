"""The uses of a param read by rows, rewritten: `eval_eqns` rules (`{id(eqn): rule}`) that
a segment runs in place of the equations that use a chunked param or a table.

Which leaves, and which of their uses: `chunk_rules` (the leaves `FSDPConfig(chunks=)`
names), `lookup_leaves` (those `FSDPConfig(lookups=)` names), `table_leaves` (a vocabulary
table read by rows, where moving the activations costs fewer bytes than gathering it:
`FSDPConfig(vocab_parallel=)`) and `table_rules`. Each follows a leaf through its casts and
transposes to its uses (`_row_uses`).

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
* A table computed by rows ([Note: a table computed by rows] in `collectives`, [Note: a
  table's uses on this device's rows]): its unit never gathers it; a matmul on it
  (`_TableDot`) and a row lookup (`_TableTake`) run on this device's rows and move the
  activations instead.
* A table looked up by columns ([Note: a table looked up by columns]): each lookup reads
  this device's columns of every device's rows (`_ColumnTake`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.extend.core import primitives as prims

from jaxdp._src import collectives, ordering
from jaxdp._src.buffer import pad_dim
from jaxdp._src.fsdp_unit import Lazy, Program, UnitIO, Units, ct_or_none
from jaxdp._src.jaxprs import bind, is_float, use_casts
from jaxdp._src.mesh import DATA


# ----------------------------------------------------------------------------- uses read by rows


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


def chunk_rules(program: Program, lazy: Lazy, units: Units, treedef) -> dict:
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


def table_leaves(program: Program, lazy: Lazy, units: Units, casts: Mapping) -> frozenset:
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


def lookup_leaves(program: Program, lazy: Lazy, units: Units, treedef) -> frozenset:
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


def table_rules(program: Program, lazy: Lazy, units: Units) -> dict:
  """`{id(eqn): rule}` for `eval_eqns`: each use of a table (`UnitIO.tables`) as `_TableDot`
  or `_TableTake`."""
  tables = {i for i in program.param_var.values() if i in units.of_leaf[i].tables}
  found = _row_uses(program, lazy, tables)
  return {
    id(use.eqn): _TableRule(use, units.of_leaf[i], i, program.jaxpr.invars[i].aval.shape[0])
    for i, leaf_uses in found.by_leaf.items()
    for use in leaf_uses
  }


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
# The program's side of [Note: a table computed by rows] (in `collectives`). `table_leaves`
# picks the leaves: every use a row lookup or a matmul that keeps the leaf's rows in its
# product, and fewer bytes to move that way than to gather the leaf. `table_rules` makes
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
