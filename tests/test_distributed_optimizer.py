"""The distributed optimizer (`optim` = ZeRO-1, `optim_grads` = ZeRO-2) against one device.

Every test model here has leaves no dim of which 8 divides, so every leaf the sharded
optimizer sees is padded (its shard dim rounded up to a multiple of dp; the first kernel
on its columns): masks, global norms and schedules are exercised on padded shards, not on
the easy case.
"""

import dataclasses
import doctest
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

import jaxdp
from jaxdp._src import distributed_optimizer, train as train_lib
from jaxdp._src.distributed_optimizer import check_exact
from jaxdp._src.ledger import measured_bytes, memory_ledger, memory_report
from jaxdp._src.state import bucket_names
from models.gpt import GPT, GPTConfig, gpt_loss
from models.mlp import MLP, mlp_loss
from tests.tolerances import assert_trees_close as assert_leaves_close, step_tolerances

STEPS = 10
DP = 8
BUCKET = 200  # elements: 3 buckets for the MLP below
# lamb and adafactor have no derived bound here (tests/tolerances.py covers Adam): their
# tests keep the old f32 bound, which is not derived. lamb is Adam times a per-leaf trust
# ratio |p| / |u| (a well-conditioned ratio of norms), so AdamBound scaled by that ratio
# would bound it; adafactor's factored second moment needs its own argument.
ATOL_F32 = 1e-5
SHARDED = ("optim", "optim_grads")


# ----------------------------------------------------------------------------- helpers


def mlp_problem(dtype=jnp.float32):
  """MLP 6 -> 30 -> 30 -> 5: leading dims 6, 30, 5, none divisible by 8."""
  params, loss_fn = jaxdp.nnx_split(
    MLP(6, 30, 5, n_layers=3, rngs=nnx.Rngs(0), param_dtype=dtype), mlp_loss
  )
  k1, k2 = jax.random.split(jax.random.key(1))
  batch = {"x": jax.random.normal(k1, (32, 6)), "y": jax.random.normal(k2, (32, 5))}
  return params, loss_fn, batch


def schedule():
  return optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=3, decay_steps=12)


def adamw_tx(params, mask="callable", weight_decay=1.0):
  """clip_by_global_norm + adamw with a schedule and a weight-decay mask (kernels only).

  The decay is large so that a mask applied to the wrong elements shows at ATOL_F32.
  """
  if mask == "pytree":
    mask = jax.tree.map(lambda x: x.ndim > 1, params)
  elif mask == "callable":
    mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  return optax.chain(
    optax.clip_by_global_norm(0.5), optax.adamw(schedule(), weight_decay=weight_decay, mask=mask)
  )


def mlp_tolerances(params, lr=None):
  """(loss rtol, grad-norm rtol, AdamBound) for `mlp_problem` (tests/tolerances.py): the
  loss averages 32 x 5 squared errors through 3 layers of 30."""
  return step_tolerances(params, 32 * 5, 3 * 30, lr or schedule(), clip=0.5)


def reference(params, loss_fn, batch, tx, steps=STEPS, master_dtype=None, bound=None):
  """Plain jax.grad + optax on the whole global batch, one device; each step's gradients
  go to `bound` (an AdamBound).

  With `master_dtype` the optimizer keeps params in that dtype and the loss sees them cast
  back to the params' dtype (single-device mixed precision).
  """
  dtypes = jax.tree.map(lambda x: x.dtype, params)
  master = jax.tree.map(lambda x: x.astype(master_dtype or x.dtype), params)

  @jax.jit
  def step(master, opt_state):
    model = jax.tree.map(lambda m, d: m.astype(d), master, dtypes)
    loss, grads = jax.value_and_grad(loss_fn)(model, batch)
    grads = jax.tree.map(lambda g, m: g.astype(m.dtype), grads, master)
    updates, opt_state = tx.update(grads, opt_state, master)
    new = optax.apply_updates(master, updates)
    return new, opt_state, loss, optax.tree.norm(grads), grads

  opt_state, losses, norms = tx.init(master), [], []
  for _ in range(steps):
    master, opt_state, loss, norm, grads = step(master, opt_state)
    if bound is not None:
      bound.add(grads)
    losses.append(float(loss))
    norms.append(float(norm))
  return master, losses, norms


