"""FSDP on models jaxdp did not write: the scanned / unrolled residual MLP of docs/memory.md, built
any number of times, with the user's remat, next to DDP; equal to the single-device program."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from tests import tolerances
from jaxdp import FSDPConfig

DP = 8
FSDP = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")


def block(h, w):
  """The residual MLP block of docs/memory.md: h + gelu(h @ W1) @ W2."""
  return h + jax.nn.gelu(h @ w["w1"]) @ w["w2"]


def body(h, w):  # a module-level scan body: lax.scan caches its trace
  return block(h, w), None


remat_body = jax.checkpoint(body)


def mlp_params(layers, d=16, ffn=40, scanned=True, seed=0):
  k = jax.random.split(jax.random.key(seed), 2 * layers + 1)
  w1 = [jax.random.normal(k[2 * i], (d, ffn)) / np.sqrt(d) for i in range(layers)]
  # W2 scaled by 1/layers (as GPT-2 scales its output projections): the residual stream and
  # the grads stay O(1) at any depth, so the absolute tolerance means the same at L=1 and 16.
  w2 = [jax.random.normal(k[2 * i + 1], (ffn, d)) / np.sqrt(ffn) / layers for i in range(layers)]
  head = jax.random.normal(k[-1], (d, 3)) / np.sqrt(d)
  if scanned:
    return {"blocks": {"w1": jnp.stack(w1), "w2": jnp.stack(w2)}, "head": head}
  return {"blocks": [{"w1": a, "w2": b} for a, b in zip(w1, w2)], "head": head}


def make_loss(scanned=True, remat="none"):
  """remat: "none", "body" (jax.checkpoint around the scan body / each block), "inner"
  (jax.checkpoint around the block inside the body)."""

  def loss_fn(params, batch):
    h = batch["x"]
    if scanned:
      f = {
        "none": body,
        "body": remat_body,
        "inner": lambda h, w: (jax.checkpoint(block)(h, w), None),
      }[remat]
      h, _ = jax.lax.scan(f, h, params["blocks"])
    else:
      f = jax.checkpoint(block) if remat != "none" else block
      for w in params["blocks"]:
        h = f(h, w)
    return jnp.mean((h @ params["head"] - batch["y"]) ** 2)

  return loss_fn


def batch(d=16, n=16):
  k1, k2 = jax.random.split(jax.random.key(7))
  return {"x": jax.random.normal(k1, (n, d)), "y": jax.random.normal(k2, (n, 3))}


def reference(params, loss_fn, b, tx, steps, bound=None):
  """Plain jax.grad + optax on one device; `bound` (a tolerances.AdamBound) sees its grads.
  Returns the params, the last loss and the first step's grads (at `params`)."""
  opt, grad_fn, first = tx.init(params), jax.jit(jax.value_and_grad(loss_fn)), None
  for _ in range(steps):
    loss, g = grad_fn(params, b)
    first = g if first is None else first
    if bound is not None:
      bound.add(g)
    u, opt = tx.update(g, opt, params)
    params = optax.apply_updates(params, u)
  return params, float(loss), first


def run(params, loss_fn, b, tx, steps, fsdp, config=FSDP, mesh=None, **kw):
  """`steps` jaxdp steps from `params` (on `mesh`, or 8 devices over "data"): the state
  after them and the step."""
  mesh = mesh or jax.make_mesh((DP,), ("data",))
  state = jaxdp.init_state(params, tx, mesh, config, fsdp=fsdp)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config, fsdp=fsdp, **kw)
  for _ in range(steps):
    state, metrics = step(state, b)
  return state, step, float(metrics["loss"])


def train(params, loss_fn, b, tx, steps, fsdp, config=FSDP, **kw):
  state, _, loss = run(params, loss_fn, b, tx, steps, fsdp, config, **kw)
  return jaxdp.get_params(state), loss


