"""JAX's internals, read in one place: the params of its call and control-flow primitives,
running a jaxpr's equations one by one (what FSDP's program cutter and the offloaded
update's streamer share; FSDP's program runs some equations by its own rules, and some
values in the dtype their uses cast them to: `eval_eqns`), what one trace of a function
tells (the dtypes a value's uses cast it to, the residuals of its vjp and what they depend
on, which inputs its outputs read, its outputs' types and the mesh axes a type varies
over), and the two private names the launcher reads (whether the backends have started;
the cluster environments `jax.distributed.initialize` detects).

A primitive's params are JAX's internals and change between releases; every read of a
call's or a scan's params goes through the accessors here, each written for the schemas
of the releases jaxdp supports:

- `lax.scan`: jax <= 0.10 counts its operands with `num_consts` and `num_carry`; from 0.11
  `ft_in` is a flat tree of `(consts, carry, xs)` and `ft_out` of `(carry, ys)`
  (jax/_src/lax/control_flow/loops.py). The body (`jaxpr`), `length` and `reverse` kept
  their names.
- a closed call (`closed_call_p`, an alias of `eval_jaxpr_p` from 0.11) holds its program
  in `call_jaxpr`; `jit` in `jaxpr`; `jax.checkpoint` (`remat_p`) an open `jaxpr` with
  `policy` and `prevent_cse`.
- `ClosedJaxpr` is `Jaxpr` from 0.11 (`.jaxpr` returns itself, `.consts` its consts):
  `open_jaxpr` and `consts_of` read either.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import xla_bridge
from jax.extend import core as jcore
from jax.extend.core import primitives as prims

try:  # private, and moved before: read only through `cluster_types`
  from jax._src import clusters as _clusters
except ImportError:
  _clusters = None


@dataclasses.dataclass(frozen=True)
class ScanParams:
  """What jaxdp reads of a `lax.scan` equation, in either schema (module docstring)."""

  consts: int
  """How many of its operands are consts (first), ..."""
  carry: int
  """... carries (next) ..."""
  xs: int
  """... and scanned-over arrays (last)."""
  body: Any
  """The body: a closed jaxpr of (consts, carry, x) -> (carry, y)."""
  length: int
  reverse: bool

  @property
  def xs_start(self) -> int:
    """The position of the first `xs` operand."""
    return self.consts + self.carry


def scan_params(eqn) -> ScanParams:
  """The `ScanParams` of a `lax.scan` equation.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> w = jnp.ones(3)
    >>> step = lambda c, x: (c + x * w, c)  # w: a const
    >>> f = lambda c, xs: jax.lax.scan(step, c, xs)
    >>> jaxpr = jax.make_jaxpr(f)(jnp.zeros(3), jnp.ones((4, 3)))
    >>> p = scan_params(jaxpr.eqns[0])
    >>> p.consts, p.carry, p.xs, p.length, p.reverse, p.xs_start
    (1, 1, 1, 4, False, 2)
  """
  return scan_params_of(eqn.params, len(eqn.invars))


def scan_params_of(params: dict, n_operands: int) -> ScanParams:
  """`scan_params` from a scan's params and its number of operands."""
  if "num_consts" in params:  # jax <= 0.10
    consts, carry = params["num_consts"], params["num_carry"]
    xs = n_operands - consts - carry
  else:  # jax >= 0.11: a flat tree of (consts, carry, xs)
    consts, carry, xs = (len(part) for part in params["ft_in"].unpack())
  if min(consts, carry, xs) < 0 or consts + carry + xs != n_operands:
    raise NotImplementedError(
      f"a lax.scan with {n_operands} operands whose params say {consts} consts, {carry} "
      f"carries and {xs} xs: a schema of scan's params jaxdp does not know"
    )
  return ScanParams(consts, carry, xs, params["jaxpr"], params["length"], params["reverse"])


def called_jaxpr(eqn):
  """The closed jaxpr a `jit` or closed-call equation runs on its operands, else None."""
  if eqn.primitive is prims.jit_p:
    return eqn.params["jaxpr"]
  if eqn.primitive is prims.closed_call_p:
    return eqn.params["call_jaxpr"]
  return None


@dataclasses.dataclass(frozen=True)
class RematParams:
  """What jaxdp reads of a `jax.checkpoint` equation."""

  jaxpr: Any
  """Its program, open (no consts)."""
  policy: Any
  prevent_cse: bool


