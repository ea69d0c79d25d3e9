"""FSDP (`optim_grads_params`) against the plain single-device program; what each device
holds; the collectives the program issues per unit; GPU-target schedule and memory."""

import dataclasses
import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxdp
from jaxdp._src import aot, fsdp as fsdp_lib, train as train_lib
from jaxdp._src.distributed_optimizer import per_leaf_state
from jaxdp._src.config import FSDPConfig
from jaxdp._src.ledger import memory_report
from jaxdp._src.state import bucket_names
from jaxdp._src.units import units_of
from models.gpt import GPT, GPTConfig, gpt_loss, lora_trainable
from models.mlp import MLP, mlp_loss
from tests.tolerances import adam_ratio_bound, bf16_grad_rtol, step_tolerances

STEPS = 5
LR = 3e-3
DP = 8
FSDP = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
N_LAYER = 3
GPT_KW = dict(vocab_size=64, block_size=16, n_layer=N_LAYER, n_head=2, d_model=32)


def mlp_problem():
  params, loss_fn = jaxdp.nnx_split(MLP(6, 32, 3, n_layers=4, rngs=nnx.Rngs(0)), mlp_loss)
  k1, k2 = jax.random.split(jax.random.key(1))
  batch = {"x": jax.random.normal(k1, (32, 6)), "y": jax.random.normal(k2, (32, 3))}
  return params, loss_fn, batch


def gpt_problem(**kw):
  config = GPTConfig(**{**GPT_KW, **kw})
  params, loss_fn = jaxdp.nnx_split(GPT(config, rngs=nnx.Rngs(0)), gpt_loss)
  tokens = jax.random.randint(jax.random.key(2), (16, 17), 0, GPT_KW["vocab_size"])
  return params, loss_fn, {"x": tokens[:, :-1], "y": tokens[:, 1:]}


PROBLEMS = {
  "mlp": (mlp_problem, {}, None),
  "gpt": (gpt_problem, {}, None),
  "gpt_scan": (gpt_problem, {"scan_layers": True}, None),
  "gpt_scan4": (gpt_problem, {"scan_layers": True, "n_layer": 4}, None),  # loops of 2 layers
  "gpt_lora": (gpt_problem, {"lora_rank": 2}, "lora"),
  "gpt_lora_scan": (gpt_problem, {"lora_rank": 2, "scan_layers": True}, "lora"),
}


def problem(name):
  make, kw, frozen = PROBLEMS[name]
  params, loss_fn, batch = make(**kw)
  if frozen == "lora":  # the base is frozen, only the adapters train
    frozen = jax.tree.map(lambda t: not t, lora_trainable(params))
  fsdp = FSDPConfig(stacked=["blocks"] if kw.get("scan_layers") else [])
  return params, loss_fn, batch, frozen, fsdp


def tolerances(name, params):
  """(loss rtol, grad-norm rtol, AdamBound) for `name` (tests/tolerances.py has the
  argument): GPT's loss averages 16 x 16 tokens, each a row of d_model + vocab products;
  the MLP's, 32 x 3 squared errors through 4 layers of 32."""
  if name == "mlp":
    return step_tolerances(params, 32 * 3, 4 * 32, LR, clip=0.5)
  return step_tolerances(params, 16 * 16, GPT_KW["d_model"] + GPT_KW["vocab_size"], LR, clip=0.5)


def adamw_clip():
  return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(LR, weight_decay=0.1))


def reference(params, loss_fn, batch, tx, frozen=None, steps=STEPS, bound=None):
  """Plain jax.grad + optax on the whole global batch, one device; frozen leaves untouched
  (the optimizer sees None there, as under jaxdp). Feeds each step's gradients to
  `bound` (an AdamBound; zeros for frozen leaves, which must come back bit for bit)."""
  keep = (
    (lambda t: t)
    if frozen is None
    else (lambda t: jax.tree.map(lambda x, f: None if f else x, t, frozen))
  )

  @jax.jit  # one compile instead of op-by-op dispatch: the same arithmetic, fused by XLA
  def step(params, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(keep(grads), opt_state, keep(params))
    new = optax.apply_updates(keep(params), updates)
    params = (
      new
      if frozen is None
      else jax.tree.map(
        lambda n, p, f: p if f else n, new, params, frozen, is_leaf=lambda x: x is None
      )
    )
    return params, opt_state, loss, optax.tree.norm(keep(grads)), grads

  opt_state, losses, norms = tx.init(keep(params)), [], []
  for _ in range(steps):
    params, opt_state, loss, norm, grads = step(params, opt_state)
    if bound is not None:
      bound.add(
        grads
        if frozen is None
        else jax.tree.map(lambda g, f: jnp.zeros_like(g) if f else g, grads, frozen)
      )
    losses.append(float(loss))
    norms.append(float(norm))
  return params, losses, norms


def train(params, loss_fn, batch, tx, fsdp, frozen=None, steps=STEPS, config=FSDP, **kw):
  mesh = jax.make_mesh((DP,), ("data",))
  state = jaxdp.init_state(params, tx, mesh, config, frozen=frozen, fsdp=fsdp)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config, fsdp=fsdp, **kw)
  losses, norms = [], []
  for _ in range(steps):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    norms.append(float(metrics["grad_norm"]))
  return state, step, losses, norms


