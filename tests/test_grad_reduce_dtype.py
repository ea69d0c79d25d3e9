"""`DDPConfig(grad_reduce_dtype=jnp.bfloat16)` on fp32 params that the loss casts to bf16:
the grad buckets are accumulated, reduced and held in bf16 (what `jax.jit` of such a loss
does on its own: the compiler reduces each matmul's grad in the matmul's bf16), and the
optimizer receives them cast back to its fp32 params. Checked on the program's collectives,
on what the optimizer sees, on the memory ledger and against the single-device program."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp.inspect import memory_ledger
from tests.tolerances import bf16_grad_rtol

DP, LAYERS, D = 8, 3, 16
BF16 = jnp.bfloat16
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def problem():
  """An MLP of `LAYERS` tanh layers and a head, fp32 params, which the loss casts to bf16
  (as a mixed-precision LLM does); the squared error in fp32."""
  k = jax.random.split(jax.random.key(0), 2 * LAYERS + 3)
  params = {
    "blocks": [
      {
        "w": jax.random.normal(k[i], (D, D)) / np.sqrt(D),
        "b": 0.1 * jax.random.normal(k[LAYERS + i], (D,)),
      }
      for i in range(LAYERS)
    ],
    "head": jax.random.normal(k[-3], (D, 4)) / np.sqrt(D),
  }

  def forward(p, x):
    p = jax.tree.map(lambda w: w.astype(BF16), p)
    h = x.astype(BF16)
    for l in p["blocks"]:
      h = jnp.tanh(h @ l["w"] + l["b"])
    return (h @ p["head"]).astype(jnp.float32)

  def loss_fn(p, batch):
    return jnp.mean((forward(p, batch["x"]) - batch["y"]) ** 2)

  batch = {"x": jax.random.normal(k[-2], (32, D)), "y": jax.random.normal(k[-1], (32, 4))}
  return params, forward, loss_fn, batch


def recording_sgd(seen: list):
  """SGD with lr 1 that records the dtypes of the grads it receives (at trace time)."""

  def update(grads, state, params=None):
    seen.append({x.dtype for x in jax.tree.leaves(grads)})
    return jax.tree.map(jnp.negative, grads), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def grad_collectives(hlo: str) -> set[str]:
  """Element types of the all-reduces and reduce-scatters of more than 2 elements in HLO
  text (the metrics are a scalar or the (loss, squared norm) pair of one f32[2] psum)."""
  found = re.findall(r"= (\w+)\[([\d,]*)\]\S* (?:all-reduce|reduce-scatter)(?:-start)?\(", hlo)
  return {t for t, dims in found if np.prod([int(n) for n in dims.split(",") if n]) > 2}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grads_reduced_in_bf16_equal_the_single_device_program(strategy):
  params, forward, loss_fn, batch = problem()
  mesh = jax.make_mesh((DP,), ("data",))
  seen = []
  tx = recording_sgd(seen)
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy, grad_reduce_dtype=BF16)
  state = jaxdp.init_state(params, tx, mesh, config)
  assert {b.grad_dtype for b in state.layout.buffers} == {jnp.dtype(BF16)}
  step = jaxdp.make_train_step(loss_fn, tx, mesh, config)
  # The lowered program, before XLA:CPU promotes bf16 collectives to f32: every gradient
  # collective moves bf16; the default moves f32. The optimizer receives fp32 grads (an
  # init may probe `tx` on other arrays: only the step's own trace counts).
  seen.clear()
  assert grad_collectives(step.lower(state, batch).as_text(dialect="hlo")) == {"bf16"}
  assert seen and all(s == {jnp.dtype(jnp.float32)} for s in seen), seen
  default = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
  default_step = jaxdp.make_train_step(loss_fn, tx, mesh, default)
  default_state = jaxdp.init_state(params, tx, mesh, default)
  assert grad_collectives(default_step.lower(default_state, batch).as_text(dialect="hlo")) == {
    "f32"
  }
  # Half the grad buffers' bytes in the ledger.
  ledger = memory_ledger(params, optax.sgd(1.0), DP, config)
  assert 2 * ledger.grads == memory_ledger(params, optax.sgd(1.0), DP, default).grads

  new, metrics = step(state, batch)
  got = jaxdp.get_params(new)
  assert jax.tree.map(lambda x: x.dtype, got) == jax.tree.map(lambda x: x.dtype, params)
  grads = jax.tree.map(lambda a, b: a - b, params, got)  # SGD, lr 1

  # The single-device program that casts the same way, its gradients in fp32.
  loss, want = jax.value_and_grad(loss_fn)(params, batch)
  # Tolerance (tests/tolerances.py, `bf16_grad_rtol`): both programs compute in bf16, each
  # op rounding its bf16 output once, and round at different ops where XLA fuses them
  # differently. A gradient of layer 0 is rounded on its way by the forward of every layer
  # (matmul, bias add, tanh: 3 * LAYERS) and the head (1), the backward of the head (1) and
  # of every layer above it (tanh' as 3 ops, the input's cotangent: 4 per layer) and its
  # own (tanh', the weight or bias gradient: 4): 7 * LAYERS + 4 (as for FSDP's bf16
  # gathers). Here each device's gradient of its 4 of 32 examples is also summed with the
  # 7 others in bf16, one rounding per addition (7 in a chain, the most), where the
  # single-device program sums the 32 examples inside one matmul in fp32; the 1/8 scale
  # and the casts between bf16 and fp32 are exact.
  rho = bf16_grad_rtol(7 * LAYERS + 4 + (DP - 1))
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
    # SGD's p - g rounds once more, by eps32 of |p| <= 3: far below rho * max |g|.
    atol = rho * float(jnp.max(jnp.abs(w)))
    np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(path))
  # The loss: the outputs differ by at most rho_f of their largest (the forward's
  # 3 * LAYERS + 1 roundings), so the mean squared error by at most 2 * rho_f * max |out| *
  # sqrt(loss) (Cauchy-Schwarz), plus fp32 sums far below it.
  out = forward(params, batch["x"])
  rho_f = bf16_grad_rtol(3 * LAYERS + 1)
  tol = 2 * rho_f * float(jnp.max(jnp.abs(out))) * float(jnp.sqrt(loss))
  assert abs(float(metrics["loss"]) - float(loss)) <= tol


def test_grad_reduce_dtype_must_be_a_float_dtype():
  with pytest.raises(ValueError, match=r"grad_reduce_dtype=.*int8.*floating-point dtype"):
    jaxdp.DDPConfig(grad_reduce_dtype=jnp.int8)
  with pytest.raises(ValueError, match=r"grad_reduce_dtype='f32'.*floating-point dtype"):
    jaxdp.DDPConfig(grad_reduce_dtype="f32")
  config = jaxdp.DDPConfig(grad_reduce_dtype="bfloat16", grad_reduce_in_fp32=True)
  assert config.grad_dtype == jnp.dtype(BF16)  # it decides over grad_reduce_in_fp32


def test_a_checkpoint_restores_under_another_reduction_dtype(tmp_path):
  """The reduction dtype names the grad buffers (`float32/bfloat16`), not the state: a run
  saved with fp32 reduction (a fused `optim` state, whose master is keyed by bucket) resumes
  with bf16 reduction bit for bit, and back."""
  params, _, loss_fn, batch = problem()
  mesh, tx = jax.make_mesh((DP,), ("data",)), optax.adam(1e-2)
  fp32 = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
  bf16 = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim", grad_reduce_dtype=BF16)
  state = jaxdp.init_state(params, tx, mesh, fp32)
  assert state.fused
  state, _ = jaxdp.make_train_step(loss_fn, tx, mesh, fp32)(state, batch)
  with jaxdp.CheckpointManager(tmp_path / "a") as mgr:
    mgr.save(1, state)
  with jaxdp.CheckpointManager(tmp_path / "a") as mgr:
    restored = mgr.restore(jaxdp.init_state(params, tx, mesh, bf16))
  host = lambda s: jax.tree.map(np.asarray, (jaxdp.get_params(s), jaxdp.get_opt_state(s)))
  for x, y in zip(jax.tree.leaves(host(restored)), jax.tree.leaves(host(state))):
    np.testing.assert_array_equal(x, y)
  restored, _ = jaxdp.make_train_step(loss_fn, tx, mesh, bf16)(restored, batch)
  with jaxdp.CheckpointManager(tmp_path / "b") as mgr:
    mgr.save(2, restored)
  with jaxdp.CheckpointManager(tmp_path / "b") as mgr:
    back = mgr.restore(jaxdp.init_state(params, tx, mesh, fp32))
  for x, y in zip(jax.tree.leaves(host(back)), jax.tree.leaves(host(restored))):
    np.testing.assert_array_equal(x, y)
