"""What an FSDP step moves, and when: the gathers in the dtype the loss casts to, the
vocabulary tables computed by rows (`FSDPConfig(vocab_parallel=)`), the scanned layers
gathered one iteration ahead. Each against the single-device program, and each read off
the program that runs (CPU) or the one compiled for 8 H100s without a GPU."""

import dataclasses
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp import FSDPConfig
from jaxdp.inspect import compile_train_step, gpu_compile_unavailable, predict_step, schedule
from models.llama import LlamaConfig, abstract_params, init_params, llama_loss
from tests import tolerances
from tests.test_fsdp_units import assert_sgd_step_within, one_sgd_step, train

DP = 8
FSDP = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
STACKED = FSDPConfig(stacked=["blocks"])
PER_LEAF = dataclasses.replace(FSDP, fused_update=False)  # a fused state gathers its tables
GATHERED = FSDPConfig(stacked=["blocks"], vocab_parallel=False)
LOOKUPS = FSDPConfig(stacked=["blocks"], lookups=["embed"])


def tiny_llama(compute_dtype=jnp.float32, vocab=300, scan_layers=True):
  """models/llama.py at d 16, 2 layers; 16 sequences of 8 tokens (2 per device). Vocab 300:
  304 rows padded, 38 per device."""
  config = LlamaConfig(
    vocab=vocab,
    d=16,
    n_layer=2,
    n_head=2,
    n_kv_head=1,
    ffn=32,
    compute_dtype=compute_dtype,
    scan_layers=scan_layers,
  )
  k1, k2 = jax.random.split(jax.random.key(1))
  ids = lambda k: jax.random.randint(k, (16, 8), 0, vocab)
  return init_params(config, jax.random.key(0)), llama_loss(config), {"x": ids(k1), "y": ids(k2)}


def lowered_hlo(params, loss_fn, b, fsdp):
  mesh = jax.make_mesh((DP,), ("data",))
  state = jaxdp.init_state(params, optax.sgd(1.0), mesh, FSDP, fsdp=fsdp)
  step = jaxdp.make_train_step(loss_fn, optax.sgd(1.0), mesh, FSDP, fsdp=fsdp)
  return step.lower(state, b).as_text(dialect="hlo")


def collectives(hlo):
  """Counter of (kind, result type) of the collectives in a pre-optimization HLO module."""
  found = re.findall(r"= (\w+\[[\d,]*\])\S* (all-gather|reduce-scatter|all-to-all)\(", hlo)
  return Counter((kind, shape) for shape, kind in found)


# ----------------------------------------------------------------------------- casts


@pytest.mark.parametrize("scan_layers", [True, False])
def test_params_the_loss_casts_are_gathered_cast(scan_layers):
  """The bf16 Llama keeps float32 params and casts each where it is used: every layer's
  params, and `out` (gathered whole with `vocab_parallel=False`), move in bfloat16; only the
  embedding, cast after its lookup, and the final norm, multiplied in float32, move in
  float32. The cast commutes with the gather, so the step is the single-device one (float32
  compute here: the same casts, to float32, are no casts and change nothing)."""
  params, loss_fn, b = tiny_llama(jnp.bfloat16, scan_layers=scan_layers)
  fsdp = FSDPConfig(stacked=["blocks"] if scan_layers else [], vocab_parallel=False)
  gathers = {
    shape
    for kind, shape in collectives(lowered_hlo(params, loss_fn, b, fsdp))
    if kind == "all-gather"
  }
  # the root unit's leaves are gathered one by one, flat: embed's 304 x 16, the norm's 16
  # padded to a 128-element bucket end
  assert {g for g in gathers if g.startswith("f32")} == {"f32[4864]", "f32[128]"}, gathers
  assert "bf16[4864]" in gathers and len(gathers) > 3, gathers
  one_sgd_step(*tiny_llama(jnp.float32, scan_layers=scan_layers), fsdp)


# ----------------------------------------------------------------------------- tables


def numel(shape: str) -> int:
  """Elements of an HLO type, e.g. `f32[2,8,16]`."""
  return int(np.prod([int(d) for d in shape[shape.index("[") + 1 : -1].split(",") if d]))


def table_collectives(found):
  """The collectives that move a table of `tiny_llama(vocab=1000)` or its gradient: of its
  whole 1000 x 16 or its 125 x 16 shard, or a 1-D bucket that big (activations are 3-D,
  a layer's params smaller)."""
  return [
    (kind, shape)
    for kind, shape in found
    if kind != "all-to-all" and shape.count(",") < 2 and numel(shape) >= 125 * 16
  ]