def train(params, loss_fn, batch, tx, config, mesh=None, steps=STEPS, **step_kw):
  mesh = mesh or jax.make_mesh((DP,), ("data",))
  state = jaxdp.init_state(params, tx, mesh, config)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config, **step_kw)
  losses, norms = [], []
  for _ in range(steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    norms.append(float(metrics["grad_norm"]))
  return state, step, losses, norms


def max_diff(a, b) -> float:
  return max(
    float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def assert_trees_close(a, b, atol, rtol=0.0):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert_leaves_close(a, b, atol, rtol)


def unpadded_master(state, like):
  """The state's master params cut back to the params' shapes (host copies): the padding
  is at the end of the one dim that is longer than the param's."""

  def cut(m, p):
    m, shape = np.asarray(m), tuple(p.shape) or (1,)
    return m[tuple(slice(0, n) for n in shape)].reshape(p.shape)

  return jax.tree.map(cut, state.master, like)


_HEADER = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_COLLECTIVE = re.compile(
  r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(\w+)\[([\d,]*)\]\S*\s+"
  r"(all-reduce|reduce-scatter|all-gather)(?:-start)?\("
)
_WHILE = re.compile(r"body=%([\w.\-]+).*\"known_trip_count\":\{\"n\":\"(\d+)\"")


def _group_size(line: str) -> int:
  """Devices in each replica group of a collective, in any of the forms XLA prints."""
  if m := re.search(r"replica_groups=\{\{([\d,]+)\}", line):
    return len(m.group(1).split(","))
  if m := re.search(r"replica_groups=\[\d+,(\d+)\]<=", line):
    return int(m.group(1))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)
  sizes = {a: int(n) for a, n in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
  return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", m.group(2)))


def collectives(step, state, batch):
  """`[(kind, elements, group size, trips)]` of every collective in the compiled program.

  `trips` is the known trip count of the while loop holding it (1 outside loops). On CPU
  every collective is a plain synchronous op, never a tuple (jaxdp turns XLA's combiners
  off), so its result type is one array.
  """
  text = step.lower(state, batch).compile().as_text()
  trips = {body: int(n) for body, n in _WHILE.findall(text)}
  out, comp = [], None
  for line in text.splitlines():
    if m := _HEADER.match(line):
      comp = m.group(1)
    elif m := _COLLECTIVE.match(line):
      _, dims, kind = m.groups()
      n = math.prod(int(d) for d in dims.split(",") if d)
      out.append((kind, n, _group_size(line), trips.get(comp, 1)))
  return out


def bucket_sizes(layout):
  return sorted(b.shard_size * layout.dp for buf in layout.buffers for b in buf.buckets)


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("strategy", SHARDED)
@pytest.mark.parametrize("mask", ["pytree", "callable"])
def test_sharded_equals_single_device_f32(strategy, mask):
  params, loss_fn, batch = mlp_problem()
  tx = adamw_tx(params, mask)
  loss_rtol, norm_rtol, bound = mlp_tolerances(params)
  ref, ref_losses, ref_norms = reference(params, loss_fn, batch, tx, bound=bound)
  # The mask matters at this tolerance: decaying the biases too moves them beyond it.
  decay_all, _, _ = reference(params, loss_fn, batch, adamw_tx(params, mask=None))
  with pytest.raises(AssertionError):
    bound.check(decay_all, ref)

  config = jaxdp.DDPConfig(
    data_parallel_sharding_strategy=strategy,
    bucket_size=BUCKET,
    overlap_param_gather=(mask == "pytree"),
  )
  state, step, losses, norms = train(params, loss_fn, batch, tx, config)
  assert not state.fused  # the mask keeps the per-leaf update
  assert state.layout.num_buckets == 3
  assert all(p.rows != (p.shape or (1,))[p.axis] for p in state.layout.params)  # all padded
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
  np.testing.assert_allclose(norms, ref_norms, rtol=norm_rtol)  # grad_norm from the shards
  # Per element: tight where a gradient stands above its rounding, up to 2 lr per step
  # where it is rounding noise (tests/tolerances.py).
  bound.check(jaxdp.get_params(state), ref)
  assert step._cache_size() == 1, "the second step recompiled"


def test_sharded_equals_single_device_bf16():
  """bf16 params, fp32 master params and fp32 grad reduction.

  Tolerance, and why: each device computes its grads in bf16 on 1/8 of the batch and
  jaxdp averages them in fp32, while the single-device reference computes one bf16 grad
  on the whole batch; the two differ by bf16 rounding (relative 2^-8). Adam divides by
  sqrt(v), so on elements whose grad is near zero that rounding can move an update by a
  fair part of the learning rate. Against the reference we allow 1e-3 on the fp32 master
  params (the 10 learning rates sum to 2.3e-2; observed 5.5e-4), and on the bf16 model
  params, which are those rounded to bf16, 1e-3 plus one bf16 ulp. The sharded strategies do exactly the per-device
  arithmetic of `no_shard` and differ from it only in the collective (reduce-scatter vs
  all-reduce), so against `no_shard` they hold to 1e-6 (observed 6e-8).
  """
  params, loss_fn, batch = mlp_problem(jnp.bfloat16)
  tx = adamw_tx(params)
  ref, ref_losses, _ = reference(params, loss_fn, batch, tx, master_dtype=jnp.float32)
  masters = {}
  for strategy in ("no_shard",) + SHARDED:
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, bucket_size=BUCKET)
    state, _, losses, _ = train(params, loss_fn, batch, tx, config)
    got = jaxdp.get_params(state)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.master))
    masters[strategy] = unpadded_master(state, params)
    np.testing.assert_allclose(losses, ref_losses, rtol=2**-7)
    assert_trees_close(masters[strategy], ref, atol=1e-3)
    assert_trees_close(
      got, jax.tree.map(lambda m: m.astype(jnp.bfloat16), ref), atol=1e-3, rtol=2**-8
    )
  for strategy in SHARDED:
    assert_trees_close(masters[strategy], masters["no_shard"], atol=1e-6)


def list_of_dicts_problem(d=12):
  """A hand-written MLP whose params are a list of dicts (a tree whose root is a list)."""
  keys = jax.random.split(jax.random.key(3), 4)
  params = [{"w": 0.3 * jax.random.normal(k, (d, d)), "b": jnp.zeros((d,))} for k in keys]

  def loss_fn(params, batch):
    x = batch["x"]
    for layer in params:
      x = jnp.tanh(x @ layer["w"] + layer["b"])
    return jnp.mean((x - batch["y"]) ** 2)

  k1, k2 = jax.random.split(jax.random.key(4))
  batch = {"x": jax.random.normal(k1, (16, d)), "y": jax.random.normal(k2, (16, d))}
  return params, loss_fn, batch