def test_scanned_step_built_twice_and_next_to_ddp():
  """lax.scan caches the trace of a module-level body: a second build must still gather."""
  lr, b = 1e-2, batch()
  tx, n_terms = optax.adam(lr), 16 * 3  # examples x outputs of the squared error

  def check(params, got, loss):
    loss_rtol, _, bound = tolerances.step_tolerances(params, n_terms, 3 * 40, lr)
    ref, ref_loss, _ = reference(params, make_loss(), b, tx, 2, bound)
    bound.check(got, ref)
    np.testing.assert_allclose(loss, ref_loss, rtol=loss_rtol)

  check(mlp_params(2), *train(mlp_params(2), make_loss(), b, tx, 2, None, config=jaxdp.DDPConfig()))
  for layers in (2, 2, 3):  # the same step built again, then another depth, same shapes
    params = mlp_params(layers)
    check(params, *train(params, make_loss(), b, tx, 2, FSDPConfig(stacked=["blocks"])))


def one_sgd_step(params, loss_fn, b, fsdp, **kw):
  """One SGD(lr=1) step under jaxdp and on one device: params - grad, so the params agree
  to the derived bound on two float32 programs' gradients (tests/tolerances.py: the batch's
  examples summed in another order), plus the rounding of params - grad.

  Returns the step and the state after it, for a test to read the program that ran (its
  lowering is cached: no second trace)."""
  tx = optax.sgd(1.0)
  ref, _, grads = reference(params, loss_fn, b, tx, 1)  # grads: the scale of the bound
  state, step, _ = run(params, loss_fn, b, tx, 1, fsdp, **kw)
  got = jaxdp.get_params(state)
  n_terms = jax.tree.leaves(b)[0].shape[0]
  for (path, x), y, g, p, atol in zip(
    jax.tree_util.tree_leaves_with_path(got),
    jax.tree.leaves(ref),
    jax.tree.leaves(grads),
    jax.tree.leaves(params),
    jax.tree.leaves(tolerances.grad_atol(grads, n_terms)),
  ):
    bound = atol + 2 * tolerances.EPS32 * float(jnp.max(jnp.abs(p) + jnp.abs(g)))
    np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), rtol=0, atol=bound, err_msg=jax.tree_util.keystr(path)
    )
  return step, state


@pytest.mark.parametrize(
  "layers,d,remat", [(1, 16, "none"), (2, 12, "body"), (3, 16, "inner"), (16, 12, "none")]
)
def test_scanned_any_layer_count_width_and_remat(layers, d, remat):
  """Layer counts 1-16; d = 12 does not divide by dp = 8 (padded shards); the user's
  jax.checkpoint around the scan body or inside it."""
  params = mlp_params(layers, d=d)
  one_sgd_step(params, make_loss(remat=remat), batch(d), FSDPConfig(stacked=["blocks"]))


@pytest.mark.parametrize("layers,remat", [(1, "none"), (3, "body"), (4, "inner")])
def test_scanned_without_prefetch(layers, remat):
  """`FSDPConfig(prefetch=0)`: each loop iteration gathers its own layer (no layer held
  ahead); the step is the single-device one all the same."""
  params = mlp_params(layers, d=12)
  one_sgd_step(
    params, make_loss(remat=remat), batch(12), FSDPConfig(stacked=["blocks"], prefetch=0)
  )


@pytest.mark.parametrize("remat", ["none", "body"])
def test_unrolled_with_and_without_remat(remat):
  params = mlp_params(3, d=12, scanned=False)
  one_sgd_step(params, make_loss(scanned=False, remat=remat), batch(12), FSDPConfig())