@pytest.mark.parametrize("vocab, blocks", [(1000, 1), (1024, 4)])
def test_vocabulary_tables_are_computed_by_rows(vocab, blocks):
  """With 16 tokens per device, a table of about 1000 rows moves fewer bytes as activations
  than gathered: `embed` (a lookup) and `out` (the logits `h @ out.T`) are never gathered
  and their gradients never reduce-scattered; every device's ids and logits move instead
  (all-to-alls of the logits, a reduce-scatter of the looked-up rows, all-gathers of ids,
  of `h` and of the rows' cotangents). The logits' cotangents move back in as many blocks
  of each device's rows as cut them evenly, up to 4 (125 rows: one; 128: four of 32). One
  SGD step equals one device's (float32). `vocab_parallel=False` gathers both whole."""
  params, loss_fn, b = tiny_llama(vocab=vocab)
  r = vocab // 8  # this device's rows
  for fsdp, by_rows in ((STACKED, True), (GATHERED, False)):
    found = collectives(lowered_hlo(params, loss_fn, b, fsdp))
    if by_rows:
      assert not table_collectives(found), found
      # every device's 2 x 8 tokens by this device's rows, then back block by block
      exchanges = Counter({shape: n for (kind, shape), n in found.items() if kind == "all-to-all"})
      want = Counter({f"f32[16,8,{r}]": 1}) + Counter({f"f32[16,8,{r // blocks}]": blocks})
      assert exchanges == want, found
      assert found["reduce-scatter", "f32[2,8,16]"] == 2, found  # the rows, h's cotangent
    else:
      assert table_collectives(found), found
      assert not any(kind == "all-to-all" for kind, _ in found), found
    one_sgd_step(params, loss_fn, b, fsdp)


@pytest.mark.parametrize("fsdp", [STACKED, LOOKUPS], ids=["by_rows", "lookups"])
def test_vocabulary_tables_in_bfloat16_equal_one_device(fsdp):
  """The bf16 Llama with its tables computed by rows, or `embed` by columns
  (`lookups=["embed"]`): the looked-up rows move in bfloat16 (every use of them casts them:
  an exact sum of one row and zeros, or the row's columns as they are), `out`'s gradient
  is one bfloat16 matmul over every device's tokens (as on one device) reduced in float32.
  The gradients round at no more ops than the chunked tables' (test_fsdp_units, which also
  rounds `out`'s block gradients once more): within `bf16_grad_rtol(16 * layers + 4)` of a
  leaf's largest."""
  params, loss_fn, b = tiny_llama(jnp.bfloat16, vocab=1000)
  found = collectives(lowered_hlo(params, loss_fn, b, fsdp))
  if fsdp is STACKED:
    assert found["reduce-scatter", "bf16[2,8,16]"] == 2, found  # the rows, h's cotangent
  else:  # every device's rows' 2 columns, out and back
    assert found["all-to-all", "bf16[16,8,2]"] == 2, found
  got, _ = train(params, loss_fn, b, optax.sgd(1.0), 1, fsdp)
  grads = jax.grad(loss_fn)(params, b)
  assert_sgd_step_within(got, params, grads, tolerances.bf16_grad_rtol(16 * 2 + 4))


def test_a_lookup_table_is_sharded_by_columns():
  """`FSDPConfig(lookups=["embed"])`: the embedding is stored by its columns (1000 x 2 per
  device) and each lookup moves every device's looked-up rows once: an all-to-all of every
  device's 16 x 8 ids' rows, 2 columns each, forward and backward, where the rows'
  sharding sums 8 devices' zero-padded rows into each (a reduce-scatter of 8 x the bytes).
  No gather of the table, no reduce-scatter of its gradient; `out` stays computed by rows.
  One SGD step equals one device's (float32)."""
  params, loss_fn, b = tiny_llama(vocab=1000)
  found = collectives(lowered_hlo(params, loss_fn, b, LOOKUPS))
  assert not table_collectives(found), found
  assert found["all-to-all", "f32[16,8,2]"] == 2, found
  assert found["reduce-scatter", "f32[2,8,16]"] == 1, found  # h's cotangent alone
  _, state = one_sgd_step(params, loss_fn, b, LOOKUPS)
  assert state.master["embed"].sharding.shard_shape((1000, 16)) == (1000, 2)