def max_diff(a, b):
  return max(
    float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize(
  "name,reshard",
  [("mlp", True)]
  + [
    pytest.param(*p, marks=pytest.mark.slow)  # a GPT: ~1 min each on 2 cores
    for p in [("gpt", True), ("gpt_scan", True), ("gpt_scan", False), ("gpt_lora_scan", True)]
  ],
)
def test_fsdp_equals_single_device(name, reshard):
  params, loss_fn, batch, frozen, fsdp = problem(name)
  fsdp = FSDPConfig(stacked=fsdp.stacked, reshard_after_forward=reshard)
  loss_rtol, norm_rtol, bound = tolerances(name, params)
  ref, ref_losses, ref_norms = reference(params, loss_fn, batch, adamw_clip(), frozen, bound=bound)
  state, step, losses, norms = train(params, loss_fn, batch, adamw_clip(), fsdp, frozen)
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
  np.testing.assert_allclose(norms, ref_norms, rtol=norm_rtol)
  got = jaxdp.get_params(state)
  assert jax.tree.structure(got) == jax.tree.structure(params)
  # Per element: tight where the gradient stands above its rounding, up to 2 lr per step
  # where it is rounding noise (the attention key biases). A wrong shard or a lost
  # gradient moves Adam's update by O(1), a param by O(lr) per step: most elements are
  # held to a tenth of one step. The rest are mostly c_attn's q and k columns, whose
  # gradients are ~1e-3 of the v columns' that set the fused leaf's rounding scale.
  bound.check(got, ref)
  assert bound.tight_fraction(LR / 10) > 0.75
  if frozen is not None:  # the frozen base comes back bit for bit
    for x, y, f in zip(jax.tree.leaves(got), jax.tree.leaves(params), jax.tree.leaves(frozen)):
      if f:
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert step._cache_size() == 1, "the second step recompiled"


@pytest.mark.slow
def test_fsdp_grad_accumulation_and_average_in_collective():
  params, loss_fn, batch, frozen, fsdp = problem("gpt_scan")
  loss_rtol, _, bound = tolerances("gpt_scan", params)
  ref, ref_losses, _ = reference(params, loss_fn, batch, adamw_clip(), bound=bound)
  config = jaxdp.DDPConfig(
    data_parallel_sharding_strategy="optim_grads_params", average_in_collective=True
  )
  state, _, losses, _ = train(
    params, loss_fn, batch, adamw_clip(), fsdp, config=config, grad_accum_steps=2
  )
  # Accumulating two micro-batches adds one more sum of two partial means per element:
  # within the same random-walk estimate (tests/tolerances.py).
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
  bound.check(jaxdp.get_params(state), ref)


@pytest.mark.slow
def test_fsdp_bf16_gathers_bf16_reduces_fp32_keeps_fp32_master():
  # Two blocks, not N_LAYER: this test compiles five bf16 programs of the GPT, and what it
  # checks (the collectives' dtypes, equality with ZeRO-1, the bf16 bound below, which
  # counts roundings per block) is the same for every block unit and between two of them.
  n_layer = 2
  params, loss_fn, batch = gpt_problem(n_layer=n_layer)
  fsdp = FSDPConfig()
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  tx, mesh = adamw_clip(), jax.make_mesh((DP,), ("data",))
  state = jaxdp.init_state(params, tx, mesh, FSDP, fsdp=fsdp)
  assert {m.dtype for m in jax.tree.leaves(state.master)} == {jnp.dtype(jnp.float32)}
  step = jaxdp.make_train_step(loss_fn, tx, mesh, FSDP, fsdp=fsdp)
  hlo = step.lower(state, batch).as_text(dialect="hlo")  # before XLA:CPU promotes bf16
  gathers = re.findall(r"= (\w+)\[\d+\]\{0\} all-gather\(", hlo)
  scatters = re.findall(r"= (\w+)\[\d+\]\{0\} reduce-scatter\(", hlo)
  assert gathers and set(gathers) == {"bf16"}, gathers
  assert scatters and set(scatters) == {"f32"}, scatters
  # ZeRO-1 does the same arithmetic (fp32 master, bf16 compute, fp32 reduce-scatter) with
  # the per-leaf update of both, resharding or not: bit for bit.
  zero1 = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim", fused_update=False)
  per_leaf = dataclasses.replace(FSDP, fused_update=False)
  ref, _, ref_losses, _ = train(params, loss_fn, batch, tx, None, config=zero1)
  for reshard in (True, False):
    same, _, same_losses, _ = train(
      params, loss_fn, batch, tx, FSDPConfig(reshard_after_forward=reshard), config=per_leaf
    )
    assert same_losses == ref_losses and max_diff(same.master, ref.master) == 0.0, reshard
  # The fused update (the default) sums the clip's global norm per unit bucket, another
  # order of the same float32 sum: the clip's scale, and through it every update, moves by
  # float32 rounding. Step 0 runs on the same params: the same loss, bit for bit. But
  # casting the masters to bf16 turns that rounding into a whole bf16 spacing wherever a
  # master lies that close to a rounding boundary, and from then on the runs are two bf16
  # programs whose params, activations and gradients differ by bf16 rounding. We bound that
  # as two bf16 programs rounding at different ops: a gradient of block 0's params passes
  # each block's two residual adds, its matmuls' and GELU's bf16 outputs (q/k/v, attention,
  # projection; fc, GELU, projection) and its two LayerNorm outputs, 11 per block, plus the
  # head and the embedding. So the gradients differ by up to rho = bf16_grad_rtol(11 *
  # n_layer + 2) of a leaf's largest (tests/tolerances.py), and Adam's update, scale-free
  # in its gradients, by up to (1 + c_t) rho of a step. Loss: to first order its decrease
  # by step k sums gradient times update over the steps before, terms of one sign while
  # Adam's updates follow -sign(g); updates off by (1 + c_t) rho move it by that much of
  # itself, plus the float32 rounding of the loss's sums. Masters: AdamBound with that
  # rho, per element. This is what bf16 rounding allows, far above what the runs show
  # (~1e-5 of the loss); the exact checks above and the float32 bounds of
  # test_fsdp_equals_single_device are the ones that catch a wrong shard or a lost gradient.
  rho = bf16_grad_rtol(11 * n_layer + 2)
  n_tokens, per_token = 16 * 16, GPT_KW["d_model"] + GPT_KW["vocab_size"]
  loss_rtol, _, bound = step_tolerances(params, n_tokens, per_token, LR, clip=0.5, grad_rtol=rho)
  reference(params, loss_fn, batch, tx, bound=bound)  # the gradients' scale, step by step
  state, _, losses, _ = train(params, loss_fn, batch, tx, fsdp)
  assert state.fused
  assert losses[0] == ref_losses[0]
  c = [adam_ratio_bound(t) for t in range(1, STEPS + 1)]
  for k in range(1, STEPS):
    decrease = ref_losses[0] - ref_losses[k]
    tol = (1 + c[k - 1]) * rho * abs(decrease) + loss_rtol * ref_losses[k]
    assert abs(losses[k] - ref_losses[k]) <= tol, (k, losses[k], ref_losses[k], tol)
  bound.check(per_leaf_state(state, mesh).master, ref.master)
  assert {x.dtype for x in jax.tree.leaves(jaxdp.get_params(state))} == {jnp.dtype(jnp.bfloat16)}


# ----------------------------------------------------------------------------- at rest


def device0_bytes(tree):
  """Bytes of `tree`'s arrays that device 0 holds (its addressable shards)."""
  return sum(
    s.data.nbytes
    for x in jax.tree.leaves(tree)
    for s in x.addressable_shards
    if s.device == jax.devices()[0]
  )


def sharded(tree):
  """The leaves sharded over "data" (Adam's step count and the like are replicated)."""
  return [x for x in jax.tree.leaves(tree) if "data" in tuple(x.sharding.spec)]


def padding_bound(params, leaves, stacked):
  """Most padding elements: every param's leading dim (per layer when stacked) rounds up
  to a multiple of dp, so at most dp - 1 rows of it are padding."""
  total = 0
  for (path, x), keep in zip(jax.tree_util.tree_leaves_with_path(params), leaves):
    layers = x.shape[0] if stacked and "['blocks']" in jax.tree_util.keystr(path) else 0
    shape = x.shape[1:] if layers else x.shape
    total += keep * (DP - 1) * math.prod(shape[1:]) * max(layers, 1)
  return total


@pytest.mark.parametrize("name", ["gpt", "gpt_scan", "gpt_lora_scan"])
def test_fsdp_at_rest_device0_holds_one_dpth(name):
  params, loss_fn, batch, frozen, fsdp = problem(name)
  tx, mesh = optax.adam(1e-3), jax.make_mesh((DP,), ("data",))
  state = jaxdp.init_state(params, tx, mesh, FSDP, frozen=frozen, fsdp=fsdp)
  is_frozen = jax.tree.leaves(frozen) if frozen else [False] * len(jax.tree.leaves(params))
  sizes = [x.size for x in jax.tree.leaves(params)]
  n_train = sum(n for n, f in zip(sizes, is_frozen) if not f)
  n_frozen = sum(n for n, f in zip(sizes, is_frozen) if f)
  stacked = bool(fsdp.stacked)
  pad_train = padding_bound(params, [not f for f in is_frozen], stacked)
  pad_frozen = padding_bound(params, is_frozen, stacked)

  def one_dpth(tree, elements, pad, copies=1):
    leaves = sharded(tree)
    total = sum(x.nbytes for x in leaves)
    assert device0_bytes(leaves) * DP == total  # exactly 1/dp of every sharded leaf
    assert copies * elements * 4 <= total <= copies * (elements + pad) * 4  # fp32

  # Trainable params are not held as params at all (None); frozen ones 1/dp, own dtype.
  assert len(jax.tree.leaves(state.params)) == sum(is_frozen)
  assert sharded(state.params) == jax.tree.leaves(state.params)
  one_dpth(state.params, n_frozen, pad_frozen)
  # The fp32 master (what the optimizer updates) and Adam's two moments: 1/dp each.
  assert sharded(state.master) == jax.tree.leaves(state.master)
  one_dpth(state.master, n_train, pad_train)
  one_dpth(state.opt_state, n_train, pad_train, copies=2)
  assert device0_bytes(state.opt_state) - device0_bytes(sharded(state.opt_state)) <= 8
  # Grads: the reduce-scattered shards the optimizer receives.
  grads = jax.jit(fsdp_lib.make_grad_fn(loss_fn, mesh, FSDP, fsdp=fsdp))(state, batch).grads
  assert sharded(grads) == jax.tree.leaves(grads)
  one_dpth(grads, n_train, pad_train)
  if frozen is not None:  # LoRA: optimizer state is the adapters' alone (/dp)
    assert sum(x.nbytes for x in sharded(state.opt_state)) == 2 * sum(
      x.nbytes for x in jax.tree.leaves(state.master)
    )
    assert 10 * n_train < n_frozen


# ----------------------------------------------------------------------------- collectives


def hlo_computations(text):
  """{name: body} of an HLO module text, and {name: names it calls}."""
  comps, calls, name = {}, {}, None
  for line in text.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      name, comps[head.group(1)] = head.group(1), []
    elif name is not None:
      comps[name].append(line)
  for n, lines in comps.items():
    body = "\n".join(lines)
    calls[n] = set(re.findall(r"(?:to_apply|body|condition|calls)=%?([\w.\-]+)", body))
  return comps, calls


def collectives_by_scope(text):
  """Collectives ("kind", result dtype[size]) outside any loop, and per while-loop body:
  an all-gather's result is the whole unit, a reduce-scatter's the shard."""
  comps, calls = hlo_computations(text)

  def reach(n, seen):
    if n in seen:
      return seen
    seen.add(n)
    for m in calls.get(n, ()):
      reach(m, seen)
    return seen

  def count(names):
    out = Counter()
    for n in names:
      for line in comps[n]:
        m = re.search(r"= (\w+\[[\d,]*\])\{[\d,]*\} (all-gather|reduce-scatter)\(", line)
        if m:
          out[m.group(2), m.group(1)] += 1
    return out

  bodies = {
    b
    for lines in comps.values()
    for line in lines
    for b in re.findall(r"while\(.*body=%?([\w.\-]+)", line)
  }
  in_loops = {n for b in bodies for n in reach(b, set())}
  loops = [count(reach(b, set())) for b in sorted(bodies)]
  return count(set(comps) - in_loops), [c for c in loops if c]


def unit_shard(state, unit):
  """Elements of a unit's shard (its gather/reduce-scatter moves dp of these)."""
  (u,) = [u for u in units_of(state.layout) if u.name == unit]
  return sum(b.shard_size for b, _ in u.gather)


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_collectives_per_unit_unrolled(reshard):
  params, loss_fn, batch, _, _ = problem("gpt")
  fsdp = FSDPConfig(reshard_after_forward=reshard)
  tx, mesh = optax.sgd(0.1), jax.make_mesh((DP,), ("data",))
  state = jaxdp.init_state(params, tx, mesh, FSDP, fsdp=fsdp)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, FSDP, fsdp=fsdp)
  outside, loops = collectives_by_scope(step.lower(state, batch).as_text(dialect="hlo"))
  assert loops == []
  units = ["['wte']", "['wpe']", "['ln_f']"] + [f"['blocks'][{i}]" for i in range(N_LAYER)]
  assert sorted(u.name for u in units_of(state.layout)) == sorted(units)
  size = {u: DP * unit_shard(state, u) for u in units}
  assert len(set(size.values())) == 4  # the blocks are alike; wte, wpe, ln_f differ
  block = size["['blocks'][0]"]
  # One reduce-scatter per unit, in fp32: the tied wte, used by two segments (the embedding
  # at the start, the logits at the end), too: of the sum of their gradients.
  wte, wpe = size["['wte']"], size["['wpe']"]
  assert outside["reduce-scatter", f"f32[{block // DP}]"] == N_LAYER
  assert outside["reduce-scatter", f"f32[{wte // DP}]"] == 1
  assert sum(n for (k, _), n in outside.items() if k == "reduce-scatter") == len(units)
  # One all-gather per unit and segment in the forward; with resharding one more for each
  # segment whose backward needs the params' values (every block, and wte's logits segment;
  # the embedding's wte grad and wpe's grad need only the cotangent).
  assert outside["all-gather", f"f32[{block}]"] == N_LAYER * (2 if reshard else 1)
  assert outside["all-gather", f"f32[{wte}]"] == (3 if reshard else 2)
  assert outside["all-gather", f"f32[{wpe}]"] == 1


