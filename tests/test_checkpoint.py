"""Checkpoints: any dp and strategy to any other, atomic async saves, kill-and-resume.

Equalities here are bitwise unless stated: restoring only moves and pads values. Training
continued on another dp reduces in another order, so it matches the uninterrupted run to
float32 rounding as Adam passes it on (tests/tolerances.py), and bitwise on the same mesh
and strategy.
"""

import os
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from orbax.checkpoint._src.path import atomicity

import jaxdp
from jaxdp._src.distributed_optimizer import per_leaf_state
from tests.tolerances import AdamBound, rtol_sum

HERE = os.path.dirname(os.path.abspath(__file__))
TX = optax.adamw(1e-2, weight_decay=0.1)


def _mesh(n, auto=False):
  """The first n devices; `auto`: a `jax.sharding.Mesh` (Auto axes) instead of
  `jax.make_mesh`'s Explicit axes."""
  if auto:
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("data",))
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _config(strategy):
  return jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)


def _params():
  """Odd leading dims (padded at every dp), a bf16 leaf (its own master), an int leaf."""
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "w1": jax.random.normal(k1, (5, 7)) * 0.5,
    "b1": jnp.zeros((7,)),
    "w2": (jax.random.normal(k2, (7, 3)) * 0.5).astype(jnp.bfloat16),
    "count": jnp.array(3, jnp.int32),
  }


def _loss(p, batch):
  h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"])
  return jnp.mean((h @ p["w2"].astype(jnp.float32) - batch["y"]) ** 2)


def _batch(i):
  rng = np.random.default_rng(i)
  return {
    "x": jnp.asarray(rng.normal(size=(16, 5)), jnp.float32),
    "y": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32),
  }


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _adam_bound(steps, exact):
  """The AdamBound (tests/tolerances.py) of w1 and b1 after `steps` steps of TX on
  `_batch(i)`, the first `exact` of them taken bit for bit alike by both runs: a
  single-device run with an fp32 master for w2 (a mean of 16 x 3 squared errors)."""
  p = _params()
  master = {k: p[k].astype(jnp.float32) for k in ("w1", "b1", "w2")}
  bound = AdamBound(1e-2, 16 * 3, {k: master[k] for k in ("w1", "b1")})
  opt_state = TX.init(master)
  for i in range(steps):
    grads = jax.grad(lambda m: _loss({**m, "w2": m["w2"].astype(jnp.bfloat16)}, _batch(i)))(master)
    bound.add({k: grads[k] for k in ("w1", "b1")}, exact=i < exact)
    updates, opt_state = TX.update(grads, opt_state, master)
    master = optax.apply_updates(master, updates)
  return bound


def _assert_same_rows(a, b, what):
  """Bitwise equal on the elements both hold; those only the padded one holds (its shard
  dim rounded up to a multiple of dp) are zero there."""
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape:
    a, b = (x.reshape(1) if x.ndim == 0 else x for x in (a, b))  # a scalar's padded form
    common = tuple(slice(0, min(m, n)) for m, n in zip(a.shape, b.shape))
    longer = a if a.size > b.size else b
    padding = np.ones(longer.shape, bool)
    padding[common] = False
    np.testing.assert_array_equal(longer[padding], 0, err_msg=f"{what}: padding")
    a, b = a[common], b[common]
  np.testing.assert_array_equal(a, b, err_msg=what)


def _per_leaf(state):
  """The state as the per-leaf update keeps it: a fused state's flat buckets (`optim` with
  an elementwise optax transformation) back as padded leaves, the others as they are."""
  return jax.jit(per_leaf_state, static_argnums=1)(state, state.step.sharding.mesh)