PER_LEAF_TXS = {
  "lamb": lambda params: optax.lamb(1e-2),
  "lars": lambda params: optax.lars(1e-2),
  "adafactor": lambda params: optax.adafactor(1e-2),
  "masked_adamw": lambda params: optax.adamw(1e-2, mask=jax.tree.map(lambda x: x.ndim > 1, params)),
}


@pytest.mark.parametrize("strategy", SHARDED)
@pytest.mark.parametrize("name", sorted(PER_LEAF_TXS))
def test_a_list_of_dicts_with_per_leaf_optimizers_equals_single_device(strategy, name):
  """A params tree that is itself a list, under an optimizer run per leaf: the step gathered
  the params with the master's leaves read as `master[i]` of the tree, a list of 4 dicts
  (IndexError at the first step). 3 steps equal one device's within ATOL_F32 (these
  optimizers have no derived bound: see its comment). adafactor's factored moments are
  refused on padded leaves (`check_exact`): its widths are ones dp divides."""
  params, loss_fn, batch = list_of_dicts_problem(16 if name == "adafactor" else 12)
  tx = PER_LEAF_TXS[name](params)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  want, want_losses, _ = reference(params, loss_fn, batch, tx, steps=3)
  state, _, losses, _ = train(params, loss_fn, batch, tx, config, steps=3)
  assert state.fused is False  # the per-leaf form: the tree's own structure
  got = jaxdp.get_params(state)
  assert jax.tree.structure(got) == jax.tree.structure(params)
  assert_trees_close(got, want, ATOL_F32)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


@pytest.mark.slow  # a GPT, compiled twice
@pytest.mark.parametrize("strategy", SHARDED)
@pytest.mark.parametrize("stacked", [(), ("blocks",)])
def test_scanned_layers_fewer_than_devices_are_sharded_within_each_layer(strategy, stacked):
  """A scanned GPT (`nnx.scan`) with 2 layers on 8 devices: each stacked `(2, ...)` weight is
  sharded on a dim that 8 divides, not padded from 2 layers to 8; training equals one
  device, also with `DDPConfig(stacked=["blocks"])` (each layer gathered and reduced inside
  the scan)."""
  gpt = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, d_model=16, scan_layers=True)
  params, loss_fn = jaxdp.nnx_split(GPT(gpt, rngs=nnx.Rngs(0)), gpt_loss)
  tokens = np.random.default_rng(0).integers(0, 32, (16, 9)).astype(np.int32)
  batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  tx = adamw_tx(params)
  # The loss averages 16 x 8 tokens, each a row of d_model + vocab products.
  loss_rtol, _, bound = step_tolerances(params, 16 * 8, 16 + 32, schedule(), clip=0.5)
  ref, ref_losses, _ = reference(params, loss_fn, batch, tx, steps=5, bound=bound)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, stacked=stacked)
  state, _, losses, _ = train(params, loss_fn, batch, tx, config, steps=5)
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
  bound.check(jaxdp.get_params(state), ref)

  stacked = [
    (jax.tree_util.keystr(k), x)
    for k, x in jax.tree_util.tree_leaves_with_path(params)
    if "blocks" in jax.tree_util.keystr(k)
  ]
  assert stacked and all(x.shape[0] == 2 for _, x in stacked)
  masters = dict(
    (jax.tree_util.keystr(k), m) for k, m in jax.tree_util.tree_leaves_with_path(state.master)
  )
  device = jax.devices()[0]
  for path, x in stacked:
    m = masters[path]
    assert m.shape == x.shape, path  # nothing padded
    assert m.sharding.spec[0] is None and m.sharding.spec[1] == "data", path
    (block,) = [s.data for s in m.addressable_shards if s.device == device]
    assert block.nbytes * DP == x.nbytes, path


def scanned_mlp_problem(n_layer, d=12, ffn=20):
  """A residual MLP scanned over stacked blocks `h + tanh(h @ w1) @ w2` (widths 12, 20: 8
  divides neither) and an unstacked head, each block under the user's `jax.checkpoint`;
  the loss is the mean of 16 x 3 squared errors."""
  keys = jax.random.split(jax.random.key(2), 5)
  params = {
    "blocks": {
      "w1": jax.random.normal(keys[0], (n_layer, d, ffn)) / np.sqrt(d),
      "w2": jax.random.normal(keys[1], (n_layer, ffn, d)) / np.sqrt(ffn),
    },
    "head": jax.random.normal(keys[2], (d, 3)) / np.sqrt(d),
  }
  block = jax.checkpoint(lambda h, w: h + jnp.tanh(h @ w["w1"]) @ w["w2"])

  def loss_fn(params, batch):
    h, _ = jax.lax.scan(lambda h, w: (block(h, w), None), batch["x"], params["blocks"])
    return jnp.mean((h @ params["head"] - batch["y"]) ** 2)

  batch = {"x": jax.random.normal(keys[3], (16, d)), "y": jax.random.normal(keys[4], (16, 3))}
  return params, loss_fn, batch