@pytest.mark.slow  # a GPT trained for 5 steps: ~40 s each on 2 cores
@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_tied_unit_reduce_scattered_once_and_equals_single_device(reshard):
  """GPT's tied wte is used by two segments (the embedding `one_hot @ wte`, the logits
  `h @ wte.T`): the compiled step reduce-scatters each unit bucket once, wte's the sum of the
  two uses' gradients (as torch FSDP2 and Megatron-FSDP reduce a param's gradient once per
  step), and trains as the single-device program does. Per-leaf update (the fused one with
  resharding: test_fsdp_equals_single_device); tolerances: that test's."""
  params, loss_fn, batch, _, _ = problem("gpt")
  fsdp = FSDPConfig(reshard_after_forward=reshard)
  config = dataclasses.replace(FSDP, fused_update=False)
  loss_rtol, norm_rtol, bound = tolerances("gpt", params)
  ref, ref_losses, ref_norms = reference(params, loss_fn, batch, adamw_clip(), bound=bound)
  state, step, losses, norms = train(params, loss_fn, batch, adamw_clip(), fsdp, config=config)
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
  np.testing.assert_allclose(norms, ref_norms, rtol=norm_rtol)
  bound.check(jaxdp.get_params(state), ref)
  assert bound.tight_fraction(LR / 10) > 0.75
  assert step._cache_size() == 1, "the second step recompiled"

  text = step.lower(state, batch).compile().as_text()
  scatters = Counter(re.findall(r"= (\w+\[[\d,]*\])\{[\d,]*\} reduce-scatter\(", text))
  buckets = [b for u in units_of(state.layout) for b, _ in u.grad]
  assert len(re.findall(r" reduce-scatter(?:-start)?\(", text)) == len(buckets), scatters
  wte = unit_shard(state, "['wte']")
  assert scatters[f"f32[{wte}]"] == 1, scatters


