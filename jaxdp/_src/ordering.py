"""The orders FSDP's program needs, written as data dependencies that XLA keeps ([Note:
orderings are data dependencies]): `together` passes two values through one barrier;
`after`, `after_alike` and `tie` add a zero that exists only once something else does;
`landed` makes such a zero once gathered params have landed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdp._src.fsdp_unit import stand_in
from jaxdp._src.jaxprs import is_float, varying


# [Note: orderings are data dependencies]
# XLA's scheduler may move any computation as far as its data dependencies allow, so every
# order FSDP's program needs (a gather not before some point, a reduce-scatter done before
# another starts) is written as one:
# * `together(a, b)` passes `a` and `b` through one `optimization_barrier`: nothing
#   computed from either result starts before both exist. The caller uses both results:
#   XLA drops a barrier's operands whose results are unused, and the order with them. It is
#   the identity on cotangents (`_barrier_vjp`): JAX's transpose of a barrier would put
#   them through one too, with zeros materialized for unused results.
# * `after(x, token)` and `tie(x, zero)` add a zero: `x` (or the gather that reads it)
#   waits for the zero, an add XLA keeps, since the zero comes out of a barrier, where XLA
#   cannot see that it is zero.
# The zeros are tokens ([Note: token list]), or made through a barrier: `together(
# stand_in(type), x)` gives a zero that exists once `x` does. The GPU scheduler keeps
# these orders (barriers are expanded only after scheduling). Megatron orders its
# collectives by when it launches them and waits on their handles
# (`param_and_grad_buffer.py`'s `start_grad_sync` / `finish_grad_sync`); a JAX program
# has only its data flow.


def together(a, b):
  """`(a, b)` through one `optimization_barrier`: XLA computes nothing from either result
  before both of `a` and `b` exist. The caller must use both results (XLA drops the operands
  of a barrier whose results are unused, and with them the ordering). Integer leaves pass
  outside the barrier, and so do leaves that vary over fewer mesh axes than the others (the
  barrier's results vary over every axis any operand varies over: a replicated model state
  would come out varying).

  Differentiated, it is the identity on the cotangents (JAX's own rule for the barrier would
  put them through one too, with zeros materialized for unused results)."""
  leaves_a, tree_a = jax.tree.flatten(a)
  leaves_b, tree_b = jax.tree.flatten(b)
  vma = lambda x: varying(jax.typeof(x))
  every = frozenset().union(*[vma(x) for x in leaves_a + leaves_b if is_float(x)])
  # the leaves that go through the barrier: float, varying over every axis
  picked_a = [n for n, x in enumerate(leaves_a) if is_float(x) and vma(x) == every]
  picked_b = [n for n, x in enumerate(leaves_b) if is_float(x) and vma(x) == every]
  if not picked_a or not picked_b:
    return a, b
  out_a, out_b = _barrier_vjp([leaves_a[n] for n in picked_a], [leaves_b[n] for n in picked_b])
  for n, x in zip(picked_a, out_a):
    leaves_a[n] = x
  for n, x in zip(picked_b, out_b):
    leaves_b[n] = x
  return jax.tree.unflatten(tree_a, leaves_a), jax.tree.unflatten(tree_b, leaves_b)


@jax.custom_vjp
def _barrier_vjp(a, b):
  return jax.lax.optimization_barrier((a, b))


def _barrier_fwd(a, b):
  return _barrier_vjp(a, b), None


def _barrier_bwd(_, ct):
  return ct


_barrier_vjp.defvjp(_barrier_fwd, _barrier_bwd)


def landed(tree):
  """`(zero, tree)`: a zero that exists once `tree` (gathered params) has landed, and `tree`
  through the barrier that orders it so. Added to shards (`after`), it orders their gather
  after `tree`, where a barrier on the shards themselves would materialize them as they
  enter it (a layer's slice of the stacked shards, in float32 where it is gathered cast:
  a copy the gather's own input fusion does not need)."""
  leaf = jax.typeof(jax.tree.leaves(tree)[0])  # a zero varying as the gathered params
  return together(stand_in(leaf.update(shape=(), dtype=jnp.float32)), tree)


def after(shards: dict, token) -> dict:
  """`shards` plus the (zero) `token`: a data dependency XLA keeps, so the gather of these
  shards cannot start before `token` exists ([Note: orderings are data dependencies])."""
  return jax.tree.map(lambda x: x + token.astype(x.dtype) if is_float(x) else x, shards)


def after_alike(tree, token):
  """`after` on the float leaves of `tree` that vary over every mesh axis `token` does; the
  others as they are. In a loop's carry a leaf must keep its type: the token (varying like
  the gathered params, over "replica" too under HSDP) added to a grad already reduced
  across "replica" would make it vary over "replica" again. Such a leaf is finished
  already, and has nothing left to order."""
  needs = varying(jax.typeof(token))
  alike = lambda x: is_float(x) and needs <= varying(jax.typeof(x))
  return jax.tree.map(lambda x: x + token.astype(x.dtype) if alike(x) else x, tree)


def tie(value, zero):
  """`value + zero`: `value` computed once `zero` exists (an input that varies over fewer
  axes than the zero is left as it is): [Note: orderings are data dependencies]."""
  varies_as_much = varying(jax.typeof(value)) >= varying(jax.typeof(zero))
  return value + zero.astype(value.dtype) if varies_as_much else value