@pytest.mark.parametrize("strategy", SHARDED)
@pytest.mark.parametrize("n_layer,fused", [(1, False), (3, False), (3, True)])
def test_stacked_scan_reduces_each_layer_in_the_loop_and_equals_single_device(
  strategy, n_layer, fused
):
  """`DDPConfig(stacked=["blocks"])`: each stacked leaf is sharded on a dim of a layer,
  gathered and reduce-scattered one layer per iteration inside the scan (one all-gather per
  param and one reduce-scatter per layer in the loop bodies, none of a whole stacked leaf),
  and 5 steps equal one device, with the step built twice in one process."""
  params, loss_fn, batch = scanned_mlp_problem(n_layer)
  # Without a mask the update is fused (one flat array per bucket: the stack's layer blocks
  # are slices of its flat master shard); with one, per leaf.
  tx = adamw_tx(params, mask=None if fused else "callable")
  # The loss averages 16 x 3 squared errors through n_layer blocks of widths 12 and 20.
  loss_rtol, norm_rtol, bound = step_tolerances(params, 16 * 3, n_layer * 32, schedule(), clip=0.5)
  ref, ref_losses, ref_norms = reference(params, loss_fn, batch, tx, steps=5, bound=bound)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, stacked=["blocks"])
  mesh = jax.make_mesh((DP,), ("data",))
  for _ in range(2):  # a second build in the same process reuses JAX's cached scan trace
    state, step, losses, norms = train(params, loss_fn, batch, tx, config, mesh, steps=5)
    np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
    np.testing.assert_allclose(norms, ref_norms, rtol=norm_rtol)
    bound.check(jaxdp.get_params(state), ref)
  assert state.fused == fused
  if not fused:
    for name in ("w1", "w2"):
      spec = state.master["blocks"][name].sharding.spec
      assert spec[0] is None and "data" in spec[1:], (name, spec)
  found = collectives(step, state, batch)
  looped = sorted((kind, n) for kind, n, _, trips in found if trips == n_layer)
  if n_layer > 1:  # w1 (12, 20) on dim 1, w2 (20, 12) on dim 0, 20 padded to 24: per layer
    # one all-gather per param, one reduce-scatter of both
    assert looped == [("all-gather", 12 * 24)] * 2 + [("reduce-scatter", 2 * 12 * 24 // DP)], found
  assert not [c for c in found if c[1] >= n_layer * 12 * 24 and n_layer > 1], found


@pytest.mark.parametrize("use", ["inside and outside the scan", "no scan"])
def test_stacked_used_outside_a_scan_is_reduced_whole_and_equals_single_device(use):
  """A stack the loss also indexes outside the scan (`w1[1]`), or loops over in Python, is
  gathered and reduced whole where it is used (`fsdp_program`'s fallback): still equal to
  one device. A `stacked=` prefix that names no param is refused."""
  params, loss_fn, batch = scanned_mlp_problem(3)

  def looped(p, b):
    h = b["x"]
    for layer in range(3):
      h = h + jnp.tanh(h @ p["blocks"]["w1"][layer]) @ p["blocks"]["w2"][layer]
    return jnp.mean((h @ p["head"] - b["y"]) ** 2)

  if use == "no scan":
    loss = looped
  else:
    loss = lambda p, b: loss_fn(p, b) + 0.1 * jnp.sum(p["blocks"]["w1"][1] ** 2)
  tx = adamw_tx(params)
  loss_rtol, _, bound = step_tolerances(params, 16 * 3, 3 * 32, schedule(), clip=0.5)
  ref, ref_losses, _ = reference(params, loss, batch, tx, steps=3, bound=bound)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim", stacked=["blocks"])
  state, _, losses, _ = train(params, loss, batch, tx, config, steps=3)
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
  bound.check(jaxdp.get_params(state), ref)
  with pytest.raises(ValueError, match=r"stacked=.*names params\['blox'\]"):
    jaxdp.init_state(
      params, tx, jax.make_mesh((DP,), ("data",)), dataclasses.replace(config, stacked=["blox"])
    )


@pytest.mark.parametrize("strategy", SHARDED)
def test_stacked_scan_with_grad_accumulation_equals_single_device(strategy):
  """`stacked=` with 2 micro-batches: `optim_grads` reduce-scatters each micro-batch's layers
  inside the scan and sums the shards; `optim` accumulates whole local grads (`no_sync`) and
  reduces the stack's bucket once after the last scan. Both equal one device's step on the
  whole batch."""
  params, loss_fn, batch = scanned_mlp_problem(3)
  tx = adamw_tx(params)
  loss_rtol, norm_rtol, bound = step_tolerances(params, 16 * 3, 3 * 32, schedule(), clip=0.5)
  ref, ref_losses, ref_norms = reference(params, loss_fn, batch, tx, steps=3, bound=bound)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, stacked=["blocks"])
  state, step, losses, norms = train(
    params, loss_fn, batch, tx, config, steps=3, grad_accum_steps=2
  )
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
  np.testing.assert_allclose(norms, ref_norms, rtol=norm_rtol)
  bound.check(jaxdp.get_params(state), ref)
  scatters = [
    (n, t) for kind, n, _, t in collectives(step, state, batch) if kind == "reduce-scatter"
  ]
  stack = 2 * 12 * 24  # one layer of w1 and w2, padded
  if strategy == "optim_grads":  # per layer, in the backward loop of each micro-batch
    assert (stack // DP, 3) in scatters, scatters
  else:  # the whole stack's bucket (its shard padded to a multiple of 16), once
    (bucket,) = [b for buf in state.layout.buffers for b in buf.buckets if b.stack]
    assert bucket.shard_size == 224 >= 3 * stack // DP
    assert (bucket.shard_size, 1) in scatters, scatters


@pytest.mark.parametrize("strategy", ("no_shard",) + SHARDED)
def test_grad_accumulation_equals_large_batch(strategy):
  """k=4 micro-batches of 4 per device equal one step on the 32-example batch, and the
  grads are reduced once per step: `no_shard` and `optim` accumulate local grads and
  reduce each bucket once, after the loop; `optim_grads` reduce-scatters each bucket once
  per micro-batch, inside the loop, keeping only its shard."""
  k = 4
  params, loss_fn, batch = mlp_problem()
  tx = adamw_tx(params)
  # Accumulating k partial means adds a sum of k terms per element: inside the same
  # random-walk estimate (tests/tolerances.py).
  loss_rtol, norm_rtol, bound = mlp_tolerances(params)
  ref, ref_losses, ref_norms = reference(params, loss_fn, batch, tx, steps=3, bound=bound)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, bucket_size=BUCKET)
  state, step, losses, norms = train(
    params, loss_fn, batch, tx, config, steps=3, grad_accum_steps=k
  )
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
  np.testing.assert_allclose(norms, ref_norms, rtol=norm_rtol)
  bound.check(jaxdp.get_params(state), ref)

  ops = collectives(step, state, batch)
  sizes = bucket_sizes(state.layout)
  if strategy == "no_shard":
    reductions = [(n, t) for kind, n, _, t in ops if kind == "all-reduce" and n > 2]
    assert sorted(reductions) == [(n, 1) for n in sizes]
  else:
    reductions = [(n * DP, t) for kind, n, _, t in ops if kind == "reduce-scatter"]
    trips = k if strategy == "optim_grads" else 1
    assert sorted(reductions) == [(n, trips) for n in sizes]
    assert not [op for op in ops if op[0] == "all-reduce" and op[1] > 2]


@pytest.mark.parametrize("mask", ["callable", None])
def test_replica_data_mesh_equals_single_device(mask):
  """num_distributed_optimizer_instances=2 on a (2, 4) mesh: each bucket is reduce-scattered
  over the 4 "data" devices, then its shard all-reduced over the 2 replicas; per-leaf
  update (a mask) or fused (none)."""
  params, loss_fn, batch = mlp_problem()
  tx = adamw_tx(params, mask)
  loss_rtol, norm_rtol, bound = mlp_tolerances(params)
  ref, ref_losses, ref_norms = reference(params, loss_fn, batch, tx, bound=bound)
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  for strategy in SHARDED:
    config = jaxdp.DDPConfig(
      data_parallel_sharding_strategy=strategy,
      bucket_size=BUCKET,
      num_distributed_optimizer_instances=2,
    )
    state, step, losses, norms = train(params, loss_fn, batch, tx, config, mesh=mesh)
    assert state.layout.dp == 4 and state.fused == (mask is None)
    np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
    np.testing.assert_allclose(norms, ref_norms, rtol=norm_rtol)
    bound.check(jaxdp.get_params(state), ref)
  ops = collectives(step, state, batch)
  sizes = bucket_sizes(state.layout)
  assert sorted(n * 4 for kind, n, g, _ in ops if kind == "reduce-scatter" and g == 4) == sizes
  assert sorted(n * 4 for kind, n, g, _ in ops if kind == "all-reduce" and g == 2) == sizes


# ----------------------------------------------------------------------------- programs


@pytest.mark.parametrize("strategy", SHARDED)
@pytest.mark.parametrize("overlap_param_gather", [True, False])
@pytest.mark.parametrize("mask", ["callable", None])
def test_one_reduce_scatter_and_one_all_gather_per_bucket(strategy, overlap_param_gather, mask):
  """Per-leaf update (a mask) and fused update (none): the same collectives per bucket."""
  params, loss_fn, batch = mlp_problem()
  tx = adamw_tx(params, mask)
  mesh = jax.make_mesh((DP,), ("data",))
  config = jaxdp.DDPConfig(
    data_parallel_sharding_strategy=strategy,
    bucket_size=BUCKET,
    overlap_param_gather=overlap_param_gather,
  )
  state = jaxdp.init_state(params, tx, mesh, config)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  ops = collectives(step, state, batch)
  sizes = bucket_sizes(state.layout)
  assert len(sizes) == 3
  assert sorted(n * DP for kind, n, _, _ in ops if kind == "reduce-scatter") == sizes
  assert sorted(n for kind, n, _, _ in ops if kind == "all-gather") == sizes
  # No gradient-sized all-reduce: only scalars. One f32[2] carries the loss and the grad
  # norm (from the reduced shards, one psum); clip_by_global_norm, run in the global view,
  # all-reduces one partial sum per leaf (6 leaves), or per bucket (3) when fused.
  assert state.fused == (mask is None)
  all_reduces = sorted(n for kind, n, _, _ in ops if kind == "all-reduce")
  assert all_reduces == [1] * (3 if state.fused else 6) + [2]


# ----------------------------------------------------------------------------- memory


def opt_bytes(state):
  return measured_bytes(state)["opt_state"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_opt_state_is_one_dp_th_and_ledger_matches_arrays(dtype):
  params, _, _ = mlp_problem(dtype)
  tx = adamw_tx(params)
  mesh = jax.make_mesh((DP,), ("data",))
  states = {}
  for strategy in ("no_shard",) + SHARDED:
    for overlap in (True, False):
      config = jaxdp.DDPConfig(
        data_parallel_sharding_strategy=strategy, bucket_size=BUCKET, overlap_param_gather=overlap
      )
      state = states[strategy, overlap] = jaxdp.init_state(params, tx, mesh, config)
      ledger = memory_ledger(params, tx, DP, config)
      measured = measured_bytes(state)
      assert measured["step"] == 4
      assert {k: measured[k] for k in ledger.state} == ledger.state, (strategy, overlap)

  # Optimizer state on device 0 is 1/dp of the unsharded state, up to padding: Adam's two
  # moments per element, computed here from the padded leading dims; the step counts are
  # scalars every device keeps.
  unsharded = states["no_shard", True].opt_state
  scalars = sum(x.nbytes for x in jax.tree.leaves(unsharded) if x.ndim == 0)
  leaves = jax.tree.leaves(params)
  # Each leaf is padded on the dim that needs the least padding to a multiple of DP.
  padding = sum(min((-(-n // DP) * DP - n) * x.size // n for n in x.shape) for x in leaves)
  full = opt_bytes(states["no_shard", True]) - scalars
  assert full == 2 * 4 * sum(x.size for x in leaves)
  for strategy in SHARDED:
    sharded = opt_bytes(states[strategy, True]) - scalars
    assert sharded * DP == full + 2 * 4 * padding
    assert sharded * DP < 1.2 * full  # the padding is small even for this tiny MLP


@pytest.mark.parametrize("fused_update", [None, False])
@pytest.mark.parametrize("n_layer,d,ffn", [(8, 12, 20), (5, 3, 3)])
def test_ledger_matches_arrays_with_stacked_layers(n_layer, d, ffn, fused_update):
  """`DDPConfig(stacked=)` shards a stack's leaves on a dim of a layer, so their padding
  is not the unstacked layout's: the ledger (via `memory_report`) predicts the built state
  byte for byte, for shapes where the two layouts' bytes differ."""
  params, _, _ = scanned_mlp_problem(n_layer, d, ffn)
  tx = adamw_tx(params)
  config = jaxdp.DDPConfig(
    data_parallel_sharding_strategy="optim", stacked=["blocks"], fused_update=fused_update
  )
  rows = {r["kind"]: r for r in memory_report(params, tx, DP, config)}
  for kind in ("params", "master", "opt_state"):
    assert rows[kind]["predicted"] == rows[kind]["measured"], (kind, rows[kind])
  unstacked = memory_ledger(params, tx, DP, dataclasses.replace(config, stacked=()))
  assert unstacked.master != rows["master"]["predicted"]  # the stacks' own padding


def test_ledger_reproduces_the_design_table():
  """Mixed-precision Adam, bf16 params, no padding: psi = 2^20 params, N = 8."""
  psi, n = 2**20, DP
  ddp = lambda strategy, **kw: jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, **kw)
  params = {
    "w": jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16),
    "v": jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16),
  }
  # FSDP keeps no bf16 params between steps: it gathers (and casts) the fp32 master shards.
  expected = {
    "no_shard": (2, 4, 4, 8),
    "optim": (2, 4, 4 / n, 8 / n),
    "optim_grads": (2, 4 / n, 4 / n, 8 / n),
    "optim_grads_params": (0, 4 / n, 4 / n, 8 / n),
  }
  for strategy, (p, g, m, o) in expected.items():
    ledger = memory_ledger(params, None, n, ddp(strategy))
    assert ledger.params == p * psi and ledger.grads == g * psi
    assert ledger.master == m * psi
    assert ledger.opt_state == o * psi + 4  # + Adam's int32 step count
  assert memory_ledger(params, None, n, ddp("no_shard")).total == 18 * psi + 4
  assert memory_ledger(params, None, n, ddp("optim")).total == 6 * psi + 12 * psi // n + 4
  assert memory_ledger(params, None, n, ddp("optim_grads")).total == 2 * psi + 16 * psi // n + 4
  # fp16/bf16 grads when grad_reduce_in_fp32=False; frozen params have no grads or state.
  bf16_grads = ddp("optim", grad_reduce_in_fp32=False)
  assert memory_ledger(params, None, n, bf16_grads).grads == 2 * psi
  frozen = memory_ledger(params, None, n, ddp("optim"), frozen={"w": True, "v": False})
  assert frozen.grads == 2 * psi and frozen.opt_state == 8 * psi // 2 // n + 4
  # HFSDP over 2 replicas: the bf16 compute rows 1/N, the fp32 master and Adam 1/(2N).
  hfsdp = ddp(
    "optim_grads_params", num_distributed_optimizer_instances=2, outer_dp_sharding_strategy="optim"
  )
  ledger = memory_ledger(params, None, n, hfsdp)
  assert (ledger.params, ledger.grads) == (2 * psi // n, 4 * psi // n)
  assert (ledger.master, ledger.opt_state) == (4 * psi // (2 * n), 8 * psi // (2 * n) + 4)
  assert ledger.total == 6 * psi // n + 12 * psi // (2 * n) + 4


def test_ledger_says_what_each_device_holds_in_the_step_and_between_steps():
  """`ledger.state["params"]` is 0 under ZeRO-1, whose step holds the params whole:
  `str(ledger)` says both, in the same bytes as the fields (the design table's psi = 2^20
  bf16 params, N = 8)."""
  params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)}
  ddp = lambda strategy, **kw: jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, **kw)
  zero1 = memory_ledger(params, None, DP, ddp("optim"))
  assert zero1.state["params"] == 0 and zero1.params == 2 * 2**20
  assert str(zero1).startswith("7.50 MiB per device in the step: params 2.00 MiB (whole, ")
  assert "gathered from master in each step; 0 B kept between steps" in str(zero1)
  after_update = memory_ledger(params, None, DP, ddp("optim", overlap_param_gather=False))
  assert after_update.state["params"] == 2 * 2**20
  assert "params 2.00 MiB (whole, kept)" in str(after_update)
  assert "params 2.00 MiB (whole, kept)" in str(memory_ledger(params, None, DP, ddp("no_shard")))
  fsdp = memory_ledger(params, None, DP, ddp("optim_grads_params"))
  assert f"the largest {fsdp.gathered_unit / 2**20:.2f} MiB, not in the total" in str(fsdp)
  assert str(fsdp).startswith(f"{fsdp.total / 2**20:.2f} MiB per device in the step: params 0 B")


# ----------------------------------------------------------------------------- exactness


def center_each_leaf() -> optax.GradientTransformation:
  """A shape-dependent transformation with no tell-tale state: subtracts each leaf's mean."""
  return optax.GradientTransformation(
    lambda params: optax.EmptyState(),
    lambda updates, state, params=None: (jax.tree.map(lambda u: u - jnp.mean(u), updates), state),
  )


def test_shape_dependent_transformations_are_refused_on_padded_leaves():
  params, _, _ = mlp_problem()
  mesh = jax.make_mesh((DP,), ("data",))
  for strategy in SHARDED:
    config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
    with pytest.raises(NotImplementedError) as e:
      jaxdp.init_state(params, optax.adafactor(1e-3), mesh, config)
    msg = str(e.value)
    for part in (
      "params['layers']",
      "padded to",
      "dp=8",
      "adafactor",
      "no_shard",
      "shape-independent",
      "divides the leading dim",
    ):
      assert part in msg, (part, msg)
  with pytest.raises(NotImplementedError, match=r"depends on the leaf's shape"):
    jaxdp.init_state(
      params,
      optax.chain(center_each_leaf(), optax.sgd(0.1)),
      mesh,
      jaxdp.DDPConfig(data_parallel_sharding_strategy="optim"),
    )
  # no_shard sees the true shapes: anything goes.
  jaxdp.init_state(params, optax.adafactor(1e-3), mesh, jaxdp.DDPConfig())


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_shape_dependent_transformation_runs_where_nothing_is_padded(axis_type):
  """adafactor factors (256, 128) leaves: shape-dependent, but exact when dp divides every
  leading dim (the optimizer then sees the true shapes); on meshes with Explicit axes (the
  update runs with them made automatic) and with Auto axes."""
  k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
  params = {"w": jax.random.normal(k1, (256, 128)) * 0.05, "b": jnp.zeros((128,))}
  batch = {"x": jax.random.normal(k2, (16, 256)), "y": jax.random.normal(k3, (16, 128))}
  loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)
  tx = optax.adafactor(1e-2)
  assert distributed_optimizer._shape_dependent_state(  # really factored
    tx, jaxdp.layout.make_layout(params, dp=DP)
  )
  ref, ref_losses, _ = reference(params, loss_fn, batch, tx, steps=5)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
  mesh = jax.make_mesh((DP,), ("data",), axis_types=(axis_type,))
  state, _, losses, _ = train(params, loss_fn, batch, tx, config, mesh=mesh, steps=5)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_trees_close(jaxdp.get_params(state), ref, atol=ATOL_F32)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_lamb_is_exact_on_padded_leaves(axis_type):
  """lamb's per-leaf trust ratio uses norms, which zero padding rows leave unchanged (on
  either kind of mesh)."""
  params, loss_fn, batch = mlp_problem()
  tx = optax.lamb(schedule(), weight_decay=0.1)
  ref, ref_losses, _ = reference(params, loss_fn, batch, tx)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads", bucket_size=BUCKET)
  mesh = jax.make_mesh((DP,), ("data",), axis_types=(axis_type,))
  state, _, losses, _ = train(params, loss_fn, batch, tx, config, mesh=mesh)
  assert not state.fused  # per-leaf trust ratios keep the per-leaf update
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_trees_close(jaxdp.get_params(state), ref, atol=ATOL_F32)


def test_check_exact_accepts_elementwise_and_global_norm_transformations():
  layout = jaxdp.layout.make_layout(
    {"w": jnp.zeros((130, 7)), "b": jnp.zeros((3,)), "s": jnp.zeros(())}, dp=DP
  )
  for tx in (
    optax.sgd(0.1, momentum=0.9),
    optax.lion(1e-3),
    optax.adam(1e-3),
    optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule())),
    optax.lars(1e-3),
  ):
    check_exact(tx, layout)
  with pytest.raises(NotImplementedError) as e:
    check_exact(center_each_leaf(), layout)
  assert "params['b'] has shape (3,)" in str(e.value)
  assert "sees it as (8,) (leading dim 3 padded to 8, a multiple of dp=8)" in str(e.value)
  assert "Also affected: params['s'], params['w']" in str(e.value)