def _master_or_param(state, key):
  m = _per_leaf(state).master[key]
  return m if m is not None else jaxdp.get_params(state)[key]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """dp=8 `optim`, 3 steps, saved at step 3; and the same run continued for 2 more steps."""
  mesh, config = _mesh(8), _config("optim")
  state = jaxdp.init_state(_params(), TX, mesh, config)
  step = jaxdp.make_train_step(_loss, TX, mesh, config)
  for i in range(3):
    state, _ = step(state, _batch(i))
  mgr = jaxdp.CheckpointManager(tmp_path_factory.mktemp("ckpt"), max_to_keep=2)
  assert mgr.save(3, state, data_position={"batch": 3})
  mgr.wait_until_finished()
  saved, saved_params = _host(_per_leaf(state)), _host(jaxdp.get_params(state))
  for i in range(3, 5):
    state, _ = step(state, _batch(i))
  return mgr, (saved, saved_params), _host(jaxdp.get_params(state))


# ----------------------------------------------------------------------------- any dp, any strategy


@pytest.mark.parametrize(
  "dp,strategy,auto",
  [(4, "optim_grads_params", False), (4, "optim_grads", True), (2, "no_shard", False)],
)
def test_restore_on_other_dp_and_strategy(source, dp, strategy, auto):
  mgr, (saved, saved_params), continued = source
  mesh, config = _mesh(dp, auto), _config(strategy)
  like = jaxdp.init_state(_params(), TX, mesh, config)
  state = mgr.restore(like)

  assert int(state.step) == 3 and mgr.data_position() == {"batch": 3}
  assert jax.tree.map(lambda x: x.sharding, state) == jax.tree.map(lambda x: x.sharding, like)
  params = _host(jaxdp.get_params(state))
  for key, want in _params().items():
    np.testing.assert_array_equal(params[key], saved_params[key])
    assert params[key].dtype == want.dtype
  for key in ("w1", "b1", "w2"):  # the optimizer's copy, fp32
    _assert_same_rows(saved.master[key], _master_or_param(state, key), f"master {key}")
  src, got = jax.tree.leaves(saved.opt_state), jax.tree.leaves(_host(_per_leaf(state).opt_state))
  assert len(src) == len(got)
  for j, (a, b) in enumerate(zip(src, got)):
    _assert_same_rows(a, b, f"opt_state leaf {j}")

  step = jaxdp.make_train_step(_loss, TX, mesh, config)
  for i in range(3, 5):
    state, _ = step(state, _batch(i))
  if not auto:  # on Auto meshes the step's outputs trim their specs: P("data") != P("data", None)
    assert step._cache_size() == 1, "the restored state recompiled the step"
  final = jaxdp.get_params(state)
  # Steps 1-3 are the same bits (restored); steps 4-5 reduce in another order.
  _adam_bound(5, exact=3).check(
    {k: final[k] for k in ("w1", "b1")}, {k: continued[k] for k in ("w1", "b1")}
  )
  # w2 is bf16, its fp32 master within the same kind of bound: where the two masters round
  # to neighbouring bf16 values the params differ by one bf16 ulp, at most 2^-7 relative.
  np.testing.assert_allclose(
    np.asarray(final["w2"], np.float32), np.asarray(continued["w2"], np.float32), rtol=1e-2
  )


def test_restore_on_same_mesh_continues_bitwise(source):
  mgr, _, continued = source
  mesh, config = _mesh(8), _config("optim")
  state = mgr.restore(jaxdp.init_state(_params(), TX, mesh, config), step=3)
  step = jaxdp.make_train_step(_loss, TX, mesh, config)
  for i in range(3, 5):
    state, _ = step(state, _batch(i))
  for key, want in continued.items():
    np.testing.assert_array_equal(np.asarray(jaxdp.get_params(state)[key]), want)


def test_no_shard_to_sharded(tmp_path):
  """An f32 param under no_shard has no master copy; the sharded target builds it."""
  state = jaxdp.init_state(_params(), TX, _mesh(2), _config("no_shard"))
  state, _ = jaxdp.make_train_step(_loss, TX, _mesh(2), _config("no_shard"))(state, _batch(0))
  assert state.master["w1"] is None and state.master["w2"] is not None
  saved = _host(state)
  mgr = jaxdp.CheckpointManager(tmp_path)
  mgr.save(1, state)
  mgr.wait_until_finished()
  got = _per_leaf(mgr.restore(jaxdp.init_state(_params(), TX, _mesh(8), _config("optim"))))
  _assert_same_rows(saved.params["w1"], got.master["w1"], "w1 master from params")
  _assert_same_rows(saved.master["w2"], got.master["w2"], "w2 master")
  for j, (a, b) in enumerate(
    zip(jax.tree.leaves(saved.opt_state), jax.tree.leaves(_host(got.opt_state)))
  ):
    _assert_same_rows(a, b, f"opt_state leaf {j}")


