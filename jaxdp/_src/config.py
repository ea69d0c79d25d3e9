"""`DDPConfig`: Megatron's `DistributedDataParallelConfig`, field for field."""

from __future__ import annotations

import dataclasses
from typing import Literal

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
Strategy = Literal["no_shard", "optim", "optim_grads", "optim_grads_params"]


@dataclasses.dataclass(frozen=True)
class DDPConfig:
  """How gradients are reduced and what is sharded across the `"data"` axis.

  The names and defaults are Megatron-Core's `DistributedDataParallelConfig`.

  Examples:
    >>> import jaxdp
    >>> jaxdp.DDPConfig(data_parallel_sharding_strategy="optim").use_distributed_optimizer
    True
    >>> jaxdp.DDPConfig(bucket_size=0)
    Traceback (most recent call last):
    ...
    ValueError: bucket_size=0: must be a positive number of elements, or None for Megatron's default max(40_000_000, 1_000_000 * dp)
  """

  data_parallel_sharding_strategy: Strategy = "no_shard"
  """What is sharded: nothing (DDP), optimizer state (ZeRO-1), + grads (ZeRO-2), + params (FSDP)."""
  grad_reduce_in_fp32: bool = True
  """Accumulate and reduce gradients in fp32 even when params are bf16/fp16 (fp32 main grads)."""
  overlap_grad_reduce: bool = True
  """Reduce each bucket as soon as its grads are ready; False: one bucket per buffer, after backward."""
  overlap_param_gather: bool = True
  """Sharded strategies: gather each bucket's params at the start of the next forward, not after the update."""
  bucket_size: int | None = None
  """Elements per bucket; None: max(40_000_000, 1_000_000 * dp)."""
  average_in_collective: bool = False
  """Average inside the collective (pmean) instead of scaling by 1/dp and summing."""
  check_for_nan_in_grad: bool = False
  """Raise (naming the parameter) when a reduced gradient holds NaN or Inf; the state is kept."""
  num_distributed_optimizer_instances: int = 1
  """Copies of the sharded optimizer: shard within the "data" axis, replicate across "replica"."""

  def __post_init__(self):
    if self.data_parallel_sharding_strategy not in STRATEGIES:
      raise ValueError(
          f"data_parallel_sharding_strategy={self.data_parallel_sharding_strategy!r}: "
          f"unknown strategy; use one of {', '.join(STRATEGIES)}")
    if self.bucket_size is not None and (
        isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int)
        or self.bucket_size <= 0):
      raise ValueError(
          f"bucket_size={self.bucket_size!r}: must be a positive number of elements, "
          "or None for Megatron's default max(40_000_000, 1_000_000 * dp)")
    n = self.num_distributed_optimizer_instances
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(
          f"num_distributed_optimizer_instances={n!r}: must be an integer >= 1")
    if n > 1 and self.data_parallel_sharding_strategy == "no_shard":
      raise ValueError(
          f"num_distributed_optimizer_instances={n} needs a sharded strategy: with "
          "'no_shard' nothing is sharded; use data_parallel_sharding_strategy='optim' or "
          "leave num_distributed_optimizer_instances=1")
    for name in ("grad_reduce_in_fp32", "overlap_grad_reduce", "overlap_param_gather",
                 "average_in_collective", "check_for_nan_in_grad"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name}={getattr(self, name)!r}: must be True or False")

  @property
  def use_distributed_optimizer(self) -> bool:
    """Megatron's flag: True for every strategy that shards the optimizer state."""
    return self.data_parallel_sharding_strategy != "no_shard"