# ----------------------------------------------------------------------------- fused update


@pytest.mark.parametrize("strategy", SHARDED)
def test_fused_update_is_taken_and_equals_single_device(strategy):
  """clip_by_global_norm + adamw (a schedule, no mask) runs as one update of flat buckets:
  the master params and Adam's moments are one flat array per bucket sharded over "data",
  and the run equals the single-device program as the per-leaf update does.

  Tolerance: test_sharded_equals_single_device_f32's. The fused update does the same
  elementwise arithmetic on the same values; only the clip's global norm sums its squares in
  another order (per bucket, zero padding included, not per leaf): a relative change of
  rtol_sum(n_params) = 4 sqrt(1.3e3) eps32 ~ 150 eps32 in the clip's scale, below the
  4 n eps32 = 640 eps32 (n = 160 terms per gradient) AdamBound allows every gradient, and
  within `norm_rtol` for the reported norm.
  """
  params, loss_fn, batch = mlp_problem()
  tx = adamw_tx(params, mask=None)
  loss_rtol, norm_rtol, bound = mlp_tolerances(params)
  ref, ref_losses, ref_norms = reference(params, loss_fn, batch, tx, bound=bound)
  states = {}
  for fused, overlap in [(None, True), (None, False), (False, True)]:
    config = jaxdp.DDPConfig(
      data_parallel_sharding_strategy=strategy,
      bucket_size=BUCKET,
      overlap_param_gather=overlap,
      fused_update=fused,
    )
    state, step, losses, norms = states[fused, overlap] = train(params, loss_fn, batch, tx, config)
    assert state.fused == (fused is None)
    np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
    np.testing.assert_allclose(norms, ref_norms, rtol=norm_rtol)
    bound.check(jaxdp.get_params(state), ref)
    assert step._cache_size() == 1, "the second step recompiled"

  state = states[None, True][0]
  flat = {name: (b.shard_size * DP,) for name, _, b in bucket_names(state.layout)}
  assert len(flat) == 3 and {k: x.shape for k, x in state.master.items()} == flat
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert sorted(x.shape for x in moments) == sorted(2 * list(flat.values()))  # mu, nu
  assert all(x.sharding.spec == P("data") for x in moments + list(state.master.values()))
  assert train_lib.state_specs(state).master == {name: P("data") for name in flat}
  # Readers see the per-leaf optax state, as under the per-leaf update.
  fused, per_leaf = (jaxdp.get_opt_state(states[k][0]) for k in [(None, True), (False, True)])
  assert jax.tree.structure(fused) == jax.tree.structure(per_leaf)
  assert jax.tree.map(jnp.shape, fused) == jax.tree.map(jnp.shape, per_leaf)