@pytest.mark.parametrize(
  "strategy,fused", [("optim", False), ("optim", None), ("optim_grads_params", None)]
)
def test_padding_rows_come_from_like(tmp_path, strategy, fused):
  """Adagrad's accumulator starts at 0.1; a padding row of 0 would give 0/sqrt(0) = NaN.
  A fused state (`fused_update`, ZeRO-1's or FSDP's) keeps the padding of its flat buckets
  from `like` too."""
  tx = optax.adagrad(0.1, initial_accumulator_value=0.1)
  params = {"w": jnp.ones((5, 2))}
  loss = lambda p, b: jnp.mean(b["x"] @ p["w"])
  batch = {"x": jnp.ones((8, 5))}
  state = jaxdp.init_state(params, tx, _mesh(2), _config("no_shard"))
  mgr = jaxdp.CheckpointManager(tmp_path)
  mgr.save(0, state)
  mgr.wait_until_finished()
  mesh = _mesh(8)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, fused_update=fused)
  got = mgr.restore(jaxdp.init_state(params, tx, mesh, config))
  assert got.fused == (fused is None)
  acc = np.asarray(jax.tree.leaves(got.opt_state)[0])
  assert acc.shape == ((128,) if got.fused else (8, 2)) and (acc == np.float32(0.1)).all()
  got, _ = jaxdp.make_train_step(loss, tx, mesh, config)(got, batch)
  assert all(np.isfinite(np.asarray(m)).all() for m in jax.tree.leaves(got.master))


@pytest.mark.parametrize(
  "dp,strategy,fused", [(8, "optim", False), (2, "optim_grads_params", False), (8, "optim", None)]
)
def test_fused_fsdp_restores_into_other_forms(tmp_path, dp, strategy, fused):
  """A fused FSDP state (one flat master per unit bucket) is saved in the canonical
  per-leaf form: per-leaf ZeRO-1, per-leaf FSDP on another dp and fused ZeRO-1 (whose
  buckets are not FSDP's units) restore it bit for bit, and train on."""
  mesh, config = _mesh(4), _config("optim_grads_params")
  state = jaxdp.init_state(_params(), TX, mesh, config)
  assert state.fused and len(state.master) == 3  # one unit per top-level param, int excluded
  step = jaxdp.make_train_step(_loss, TX, mesh, config)
  for i in range(2):
    state, _ = step(state, _batch(i))
  mgr = jaxdp.CheckpointManager(tmp_path)
  mgr.save(2, state)
  mgr.wait_until_finished()
  saved, saved_params = _host(_per_leaf(state)), _host(jaxdp.get_params(state))

  mesh = _mesh(dp)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, fused_update=fused)
  like = jaxdp.init_state(_params(), TX, mesh, config)
  got = mgr.restore(like)
  assert got.fused == (fused is None) and int(got.step) == 2
  assert jax.tree.map(lambda x: x.sharding, got) == jax.tree.map(lambda x: x.sharding, like)
  params = _host(jaxdp.get_params(got))
  for key in saved_params:
    np.testing.assert_array_equal(params[key], saved_params[key])
  for key in ("w1", "b1", "w2"):
    _assert_same_rows(saved.master[key], _master_or_param(got, key), f"master {key}")
  src, out = jax.tree.leaves(saved.opt_state), jax.tree.leaves(_host(_per_leaf(got).opt_state))
  assert len(src) == len(out)
  for j, (a, b) in enumerate(zip(src, out)):
    _assert_same_rows(a, b, f"opt_state leaf {j}")
  got, metrics = jaxdp.make_train_step(_loss, TX, mesh, config)(got, _batch(2))
  assert np.isfinite(float(metrics["loss"]))


