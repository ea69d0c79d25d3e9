"""The accessors of JAX's primitive params (`jaxdp/_src/jaxprs.py`) on the installed JAX,
and on the other releases' schemas fed by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore
from jax.extend.core import primitives as prims

from jaxdp._src import jaxprs


def _eqn(jaxpr, primitive):
  (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive is primitive]
  return eqn


def _scan_program():
  """A scan with 2 consts (a closed-over array and a float), 2 carries and 3 xs."""
  w, scale = jnp.arange(3.0), jnp.float32(0.5)

  def body(carry, xs):
    h, n = carry
    a, b, c = xs
    h = jnp.tanh(h * w + a * scale) + b
    return (h, n + 1), h * c

  def f(h, a, b, c):
    return jax.lax.scan(body, (h, 0), (a, b, c), reverse=True)

  args = (jnp.zeros(3), jnp.ones((4, 3)), jnp.ones((4, 3)), jnp.ones((4, 3)))
  return jax.make_jaxpr(f)(*args)


def test_scan_params_on_the_installed_jax():
  eqn = _eqn(_scan_program(), prims.scan_p)
  p = jaxprs.scan_params(eqn)
  assert (p.consts, p.carry, p.xs, p.length, p.reverse) == (2, 2, 3, 4, True)
  assert p.xs_start == 4
  body = jaxprs.open_jaxpr(p.body)
  assert len(body.invars) == len(eqn.invars) == 7
  assert jaxprs.inner_jaxpr(eqn) is body


class _FlatTree:
  """Stands in for jax >= 0.11's `flattree.FlatTree` of a scan's operands: `unpack` gives
  its parts, each sized by `len` (the number of leaves)."""

  def __init__(self, *parts):
    self.parts = parts

  def unpack(self):
    return tuple(_Leaves(n) for n in self.parts)


class _Leaves:
  def __init__(self, n):
    self.n = n

  def __len__(self):
    return self.n


def test_scan_params_of_both_schemas_agree():
  """jax <= 0.10's `num_consts`/`num_carry` and jax >= 0.11's `ft_in` flat tree of
  (consts, carry, xs) read as the same `ScanParams`."""
  body, common = object(), {"length": 4, "reverse": False}
  old = jaxprs.scan_params_of({"num_consts": 2, "num_carry": 1, "jaxpr": body, **common}, 6)
  new = jaxprs.scan_params_of(
    {"ft_in": _FlatTree(2, 1, 3), "ft_out": _FlatTree(1, 2), "jaxpr": body, **common}, 6
  )
  assert old == new == jaxprs.ScanParams(2, 1, 3, body, 4, False)


def test_a_scan_schema_that_does_not_add_up_is_refused():
  params = {"num_consts": 2, "num_carry": 3, "jaxpr": None, "length": 1, "reverse": False}
  with pytest.raises(NotImplementedError, match="2 consts, 3 carries and -1 xs"):
    jaxprs.scan_params_of(params, 4)


def test_a_closed_call_and_a_jit_hand_over_their_programs():
  """A closed call holds its program in `call_jaxpr` (read as `jaxpr` before, so never
  seen); `jit` in `jaxpr`. Both run on their operands one to one."""
  inner = jax.make_jaxpr(lambda x, y: (jnp.sin(x) * y,))(1.0, 2.0)
  # as a partial evaluation emits it: an equation over the program's own operands
  eqn = jcore.new_jaxpr_eqn(
    list(inner.jaxpr.invars),
    list(inner.jaxpr.outvars),
    prims.closed_call_p,
    {"call_jaxpr": inner},
    jcore.no_effects,
  )
  assert jaxprs.called_jaxpr(eqn) is inner
  assert jaxprs.inner_jaxpr(eqn) is jaxprs.open_jaxpr(inner)
  jitted = jax.make_jaxpr(lambda x: jax.jit(jnp.cos)(x) + 1)(1.0)
  eqn = _eqn(jitted, prims.jit_p)
  assert len(jaxprs.open_jaxpr(jaxprs.called_jaxpr(eqn)).invars) == 1
  assert jaxprs.remat_params(eqn) is None
  out = jaxprs.inline_jits(jitted.jaxpr, jitted.consts, [jnp.float32(0.3)])
  np.testing.assert_allclose(out[0], np.cos(0.3) + 1, rtol=1e-6)


def test_a_remat_hands_over_its_program_and_policy():
  policy = jax.checkpoint_policies.nothing_saveable
  traced = jax.make_jaxpr(jax.checkpoint(lambda x: jnp.sin(x) * 2, policy=policy))(1.0)
  eqn = _eqn(traced, prims.remat_p)
  remat = jaxprs.remat_params(eqn)
  assert remat.policy is policy and remat.prevent_cse is True
  assert isinstance(remat.jaxpr, jcore.Jaxpr) and len(remat.jaxpr.invars) == 1
  assert jaxprs.inner_jaxpr(eqn) is jaxprs.open_jaxpr(remat.jaxpr)
  assert jaxprs.called_jaxpr(eqn) is None


def test_a_custom_vjp_is_not_read_as_a_call():
  """A `custom_vjp`'s equation is no call whose program runs on its operands one to one:
  the accessors leave it alone (FSDP binds it as it is)."""

  @jax.custom_vjp
  def f(x):
    return jnp.sin(x)

  f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))
  traced = jax.make_jaxpr(f)(1.0)
  (eqn,) = traced.jaxpr.eqns
  assert eqn.primitive not in (prims.jit_p, prims.closed_call_p, prims.remat_p, prims.scan_p)
  assert jaxprs.inner_jaxpr(eqn) is None and jaxprs.called_jaxpr(eqn) is None
  assert jaxprs.remat_params(eqn) is None


def test_the_launchers_private_reads_on_the_installed_jax():
  """The two private names jaxdp.distributed reads, here rather than at their use."""
  jax.devices()  # started by now
  assert jaxprs.backends_started()
  names = [env.__name__ for env in jaxprs.cluster_types()]
  assert "SlurmCluster" in names and "OmpiCluster" in names
