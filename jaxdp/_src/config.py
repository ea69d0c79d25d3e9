"""The configs: `DDPConfig` (the field names of Megatron's `DistributedDataParallelConfig`,
three of its defaults changed, a few fields of jaxdp's own) and `FSDPConfig` (the units of
`optim_grads_params`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal, Mapping, Sequence

import jax.numpy as jnp
import jaxlib
import numpy as np

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
Strategy = Literal["no_shard", "optim", "optim_grads", "optim_grads_params"]
Prefix = str | tuple


@dataclasses.dataclass(frozen=True)
class DDPConfig:
  """How gradients are reduced and what is sharded across the `"data"` axis.

  The field names are Megatron-Core's `DistributedDataParallelConfig` (those jaxdp has;
  `grad_reduce_dtype`, `fused_update` and `stacked` are its own), and so are the defaults
  but three, which Megatron's class sets False and jaxdp True:

  * `grad_reduce_in_fp32`: the grads of bf16 params are accumulated and summed over the
    devices in fp32 (fp32 main grads), the more accurate sum; `grad_reduce_dtype=jnp.bfloat16`
    trades it for half the bytes. Megatron-LM's `--bf16` training turns it on as well,
    unless given `--grad-reduce-in-bf16`.
  * `overlap_grad_reduce`: reducing each bucket inside the backward, under the rest of it,
    is what jaxdp is for (a grad-ready hook per bucket; XLA runs the collectives
    asynchronously).
  * `overlap_param_gather`: between steps a sharded strategy holds only its master shards,
    and the gathers run under the next forward.

  `bucket_size=None` picks jaxdp's own sizes (below). The API reference (docs/api.md)
  gives each field in full.

  Attributes:
    data_parallel_sharding_strategy: what is sharded over "data": `"no_shard"` (DDP),
      `"optim"` (ZeRO-1: optimizer state), `"optim_grads"` (ZeRO-2: + grads),
      `"optim_grads_params"` (FSDP: + params).
    grad_reduce_in_fp32: accumulate and reduce grads in fp32 even for bf16/fp16 params
      (fp32 main grads). Default True.
    grad_reduce_dtype: not a Megatron field: the dtype grads are accumulated, reduced and
      held in (e.g. `jnp.bfloat16`: half the bytes); when set it decides, whatever
      `grad_reduce_in_fp32` says. Default None.
    overlap_grad_reduce: reduce each bucket inside the backward as soon as its grads are
      ready; False: one bucket per buffer, after the backward. Default True.
    overlap_param_gather: sharded strategies: gather the params at the start of the next
      forward (under it), not right after the update. Default True.
    bucket_size: elements per bucket; None: `no_shard` 6_553_600 (25 MiB of fp32), the
      sharded strategies max(16_000_000, 1_000_000 * dp).
    average_in_collective: average inside the collective (pmean) instead of scaling by
      1/dp and summing. Default False.
    check_for_nan_in_grad: raise `NonFiniteGradError` naming the param whose reduced grad
      holds NaN or Inf; the step skips its update and the error carries the state as it
      was (`e.state`). Default False.
    num_distributed_optimizer_instances: copies of the sharded state: shard within "data",
      replicate across a "replica" axis of this size (HSDP). Default 1.
    outer_dp_sharding_strategy: FSDP across "replica": `"no_shard"` (HSDP) keeps whole
      copies, `"optim"` (HFSDP) shards the master and optimizer state across it too.
    fused_update: update each bucket as one flat array (Megatron's fused Adam); None:
      where a probe finds it exact (sharded strategies), True: require it, False: per leaf.
    grad_norm_skip_threshold: Megatron's `OptimizerConfig` field: skip the update of a step
      whose global grad norm is above it (or not finite). Default inf: off.
    skip_step_on_spikes: MaxText's: skip the update of a step whose grad norm is above the
      mean of the last `skip_step_interval` steps' by more than `skip_step_scaling_factor`
      standard deviations (or not finite). Default False.
    skip_step_interval: MaxText's: how many recent steps' grad norms the spike guard
      keeps. Default 128.
    skip_step_scaling_factor: MaxText's: how many standard deviations above the mean a
      spike is. Default 6.0.
    stacked: `optim`/`optim_grads` only: prefixes of subtrees whose leaves carry a leading
      layer axis that the loss scans over; each layer's grads are reduce-scattered inside
      the scan. Default ().
    optimizer_cpu_offload: sharded strategies: keep the optimizer state (and the master
      params, where the step reads them only in its update) in the host's pinned memory
      between steps; each step streams them through the device to update them. Default
      False.
    optimizer_offload_fraction: with `optimizer_cpu_offload`, the fraction of the optimizer
      state (whole buckets; FSDP: whole units) kept on the host, in [0, 1]. Default 1.0.

  Examples:
    >>> import jaxdp
    >>> jaxdp.DDPConfig(data_parallel_sharding_strategy="optim").use_distributed_optimizer
    True
    >>> jaxdp.DDPConfig(bucket_size=0)
    Traceback (most recent call last):
    ...
    ValueError: bucket_size=0: must be a positive number of elements, or None for the strategy's default (no_shard: 6_553_600 = 25 MiB of fp32; sharded: max(16_000_000, 1_000_000 * dp))
  """

  data_parallel_sharding_strategy: Strategy = "no_shard"
  """What is sharded: nothing (DDP), optimizer state (ZeRO-1), + grads (ZeRO-2), + params (FSDP)."""
  grad_reduce_in_fp32: bool = True
  """Accumulate and reduce gradients in fp32 even when params are bf16/fp16 (fp32 main grads)."""
  grad_reduce_dtype: Any = None
  """Not a Megatron field: the dtype the grad buckets are accumulated, reduced and held in
  until the update, which receives each grad cast back to its master's dtype (fp32), e.g.
  `jnp.bfloat16` for fp32 params the loss casts to bf16 (PyTorch DDP's `bf16_compress_hook`,
  torch FSDP2's `MixedPrecisionPolicy(reduce_dtype=)`): half the bytes on the wire and in
  the grad buffers, the sums rounded to bf16. It is what `jax.jit` of such a loss does
  without being asked (the compiler reduces each matmul's grad in the matmul's output
  dtype). None: fp32 with `grad_reduce_in_fp32`, else each param's dtype; when set it
  decides, whatever `grad_reduce_in_fp32` says."""
  overlap_grad_reduce: bool = True
  """Reduce each bucket as soon as its grads are ready; False: one bucket per buffer, after backward."""
  overlap_param_gather: bool = True
  """Sharded strategies: gather each bucket's params at the start of the next forward, not after the update."""
  bucket_size: int | None = None
  """Elements per bucket; None: no_shard 6_553_600 (PyTorch DDP's 25 MiB of fp32: XLA copies
  a bucket before reducing it; a model that fits one gets 16 buckets, of at least 16_384), the
  sharded strategies max(16_000_000, 1_000_000 * dp); see `layout.default_bucket_size`."""
  average_in_collective: bool = False
  """Average inside the collective (pmean) instead of scaling by 1/dp and summing."""
  check_for_nan_in_grad: bool = False
  """Raise (naming the parameter) when a reduced gradient holds NaN or Inf: the step skips its
  update on the device and `NonFiniteGradError.state` is the state as it was (the state is
  donated all the same)."""
  num_distributed_optimizer_instances: int = 1
  """Copies of the sharded optimizer: shard within the "data" axis, replicate across "replica"."""
  outer_dp_sharding_strategy: Literal["no_shard", "optim"] = "no_shard"
  """FSDP across "replica": "no_shard" (HSDP) keeps whole copies; "optim" (HFSDP) also shards the master and optimizer state across it."""
  fused_update: bool | None = None
  """Update each bucket (its shard; FSDP: each unit's) as one flat array (Megatron's fused
  multi-tensor Adam); None: the sharded strategies do when the optax transformation gives
  the same updates on the flat buckets (probed at init) and no FSDP unit is stacked or
  chunked, `no_shard` updates per leaf; True: require it (no_shard: params that need no fp32
  copy); False: per-leaf update."""
  grad_norm_skip_threshold: float = math.inf
  """Megatron's `OptimizerConfig.grad_norm_skip_threshold` (jaxdp has one config): a step
  whose global grad norm (`metrics["grad_norm"]`, before clipping) is above it, or not
  finite, skips its update on the device: params, master params, optimizer state and model
  state stay as they were, the step is counted and `metrics["skipped"]` says so. inf: off."""
  skip_step_on_spikes: bool = False
  """MaxText's spike guard, on the grad norm: a step whose global grad norm is above the
  mean of the last `skip_step_interval` norms the guard let through by more than
  `skip_step_scaling_factor` of their standard deviations, or not finite, skips its update
  as with `grad_norm_skip_threshold`. The norms live in the state (`TrainState.spike_window`,
  checkpointed); a skipped step's norm is not added to them, and the guard judges only once
  it holds `max(2, skip_step_interval // 2)` of them."""
  skip_step_interval: int = 128
  """MaxText's: how many recent grad norms the spike guard's mean and deviation are over."""
  skip_step_scaling_factor: float = 6.0
  """MaxText's: how many standard deviations above the mean a grad norm is a spike."""
  stacked: Sequence[Prefix] = ()
  """`optim` and `optim_grads` (not a Megatron field; FSDP's is `FSDPConfig.stacked`):
  prefixes, as `FSDPConfig.stacked`, of subtrees whose leaves carry a leading layer axis
  that the loss scans over (`lax.scan`, `nnx.scan`).
  Each such leaf is sharded on a dim of a layer, not on the layers, and each layer's
  gradients are reduce-scattered inside the backward loop of the scan, in that layer's
  iteration, so no stacked whole-size gradient is ever built (GSPMD's ZeRO-1 does the same);
  with `overlap_param_gather` each is all-gathered on its own (no bucket copy). A leaf of
  one dim, or one the loss uses outside a scan's `xs`, is reduced whole as before."""

  optimizer_cpu_offload: bool = False
  """Sharded strategies: the optimizer state (of the buckets `optimizer_offload_fraction`
  picks) lives in the host's pinned memory (`memory_kind="pinned_host"`) between steps, and
  so do their master params where the step reads them only in its update (ZeRO without
  `overlap_param_gather`; FSDP's forward and ZeRO's overlapped gather read all of them, so
  there they stay on the device, as Megatron keeps the params on the GPU); each step streams
  the offloaded state through the device a piece at a time, updates it there and writes it
  back (Megatron's `optimizer_cpu_offload`, with the update on the device)."""
  optimizer_offload_fraction: float = 1.0
  """With `optimizer_cpu_offload`, the fraction of the optimizer state offloaded, in [0, 1]
  (Megatron's `optimizer_offload_fraction`): the first buckets in layout order (FSDP: units)
  until their elements reach this fraction of all; whole buckets, so the fraction offloaded
  is this or a little more (0: none, 1: all)."""

  def __post_init__(self):
    if self.data_parallel_sharding_strategy not in STRATEGIES:
      raise ValueError(
        f"data_parallel_sharding_strategy={self.data_parallel_sharding_strategy!r}: "
        f"unknown strategy; use one of {', '.join(STRATEGIES)}"
      )
    if self.bucket_size is not None and (
      isinstance(self.bucket_size, bool)
      or not isinstance(self.bucket_size, int)
      or self.bucket_size <= 0
    ):
      raise ValueError(
        f"bucket_size={self.bucket_size!r}: must be a positive number of elements, "
        "or None for the strategy's default (no_shard: 6_553_600 = 25 MiB of fp32; "
        "sharded: max(16_000_000, 1_000_000 * dp))"
      )
    n = self.num_distributed_optimizer_instances
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(f"num_distributed_optimizer_instances={n!r}: must be an integer >= 1")
    if n > 1 and self.data_parallel_sharding_strategy == "no_shard":
      raise ValueError(
        f"num_distributed_optimizer_instances={n} needs a sharded strategy: with "
        "'no_shard' nothing is sharded; use data_parallel_sharding_strategy='optim' or "
        "leave num_distributed_optimizer_instances=1"
      )
    outer = self.outer_dp_sharding_strategy
    if outer not in ("no_shard", "optim"):
      raise ValueError(
        f"outer_dp_sharding_strategy={outer!r}: unknown strategy; use 'no_shard' (whole "
        "copies across 'replica') or 'optim' (master and optimizer state sharded across it)"
      )
    if outer == "optim" and self.data_parallel_sharding_strategy != "optim_grads_params":
      raise ValueError(
        "outer_dp_sharding_strategy='optim' shards FSDP's master params and optimizer "
        "state across 'replica' (Megatron-FSDP's HFSDP) and needs "
        "data_parallel_sharding_strategy='optim_grads_params'; for "
        f"{self.data_parallel_sharding_strategy!r} shard over every device instead (one "
        "'data' axis of replica x data devices, num_distributed_optimizer_instances=1), or "
        "leave outer_dp_sharding_strategy='no_shard'"
      )
    if outer == "optim" and n == 1:
      raise ValueError(
        "outer_dp_sharding_strategy='optim' shards across the 'replica' axis, but "
        "num_distributed_optimizer_instances=1 says there is none; set "
        "num_distributed_optimizer_instances to the 'replica' axis size (> 1), or leave "
        "outer_dp_sharding_strategy='no_shard'"
      )
    for name in (
      "grad_reduce_in_fp32",
      "overlap_grad_reduce",
      "overlap_param_gather",
      "average_in_collective",
      "check_for_nan_in_grad",
      "skip_step_on_spikes",
    ):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r}: must be True or False")
    object.__setattr__(
      self,
      "grad_norm_skip_threshold",
      _positive(
        "grad_norm_skip_threshold",
        self.grad_norm_skip_threshold,
        "a grad norm above which a step skips its update; inf (the default) turns it off",
        allow_inf=True,
      ),
    )
    object.__setattr__(
      self,
      "skip_step_scaling_factor",
      _positive(
        "skip_step_scaling_factor",
        self.skip_step_scaling_factor,
        "how many standard deviations above the recent mean a grad norm is a spike (6.0)",
      ),
    )
    interval = self.skip_step_interval
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 2:
      raise ValueError(
        f"skip_step_interval={interval!r}: must be an int >= 2, the number of recent grad "
        "norms the spike guard's mean and standard deviation are over (128)"
      )
    if self.grad_reduce_dtype is not None:
      object.__setattr__(
        self,
        "grad_reduce_dtype",
        _float_dtype(
          f"grad_reduce_dtype={self.grad_reduce_dtype!r}",
          self.grad_reduce_dtype,
          "the dtype gradients are reduced in; None reduces in fp32 "
          "(grad_reduce_in_fp32=True) or in each param's dtype",
        ),
      )
    if not isinstance(self.optimizer_cpu_offload, bool):
      raise ValueError(
        f"optimizer_cpu_offload={self.optimizer_cpu_offload!r}: must be True or False"
      )
    fraction = self.optimizer_offload_fraction
    if (
      isinstance(fraction, bool)
      or not isinstance(fraction, (int, float))
      or not 0.0 <= fraction <= 1.0
    ):
      raise ValueError(
        f"optimizer_offload_fraction={fraction!r}: must be a number in [0, 1], the fraction "
        "of the optimizer state kept in host memory (1.0: all of it)"
      )
    if self.optimizer_cpu_offload:
      check_offload_supported(jaxlib_version())
    if self.optimizer_cpu_offload and self.data_parallel_sharding_strategy == "no_shard":
      raise ValueError(
        "optimizer_cpu_offload=True offloads each device's shard of the optimizer state, "
        "but 'no_shard' keeps a whole replica of it on every device (every device would "
        "stream the whole state each step); use data_parallel_sharding_strategy='optim', "
        "'optim_grads' or 'optim_grads_params', or leave optimizer_cpu_offload=False"
      )
    if self.fused_update not in (None, True, False):
      raise ValueError(f"fused_update={self.fused_update!r}: must be None, True or False")
    if isinstance(self.stacked, (str, bytes)):
      raise ValueError(
        f"stacked={self.stacked!r} is one string; pass a list of prefixes, e.g. "
        f"stacked=[{self.stacked!r}]"
      )
    if self.stacked and self.data_parallel_sharding_strategy == "optim_grads_params":
      raise ValueError(
        f"DDPConfig(stacked={list(self.stacked)}) is for 'optim' and 'optim_grads'; FSDP "
        "('optim_grads_params') takes its stacks from its own config: pass "
        f"FSDPConfig(stacked={list(self.stacked)}) and leave DDPConfig's stacked out"
      )
    object.__setattr__(self, "stacked", tuple(_prefix(s) for s in self.stacked))
    if self.stacked and self.data_parallel_sharding_strategy == "no_shard":
      raise ValueError(
        f"stacked={self.stacked} needs a sharded strategy (it places and reduce-scatters "
        "the optimizer's shards of scanned layers); 'no_shard' all-reduces whole grads: "
        "leave stacked out, or use data_parallel_sharding_strategy='optim'"
      )

  def stack_of(self, path: str) -> str | None:
    """The `stacked` prefix the leaf at `path` (`jax.tree_util.keystr`) is under, else None.

    Examples:
      >>> c = DDPConfig(data_parallel_sharding_strategy="optim", stacked=["blocks"])
      >>> c.stack_of("['blocks']['w1']"), c.stack_of("['head']")
      ("['blocks']", None)
    """
    return next((s for s in self.stacked if _prefix_under(path, s)), None)

  @property
  def grad_dtype(self) -> np.dtype | None:
    """The dtype of the grad buckets: `grad_reduce_dtype`, else fp32 with
    `grad_reduce_in_fp32`, else None (each param's own dtype).

    Examples:
      >>> DDPConfig().grad_dtype, DDPConfig(grad_reduce_in_fp32=False).grad_dtype
      (dtype('float32'), None)
      >>> DDPConfig(grad_reduce_dtype="bfloat16").grad_dtype
      dtype(bfloat16)
    """
    if self.grad_reduce_dtype is not None:
      return self.grad_reduce_dtype
    return np.dtype(np.float32) if self.grad_reduce_in_fp32 else None

  @property
  def skips_steps(self) -> bool:
    """Does the step decide on the device whether to skip its update: a guard is on
    (`grad_norm_skip_threshold`, `skip_step_on_spikes`) or the NaN check is.

    Examples:
      >>> DDPConfig().skips_steps, DDPConfig(grad_norm_skip_threshold=10.0).skips_steps
      (False, True)
      >>> DDPConfig(grad_norm_skip_threshold=0.0)
      Traceback (most recent call last):
      ...
      ValueError: grad_norm_skip_threshold=0.0: must be a number > 0, a grad norm above which a step skips its update; inf (the default) turns it off
    """
    return (
      self.check_for_nan_in_grad
      or self.skip_step_on_spikes
      or self.grad_norm_skip_threshold != math.inf
    )

  @property
  def use_distributed_optimizer(self) -> bool:
    """Megatron's flag: True for every strategy that shards the optimizer state."""
    return self.data_parallel_sharding_strategy != "no_shard"

  @property
  def shards_grads(self) -> bool:
    """`optim_grads` and FSDP: every micro-batch's grads are reduce-scattered, so a device
    keeps only its shard of the accumulated grads (ZeRO-2)."""
    return self.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params")

  @property
  def shards_params(self) -> bool:
    """FSDP (`optim_grads_params`, ZeRO-3): the params themselves are sharded between
    steps, gathered unit by unit inside the step."""
    return self.data_parallel_sharding_strategy == "optim_grads_params"

  @property
  def outer_shards(self) -> int:
    """How many ways the master params and optimizer state are split across "replica" as
    well as "data": `num_distributed_optimizer_instances` under HFSDP
    (`outer_dp_sharding_strategy="optim"`), else 1 (each replica holds a whole copy).

    Examples:
      >>> DDPConfig(data_parallel_sharding_strategy="optim_grads_params",
      ...           num_distributed_optimizer_instances=2,
      ...           outer_dp_sharding_strategy="optim").outer_shards
      2
    """
    if self.outer_dp_sharding_strategy == "optim":
      return self.num_distributed_optimizer_instances
    return 1


@dataclasses.dataclass(frozen=True)
class FSDPConfig:
  """What the units of `optim_grads_params` are, and whether forward keeps them gathered.

  Pass the same config to `init_state(..., fsdp=)` and `make_train_step(..., fsdp=)` (a
  step given another is refused); the other strategies take none. Prefixes are key tuples
  (`("blocks", 3)`), a single top-level key (`"wte"`), or `jax.tree_util.keystr` strings
  (`"['blocks'][3]"`; an attribute path of an `eqx.Module`'s fields is `".blocks"`). The API
  reference (docs/api.md) gives each field in full.

  Attributes:
    units: None: one unit per layer; a list of prefixes (one unit each, the rest one root
      unit); or `fn(path: str) -> unit name`.
    stacked: prefixes of subtrees whose leaves carry a leading layer axis (scanned
      layers): one unit per layer, gathered inside the model's scan. Default ().
    reshard_after_forward: free each unit after its forward and gather it again for its
      backward (torch FSDP2's default). Default True.
    reshard_last_layer: with `reshard_after_forward` and `prefetch` >= 1, free a scanned
      unit's last layer too. Default False: the backward, which runs that layer first,
      runs it on the params its forward ran on, as torchtitan leaves its last block
      unsharded: no gather waited for between the loss and the backward's first layer,
      one layer held across the loss (more at the peak where the loss is the peak).
    reshard_after_backward: with `grad_accum_steps` > 1, False gathers each unit once per
      step and reduce-scatters once at the end. Default True.
    prefetch: how many units ahead an all-gather may start. Default 1.
    chunks: `{prefix: C}`: params gathered and reduce-scattered C row blocks at a time
      where the loss uses them (a large embedding or output projection). Default {}.
    vocab_parallel: compute a param the loss only reads by rows (a vocabulary table) on
      each device's rows, moving activations instead, where that moves fewer bytes than
      gathering it. Default True.
    lookups: prefixes of params the loss only reads by row lookups (an untied input
      embedding, `embed[ids]`): sharded by their columns, each lookup moves the rows it
      reads (an all-to-all of its output's size), not dp times as many. Default ().
    param_dtype: the dtype every float param is gathered in and the loss receives (e.g.
      `jnp.bfloat16`); the fp32 master stays sharded. None: each param's own dtype, or the
      narrower one every use of it in the loss casts it to.

  Examples:
    >>> FSDPConfig(units=["blocks", ("head", 0)]).units
    ("['blocks']", "['head'][0]")
    >>> FSDPConfig(stacked=["blocks"], units=lambda path: "one")
    Traceback (most recent call last):
    ...
    ValueError: FSDPConfig: stacked= needs the default units or a list of prefixes; a units function must name the unit of every leaf itself, so put each stacked subtree in a unit of its own and leave stacked= out
    >>> FSDPConfig(param_dtype="bfloat16").param_dtype
    dtype(bfloat16)
    >>> FSDPConfig(param_dtype="int8")
    Traceback (most recent call last):
    ...
    ValueError: FSDPConfig: param_dtype='int8': must be a floating-point dtype (e.g. jnp.bfloat16), the dtype the params are gathered and computed in; None keeps each param's own dtype
  """

  units: Sequence[Prefix] | Callable[[str], str] | None = None
  """None: one unit per layer (the subtree at the first sequence index of a leaf's path,
  else the top-level entry); a list of prefixes (one unit each, the rest is one root unit);
  or `fn(path: str) -> unit name`."""
  stacked: Sequence[Prefix] = ()
  """Prefixes of subtrees whose leaves carry a leading layer axis (scanned layers): one unit
  per layer, gathered inside the model's own scan over them."""
  reshard_after_forward: bool = True
  """Free each unit's gathered params after its forward and gather again for its backward
  (torch FSDP2's default); False keeps them from forward to backward (no second gather)."""
  reshard_last_layer: bool = False
  """With `reshard_after_forward` and `prefetch` >= 1: True frees a scanned unit's last layer
  after its forward too. False (torchtitan's choice for the last block): the backward runs
  that layer first on the params its forward ran on, so nothing waits for its gather
  between the loss and the backward; the price is one layer held across the loss, which
  raises the peak where the loss is the peak (docs/bench.md: on 64 GPUs, not on 8)."""
  reshard_after_backward: bool = True
  """With `grad_accum_steps` > 1: False gathers every unit once per step and keeps it for all
  micro-batches, accumulating whole-size gradients, reduce-scattered once at the end (torch
  FSDP2's `set_reshard_after_backward(False)` with gradient sync on the last micro-batch):
  1 all-gather + 1 reduce-scatter per unit and step instead of k + k, for the memory of the
  whole params and their gradients during the step. No effect with one micro-batch."""
  prefetch: int = 1
  """How many units ahead an all-gather may start (torch FSDP2's
  `set_modules_to_forward_prefetch` depth, Megatron-FSDP's double buffer): with 1, unit i+1's
  gather may run while unit i computes, in the forward and (reversed) in the backward, and no
  earlier, so at most prefetch + 1 unrolled units are gathered at once. Enforced by data
  dependencies (`optimization_barrier`), not left to XLA's scheduler. A scanned unit's
  loops gather the next layer while one layer computes, its gathers combined into one
  collective on GPU (docs/design.md, "Scanned layers one iteration ahead"); with 0 each
  iteration gathers its own layer param by param: about a layer less at the peak, and
  only what XLA overlaps within a layer hidden."""
  chunks: Mapping[Prefix, int] = dataclasses.field(default_factory=dict)
  """`{prefix: C}`: params gathered and reduce-scattered C row blocks at a time, for a large
  embedding or output projection (`{"wte": 8}`): each matmul that uses such a param runs as C
  matmuls, each on one block of rows (1/C of the param) gathered for it alone, and in the
  backward each block's gradient is reduce-scattered right after its matmul, so a unit never
  holds the whole param or its whole gradient (e.g. GPT-2's 147 MiB tied `wte`: 2/C of it
  instead of twice it). Every use of the param in the loss must be a matmul
  (`dot_general`: `x @ w.T`, `one_hot @ w`, an einsum) or a row lookup (`w[ids]`,
  `jnp.take(w, ids, axis=0)`: each block gathered once, nothing in the backward), possibly
  after a cast (`w.astype(jnp.bfloat16)`: the blocks then move in that dtype); stored as
  sorted `(prefix, C)` pairs."""
  vocab_parallel: bool = True
  """Compute a param that the loss only reads by rows (a vocabulary table: row lookups
  `w[ids]`, matmuls that keep its rows in the product, `h @ w.T`) on each device's own rows,
  moving the activations instead of gathering the param (Megatron's vocab-parallel
  embedding and output layer, over "data"), wherever that moves fewer bytes than gathering
  it and reduce-scattering its gradient: the param and its gradient are then never whole.
  Decided per param from the shapes when the step is traced; a param in `chunks` keeps its
  row blocks. On meshes with tensor- or expert-parallel params, "replica" or a fused
  state, params are gathered as usual. False: always gathered."""
  lookups: Sequence[Prefix] = ()
  """Prefixes of params the loss only reads by row lookups (`w[ids]`, `jnp.take(w, ids,
  axis=0)`, `nnx.Embed`: an untied input embedding): each is sharded over "data" by its
  columns (its dim 1) rather than its rows, so that a lookup runs on every device's ids
  with this device's columns of the rows they read and one all-to-all hands each device its
  own rows whole: it moves the lookup's output once (its cotangent once in the backward),
  where a table sharded by rows (`vocab_parallel`) sums dp devices' zero-padded rows into
  each device, dp times the bytes, and gathering moves the whole table. Not the default
  because the shard dim is fixed when the state is made, from the params alone, before any
  loss is seen (pass the same config to `init_state` and `make_train_step`); a param so
  named that the loss uses otherwise is refused when the step is built."""
  param_dtype: Any = None
  """The dtype every float param is gathered in and the loss receives (torch FSDP2's
  `MixedPrecisionPolicy(param_dtype=)`, e.g. `jnp.bfloat16`): the fp32 master stays sharded,
  each unit's shard is cast before its all-gather (which moves, and gathers, half the bytes
  of fp32), and gradients are reduce-scattered in fp32 with `DDPConfig(grad_reduce_in_fp32=
  True)` (the default), else in this dtype. None: each param's own dtype, or the narrower
  one every use of it in the loss casts it to (a float32 param the loss always casts to
  bfloat16 is gathered in bfloat16; the loss computes on the same values)."""

  def __post_init__(self):
    if self.units is not None and not callable(self.units):
      if isinstance(self.units, (str, bytes)):
        raise ValueError(
          f"FSDPConfig: units={self.units!r} is one string; pass a list of "
          "prefixes, e.g. units=['blocks']"
        )
      object.__setattr__(self, "units", tuple(_prefix(u) for u in self.units))
    if isinstance(self.stacked, (str, bytes)):
      raise ValueError(
        f"FSDPConfig: stacked={self.stacked!r} is one string; pass a list of "
        f"prefixes, e.g. stacked=[{self.stacked!r}]"
      )
    object.__setattr__(self, "stacked", tuple(_prefix(s) for s in self.stacked))
    if self.stacked and callable(self.units):
      raise ValueError(
        "FSDPConfig: stacked= needs the default units or a list of prefixes; a units "
        "function must name the unit of every leaf itself, so put each stacked subtree in "
        "a unit of its own and leave stacked= out"
      )
    if not isinstance(self.reshard_after_forward, bool):
      raise ValueError(
        f"FSDPConfig: reshard_after_forward={self.reshard_after_forward!r}: must be True or False"
      )
    if not isinstance(self.reshard_last_layer, bool):
      raise ValueError(
        f"FSDPConfig: reshard_last_layer={self.reshard_last_layer!r}: must be True or False"
      )
    if not isinstance(self.reshard_after_backward, bool):
      raise ValueError(
        f"FSDPConfig: reshard_after_backward={self.reshard_after_backward!r}: must be True or False"
      )
    if not isinstance(self.chunks, Mapping) and not isinstance(self.chunks, tuple):
      raise ValueError(
        f"FSDPConfig: chunks={self.chunks!r}: pass a dict from prefix to the number of row "
        "blocks, e.g. chunks={'wte': 8}"
      )
    pairs = dict(self.chunks).items()
    for prefix, n in pairs:
      if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(
          f"FSDPConfig: chunks[{prefix!r}]={n!r}: must be an int >= 1 (the number of row "
          "blocks the param is gathered in)"
        )
    object.__setattr__(self, "chunks", tuple(sorted((_prefix(p), n) for p, n in pairs)))
    if any(
      _prefix_under(p, s) or _prefix_under(s, p) for p, _ in self.chunks for s in self.stacked
    ):
      raise ValueError(
        f"FSDPConfig: chunks={dict(self.chunks)} names params under stacked={self.stacked}; "
        "a stacked layer is gathered whole inside its scan iteration: chunk only unstacked "
        "params (an embedding, an output projection)"
      )
    if isinstance(self.lookups, (str, bytes)):
      raise ValueError(
        f"FSDPConfig: lookups={self.lookups!r} is one string; pass a list of "
        f"prefixes, e.g. lookups=[{self.lookups!r}]"
      )
    object.__setattr__(self, "lookups", tuple(_prefix(p) for p in self.lookups))
    for p in self.lookups:
      clash = [
        s
        for s in (*self.stacked, *(c for c, _ in self.chunks))
        if _prefix_under(p, s) or _prefix_under(s, p)
      ]
      if clash:
        raise ValueError(
          f"FSDPConfig: lookups names {p}, which stacked= or chunks= names too ({clash[0]}); "
          "a lookup table is sharded by its columns, a stacked or chunked param by its "
          "rows: name it in one of them"
        )
    if not isinstance(self.vocab_parallel, bool):
      raise ValueError(f"FSDPConfig: vocab_parallel={self.vocab_parallel!r}: must be True or False")
    if self.param_dtype is not None:
      object.__setattr__(
        self,
        "param_dtype",
        _float_dtype(
          f"FSDPConfig: param_dtype={self.param_dtype!r}",
          self.param_dtype,
          "the dtype the params are gathered and computed in; None keeps each param's own dtype",
        ),
      )
    if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
      raise ValueError(
        f"FSDPConfig: prefetch={self.prefetch!r}: must be an int >= 0 (how "
        "many units ahead an all-gather may start; 1 is the default)"
      )


def _positive(name: str, value, meaning: str, allow_inf: bool = False) -> float:
  """`value` as a float > 0 (finite unless `allow_inf`), or a ValueError naming `name`."""
  number = None
  if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
    number = float(value)
  if number is None or not number > 0 or (number == math.inf and not allow_inf):
    raise ValueError(
      f"{name}={value!r}: must be a {'number' if allow_inf else 'finite number'} > 0, {meaning}"
    )
  return number


def _float_dtype(what: str, value, meaning: str) -> np.dtype:
  """`value` as a floating-point dtype, or a ValueError that starts with `what`."""
  try:
    dtype = np.dtype(value)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"{what}: must be a floating-point dtype (e.g. jnp.bfloat16), {meaning}")
  return dtype