def _branches(params):
  return jax.tree.map(lambda x: "matrix" if x.ndim > 1 else "vector", params)


MASKED_TX = optax.multi_transform(
  {"matrix": optax.adam(1e-2), "vector": optax.adamw(5e-3)}, _branches
)


@pytest.mark.parametrize("source", ["optim", "optim_grads_params"])
def test_a_fused_state_holding_masked_nodes_saves_and_restores(tmp_path, source):
  """`multi_transform` on vectors alone fuses, and its "matrix" branch's state is
  optax.masked's `MaskedNode` in every bucket: saving read the node's `.shape`, restoring
  counted its leaves and made the per-leaf form flat over it (AttributeError, a structure
  error). Saved fused, restored under every strategy, bit for bit; and trains on."""
  params = {"a": jnp.arange(16.0) / 10, "b": jnp.ones((3,)), "c": jnp.full((6,), 0.1)}

  def loss(p, batch):
    x = batch["x"][:, 0]
    return jnp.mean(jnp.tanh(x[:, None] * p["a"][:3] + p["b"])) + jnp.mean(x) * jnp.sum(p["c"])

  mesh, batch = _mesh(8), {"x": jnp.linspace(-1.0, 1.0, 32).reshape(16, 2)}
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=source)
  state = jaxdp.init_state(params, MASKED_TX, mesh, config)
  assert state.fused
  state, _ = jaxdp.make_train_step(loss, MASKED_TX, mesh, config)(state, batch)
  mgr = jaxdp.CheckpointManager(tmp_path)
  mgr.save(1, state)
  mgr.wait_until_finished()
  want = _host((jaxdp.get_params(state), jaxdp.get_opt_state(state)))
  for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
    other = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
    got = mgr.restore(jaxdp.init_state(params, MASKED_TX, mesh, other))
    jax.tree.map(
      np.testing.assert_array_equal,
      _host((jaxdp.get_params(got), jaxdp.get_opt_state(got))),
      want,
    )
    got, metrics = jaxdp.make_train_step(loss, MASKED_TX, mesh, other)(got, batch)
    assert np.isfinite(float(metrics["loss"]))
  mgr.close()


def test_stacked_fsdp_layers_to_optim_and_back(tmp_path):
  """A stacked FSDP leaf `(layers, n, ...)` is padded on axis 1, an `optim` one on axis 0."""
  from jaxdp._src.config import FSDPConfig

  k1, k2 = jax.random.split(jax.random.key(1))
  params = {
    "blocks": {"w": jax.random.normal(k1, (3, 5, 5)) * 0.3, "b": jnp.zeros((3, 5))},
    "head": jax.random.normal(k2, (5, 3)),
  }

  def loss(p, batch):
    def body(h, layer):
      return jnp.tanh(h @ layer["w"] + layer["b"]), None

    h, _ = jax.lax.scan(body, batch["x"], p["blocks"])
    return jnp.mean((h @ p["head"] - batch["y"]) ** 2)

  fsdp, config = FSDPConfig(stacked=("blocks",)), _config("optim_grads_params")
  state = jaxdp.init_state(params, TX, _mesh(8), config, fsdp=fsdp)
  step = jaxdp.make_train_step(loss, TX, _mesh(8), config, fsdp=fsdp)
  for i in range(2):
    state, _ = step(state, _batch(i))
  assert state.master["blocks"]["w"].shape == (3, 8, 5)
  mgr = jaxdp.CheckpointManager(tmp_path)
  mgr.save(2, state)
  mgr.wait_until_finished()
  saved, saved_params = _host(state), _host(jaxdp.get_params(state))
  _, want = step(state, _batch(2))

  for target, target_fsdp in [("optim", None), ("optim_grads_params", fsdp)]:
    like = jaxdp.init_state(params, TX, _mesh(4), _config(target), fsdp=target_fsdp)
    got = mgr.restore(like)
    for a, b in zip(jax.tree.leaves(saved_params), jax.tree.leaves(jaxdp.get_params(got))):
      np.testing.assert_array_equal(a, b)
    mu = np.asarray(_per_leaf(got).opt_state[0].mu["blocks"]["w"])
    rows = mu[:3] if target == "optim" else mu[:, :5]  # (4, 5, 5) or (3, 8, 5)
    np.testing.assert_array_equal(rows, saved.opt_state[0].mu["blocks"]["w"][:, :5])
    _, metrics = jaxdp.make_train_step(loss, TX, _mesh(4), _config(target), fsdp=target_fsdp)(
      got, _batch(2)
    )
    # The same params (restored bit for bit), the mean of 16 x 3 squared errors through 3
    # layers of 5 summed over 4 devices instead of 8: rtol_sum (tests/tolerances.py).
    np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=rtol_sum(16 * 3) + rtol_sum(15))