def remat_params(eqn) -> RematParams | None:
  """The `RematParams` of a `jax.checkpoint` equation, else None."""
  if eqn.primitive is not prims.remat_p:
    return None
  params = eqn.params
  return RematParams(params["jaxpr"], params["policy"], params["prevent_cse"])


def inner_jaxpr(eqn):
  """The open jaxpr a call-like `eqn` runs on its operands one to one (`jit`, a closed
  call, `jax.checkpoint`, `lax.scan`: consts, carry and xs in order), else None."""
  if eqn.primitive is prims.scan_p:
    inner = scan_params(eqn).body
  elif eqn.primitive is prims.remat_p:
    inner = remat_params(eqn).jaxpr
  else:
    inner = called_jaxpr(eqn)
  if inner is None:
    return None
  inner = open_jaxpr(inner)
  return inner if len(inner.invars) == len(eqn.invars) else None


def open_jaxpr(jaxpr):
  """The open jaxpr of a closed one (itself if open)."""
  return getattr(jaxpr, "jaxpr", jaxpr)


def consts_of(jaxpr) -> list:
  """A closed jaxpr's consts (none for an open one)."""
  return list(getattr(jaxpr, "consts", ()))


def read(env: dict, v):
  """The value of `v` (a var of `env`, or a literal)."""
  return v.val if isinstance(v, jcore.Literal) else env[v]


def bind(eqn, invals, **changed) -> list:
  """`eqn`'s primitive on `invals`, with its params (`changed` ones replaced) and in its
  context: the list of its outputs."""
  params = {**eqn.primitive.get_bind_params(eqn.params), **changed}
  with eqn.ctx.manager:
    out = eqn.primitive.bind(*invals, **params)
  return out if eqn.primitive.multiple_results else [out]


def inline_jits(jaxpr, consts, args) -> list:
  """Evaluates `jaxpr`, inlining `jit` calls (so a jitted block, or a scan inside one, is
  seen equation by equation)."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    invals = [read(env, v) for v in eqn.invars]
    if eqn.primitive is prims.jit_p:
      inner = called_jaxpr(eqn)
      outs = inline_jits(open_jaxpr(inner), consts_of(inner), invals)
    else:
      outs = bind(eqn, invals)
    env.update(zip(eqn.outvars, outs))
  return [read(env, v) for v in jaxpr.outvars]


def as_param(x, aval):
  """A gathered param as the program reads it: in its own dtype where the unit gathered it
  cast (see [Note: gathered in the dtype the loss casts to]); the identity otherwise."""
  return x.astype(aval.dtype) if x.dtype != aval.dtype else x


def eval_eqns(eqns, env, rules=None, narrowed=frozenset()):
  """Runs `eqns` on `env`; `rules` maps `id(eqn)` to a function `rule(invals, env)` run
  instead of binding it. `narrowed`: vars whose value in `env` is in the dtype every use
  casts them to, not their own (see [Note: gathered in the dtype the loss casts to])."""
  for eqn in eqns:
    invals = [read(env, v) for v in eqn.invars]
    rule = rules.get(id(eqn)) if rules else None
    flags = [isinstance(v, jcore.Var) and v in narrowed for v in eqn.invars]
    if rule:
      outs = rule(invals, env)
    elif any(flags):
      outs = _bind_narrowed(eqn, invals, flags)
    else:
      outs = bind(eqn, invals)
    for var, value in zip(eqn.outvars, outs):
      env[var] = value


def eval_jaxpr(jaxpr, consts, args, narrowed: Sequence[bool]) -> list:
  """`jaxpr` on `args`, those flagged in `narrowed` given in the dtype every use casts them
  to (`eval_eqns`)."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  narrow = {v for v, n in zip(jaxpr.invars, narrowed) if n}
  eval_eqns(jaxpr.eqns, env, narrowed=narrow)
  return [as_param(read(env, v), v.aval) if v in narrow else read(env, v) for v in jaxpr.outvars]


