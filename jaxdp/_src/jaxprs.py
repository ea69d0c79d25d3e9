"""JAX's internals, read in one place: the params of its call and control-flow primitives,
running a jaxpr's equations one by one (what FSDP's program cutter and the offloaded
update's streamer share), and the two private names the launcher reads (whether the
backends have started; the cluster environments `jax.distributed.initialize` detects).

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
from typing import Any

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


def backends_started() -> bool:
  """Have JAX's backends started? (`jax.distributed.initialize` and
  `jax_num_cpu_devices` must both come before.)"""
  return xla_bridge.backends_are_initialized()


def cluster_types() -> list | None:
  """The cluster environments `jax.distributed.initialize()` tries, in its order; None
  where this JAX keeps them elsewhere."""
  types = getattr(getattr(_clusters, "ClusterEnv", None), "_cluster_types", None)
  return None if types is None else list(types)