@pytest.mark.parametrize("fused", [None, False])
def test_stacked_optim_layers_to_other_forms_and_back(tmp_path, fused):
  """`DDPConfig(stacked=)` pads a stack's leaf `(layers, n, ...)` on a dim of a layer;
  unstacked `optim` pads another dim, stacked FSDP axis 1: a stacked `optim` checkpoint
  (fused flat buckets or per leaf) restores into each, and each restores into stacked
  `optim`, the params and moments bit for bit."""
  from jaxdp._src.config import FSDPConfig

  k1, k2 = jax.random.split(jax.random.key(1))
  params = {
    "blocks": {"w": jax.random.normal(k1, (3, 5, 5)) * 0.3, "b": jnp.zeros((3, 5))},
    "head": jax.random.normal(k2, (5, 3)),
  }

  def loss(p, batch):
    body = lambda h, layer: (jnp.tanh(h @ layer["w"] + layer["b"]), None)
    h, _ = jax.lax.scan(body, batch["x"], p["blocks"])
    return jnp.mean((h @ p["head"] - batch["y"]) ** 2)

  def config(strategy, stacked=()):
    return jaxdp.DDPConfig(
      data_parallel_sharding_strategy=strategy, stacked=stacked, fused_update=fused
    )

  stacked = config("optim", ["blocks"])
  state = jaxdp.init_state(params, TX, _mesh(8), stacked)
  step = jaxdp.make_train_step(loss, TX, _mesh(8), stacked)
  for i in range(2):
    state, _ = step(state, _batch(i))
  assert state.fused == (fused is None)
  assert _per_leaf(state).master["blocks"]["w"].shape == (3, 8, 5)  # a layer's dim padded
  mgr = jaxdp.CheckpointManager(tmp_path / "stacked")
  mgr.save(2, state)
  mgr.wait_until_finished()
  saved, saved_params = _host(_per_leaf(state)), _host(jaxdp.get_params(state))
  _, want = step(state, _batch(2))
  fsdp = FSDPConfig(stacked=["blocks"])
  targets = [
    (config("optim"), None),
    (config("optim", ["blocks"]), None),
    (config("optim_grads_params"), fsdp),
  ]
  for n, (target, target_fsdp) in enumerate(targets):
    like = jaxdp.init_state(params, TX, _mesh(4), target, fsdp=target_fsdp)
    got = mgr.restore(like)
    for a, b in zip(jax.tree.leaves(saved_params), jax.tree.leaves(jaxdp.get_params(got))):
      np.testing.assert_array_equal(a, b)
    mu = _per_leaf(got).opt_state[0].mu["blocks"]["w"]
    _assert_same_rows(mu, saved.opt_state[0].mu["blocks"]["w"], str(target))
    # And back: the restored state, saved, restores into stacked `optim` unchanged.
    back = jaxdp.CheckpointManager(tmp_path / f"back{n}")
    back.save(2, got)
    back.wait_until_finished()
    again = back.restore(jaxdp.init_state(params, TX, _mesh(8), stacked))
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(_host(_per_leaf(again)))):
      np.testing.assert_array_equal(a, b)
    _, metrics = jaxdp.make_train_step(loss, TX, _mesh(4), target, fsdp=target_fsdp)(got, _batch(2))
    # The same params (restored bit for bit), the mean of 16 x 3 squared errors through 3
    # layers of 5 summed over 4 devices instead of 8: rtol_sum (tests/tolerances.py).
    np.testing.assert_allclose(metrics["loss"], want["loss"], rtol=rtol_sum(16 * 3) + rtol_sum(15))