@pytest.mark.parametrize("reshard, last", [(True, False), (True, True), (False, False)])
def test_fsdp_collectives_inside_scan_body(reshard, last):
  params, loss_fn, batch, _, fsdp = problem("gpt_scan")
  fsdp = FSDPConfig(stacked=["blocks"], reshard_after_forward=reshard, reshard_last_layer=last)
  tx, mesh = optax.sgd(0.1), jax.make_mesh((DP,), ("data",))
  state = jaxdp.init_state(params, tx, mesh, FSDP, fsdp=fsdp)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, FSDP, fsdp=fsdp)
  outside, loops = collectives_by_scope(step.lower(state, batch).as_text(dialect="hlo"))

  # A layer's params, whole: what its per-param all-gathers return (the GPT's dims divide 8).
  def gathered(keep):
    return Counter(
      ("all-gather", "f32[" + ",".join(map(str, x.shape[1:])) + "]")
      for path, x in jax.tree_util.tree_leaves_with_path(params["blocks"])
      if keep(path[-1].key)
    )

  # Forward loop: one all-gather per param of the next layer in each iteration. Backward
  # loop: one reduce-scatter per param of a layer per iteration (no ravel of the layer's
  # whole-size grads into a bucket: that copy was the scanned program's memory peak),
  # each returning the param's block of one layer, and, when resharding, the all-gathers of
  # the next layer's params whose values the backward needs: the kernels and LayerNorm
  # scales (a bias's grad needs only the cotangent, so its gather is dead code, dropped).
  forward = gathered(lambda name: True)
  scatters = Counter(
    ("reduce-scatter", "f32[" + ",".join(map(str, x.sharding.shard_shape(x.shape)[1:])) + "]")
    for x in jax.tree.leaves(state.master["blocks"])
  )
  regathers = gathered(lambda name: name in ("kernel", "scale")) if reshard else Counter()
  items = lambda counters: sorted(sorted(c.items()) for c in counters)
  assert items(loops) == items([forward, scatters + regathers]), loops
  # Outside the loops, besides the unrolled units' 1-D bucket collectives, the layers the
  # loops run ahead of or after (a layer gathered one iteration ahead): the forward's first
  # layer gathered (in two parts) and run, with its second gathered under it; the backward's
  # first layer run on the params the forward's last ran on
  # (kept, not gathered again, unless `reshard_last_layer`) and its second gathered (when
  # resharding), the gradients of its first layer reduce-scattered before its loop and of
  # its last layer after it, with the delayed ones of the layer before. Counted on the
  # kernels (2-D).
  kernels = lambda c: Counter({k: n for k, n in c.items() if "," in k[1]})
  first = regathers if last else Counter()
  want = forward + forward + first + regathers + scatters + scatters
  assert kernels(outside) == kernels(want), outside