def test_nnx_scan_model_with_nnx_remat():
  """A model built the nnx way (nnx.vmap-created stacked blocks, nnx.scan over them, nnx.remat
  in the body): jaxdp finds the scan over the stacked params without any marker."""
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, d, rngs):
      self.lin = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
      return x + jax.nn.gelu(self.lin(x))

  class Model(nnx.Module):
    def __init__(self, d, n, rngs):
      @nnx.split_rngs(splits=n)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return Block(d, rngs)

      self.blocks = make(rngs)
      self.head = nnx.Linear(d, 3, rngs=rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      @nnx.remat
      def run(x, block):
        return block(x)

      return self.head(run(x, self.blocks))

  def model_loss(model, b):
    return jnp.mean((model(b["x"]) - b["y"]) ** 2)

  params, loss_fn = jaxdp.nnx_split(Model(16, 3, nnx.Rngs(0)), model_loss)
  step, state = one_sgd_step(params, loss_fn, batch(), FSDPConfig(stacked=["blocks"]))
  # The blocks are gathered one layer per iteration inside the loops (forward: a gather per
  # param; backward: the same and a reduce-scatter per param), never whole outside them.
  from tests.test_fsdp import collectives_by_scope

  outside, loops = collectives_by_scope(step.lower(state, batch()).as_text(dialect="hlo"))
  layer = {("all-gather", "f32[16,16]"): 1, ("all-gather", "f32[16]"): 1}  # kernel, bias
  # (each reduce-scatter's shard: 16 rows over 8 devices)
  scatters = {("reduce-scatter", "f32[2,16]"): 1, ("reduce-scatter", "f32[2]"): 1}
  assert sorted(map(dict, loops), key=len) == [layer, {**layer, **scatters}]
  assert all(size not in ("f32[3,16,16]", "f32[3,16]") for _, size in outside)


def _script():
  import importlib.util
  from pathlib import Path

  path = Path(__file__).parents[1] / "scripts" / "bench" / "fsdp_memory.py"
  spec = importlib.util.spec_from_file_location("fsdp_memory", path)
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  return script


@pytest.mark.slow
@pytest.mark.skipif(
  __import__("jaxdp._src.aot", fromlist=["x"]).gpu_compile_unavailable() is not None,
  reason="no GPU compile here",
)
def test_memory_relations_on_the_residual_mlp():
  """scripts/bench/fsdp_memory.py's relations on a half-width residual MLP (d 512, ffn 2048, each
  block under the user's jax.checkpoint, Adam, f32), 8 x H100. Unrolled, jaxdp's FSDP peaks
  below GSPMD's FSDP and below its own ZeRO-1 and DDP; in both forms it grows per layer by its
  1/8 share of the layer (params + Adam state + grad shard: 16 bytes x 2M elements / 8) plus
  the saved block input, not by the layer. Scanned, GSPMD gathers a layer param by param
  inside its loop, as jaxdp does with `prefetch=0` (bound: half a layer's params above it),
  while jaxdp's default loops run one layer ahead (docs/design.md, "Scanned layers one
  iteration ahead"): they hold the next layer gathered while computing one, and in the
  backward the gradients of a layer's first half until the next iteration (bound: two
  layers' f32 params above GSPMD, one gathered ahead and one of gradients waiting; the
  price of the overlap, not growing with depth). jaxdp's DDP and ZeRO-1 within 5% of GSPMD's
  DDP and ZeRO-1 in both forms (the GSPMD programs of scripts/bench/gspmd_baselines.py),
  but for the scanned ZeRO-1 at L = 8 (see below). (~28 compiles, about a minute.)"""
  script, MiB = _script(), 2**20
  kw = dict(d=512, ffn=2048, batch=16, seq=128, log=False, remat=True)
  per_layer = 16 * 2 * 512 * 2048 / 8 + 16 * 128 * 512 * 4 / 8
  unrolled = script.measure(
    "mlp", (4, 8), scanned=False, programs=("GSPMD FSDP", "jaxdp FSDP"), **kw
  )
  ddp = ("GSPMD DDP", "jaxdp no_shard", "GSPMD ZeRO-1", "jaxdp optim")
  unrolled.update(script.measure("mlp", (4, 8), scanned=False, programs=ddp, **kw))
  scanned = script.measure("mlp", (4, 8), scanned=True, programs=("jaxdp FSDP",), **kw)
  own = script.measure("mlp", (4, 8), scanned=True, programs=("jaxdp FSDP",), prefetch=0, **kw)
  scanned.update(script.measure("mlp", (4, 8), scanned=True, programs=("GSPMD FSDP",) + ddp, **kw))
  print(
    {k: v / MiB for k, v in {**unrolled, **{("scan",) + k: v for k, v in scanned.items()}}.items()}
  )
  for n in (4, 8):
    assert unrolled["jaxdp FSDP", n] <= unrolled["GSPMD FSDP", n]
  assert unrolled["jaxdp FSDP", 4] < unrolled["jaxdp optim", 4] < unrolled["jaxdp no_shard", 4]
  for stats in (unrolled, scanned):
    assert script.growth(stats, "jaxdp FSDP", (4, 8)) <= per_layer + 0.5 * MiB
  layer = 2 * 512 * 2048 * 4  # bytes: the layer's two f32 matrices
  for n in (4, 8):
    assert own["jaxdp FSDP", n] <= scanned["GSPMD FSDP", n] + layer / 2, (own, n)
    assert scanned["jaxdp FSDP", n] <= scanned["GSPMD FSDP", n] + 2 * layer, (scanned, n)
  # DDP: within 5% of GSPMD's all-reduce-per-grad program, the bound asked of it. Each bucket is
  # copied before its all-reduce (XLA has no buffer views), so this holds because no_shard's
  # default bucket is 25 MiB (Megatron's 40M elements put it 11% over at d 1024).
  # Measured: unrolled equal (156.5 / 284.5 MiB), scanned 160.5 / 288.5 against 153 / 283.
  for stats in (unrolled, scanned):
    for n in (4, 8):
      assert stats["jaxdp no_shard", n] <= 1.05 * stats["GSPMD DDP", n], (stats, n)
  # ZeRO-1: within 5% of GSPMD's (optimizer state sharded) in both forms. Scanned, jaxdp's
  # `optim` (the script passes DDPConfig(stacked=["blocks"])) gathers and reduce-scatters
  # each layer inside the scan, as GSPMD reduce-scatters inside its backward loop (before,
  # the whole stacked gradient was reduced after the scan: 1.24 x at d 1024).
  # Measured: unrolled equal (76.5 / 152.5 MiB), scanned 73 / 123 against 78.5 / 115: at
  # L = 8 GSPMD ZeRO-1 shards Adam's stacked moments on their layer axis (MaxText's
  # shard_optimizer_over_data puts "data" on the first dim that dp divides, and 8 divides
  # the 8 layers), a placement jaxdp's stack, sharded within each layer, does not take:
  # 1.07 x, bounded at 1.10 x there until it does.
  for stats in (unrolled, scanned):
    for n in (4, 8):
      bound = 1.10 if stats is scanned and n == 8 else 1.05
      assert stats["jaxdp optim", n] <= bound * stats["GSPMD ZeRO-1", n], (stats, n)


@pytest.mark.parametrize("scanned", [True, False])
def test_grad_accumulation_keeps_units_gathered(scanned):
  """FSDPConfig(reshard_after_backward=False), 2 micro-batches: one all-gather and one
  reduce-scatter per unit and step, the same update as the single-device program."""
  import re

  params, d = mlp_params(3, d=12, scanned=scanned), 12
  fsdp = FSDPConfig(stacked=["blocks"] if scanned else [], reshard_after_backward=False)
  step, state = one_sgd_step(params, make_loss(scanned), batch(d), fsdp, grad_accum_steps=2)
  hlo = step.lower(state, batch(d)).as_text(dialect="hlo")
  units = 2 if scanned else 4  # blocks (stacked: one unit) + head
  assert len(re.findall(r" all-gather\(", hlo)) == units
  assert len(re.findall(r" reduce-scatter\(", hlo)) == units


@pytest.mark.parametrize("scanned", [False, True])
def test_chunked_tied_embedding(scanned):
  """FSDPConfig(chunks={"wte": 4}) on a tiny GPT whose tied wte (vocab 300: 304 padded rows,
  38 per device, blocks of 9 / 10 / 9 / 10) is used by the embedding (one_hot @ wte: rows
  contracted) and the logits (h @ wte.T: rows free): the same update as one device, and wte
  is never gathered whole. Per block, the embedding's forward, the logits' forward and the
  logits' backward gather it (the embedding's gradient needs no value of wte), and the two
  backwards reduce-scatter it: 3 all-gathers and 2 reduce-scatters per block, of 1/4 of wte
  (one per use: summing the uses' gradients first would hold wte's whole gradient)."""
  import re

  from flax import nnx

  from models.gpt import GPT, GPTConfig, gpt_loss

  vocab, d = 300, 16
  config = GPTConfig(
    vocab_size=vocab, block_size=8, n_layer=2, n_head=2, d_model=d, remat=True, scan_layers=scanned
  )
  params, loss_fn = jaxdp.nnx_split(GPT(config, rngs=nnx.Rngs(0)), gpt_loss)
  k1, k2 = jax.random.split(jax.random.key(1))
  b = {
    "x": jax.random.randint(k1, (16, 8), 0, vocab),
    "y": jax.random.randint(k2, (16, 8), 0, vocab),
  }
  fsdp = FSDPConfig(chunks={"wte": 4}, stacked=["blocks"] if scanned else [])
  step, state = one_sgd_step(params, loss_fn, b, fsdp)
  hlo = step.lower(state, b).as_text(dialect="hlo")
  count = lambda kind, shape: len(re.findall(rf"= f32\[{shape}\]\S* {kind}\(", hlo))
  for rows in (9, 10):  # two blocks of each size
    assert count("all-gather", f"{DP * rows},{d}") == 3 * 2
    assert count("reduce-scatter", f"{rows},{d}") == 2 * 2
  assert count("all-gather", f"{304 * d}") == count("all-gather", f"304,{d}") == 0


def test_chunks_refuse_a_param_used_outside_a_matmul_or_lookup():
  """A chunked param's value is never whole, so any use but a cast, a matmul or a row
  lookup is refused, by name."""
  params = {"wte": jnp.ones((64, 8)), "head": jnp.ones((4, 3))}

  def loss_fn(params, batch):
    h = params["wte"][:, :4] + batch["x"]  # a slice of the table, not its rows by id
    return jnp.mean(h @ params["head"])

  mesh = jax.make_mesh((DP,), ("data",))
  fsdp = FSDPConfig(chunks={"wte": 2})
  state = jaxdp.init_state(params, optax.sgd(1.0), mesh, FSDP, fsdp=fsdp)
  step = jaxdp.make_train_step(loss_fn, optax.sgd(1.0), mesh, FSDP, fsdp=fsdp)
  with pytest.raises(ValueError, match=r"params\['wte'\].*`slice`.*leave it out of chunks="):
    step(state, {"x": jnp.zeros((8, 64, 4))})


def _tiny_llama(compute_dtype):
  from models.llama import LlamaConfig, init_params, llama_loss

  # vocab 300: 304 padded rows, 38 per device, row blocks of 9 / 10 / 9 / 10 at C = 4
  config = LlamaConfig(
    vocab=300, d=16, n_layer=2, n_head=2, n_kv_head=1, ffn=32, compute_dtype=compute_dtype
  )
  k1, k2 = jax.random.split(jax.random.key(1))
  b = {"x": jax.random.randint(k1, (16, 8), 0, 300), "y": jax.random.randint(k2, (16, 8), 0, 300)}
  return init_params(config, jax.random.key(0)), llama_loss(config), b


LLAMA_CHUNKS = FSDPConfig(chunks={"embed": 4, "out": 4}, stacked=["blocks"])


def test_chunked_vocabulary_of_a_llama():
  """models/llama.py reads its embedding by indexing (`embed[ids]`) and casts its output
  matrix before `h @ out.T`: both chunked, one SGD step equals one device's (float32), and
  in bfloat16 neither is ever gathered whole. The lookup's forward gathers each row block
  once, in the table's float32 (the rows are cast after the lookup), and its backward
  gathers nothing (linear in the table); `out`'s blocks move in the loss's bfloat16, twice
  (forward, and backward for the cotangent of `h`). Each block's gradient is
  reduce-scattered in float32."""
  import re

  params, loss_fn, b = _tiny_llama(jnp.float32)
  one_sgd_step(params, loss_fn, b, LLAMA_CHUNKS)

  params, loss_fn, b = _tiny_llama(jnp.bfloat16)
  mesh = jax.make_mesh((DP,), ("data",))
  state = jaxdp.init_state(params, optax.sgd(1.0), mesh, FSDP, fsdp=LLAMA_CHUNKS)
  step = jaxdp.make_train_step(loss_fn, optax.sgd(1.0), mesh, FSDP, fsdp=LLAMA_CHUNKS)
  hlo = step.lower(state, b).as_text(dialect="hlo")
  count = lambda kind, dtype, shape: len(re.findall(rf"= {dtype}\[{shape}\]\S* {kind}\(", hlo))
  for rows in (9, 10):  # two blocks of each size, of each table
    assert count("all-gather", "f32", f"{DP * rows},16") == 2  # embed: forward only
    assert count("all-gather", "bf16", f"{DP * rows},16") == 2 * 2  # out: forward, backward
    assert count("reduce-scatter", "f32", f"{rows},16") == 2 * 2
  for dtype in ("f32", "bf16"):
    assert count("all-gather", dtype, "304,16") == count("all-gather", dtype, f"{304 * 16}") == 0


def test_chunked_vocabulary_in_bfloat16_equals_one_device():
  """The bfloat16 Llama, chunked: one SGD step (lr 1: params - grads) against one device's.
  Two bfloat16 programs: the blocks' matmuls and the unchunked ones may round at other ops,
  and `out`'s block gradients are rounded to bfloat16 once more after their float32
  reduction. An embedding gradient is rounded at most at each bfloat16 op on its way back
  from the loss: per layer its two residual adds, the two RMSNorms, q, k, v and their two
  rotary embeddings, the scores, the probabilities, the attention output and its
  projection, the gate, the up projection, their product and the down projection (16),
  plus the logits, the final norm, `out`'s extra rounding and the embedding's cast: so the
  gradients differ by up to `bf16_grad_rtol(16 * layers + 4)` of a leaf's largest."""
  params, loss_fn, b = _tiny_llama(jnp.bfloat16)
  got, _ = train(params, loss_fn, b, optax.sgd(1.0), 1, LLAMA_CHUNKS)
  grads = jax.grad(loss_fn)(params, b)
  assert_sgd_step_within(got, params, grads, tolerances.bf16_grad_rtol(16 * 2 + 4))


@pytest.mark.parametrize("mode", ["fill", "clip"])
def test_chunked_lookup_modes(mode):
  """`jnp.take(w, ids, axis=0, mode=...)`: "fill" reads NaN for an id out of range and
  "clip" the nearest row, as the lookup does on one device; in range, the same rows."""
  params = {"wte": jax.random.normal(jax.random.key(0), (60, 8)), "head": jnp.ones((8, 3))}
  ids = jnp.array([[0, 59, 17, 31], [45, 8, 59, 3]] * 4, jnp.int32)

  def loss_fn(params, batch):
    h = jnp.take(params["wte"], batch["ids"], axis=0, mode=mode)
    return jnp.mean(jnp.tanh(h) @ params["head"])

  if mode == "clip":  # ids past either end read (and train) the first and last rows
    ids = ids.at[0, 0].set(70).at[1, 1].set(-3)
  step, state = one_sgd_step(params, loss_fn, {"ids": ids}, FSDPConfig(chunks={"wte": 3}))
  if mode == "fill":  # an id past the end: the loss is NaN, whatever the params
    _, metrics = step(state, {"ids": ids.at[0, 0].set(60)})
    assert np.isnan(float(metrics["loss"]))


def assert_sgd_step_within(got, params, grads, rho):
  """`got`, the params after one `optax.sgd(1.0)` step, moved each leaf by its gradient in
  `grads` to within `rho` of the leaf's largest gradient (plus float32 rounding of the
  subtraction)."""
  for (path, x), p, g in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(params), jax.tree.leaves(grads)
  ):
    scale = float(jnp.max(jnp.abs(g)))
    atol = rho * scale + 2 * tolerances.EPS32 * float(jnp.max(jnp.abs(p) + jnp.abs(g)))
    np.testing.assert_allclose(
      np.asarray(p - x), np.asarray(g), rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path)
    )