def test_a_lookup_table_under_hsdp_is_gathered_by_columns():
  """On a (replica 2, data 4) mesh a table is never computed where it is stored (its
  gradient would be reduced over "data" alone): a `lookups=` table is gathered as any
  param, from its columns' shards, and the step equals one device's."""
  params, loss_fn, b = tiny_llama(vocab=1000)
  hsdp = dataclasses.replace(PER_LEAF, num_distributed_optimizer_instances=2)
  mesh = jax.make_mesh((2, 4), ("replica", "data"))
  step, state = one_sgd_step(params, loss_fn, b, LOOKUPS, config=hsdp, mesh=mesh)
  assert state.master["embed"].sharding.shard_shape((1000, 16)) == (1000, 4)
  found = collectives(step.lower(state, b).as_text(dialect="hlo"))
  assert not any(kind == "all-to-all" for kind, _ in found), found


def test_lookups_refuses_a_table_the_loss_multiplies():
  """A tied table (a lookup and the logits) named in `lookups=` is refused when the step is
  built, naming the param and the use; so is a name that is no table."""
  k = jax.random.split(jax.random.key(3), 2)
  params = {"wte": jax.random.normal(k[0], (1000, 16)) / 4, "b": jnp.zeros(16)}
  ids = jax.random.randint(k[1], (16, 8), 0, 1000)

  def loss_fn(params, batch):
    h = jnp.tanh(params["wte"][batch["ids"]] + params["b"])
    return jnp.mean(jax.nn.log_softmax(h @ params["wte"].T))

  mesh, tx = jax.make_mesh((DP,), ("data",)), optax.sgd(1.0)
  fsdp = FSDPConfig(lookups=["wte"])
  state = jaxdp.init_state(params, tx, mesh, PER_LEAF, fsdp=fsdp)
  step = jaxdp.make_train_step(loss_fn, tx, mesh, PER_LEAF, fsdp=fsdp)
  with pytest.raises(ValueError, match=r"lookups=.*params\['wte'\].*dot_general"):
    step.lower(state, {"ids": ids})
  with pytest.raises(ValueError, match=r"params\['b'\] of shape \(16,\)"):
    jaxdp.init_state(params, tx, mesh, PER_LEAF, fsdp=FSDPConfig(lookups=["b"]))
  with pytest.raises(ValueError, match="one string"):
    FSDPConfig(lookups="wte")
  with pytest.raises(ValueError, match="chunks= names too"):
    FSDPConfig(lookups=["wte"], chunks={"wte": 4})


def test_a_table_cheaper_to_gather_is_gathered():
  """A 40-row table read by 16 tokens per device of width 16: its activations (16 x 16 per
  device, moved 7 times over in each direction) outweigh the table (40 x 16, gathered once
  and reduce-scattered), so it is gathered as any param."""
  params, loss_fn, b = tiny_llama(vocab=40)
  found = collectives(lowered_hlo(params, loss_fn, b, STACKED))
  assert not any(kind == "all-to-all" for kind, _ in found), found
  assert any(kind == "all-gather" and numel(shape) >= 40 * 16 for kind, shape in found), found


@pytest.mark.parametrize("by", ["rows", "columns"])
@pytest.mark.parametrize("mode", ["fill", "clip"])
def test_table_lookup_modes(mode, by):
  """`jnp.take(w, ids, axis=0, mode=...)` on a table computed by rows, or by columns
  (`lookups=`): "fill" reads NaN for an id out of range and "clip" the nearest row, as the
  lookup does on one device. By rows, rows 198 and 199 of the table are padding (200 rows,
  25 per device: its 6 columns would pad more), never read; by columns, columns 6 and 7
  (one per device), cut off the looked-up rows."""
  params = {"wte": jax.random.normal(jax.random.key(0), (198, 6)), "head": jnp.ones((6, 3))}
  ids = jnp.array([[0, 197, 17, 131], [45, 8, 197, 3]] * 4, jnp.int32)

  def loss_fn(params, batch):
    h = jnp.take(params["wte"], batch["ids"], axis=0, mode=mode)
    return jnp.mean(jnp.tanh(h) @ params["head"])

  if mode == "clip":  # ids past either end read (and train) the first and last rows
    ids = ids.at[0, 0].set(270).at[1, 1].set(-3)
  fsdp = FSDPConfig(lookups=["wte"] if by == "columns" else [])
  step, state = one_sgd_step(params, loss_fn, {"ids": ids}, fsdp, config=PER_LEAF)
  found = collectives(step.lower(state, {"ids": ids}).as_text(dialect="hlo"))
  if by == "rows":
    assert found["reduce-scatter", "f32[1,4,6]"] == 1, found  # the rows, to their devices
  else:  # every device's rows' one column, out and back
    assert found["all-to-all", "f32[8,4,1]"] == 2, found
  assert found["all-gather", "s32[8,4,1]"] >= 1, found  # every device's ids
  if mode == "fill":  # an id past the end: the loss is NaN, whatever the params
    _, metrics = step(state, {"ids": ids.at[0, 0].set(198)})
    assert np.isnan(float(metrics["loss"]))