# ----------------------------------------------------------------------------- fused update


def frozen_kernel(params, freeze):
  """`frozen` for `params` (the MLP): layer 1's kernel when `freeze`, so that unit's gather
  bucket holds a frozen and a trainable param of one dtype (its flat master shard holds the
  bias only)."""
  return jax.tree_util.tree_map_with_path(
    lambda path, _: freeze and jax.tree_util.keystr(path) == "['layers'][1]['kernel']", params
  )


@pytest.mark.parametrize("freeze", [False, True])
def test_fsdp_fused_update_is_taken_and_equals_single_device(freeze):
  """clip_by_global_norm + adamw under FSDP runs as one update of flat unit buckets: master
  and Adam's moments are one flat array per unit bucket sharded over "data", frozen params
  keep their own sharded form, and the run equals the single-device program as the
  per-leaf update does.

  Tolerance: test_fsdp_equals_single_device's (`tolerances`, tests/tolerances.py). The
  fused update does the same elementwise arithmetic on the same values; only the clip's
  global norm sums its squares in another order (per unit bucket, zero padding included,
  not per leaf): a relative change of rtol_sum(n_params) = 4 sqrt(2435) eps32 ~ 200 eps32
  in the clip's scale, below the 4 n eps32 (n = 32 x 3 = 96 terms per gradient) = 384 eps32
  the AdamBound allows every gradient, and within `norm_rtol` for the reported norm. ~15 s.
  """
  params, loss_fn, batch, _, fsdp = problem("mlp")
  frozen = frozen_kernel(params, freeze)
  loss_rtol, norm_rtol, bound = tolerances("mlp", params)
  ref, ref_losses, ref_norms = reference(params, loss_fn, batch, adamw_clip(), frozen, bound=bound)
  runs = {}
  for fused in (None, False):
    config = dataclasses.replace(FSDP, fused_update=fused)
    state, step, losses, norms = runs[fused] = train(
      params, loss_fn, batch, adamw_clip(), fsdp, frozen, config=config
    )
    assert state.fused == (fused is None)
    np.testing.assert_allclose(losses, ref_losses, rtol=loss_rtol)
    np.testing.assert_allclose(norms, ref_norms, rtol=norm_rtol)
    got = jaxdp.get_params(state)
    assert jax.tree.structure(got) == jax.tree.structure(params)
    assert jax.tree.map(lambda x: x.dtype, got) == jax.tree.map(lambda x: x.dtype, params)
    bound.check(got, ref)
    for x, y, f in zip(jax.tree.leaves(got), jax.tree.leaves(params), jax.tree.leaves(frozen)):
      if f:  # the frozen kernel comes back bit for bit
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert step._cache_size() == 1, "the second step recompiled"

  state = runs[None][0]
  layout = state.layout
  flat = {name: (b.shard_size * DP,) for name, _, b in bucket_names(layout)}
  assert len(flat) == len(units_of(layout)) == 4  # one bucket per unit
  assert {k: x.shape for k, x in state.master.items()} == flat
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
  assert sorted(x.shape for x in moments) == sorted(2 * list(flat.values()))  # mu, nu
  assert all(x.sharding.spec == P("data") for x in moments + list(state.master.values()))
  assert train_lib.state_specs(state).master == {name: P("data") for name in flat}
  if freeze:  # the frozen kernel stays in params, its rows sharded as stored
    kernel = state.params["layers"][1]["kernel"]
    assert kernel.shape == (32, 32) and kernel.sharding.spec == P("data", None)
  # Readers see the per-leaf optax state, as under the per-leaf update.
  fused, per_leaf = (jaxdp.get_opt_state(runs[k][0]) for k in (None, False))
  assert jax.tree.structure(fused) == jax.tree.structure(per_leaf)
  assert jax.tree.map(jnp.shape, fused) == jax.tree.map(jnp.shape, per_leaf)
  # The ledger predicts the flat state byte for byte (unit buckets' end padding included).
  rows = memory_report(params, adamw_clip(), DP, FSDP, frozen=frozen, fsdp=fsdp)
  for r in rows[:4]:
    assert r["measured"] == r["predicted"], r
  measured = {r["kind"]: r["measured"] for r in rows}
  assert measured["master"] == sum(x.size * 4 for x in state.master.values()) // DP