def _bind_narrowed(eqn, invals, flags) -> list:
  """`eqn` on `invals`, those flagged given in the dtype the eqn casts them to (see [Note:
  gathered in the dtype the loss casts to]): the cast is the value itself; a call or a
  `jax.checkpoint` runs its jaxpr the same way (the checkpoint traced anew, with its policy,
  on the narrower values); any other eqn gets them cast back, exactly."""
  if eqn.primitive is prims.convert_element_type_p:
    (x,) = invals
    return [x] if x.dtype == eqn.params["new_dtype"] else bind(eqn, invals)
  if (inner := called_jaxpr(eqn)) is not None:
    return eval_jaxpr(open_jaxpr(inner), consts_of(inner), invals, flags)
  if (remat := remat_params(eqn)) is not None:
    run = lambda *a: eval_jaxpr(remat.jaxpr, (), a, flags)
    checkpointed = jax.checkpoint(run, prevent_cse=remat.prevent_cse, policy=remat.policy)
    return list(checkpointed(*invals))
  widened = [as_param(x, v.aval) if f else x for x, v, f in zip(invals, eqn.invars, flags)]
  return bind(eqn, widened)


def use_casts(jaxpr: jcore.Jaxpr, var) -> set | None:
  """The dtypes every use of `var` in `jaxpr` casts it to, or None where one use is not a
  float cast (or it is an output)."""
  if any(v is var for v in jaxpr.outvars):
    return None
  dtypes: set = set()
  for eqn in jaxpr.eqns:
    for pos, v in enumerate(eqn.invars):
      if v is not var:
        continue
      if eqn.primitive is prims.convert_element_type_p:
        dtype = eqn.params["new_dtype"]
        if not jnp.issubdtype(dtype, jnp.floating):
          return None
        dtypes.add(np.dtype(dtype))
        continue
      inner = inner_jaxpr(eqn)
      found = None if inner is None else use_casts(inner, inner.invars[pos])
      if found is None:
        return None
      dtypes |= found
  return dtypes


def is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


def residual_masks(fn, args, *taints: Sequence[bool]) -> list[list[bool]]:
  """For each of `taints` (a flag per arg): which leaves of `jax.vjp(fn, *args)`'s residuals
  depend on the tainted args, from one trace of the vjp.

  A residual computed from untainted args alone (params, consts) is one a unit's backward
  recomputes instead of saving.
  """
  closed = jax.make_jaxpr(lambda *a: jax.tree.leaves(jax.vjp(fn, *a)[1]))(*args)
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


def swap(vjp, saved, keep):
  """`vjp` with the residual leaves marked in `keep` replaced by `saved` ([Note: saved and
  replayed residuals]): the vjp function is a pytree whose leaves are its residuals."""
  leaves, tree = jax.tree.flatten(vjp)
  if len(leaves) != len(keep) or sum(keep) != len(saved):
    raise AssertionError(
      f"jaxdp FSDP: a unit's backward traced {len(leaves)} residuals, its "
      f"forward {len(keep)}; please report this with the model"
    )
  saved_leaves = iter(saved)
  return jax.tree.unflatten(tree, [next(saved_leaves) if s else x for x, s in zip(leaves, keep)])


def traced_avals(fn, *args):
  """The types (varying axes included) of `fn(*args)`'s outputs, from one trace ([Note:
  stand-ins])."""
  closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  return jax.tree.unflatten(jax.tree.structure(shape), closed.out_avals)


def reads(fn, args) -> Any:
  """Which leaves of `args` (a tree, traced on: stand-ins where only the types matter) the
  outputs of `fn(args)` depend on, from one trace: a tree of bools. An equation that computes
  a live output, or has effects, reads all of its inputs (a conservative answer for calls and
  loops)."""
  jaxpr = jax.make_jaxpr(fn)(args).jaxpr
  live = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
  for eqn in reversed(jaxpr.eqns):
    if eqn.effects or any(v in live for v in eqn.outvars):
      live.update(v for v in eqn.invars if isinstance(v, jcore.Var))
  return jax.tree.unflatten(jax.tree.structure(args), [v in live for v in jaxpr.invars])


def avals(tree):
  return jax.tree.map(jax.typeof, tree)


def varying(aval) -> frozenset:
  """The mesh axes a value of type `aval` varies over (inside `shard_map`)."""
  return frozenset(getattr(getattr(aval, "mat", None), "varying", ()) or ())


def backends_started() -> bool:
  """Have JAX's backends started? (`jax.distributed.initialize` and
  `jax_num_cpu_devices` must both come before.)"""
  return xla_bridge.backends_are_initialized()


def cluster_types() -> list | None:
  """The cluster environments `jax.distributed.initialize()` tries, in its order; None
  where this JAX keeps them elsewhere."""
  types = getattr(getattr(_clusters, "ClusterEnv", None), "_cluster_types", None)
  return None if types is None else list(types)