def test_tied_table_is_computed_by_rows_in_both_uses():
  """A table read by a lookup and by the logits (GPT-2's tied `wte`): both uses compute on
  this device's rows and their gradients add up there: no gather of the table, no
  reduce-scatter of its gradient; equal to one device."""
  k = jax.random.split(jax.random.key(3), 3)
  params = {"wte": jax.random.normal(k[0], (1000, 16)) / 4, "w": jax.random.normal(k[1], (16, 16))}
  ids = jax.random.randint(k[2], (16, 8), 0, 1000)

  def loss_fn(params, batch):
    h = jnp.tanh(params["wte"][batch["ids"]] @ params["w"])
    logp = jax.nn.log_softmax(h @ params["wte"].T)
    return -jnp.mean(jnp.take_along_axis(logp, batch["ids"][..., None], -1))

  step, state = one_sgd_step(params, loss_fn, {"ids": ids}, FSDPConfig(), config=PER_LEAF)
  found = collectives(step.lower(state, {"ids": ids}).as_text(dialect="hlo"))
  assert not table_collectives(found), found
  assert found["all-to-all", "f32[16,8,125]"] == 2, found  # the logits, out and back


def test_table_as_the_left_operand_is_computed_by_rows():
  """Logits laid out rows first (`einsum("vd,btd->vbt", out, h)`: the table's rows lead the
  product, every device's tokens after them), in four row blocks: equal to one device."""
  k = jax.random.split(jax.random.key(4), 3)
  params = {"out": jax.random.normal(k[0], (1024, 16)) / 4, "w": jax.random.normal(k[1], (16, 16))}
  ids = jax.random.randint(k[2], (16, 8), 0, 1024)

  def loss_fn(params, batch):
    h = jnp.tanh(jax.nn.one_hot(batch["ids"] % 16, 16) @ params["w"])
    logp = jax.nn.log_softmax(jnp.einsum("vd,btd->vbt", params["out"], h), axis=0)
    return -jnp.mean(jnp.take_along_axis(logp, batch["ids"][None], 0))

  step, state = one_sgd_step(params, loss_fn, {"ids": ids}, FSDPConfig(), config=PER_LEAF)
  found = collectives(step.lower(state, {"ids": ids}).as_text(dialect="hlo"))
  assert not table_collectives(found), found
  # this device's 128 rows by every device's 2 x 8 tokens, then back in four blocks of 32
  assert found["all-to-all", "f32[128,16,8]"] == 1, found
  assert found["all-to-all", "f32[32,16,8]"] == 4, found


# ----------------------------------------------------------------------------- the layer loops

GPU_REASON = gpu_compile_unavailable()


