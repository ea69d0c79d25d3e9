"""What a train step should communicate and store, next to what it does.

DESIGN.md's table, per device and per step, with the layout's real padding:

| strategy | communication (ring algorithm) |
|---|---|
| `no_shard` | all-reduce of the grad buffers: `2(N-1)/N · G` |
| `optim`, `optim_grads` | reduce-scatter `(N-1)/N · G` + all-gather `(N-1)/N · P` |
| `optim_grads_params` | all-gather `(N-1)/N · P`, twice with `reshard_after_forward`, + reduce-scatter `(N-1)/N · G` |

`G` is the bytes of the grad buffers (fp32 with `grad_reduce_in_fp32`), `P` of the param
buffers in the params' dtype, `N` the size of the "data" axis. With fp32 params `P = G`, so
ZeRO-1/2 move what DDP moves and FSDP 1.5× that. :func:`ring_formula` gives these numbers
for a `TrainState`, to hold against :meth:`jaxdp.inspect.Schedule.comm_bytes` of the
compiled step (`jaxdp.inspect.report(..., expected=ring_formula(state))` prints both).

:func:`memory_report` puts the memory ledger (`memory_ledger`, predicted), the bytes a
built `TrainState` holds (`measured_bytes`, from `addressable_shards`) and the compiled GPU
program's `memory_analysis()` side by side, as rows a notebook can tabulate or plot.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxdp._src import aot, distributed_optimizer
from jaxdp._src.inspect import memory_stats

PyTree = Any

_SHARDED_GRADS_PER_MICROBATCH = ("optim_grads", "optim_grads_params")


def _buffer_bytes(layout) -> tuple[int, int]:
  """(grad bytes, param bytes) of a layout's buffers, padding and stacked layers included."""
  grad = param = 0
  for buf in layout.buffers:
    for b in buf.buckets:
      layers = max((p.layers for p in b.params), default=0) or 1
      n = b.shard_size * layout.dp * layers
      grad += n * np.dtype(buf.grad_dtype).itemsize
      param += n * np.dtype(buf.param_dtype).itemsize
  return grad, param


def ring_formula(state, *, fsdp=None, grad_accum_steps: int = 1) -> dict[str, float]:
  """Bytes each device should send per step, by collective kind (DESIGN.md's table).

  Computed from the state's layout (padding included), for the data axis; a "replica"
  axis (`num_distributed_optimizer_instances > 1`) adds an all-reduce of the shards that
  is not counted here. Small collectives of the step's metrics (the loss, norms) are not
  counted either.

  Args:
    state: a `TrainState` from `jaxdp.init_state` (or its `jax.eval_shape`).
    fsdp: the `FSDPConfig` of an `optim_grads_params` state (None: the default, which
      reshards after forward: two all-gathers per unit).
    grad_accum_steps: micro-batches per step (`optim_grads` reduce-scatters, and FSDP
      gathers and reduce-scatters, once per micro-batch).

  Returns:
    `{kind: ring bytes per device per step}`, with kinds as in `jaxdp.inspect`
    (`"all-reduce"`, `"reduce-scatter"`, `"all-gather"`).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> params = {"w": jnp.zeros((1024, 256))}          # 1 MiB of fp32 grads
    >>> for strategy in ("no_shard", "optim"):
    ...   config = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy)
    ...   state = jaxdp.init_state(params, optax.sgd(0.1), mesh, config)
    ...   print(strategy, {k: v / 2**20 for k, v in ring_formula(state).items()})
    no_shard {'all-reduce': 1.75}
    optim {'reduce-scatter': 0.875, 'all-gather': 0.875}
  """
  layout, config = state.layout, state.config
  strategy = config.data_parallel_sharding_strategy
  n = layout.dp
  share = (n - 1) / n
  grad, param = _buffer_bytes(layout)
  if strategy == "no_shard":
    return {"all-reduce": 2 * share * grad}
  k = grad_accum_steps if strategy in _SHARDED_GRADS_PER_MICROBATCH else 1
  if strategy in ("optim", "optim_grads"):
    return {"reduce-scatter": k * share * grad, "all-gather": share * param}
  from jaxdp._src import fsdp as fsdp_lib  # noqa: PLC0415 - fsdp imports ddp

  fsdp = fsdp or fsdp_lib.FSDPConfig()
  _, gathered = _buffer_bytes(fsdp_lib.gather_layout(layout))
  gathers = 2 if fsdp.reshard_after_forward else 1
  return {"all-gather": k * gathers * share * gathered, "reduce-scatter": k * share * grad}


def _batch_bytes_per_device(batch: PyTree, dp: int) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize // dp
             for x in jax.tree.leaves(batch))