def _prefix_under(path: str, prefix: str) -> bool:
  return path == prefix or (path.startswith(prefix) and path[len(prefix)] in "[.")


def _prefix(p: Prefix) -> str:
  """A prefix as a keystr string: "blocks" -> "['blocks']", ("blocks", 3) -> "['blocks'][3]"."""
  if isinstance(p, str):
    return p if p.startswith(("[", ".")) else f"[{p!r}]"
  if isinstance(p, tuple) and p:
    return "".join(f"[{k!r}]" for k in p)
  raise ValueError(
    f"prefix {p!r}: use a key tuple like ('blocks', 3), a "
    "top-level key like 'wte', or a keystr like \"['blocks'][3]\""
  )


OFFLOAD_MIN_JAXLIB = (0, 10, 2)
"""The oldest jaxlib whose XLA compiles host offload (`optimizer_cpu_offload`): the SPMD
partitioner of 0.10.0 and 0.10.1 stops at the placement annotations of memory kinds
("Side-effect HLO must have sharding")."""


def jaxlib_version() -> tuple[int, ...]:
  """The installed jaxlib's release as numbers, e.g. (0, 10, 2)."""
  return tuple(int(part) for part in jaxlib.__version__.split(".")[:3] if part.isdigit())


def check_offload_supported(version: tuple[int, ...]) -> None:
  """Raise a clear error where jaxlib `version` cannot compile host offload.

  Examples:
    >>> check_offload_supported((0, 10, 2))
    >>> check_offload_supported((0, 10, 0))
    Traceback (most recent call last):
    ...
    NotImplementedError: optimizer_cpu_offload=True needs jaxlib >= 0.10.2 ...
  """
  if version < OFFLOAD_MIN_JAXLIB:
    need = ".".join(map(str, OFFLOAD_MIN_JAXLIB))
    raise NotImplementedError(
      f"optimizer_cpu_offload=True needs jaxlib >= {need} (installed: "
      f"{'.'.join(map(str, version))}): the SPMD partitioner of older releases fails on "
      f"the placement of host memory; `pip install 'jax>={need}' 'jaxlib>={need}'`, or "
      "leave optimizer_cpu_offload=False"
    )
