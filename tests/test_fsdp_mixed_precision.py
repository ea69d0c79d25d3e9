"""FSDP with `FSDPConfig(param_dtype=jnp.bfloat16)` on fp32 params (torch FSDP2's
`MixedPrecisionPolicy(param_dtype=bf16)`): the fp32 master stays sharded, each unit's shard
is cast to bf16 before its all-gather, the loss receives bf16 params and the gradients are
reduce-scattered in fp32. Checked against the single-device program that casts the same way,
on the program's collectives, and on the memory ledger."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp import FSDPConfig
from jaxdp._src import fsdp as fsdp_lib
from jaxdp.inspect import memory_ledger, ring_formula
from tests.tolerances import bf16_grad_rtol

DP, LAYERS, D = 8, 3, 16
FSDP = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim_grads_params")
# HFSDP on a (replica=2, data=4) mesh: the fp32 master 1/8, the compute params 1/4
HFSDP = jaxdp.DDPConfig(
  data_parallel_sharding_strategy="optim_grads_params",
  num_distributed_optimizer_instances=2,
  outer_dp_sharding_strategy="optim",
)
MESHES = {  # name: (mesh shape, axis names, config)
  "data": ((DP,), ("data",), FSDP),
  "hfsdp": ((2, DP // 2), ("replica", "data"), HFSDP),
}
BF16 = jnp.bfloat16
FORMS = {  # name: (stacked layers, FSDPConfig without param_dtype)
  "unrolled": (False, FSDPConfig()),
  "stacked": (True, FSDPConfig(stacked=["blocks"])),
  "chunks": (False, FSDPConfig(chunks={"head": 2})),  # head: 16 rows, 2 per device
}


def problem(stacked):
  """An MLP of `LAYERS` tanh layers and a head, fp32 params; it computes in its params'
  dtype (the batch is cast to it, as an LLM casts its embeddings), the loss in fp32."""
  k = jax.random.split(jax.random.key(0), 2 * LAYERS + 3)
  w = [jax.random.normal(k[i], (D, D)) / np.sqrt(D) for i in range(LAYERS)]
  b = [0.1 * jax.random.normal(k[LAYERS + i], (D,)) for i in range(LAYERS)]
  head = jax.random.normal(k[-3], (D, 4)) / np.sqrt(D)
  if stacked:
    params = {"blocks": {"w": jnp.stack(w), "b": jnp.stack(b)}, "head": head}
  else:
    params = {"blocks": [{"w": a, "b": c} for a, c in zip(w, b)], "head": head}

  def forward(p, batch):
    h = batch["x"].astype(p["head"].dtype)
    if stacked:
      h, _ = jax.lax.scan(lambda h, l: (jnp.tanh(h @ l["w"] + l["b"]), None), h, p["blocks"])
    else:
      for l in p["blocks"]:
        h = jnp.tanh(h @ l["w"] + l["b"])
    return h @ p["head"]

  def loss_fn(p, batch):
    return jnp.mean((forward(p, batch).astype(jnp.float32) - batch["y"]) ** 2)

  x, y = jax.random.normal(k[-2], (32, D)), jax.random.normal(k[-1], (32, 4))
  return params, forward, loss_fn, {"x": x, "y": y}


def cast(tree, dtype=BF16):
  return jax.tree.map(lambda x: x.astype(dtype), tree)


def result_dtypes(hlo, kind):
  """Element type and element count of each `kind` collective's result in HLO text."""
  found = re.findall(rf"= (\w+)\[([\d,]*)\]\{{[\d,]*\}} {kind}\(", hlo)
  return [(t, int(np.prod([int(n) for n in dims.split(",") if n]))) for t, dims in found]