def scalar_all_reduces(step, state, batch):
  """Result types of the compiled step's all-reduces."""
  text = step.lower(state, batch).compile().as_text()
  return sorted(re.findall(r"= (\w+\[[\d,]*\])\{?[\d,]*\}? all-reduce\(", text))


def test_fsdp_fused_clip_all_reduces_one_norm_per_unit_bucket():
  """The clip's global norm, run in the global view on the sharded grads, all-reduces one
  partial sum per leaf under the per-leaf update (8 leaves), one per unit bucket when fused
  (4 units); the f32[2] carries the loss and the reported norm."""
  params, loss_fn, batch, _, fsdp = problem("mlp")
  mesh, tx = jax.make_mesh((DP,), ("data",)), adamw_clip()
  for fused, n in ((None, 4), (False, 8)):
    config = dataclasses.replace(FSDP, fused_update=fused)
    state = jaxdp.init_state(params, tx, mesh, config, fsdp=fsdp)
    step = jaxdp.make_train_step(loss_fn, tx, mesh, config, fsdp=fsdp)
    assert state.fused == (fused is None)
    assert scalar_all_reduces(step, state, batch) == ["f32[2]"] + ["f32[]"] * n


def test_fsdp_fused_update_falls_back_for_masks_lamb_and_stacked_units():
  """Masks of the param tree and per-leaf statistics keep the per-leaf update (the probe
  runs on FSDP's unit buckets), and so do stacked units; fused_update=True refuses them,
  naming why."""
  params, _, _, _, _ = problem("mlp")
  mesh = jax.make_mesh((DP,), ("data",))
  decay = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  masked = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(LR, mask=decay))
  assert jaxdp.init_state(params, adamw_clip(), mesh, FSDP).fused
  for tx in (masked, optax.lamb(LR)):
    assert not jaxdp.init_state(params, tx, mesh, FSDP).fused
  forced = dataclasses.replace(FSDP, fused_update=True)
  with pytest.raises(ValueError, match="fused_update=True: the optax transformation updates"):
    jaxdp.init_state(params, optax.lamb(LR), mesh, forced)
  toy, cfg = {"w": jnp.ones((3, 16, 4)), "b": jnp.ones((4,))}, FSDPConfig(stacked=["w"])
  assert not jaxdp.init_state(toy, adamw_clip(), mesh, FSDP, fsdp=cfg).fused
  with pytest.raises(ValueError, match="fused_update=True: some params are stacked FSDP units"):
    jaxdp.init_state(toy, adamw_clip(), mesh, forced, fsdp=cfg)


