"""Running a jaxpr's equations one by one: what FSDP's program cutter and the offloaded
update's streamer share."""

from __future__ import annotations

from jax.extend import core as jcore
from jax.extend.core import primitives as prims


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
      inner = eqn.params["jaxpr"]
      outs = inline_jits(inner.jaxpr, inner.consts, invals)
    else:
      outs = bind(eqn, invals)
    env.update(zip(eqn.outvars, outs))
  return [read(env, v) for v in jaxpr.outvars]