@pytest.mark.parametrize(
  "form,where",
  [(form, "data") for form in FORMS] + [("unrolled", "hfsdp"), ("stacked", "hfsdp")],
)
def test_param_dtype_equals_the_single_device_program_that_casts(form, where):
  """Also under HFSDP (no chunks there): its compute rows are cast before the gather the
  same way, and its reduce-scatter across "replica" adds the two replicas' fp32 partial
  sums as HSDP's all-reduce would: the same programs, the same tolerance argument."""
  stacked, base = FORMS[form]
  shape, names, FSDP = MESHES[where]
  params, forward, loss_fn, batch = problem(stacked)
  fsdp = FSDPConfig(
    units=base.units, stacked=base.stacked, chunks=dict(base.chunks), param_dtype=BF16
  )
  mesh, tx = jax.make_mesh(shape, names), optax.sgd(1.0)
  state = jaxdp.init_state(params, tx, mesh, FSDP, fsdp=fsdp)
  assert {x.dtype for x in jax.tree.leaves(state.master)} == {jnp.dtype(jnp.float32)}
  step = jaxdp.make_train_step(loss_fn, tx, mesh, FSDP, fsdp=fsdp)
  # The lowered program, before XLA:CPU promotes bf16 arithmetic: every all-gather of a
  # unit moves bf16, every reduce-scatter fp32 (grad_reduce_in_fp32, the default). HFSDP's
  # all-gathers across "replica" after the update (one per unit bucket) move the compute
  # rows, which the state keeps in the params' own dtype (fp32) and the units cast.
  hlo = step.lower(state, batch).as_text(dialect="hlo")
  gathers, scatters = result_dtypes(hlo, "all-gather"), result_dtypes(hlo, "reduce-scatter")
  outer = state.layout.num_buckets if where == "hfsdp" else 0
  assert len([t for t, _ in gathers if t == "f32"]) == outer, gathers
  assert len(gathers) > outer and {t for t, _ in gathers} - {"f32"} == {"bf16"}, gathers
  assert scatters and {t for t, _ in scatters} == {"f32"}, scatters

  # Step 0 of fp32 params with param_dtype=bf16 is the step of those params stored in bf16
  # (their fp32 master holds the bf16 values): the same gathers, the same program, bit for
  # bit.
  plain = FSDPConfig(units=base.units, stacked=base.stacked, chunks=dict(base.chunks))
  grad_fn = lambda f: jax.jit(fsdp_lib.make_grad_fn(loss_fn, mesh, FSDP, fsdp=f))
  got = grad_fn(fsdp)(state, batch)
  same = grad_fn(plain)(jaxdp.init_state(cast(params), tx, mesh, FSDP, fsdp=plain), batch)
  # the grads, the loss and the grad norm
  got, same = [(out.grads, out.loss, out.grad_norm) for out in (got, same)]
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(same)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

  if (
    form == "unrolled" and where == "data"
  ):  # one all-gather per unit: the largest is the ledger's unit
    ledger = memory_ledger(params, tx, DP, FSDP, fsdp=fsdp)
    assert ledger.gathered_unit == 2 * max(n for _, n in gathers)
    assert memory_ledger(params, tx, DP, FSDP, fsdp=plain).gathered_unit == 2 * ledger.gathered_unit
    ring = ring_formula(state, fsdp=fsdp)
    assert ring["all-gather"] == ring_formula(state, fsdp=plain)["all-gather"] / 2
    assert ring["reduce-scatter"] == ring_formula(state, fsdp=plain)["reduce-scatter"]

  new, metrics = step(state, batch)
  grads = jax.tree.map(lambda a, b: a - b, params, jaxdp.get_params(new))  # SGD, lr 1
  assert jax.tree.map(lambda x: x.dtype, jaxdp.get_params(new)) == jax.tree.map(
    lambda x: x.dtype, params
  )

  # The single-device program that casts the same way: params cast to bf16 before the loss,
  # the gradients (bf16 at the cast) in fp32.
  loss, want = jax.value_and_grad(lambda p: loss_fn(cast(p), batch))(params)
  out = forward(cast(params), batch).astype(jnp.float32)
  # Tolerance (tests/tolerances.py, `bf16_grad_rtol`): both programs compute in bf16, each op
  # rounding its bf16 output once (XLA:CPU computes bf16 ops, reductions and dots included,
  # in fp32 and rounds the result); they differ in the batch each device sums (its 4 of 32
  # examples, then an fp32 reduce-scatter, against one bf16 sum of 32) and in how XLA fuses
  # them, so they round at different ops. A gradient of layer 0 is rounded on its way by
  # the forward of every layer (matmul, bias add, tanh: 3 * LAYERS) and the head (1, and
  # with chunks=2 the two partial products of its row blocks, 2 more), the backward of the
  # head (1) and of every layer above it (tanh' as 3 ops, the input's cotangent: 4 per
  # layer), and its own (tanh', the weight or bias gradient: 4): 7 * LAYERS + 4 at most.
  rho = bf16_grad_rtol(7 * LAYERS + 4)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
    # SGD's p - g rounds once more, by eps32 of |p| <= 3: far below rho * max |g|.
    atol = rho * float(jnp.max(jnp.abs(w)))
    np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))
  # The loss: the outputs differ by at most rho_f of their largest (the forward's 3 *
  # LAYERS + 3 roundings), so the mean squared error by at most 2 * rho_f * max |out| *
  # sqrt(loss) (Cauchy-Schwarz), plus fp32 sums far below it.
  rho_f = bf16_grad_rtol(3 * LAYERS + 3)
  tol = 2 * rho_f * float(jnp.max(jnp.abs(out))) * float(jnp.sqrt(loss))
  assert abs(float(metrics["loss"]) - float(loss)) <= tol


def test_param_dtype_must_be_a_float_dtype():
  with pytest.raises(ValueError, match=r"param_dtype=.*int8.*floating-point dtype"):
    FSDPConfig(param_dtype=jnp.int8)
  with pytest.raises(ValueError, match=r"param_dtype='f32'.*floating-point dtype"):
    FSDPConfig(param_dtype="f32")
  assert FSDPConfig(param_dtype="bfloat16").param_dtype == jnp.dtype(BF16)