# ----------------------------------------------------------------------------- units, errors


def test_units_from_prefixes_and_function():
  params, _, _, _, _ = problem("gpt")
  mesh = jax.make_mesh((DP,), ("data",))
  state = jaxdp.init_state(params, optax.sgd(0.1), mesh, FSDP, fsdp=FSDPConfig(units=["blocks"]))
  assert sorted(u.name for u in units_of(state.layout)) == ["<root>", "['blocks']"]
  two = FSDPConfig(units=lambda path: "even" if "[0]" in path or "[2]" in path else "odd")
  state = jaxdp.init_state(params, optax.sgd(0.1), mesh, FSDP, fsdp=two)
  assert sorted(b.unit for b in state.layout.buffers[0].buckets) == ["even", "odd"]


def test_fsdp_errors_name_the_fix():
  params, loss_fn, batch, _, _ = problem("gpt_scan")
  tx, mesh = optax.sgd(0.1), jax.make_mesh((DP,), ("data",))
  with pytest.raises(ValueError, match="optim_grads_params"):
    jaxdp.init_state(params, tx, mesh, jaxdp.DDPConfig(), fsdp=FSDPConfig())
  state = jaxdp.init_state(params, tx, mesh, FSDP, fsdp=FSDPConfig(stacked=["blocks"]))
  with pytest.raises(ValueError, match="same fsdp="):
    jaxdp.make_train_step(loss_fn, tx, mesh, FSDP)(state, batch)

  # A model that scans its stacked layers with no marker of jaxdp's trains: d loss / d w = mean(x) = 1 everywhere, so one SGD step of 0.1 gives 0.9 (exact
  # up to f32 rounding of the sum over devices).
  def no_hook(p, b):
    _, per_layer = jax.lax.scan(lambda c, w: (c, jnp.sum(w)), None, p["w"])
    return jnp.sum(per_layer) * jnp.mean(b["x"])

  toy, cfg = {"w": jnp.ones((3, 16, 4))}, FSDPConfig(stacked=["w"])
  state = jaxdp.init_state(toy, tx, mesh, FSDP, fsdp=cfg)
  state, _ = jaxdp.make_train_step(no_hook, tx, mesh, FSDP, fsdp=cfg)(state, {"x": jnp.ones((8,))})
  np.testing.assert_allclose(np.asarray(jaxdp.get_params(state)["w"]), 0.9, rtol=1e-6)
  # A shape-dependent optimizer on padded leaves (the MLP's 6-row kernel pads to 8).
  mlp_params, _, _ = mlp_problem()
  with pytest.raises(NotImplementedError, match="adafactor|factored|shape"):
    jaxdp.init_state(mlp_params, optax.adafactor(1e-3), mesh, FSDP)
  with pytest.raises(ValueError, match="layer axes"):
    jaxdp.layout.make_layout(
      {"a": jnp.zeros((2, 3)), "b": jnp.zeros((4,))}, dp=2, units=lambda p: "u", stacked={"['a']"}
    )


# ----------------------------------------------------------------------------- GPU target

needs_gpu_compile = pytest.mark.skipif(
  aot.gpu_compile_unavailable() is not None, reason=str(aot.gpu_compile_unavailable())
)


def gpu_step(name, reshard=True):
  params, loss_fn, batch, frozen, fsdp = problem(name)
  fsdp = FSDPConfig(stacked=fsdp.stacked, reshard_after_forward=reshard)
  tx = optax.adamw(1e-3)
  mesh = aot.gpu_mesh((DP,), ("data",))
  state = jax.eval_shape(lambda p: jaxdp.init_state(p, tx, mesh, FSDP, fsdp=fsdp), params)
  batch = aot.abstract_like(jax.device_put(batch), mesh)
  batch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=jax.NamedSharding(mesh, jax.P("data"))
    ),
    batch,
  )
  step = jaxdp.make_train_step(loss_fn, tx, mesh, FSDP, fsdp=fsdp)
  return state, step.lower(state, batch).compile()