# ----------------------------------------------------------------------------- mismatches


@pytest.fixture(scope="module")
def small(tmp_path_factory):
  params = {"a": jnp.ones((3, 2)), "b": jnp.zeros((2,))}
  mgr = jaxdp.CheckpointManager(tmp_path_factory.mktemp("small"))
  mgr.save(1, jaxdp.init_state(params, optax.adam(1e-3), _mesh(8), _config("optim")))
  mgr.wait_until_finished()
  return mgr, params


def _restore_error(mgr, like):
  calls = []
  real = mgr._mgr.restore

  def spy(step, args=None):
    calls.append(sorted(args.keys()))
    return real(step, args=args)

  mgr._mgr.restore = spy
  try:
    with pytest.raises(ValueError) as err:
      mgr.restore(like)
  finally:
    mgr._mgr.restore = real
  assert calls == [["meta"]], "arrays were read before the check"
  return str(err.value)


def test_other_model_names_the_leaf(small):
  mgr, _ = small
  like = jaxdp.init_state(
    {"a": jnp.ones((3, 4)), "b": jnp.zeros((2,))}, optax.adam(1e-3), _mesh(4), _config("no_shard")
  )
  msg = _restore_error(mgr, like)
  assert "does not fit `like`: params['a']: shape (3, 2) in the checkpoint, (3, 4) in `like`" in msg


def test_other_leaf_names_the_leaf(small):
  mgr, _ = small
  like = jaxdp.init_state(
    {"a": jnp.ones((3, 2)), "c": jnp.zeros((2,))}, optax.adam(1e-3), _mesh(8), _config("optim")
  )
  # Paired by path: the leaf only one side has is named, on each side.
  assert (
    "only the checkpoint has params['b'] and only `like` has params['c'] (2 params leaves in "
    "the checkpoint, 2 in `like`)"
  ) in _restore_error(mgr, like)


def test_an_extra_leaf_is_named_not_paired_by_position(small):
  """`like` has one leaf fewer than the checkpoint: the missing one is named, and no leaf
  is compared with its neighbour's shape."""
  mgr, _ = small
  like = jaxdp.init_state({"a": jnp.ones((3, 2))}, optax.adam(1e-3), _mesh(8), _config("optim"))
  msg = _restore_error(mgr, like)
  assert "does not fit `like`: only the checkpoint has params['b'] (2 params leaves" in msg, msg
  assert "only `like` has" not in msg and "shape" not in msg, msg


def test_other_dtype_names_the_leaf(small):
  mgr, _ = small
  like = jaxdp.init_state(
    {"a": jnp.ones((3, 2), jnp.bfloat16), "b": jnp.zeros((2,))},
    optax.adam(1e-3),
    _mesh(8),
    _config("optim"),
  )
  assert "params['a']: dtype float32 in the checkpoint, bfloat16 in `like`" in _restore_error(
    mgr, like
  )


def test_other_optimizer_names_the_leaf(small):
  mgr, params = small
  like = jaxdp.init_state(params, optax.sgd(1e-3, momentum=0.9), _mesh(8), _config("optim"))
  msg = _restore_error(mgr, like)
  assert (
    "only the checkpoint has opt_state[0].count, opt_state[0].mu['a'], opt_state[0].mu['b'], "
    "opt_state[0].nu['a'] and 1 more and only `like` has opt_state[0].trace['a'], "
    "opt_state[0].trace['b']"
    in msg
    and "another optimizer" in msg
  ), msg


def test_optimizer_with_same_leaves_other_structure(small):
  mgr, params = small
  like = jaxdp.init_state(params, optax.adamw(1e-3), _mesh(8), _config("optim"))
  assert "optimizer state has the structure" in _restore_error(mgr, like)