def memory_report(params: PyTree, tx, config, *, dp: int = 8, loss_fn=None,
                  batch: PyTree = None, frozen=None, fsdp=None) -> list[dict[str, Any]]:
  """Bytes per device: predicted (the ledger) vs measured (a built state) vs compiled (GPU).

  - *predicted*: `jaxdp.inspect.memory_ledger` for `config`'s strategy and `dp`.
  - *measured*: `jaxdp.inspect.measured_bytes` of `jaxdp.init_state` on the first `dp`
    CPU devices of this process (None when it has fewer).
  - *compiled*: the train step compiled for `dp` H100s without a GPU
    (`compile_train_step`, `memory_analysis()`), when `loss_fn` and `batch` are given and
    the `aot` extra is installed (else None). `state` is the program's arguments less the
    batch, `total` its peak (state, grads, gathered params, activations, temporaries).

  Args:
    params: the model params (arrays; `jax.ShapeDtypeStruct`s when nothing is measured).
    tx: the optax transformation.
    config: the `jaxdp.DDPConfig` (its strategy, `grad_reduce_in_fp32`, buckets, ...).
    dp: data-parallel size.
    loss_fn: `loss_fn(params, batch)`, to compile the step for the GPU column.
    batch: one global batch (arrays or `jax.ShapeDtypeStruct`s).
    frozen: as in `init_state`.
    fsdp: the `FSDPConfig` of `optim_grads_params`.

  Returns:
    One dict per kind: `strategy`, `dp`, `kind` (`"params"`, `"master"`, `"opt_state"`:
    what `TrainState` holds; `"state"`: their sum with the step counter; `"grads"`: the
    reduced grads, alive only inside the step; `"gathered"`: params gathered inside the
    step; `"total"`: params + grads + master + opt_state, against the compiled peak),
    `predicted`, `measured`, `compiled` (bytes, or None where a source does not say).

  Examples:
    >>> import jax.numpy as jnp, optax, jaxdp
    >>> params = {"w": jnp.zeros((1024, 256), jnp.float32)}
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
    >>> rows = memory_report(params, optax.adam(1e-3), config, dp=8)
    >>> [(r["kind"], r["predicted"] // 1024, r["measured"] // 1024)
    ...  for r in rows if r["kind"] in ("master", "opt_state")]
    [('master', 128, 128), ('opt_state', 256, 256)]
  """
  strategy = config.data_parallel_sharding_strategy
  fsdp_step = strategy == "optim_grads_params"
  ledger = distributed_optimizer.memory_ledger(
      params, strategy, dp, tx, grad_reduce_in_fp32=config.grad_reduce_in_fp32,
      bucket_size=config.bucket_size, overlap_grad_reduce=config.overlap_grad_reduce,
      overlap_param_gather=config.overlap_param_gather, frozen=frozen)
  predicted_state = {**ledger.state, "step": 4}

  measured = None
  # This process's own devices: the measured state never spans processes, so building it
  # needs no other process (in a multi-process job each measures on its own).
  cpus = jax.local_devices(backend="cpu")
  if len(cpus) >= dp and all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)):
    from jaxdp._src import ddp  # noqa: PLC0415

    mesh = jax.sharding.Mesh(np.array(cpus[:dp]), ("data",))
    extra = {"fsdp": fsdp} if fsdp_step else {}
    state = ddp.init_state(params, tx, mesh, config, frozen=frozen, **extra)
    measured = distributed_optimizer.measured_bytes(state)
    del state

  compiled = None
  if loss_fn is not None and batch is not None and aot.gpu_compile_unavailable() is None:
    program = aot.compile_train_step(loss_fn, tx, config, params, batch, dp=dp,
                                     frozen=frozen, fsdp=fsdp if fsdp_step else None)
    stats = memory_stats(program)
    compiled = {"state": stats.argument_bytes - _batch_bytes_per_device(batch, dp),
                "total": stats.peak_bytes}

  def row(kind, predicted, measured_value=None, compiled_value=None):
    return {"strategy": strategy, "dp": dp, "kind": kind, "predicted": int(predicted),
            "measured": measured_value, "compiled": compiled_value}

  rows = [row(k, predicted_state[k], measured and measured[k])
          for k in ("params", "master", "opt_state")]
  rows.append(row("state", sum(predicted_state.values()),
                  measured and sum(measured.values()), compiled and compiled["state"]))
  rows.append(row("grads", ledger.grads))
  rows.append(row("gathered", ledger.gathered_in_step))
  rows.append(row("total", ledger.total, None, compiled and compiled["total"]))
  return rows