@pytest.mark.slow
@needs_gpu_compile
def test_fsdp_gpu_schedule_prefetches_next_unit():
  from jaxdp._src import inspect as jinspect

  state, compiled = gpu_step("gpt")
  s = jinspect.schedule(compiled)
  block = 4 * unit_shard(state, "['blocks'][0]")  # f32 bytes of a block's shard
  gathers = [c for c in s.collectives if c.kind == "all-gather" and c.operand_bytes == block]
  scatters = [c for c in s.collectives if c.kind == "reduce-scatter"]
  assert len(gathers) == 2 * N_LAYER  # forward + backward re-gather, kept apart by XLA
  # One reduce-scatter per unit: the tied wte's sums its two uses (embedding, logits).
  assert len(scatters) == 6 and all(c.is_async for c in gathers + scatters)
  # Prefetch (depth 1, by data dependencies): every block's all-gather but the first runs
  # while compute runs, and while GEMMs run except the first of the backward, which may start
  # only once the backward of the unit after the last block (ln_f: no GEMM) has.
  assert all(c.overlaps_compute for c in gathers[1:]), [c.overlapped for c in gathers]
  forward, backward = gathers[:N_LAYER], gathers[N_LAYER:]
  assert all(c.overlaps_gemm for c in forward[1:] + backward[1:]), [c.overlapped for c in gathers]
  assert sum(c.overlaps_gemm for c in scatters) >= N_LAYER


@pytest.mark.slow
@needs_gpu_compile
def test_fsdp_gpu_schedule_scan_pipelines_layer_gathers():
  """The scanned GPT (4 layers) on 8 H100s, its loops one layer ahead (docs/design.md,
  "Scanned layers one iteration ahead"): the forward loop's one collective is the next
  layer's gather, its per-param all-gathers combined into one, under a GEMM; the first
  layer's MLP params gathered under its attention's GEMMs; the backward gathers each
  layer's kernels and LayerNorm scales once (the params whose values it reads), but the
  forward's last layer's, which it runs first on the params the forward kept, and
  reduce-scatters each kernel's whole-size gradient once per layer (never a layer's raveled
  bucket), all of it under compute, each gather under a GEMM."""
  from jaxdp._src import inspect as jinspect

  n = 4  # layers: the forward's first and last run outside its loop
  state, compiled = gpu_step("gpt_scan4")
  s = jinspect.schedule(compiled)
  leaves = jax.tree_util.tree_leaves_with_path(state.master["blocks"])
  shard_bytes = lambda keep: sum(4 * x.size // n // DP for p, x in leaves if keep(p))
  in_loop = [c for c in s.collectives if c.trip_count > 1]
  (forward,) = in_loop
  assert forward.kind == "all-gather" and forward.trip_count == n - 2, in_loop
  assert forward.operand_bytes == shard_bytes(lambda p: True), forward
  assert forward.is_async and forward.overlaps_gemm, forward.overlapped
  # [Note: the first layer in two parts]: the MLP's params (the largest first, and what
  # follows it) gathered once the attention's have landed, under its GEMMs
  mlp = shard_bytes(lambda p: p[0].key == "mlp")
  (rest,) = [c for c in s.collectives if c.kind == "all-gather" and c.operand_bytes == mlp]
  assert rest.is_async and rest.overlaps_gemm, rest.overlapped
  needed = shard_bytes(lambda p: p[-1].key in ("kernel", "scale"))
  backward = [c for c in s.collectives if c.kind == "all-gather" and c.operand_bytes == needed]
  assert sum(c.trip_count for c in backward) == n - 1, [c.operand_bytes for c in s.collectives]
  assert all(c.is_async and c.overlaps_gemm for c in backward), [c.overlapped for c in backward]
  # The kernels' reduce-scatters (2-D: no other unit's collective has their sizes).
  kernels = Counter(4 * math.prod(x.shape[1:]) for _, x in leaves if x.ndim > 2)
  scatters = [c for c in s.collectives if c.kind == "reduce-scatter" and c.operand_bytes in kernels]
  runs = Counter()
  for c in scatters:
    runs[c.operand_bytes] += c.trip_count
  assert runs == {b: k * n for b, k in kernels.items()}, runs
  assert all(c.is_async for c in scatters), scatters
  # Each under compute, but possibly the last of the layer the backward runs first: that
  # layer starts at once on the params its forward kept, and the barrier that keeps its
  # reduce-scatters in its own iteration comes right after its last gradient.
  first_layer = sum(kernels.values())  # its scatters come first
  unhidden = [j for j, c in enumerate(scatters) if not c.overlaps_compute]
  assert len(unhidden) <= 1 and all(j < first_layer for j in unhidden), [
    c.overlapped for c in scatters
  ]