@pytest.mark.slow  # two H100 compiles of a 4-layer Llama: ~40 s on 2 cores
@pytest.mark.skipif(GPU_REASON is not None, reason=f"no deviceless GPU compile: {GPU_REASON}")
@pytest.mark.xdist_group("h100_llama")
def test_scanned_layers_are_gathered_one_iteration_ahead():
  """A scanned Llama on 8 H100s: the forward loop's one collective is the next layer's
  gather (its per-param all-gathers combined into one, in bfloat16, the dtype the loss casts
  every layer param to), under this layer's matmuls, its result leaving the iteration for the
  next one, unread in this one. Each layer is gathered once forward and once backward (the
  blocks are remat'ed), one collective each, but the forward's first, gathered in two parts,
  and its last, whose backward runs next on the params it kept."""
  config = LlamaConfig(vocab=1024, d=256, n_layer=4, n_head=4, n_kv_head=2, ffn=512)
  params = abstract_params(config)
  tokens = jax.ShapeDtypeStruct((DP, 128), jnp.int32)
  compiled = compile_train_step(
    llama_loss(config),
    optax.adamw(1e-4),
    DP,
    FSDP,
    params,
    {"x": tokens, "y": tokens},
    fsdp=STACKED,
  )
  s = schedule(compiled)
  n = config.n_layer
  layer = sum(x.size // n // DP * 2 for x in jax.tree.leaves(params["blocks"]))  # bf16 bytes
  (gather,) = [c for c in s.collectives if c.trip_count > 1 and c.kind == "all-gather"]
  assert gather.trip_count == n - 2 and gather.operand_bytes == layer, s
  assert gather.is_async and gather.overlaps_gemm, gather.overlapped
  # the gathered layer is the body's output, read by the next iteration: its values (the
  # combined gather's elements) only reach the loop's tuple
  users = gathered_users(compiled.as_text(), gather.name)
  assert users and users <= {"tuple", "get-tuple-element", "bitcast", "copy"}, users
  # a layer's gather alone, or combined with an unrolled unit's small ones
  layers = [c for c in s.collectives if c.kind == "all-gather" and c.operand_bytes >= layer]
  assert sum(c.trip_count for c in layers) == 2 * n - 2, [
    (c.operand_bytes, c.trip_count) for c in layers
  ]
  assert all(c.operand_bytes < layer + layer // 4 and c.is_async for c in layers)
  # The first layer in two parts ([Note: the first layer in two parts]): its MLP's matrices
  # (the largest params, and what the layer uses after them) gathered once the attention's
  # params have landed, a collective of its own (what runs under it at these sizes is the
  # scheduler's choice: tests/test_fsdp.py checks a GEMM on the GPT).
  mlp = sum(params["blocks"][k].size // n // DP * 2 for k in ("w_gate", "w_up", "w_down"))
  (rest,) = [c for c in s.collectives if c.kind == "all-gather" and c.operand_bytes == mlp]
  assert rest.is_async and rest.trip_count == 1, rest


@pytest.mark.slow  # four H100 compiles of a 2-layer Llama: ~60 s on 2 cores
@pytest.mark.skipif(GPU_REASON is not None, reason=f"no deviceless GPU compile: {GPU_REASON}")
@pytest.mark.xdist_group("h100_llama")
def test_fsdp_runs_the_matmuls_of_the_users_loss():
  """FSDP replays the loss unit by unit, the user's `jax.checkpoint` traced anew on params
  gathered in their cast dtype: the compiled step runs as many matmuls as DDP's, which is
  `jax.grad` of the loss unchanged, with each block under remat (its forward's matmuls run
  again in the backward) and without (fewer)."""

  def gemms(remat, config, fsdp=None):
    llama = LlamaConfig(vocab=1024, d=256, n_layer=2, n_head=4, n_kv_head=2, ffn=512)
    llama = dataclasses.replace(llama, remat=remat)
    tokens = jax.ShapeDtypeStruct((DP, 128), jnp.int32)
    kw = {} if fsdp is None else {"fsdp": fsdp}
    compiled = compile_train_step(
      llama_loss(llama), optax.adamw(1e-4), DP, config, abstract_params(llama),
      {"x": tokens, "y": tokens}, **kw,
    )  # fmt: skip
    return sum(i.kind == "gemm" for i in predict_step(compiled).timeline)

  ddp = jaxdp.DDPConfig()
  with_remat, without = gemms(True, ddp), gemms(False, ddp)
  assert with_remat > without
  assert gemms(True, FSDP, STACKED) == with_remat
  assert gemms(False, FSDP, STACKED) == without


def gathered_users(text: str, start: str) -> set:
  """The ops that read the result of the all-gather `start` in the HLO `text`, looking
  through its done, the elements of a combined gather and bitcasts."""
  ops, seen = set(), set()
  (done,) = re.findall(rf"%(\S+) = .* all-gather-done\(%{re.escape(start)}\)", text)
  frontier = [done]
  while frontier:
    value = frontier.pop()
    for name, op in re.findall(rf"%(\S+) = .*\s([a-z][\w-]*)\([^()]*%{re.escape(value)}[,)]", text):
      ops.add(op)
      if op in ("get-tuple-element", "bitcast") and name not in seen:
        seen.add(name)
        frontier.append(name)
  return ops