def test_no_shard_fused_update_equals_single_device_and_keeps_no_master():
  """DDP fuses when asked (fused_update=True; None keeps its per-leaf update): the optax
  state is one flat array per bucket, replicated; the params stay the leaves the forward
  uses (no flat master: they are raveled for the update and the updates' slices added to
  them). Same tolerance and argument as the sharded test above (only the clip's norm sums
  in another order). The ledger predicts the flat state byte for byte; bf16 params, which
  DDP keeps an fp32 master of, cannot fuse."""
  params, loss_fn, batch = mlp_problem()
  tx = adamw_tx(params, mask=None)
  loss_rtol, norm_rtol, bound = mlp_tolerances(params)
  ref, ref_losses, ref_norms = reference(params, loss_fn, batch, tx, bound=bound)
  runs = {}
  for fused in (True, None):
    config = jaxdp.DDPConfig(bucket_size=BUCKET, fused_update=fused)
    state, step, losses, norms = runs[fused] = train(params, loss_fn, batch, tx, config)
    assert state.fused == bool(fused)
    np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
    np.testing.assert_allclose(norms, ref_norms, rtol=norm_rtol)
    bound.check(jaxdp.get_params(state), ref)
    assert step._cache_size() == 1, "the second step recompiled"
    ledger = memory_ledger(params, tx, DP, config)
    assert {k: measured_bytes(state)[k] for k in ledger.state} == ledger.state

  state = runs[True][0]
  flat = {name: (b.shard_size * DP,) for name, _, b in bucket_names(state.layout)}
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert sorted(x.shape for x in moments) == sorted(2 * list(flat.values()))  # mu, nu
  assert all(x.sharding.is_fully_replicated for x in moments)
  assert jax.tree.leaves(state.master) == []
  fused, per_leaf = (jaxdp.get_opt_state(runs[k][0]) for k in (True, None))
  assert jax.tree.map(jnp.shape, fused) == jax.tree.map(jnp.shape, per_leaf)
  bf16, _, _ = mlp_problem(jnp.bfloat16)
  mesh = jax.make_mesh((DP,), ("data",))
  with pytest.raises(ValueError, match="no_shard keeps an fp32 copy of low-precision params"):
    jaxdp.init_state(bf16, tx, mesh, jaxdp.DDPConfig(fused_update=True))