def test_a_like_consumed_by_a_restore_is_refused(small):
  """A restore into `init_state`'s state donates its arrays to the result: restoring into
  the same `like` again (or saving it) is refused on the host, not a crash."""
  mgr, params = small
  like = jaxdp.init_state(params, optax.adam(1e-3), _mesh(8), _config("optim"))
  restored = mgr.restore(like)
  assert like.step.is_deleted()
  with pytest.raises(
    ValueError, match=r"CheckpointManager\.restore\(like\): this state was donated"
  ):
    mgr.restore(like)
  assert int(restored.step) == 0 and not restored.step.is_deleted()


def test_other_frozen_set(small):
  mgr, params = small
  like = jaxdp.init_state(
    params, optax.adam(1e-3), _mesh(8), _config("optim"), frozen={"a": False, "b": True}
  )
  assert "params['b']: trainable in the checkpoint, frozen in `like`" in _restore_error(mgr, like)


def test_nothing_to_restore(tmp_path):
  mgr = jaxdp.CheckpointManager(tmp_path)
  like = jaxdp.init_state({"a": jnp.ones(2)}, optax.sgd(0.1), _mesh(2), _config("no_shard"))
  with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
    mgr.restore(like)
  with pytest.raises(TypeError, match="expected the TrainState"):
    mgr.save(0, {"a": jnp.ones(2)})


# ----------------------------------------------------------------------------- async, atomic


@pytest.fixture
def tiny():
  mesh, config = _mesh(8), _config("optim")
  params = {"w": jnp.arange(10.0).reshape(5, 2)}
  loss = lambda p, b: jnp.mean(b["x"] @ p["w"])
  step = jaxdp.make_train_step(loss, optax.adam(0.1), mesh, config)
  return jaxdp.init_state(params, optax.adam(0.1), mesh, config), step, {"x": jnp.ones((8, 5))}


def test_save_is_async_and_uncommitted_steps_are_invisible(tmp_path, tiny, monkeypatch):
  state, _, _ = tiny
  held, release = threading.Event(), threading.Event()
  finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def hold(self):
    held.set()
    release.wait(60)
    return await finalize(self)

  mgr = jaxdp.CheckpointManager(tmp_path)
  mgr.save(1, state)
  mgr.wait_until_finished()
  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", hold)
  assert mgr.save(2, state)  # returns while the write is still in flight
  assert held.wait(60)
  assert "2.orbax-checkpoint-tmp" in os.listdir(tmp_path)
  assert mgr.all_steps() == [1] and mgr.latest_step() == 1
  release.set()
  mgr.wait_until_finished()
  assert mgr.all_steps() == [1, 2] and sorted(os.listdir(tmp_path)) == ["1", "2"]


def test_state_may_be_donated_right_after_save(tmp_path, tiny):
  state, step, batch = tiny
  before = _host(_per_leaf(state))
  mgr = jaxdp.CheckpointManager(tmp_path)
  mgr.save(0, state)
  step(state, batch)  # donates `state` while the write is in flight
  assert all(m.is_deleted() for m in jax.tree.leaves(state.master))
  mgr.wait_until_finished()
  got = mgr.restore(
    jaxdp.init_state({"w": jnp.zeros((5, 2))}, optax.adam(0.1), _mesh(8), _config("optim"))
  )
  np.testing.assert_array_equal(np.asarray(_per_leaf(got).master["w"]), before.master["w"])


def test_leftover_temporary_directory_is_ignored_and_removed(tmp_path, tiny):
  state, _, _ = tiny
  mgr = jaxdp.CheckpointManager(tmp_path)
  mgr.save(3, state)
  mgr.wait_until_finished()
  (tmp_path / "6.orbax-checkpoint-tmp" / "state").mkdir(parents=True)  # a killed save
  (tmp_path / "6.orbax-checkpoint-tmp" / "state" / "half").write_text("x")
  mgr = jaxdp.CheckpointManager(tmp_path)
  assert mgr.latest_step() == 3 and mgr.all_steps() == [3]
  mgr.save(4, state)  # orbax removes leftovers in the background, at the latest by now
  mgr.wait_until_finished()
  assert sorted(os.listdir(tmp_path)) == ["3", "4"]


def test_interval_and_max_to_keep(tmp_path, tiny):
  state, _, _ = tiny
  mgr = jaxdp.CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=2)
  saved = [mgr.save(s, state) for s in range(1, 8)]
  mgr.wait_until_finished()
  assert saved == [False, True, False, True, False, True, False]
  assert mgr.all_steps() == [4, 6]
  assert mgr.save(7, state, force=True)
  mgr.wait_until_finished()
  assert mgr.all_steps() == [6, 7]
  meta = mgr.metadata()
  assert (meta["strategy"], meta["dp"], meta["jaxdp_version"]) == ("optim", 8, jaxdp.__version__)
  assert meta["layout"] == state.layout.summary()


# ----------------------------------------------------------------------------- SIGKILL


def _worker(directory, out, *extra, kill_when=None):
  """Runs tests/ckpt_worker.py (12 steps, a checkpoint every 3); SIGKILLs it when
  `kill_when(line)` holds. Returns the lines it printed."""
  cmd = [
    sys.executable,
    os.path.join(HERE, "ckpt_worker.py"),
    str(directory),
    str(out),
    "--steps",
    "12",
    "--save-every",
    "3",
    *extra,
  ]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.Popen(
    cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
  )
  lines = []
  try:
    for line in proc.stdout:
      lines.append(line.strip())
      if kill_when is not None and kill_when(lines[-1]):
        proc.send_signal(signal.SIGKILL)
        break
    proc.wait(timeout=600)
  finally:
    if proc.poll() is None:
      proc.kill()
  if kill_when is not None:
    assert proc.returncode == -signal.SIGKILL, lines
  else:
    assert proc.returncode == 0, lines
  return lines


def _committed(directory):
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("uninterrupted")
  _worker(tmp / "ckpt", tmp / "params.npz")
  return np.load(tmp / "params.npz")


def _assert_bitwise(out, uninterrupted):
  got = np.load(out)
  assert sorted(got) == sorted(uninterrupted)
  for key in got:
    np.testing.assert_array_equal(got[key], uninterrupted[key], err_msg=key)


@pytest.mark.slow
@pytest.mark.xdist_group("uninterrupted")  # one worker: the fixture's run happens once
def test_sigkill_mid_run_then_resume_is_bitwise(tmp_path, uninterrupted):
  ckpt = tmp_path / "ckpt"

  def mid_run(line):  # once a checkpoint is committed and training has gone on past it
    return line.startswith("step ") and int(line.split()[1]) >= 7 and bool(_committed(ckpt))

  _worker(ckpt, tmp_path / "params.npz", kill_when=mid_run)
  assert not (tmp_path / "params.npz").exists()
  first = _committed(ckpt)[-1]
  lines = _worker(ckpt, tmp_path / "params.npz", "--resume")
  assert lines[0] == f"resumed {first}" and lines[-1] == "step 12"
  _assert_bitwise(tmp_path / "params.npz", uninterrupted)


@pytest.mark.slow
@pytest.mark.xdist_group("uninterrupted")  # one worker: the fixture's run happens once
def test_sigkill_mid_save_then_resume_is_bitwise(tmp_path, uninterrupted):
  ckpt = tmp_path / "ckpt"
  lines = _worker(
    ckpt,
    tmp_path / "params.npz",
    "--hold-commit",
    "6",
    kill_when=lambda line: line == "committing 6",
  )
  # Killed with checkpoint 6 fully written but not committed: 3 is the latest.
  assert "6.orbax-checkpoint-tmp" in os.listdir(ckpt) and _committed(ckpt) == [3], lines
  lines = _worker(ckpt, tmp_path / "params.npz", "--resume")
  assert lines[0] == "resumed 3" and lines[-1] == "step 12"
  assert _committed(ckpt) == [3, 6, 9, 12]
  _assert_bitwise(tmp_path / "params.npz", uninterrupted)


def test_doctests():
  import doctest

  from jaxdp._src import checkpoint

  result = doctest.testmod(checkpoint, optionflags=doctest.ELLIPSIS)
  assert result.attempted and not result.failed