def test_fused_update_falls_back_for_masks_and_per_leaf_statistics():
  """Masks of the param tree, per-leaf trust ratios and shape-dependent updates keep the
  per-leaf update (exact: test_sharded_equals_single_device_f32, test_lamb_is_exact_...);
  only fused_update=True turns that into an error."""
  params, _, _ = mlp_problem()
  layout = jaxdp.layout.make_layout(params, dp=DP, bucket_size=BUCKET)
  for tx in (
    adamw_tx(params, mask=None),
    optax.sgd(0.1, momentum=0.9),
    optax.lion(1e-3),
    optax.adagrad(0.1),
  ):
    assert distributed_optimizer.fuses(tx, layout), tx
  for tx in (
    adamw_tx(params, "callable"),
    adamw_tx(params, "pytree"),
    optax.lamb(1e-3),
    optax.contrib.muon(1e-3),
  ):
    assert not distributed_optimizer.fuses(tx, layout), tx
  mesh = jax.make_mesh((DP,), ("data",))
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim", bucket_size=BUCKET)
  assert not jaxdp.init_state(params, adamw_tx(params), mesh, config).fused
  forced = dataclasses.replace(config, fused_update=True)
  with pytest.raises(ValueError, match="fused_update=True: the optax transformation updates"):
    jaxdp.init_state(params, optax.lamb(1e-3), mesh, forced)


def test_doctests():
  result = doctest.testmod(distributed_optimizer, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0
