"""What a train step should communicate and store, next to what it does.

`memory_ledger` predicts what each device holds per strategy (with the layout's real
padding) and `measured_bytes` reads what a `TrainState` does hold.

What each device sends per step, by strategy:

| strategy | communication (ring algorithm) |
|---|---|
| `no_shard` | all-reduce of the grad buffers: `2(N-1)/N · G` |
| `optim`, `optim_grads` | reduce-scatter `(N-1)/N · G` + all-gather `(N-1)/N · P` |
| `optim_grads_params` | all-gather `(N-1)/N · P`, twice with `reshard_after_forward`, + reduce-scatter `(N-1)/N · G` |

`G` is the bytes of the grad buffers (in `DDPConfig.grad_dtype`: fp32 with
`grad_reduce_in_fp32`, or `grad_reduce_dtype`), `P` of the param
buffers in the params' dtype (FSDP: in `FSDPConfig.param_dtype` when set, the dtype its
all-gathers move), `N` the size of the "data" axis. With fp32 params `P = G`, so
ZeRO-1/2 move what DDP moves and FSDP 1.5× that. `ring_formula` gives these numbers
for a `TrainState`, to hold against `jaxdp.inspect.Schedule.comm_bytes` of the
compiled step (`jaxdp.inspect.report(..., expected=ring_formula(state))` prints both),
with the other axes of its mesh: the "replica" axis (HSDP's all-reduce of each shard,
HFSDP's reduce-scatter and all-gather across it), "expert" (expert buckets are reduced
over the data axes but "expert") and tensor parallelism (a leaf split over "model" moves
each device's own slice).

Both follow the caller's placements: `memory_ledger` of params placed on a mesh (arrays
or `jax.ShapeDtypeStruct`s with a `NamedSharding`) counts 1/tp of a tensor-parallel leaf
and 1/ep of an expert one per device, as `init_state` on that mesh places them.

`memory_report` puts the memory ledger (`memory_ledger`, predicted), the bytes a
built `TrainState` holds (`measured_bytes`, from `addressable_shards`) and the compiled GPU
program's `memory_analysis()` side by side, as rows a notebook can tabulate or plot.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from jaxdp._src import aot, ddp, fsdp as fsdp_lib, train
from jaxdp._src.collectives import holds_own
from jaxdp._src.config import DDPConfig, FSDPConfig
from jaxdp._src.distributed_optimizer import (
  layout_own_specs,
  own_specs,
  trainable_leaves,
  use_fused,
)
from jaxdp._src.inspect import memory_stats, ring_bytes
from jaxdp._src.layout import (
  Frozen,
  Layout,
  alone_size,
  default_bucket_size,
  float_elements,
  make_layout,
  master_dtype,
  sharded_shape,
)
from jaxdp._src.mesh import DATA, EXPERT, REPLICA, ModelSpec, data_axes_in, model_specs_of
from jaxdp._src.state import (
  HOST,
  bucket_names,
  is_flat_leaf,
  match_opt_leaf,
  offloaded_buckets,
  offloaded_leaves,
  offloads_master,
)
from jaxdp._src.units import chunked_leaves, units_of

PyTree = Any


# ----------------------------------------------------------------------------- memory


@dataclasses.dataclass(frozen=True)
class MemoryLedger:
  """Bytes one device holds, by kind, with the layout's padding.

  `params` are the model params in their own dtypes as a step uses them (all of them,
  whole on every device, for `no_shard`, `optim`, `optim_grads`: ZeRO-1/2 keep the params
  whole; for `optim_grads_params` only the frozen params' shards and integer leaves: its
  trainable params live only in `master`, and the gathered units are not counted). Of
  those, `gathered_in_step` bytes are not kept between steps (`overlap_param_gather`: the
  trainable params are gathered whole from `master` at the start of each step), so
  `TrainState.params` holds `params - gathered_in_step`: `state["params"]` is 0 under
  `optim` while each step still holds `params` whole. `str(ledger)` says both. `grads` are the
  reduced (main) grads: whole buffers, or a 1/dp shard of each under `optim_grads`; they
  live only inside the step. `master` and `opt_state` are what `TrainState` holds.
  `gathered_unit` (`optim_grads_params`) is the largest unit gathered whole inside the step
  (one layer of a stacked unit; a param gathered by row blocks counted whole), in the dtype
  its all-gather moves (`FSDPConfig.param_dtype`, else the params' own), padding included:
  at most `prefetch + 1` units are gathered at once; not part of `total`.
  With `DDPConfig.optimizer_cpu_offload`, `master` and `opt_state` count the device's
  memory only, and `host_master`, `host_opt_state` what each device keeps of the offloaded
  buckets in the host's memory (the host of `k` devices holds `k` times that); neither is
  part of `total`.

  Examples:
    >>> import jax, jax.numpy as jnp, jaxdp
    >>> from jaxdp.inspect import memory_ledger
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)}
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
    >>> ledger = memory_ledger(params, None, 8, config)  # bf16 params, fp32 grads and Adam
    >>> ledger.params // 2**20, ledger.grads // 2**20, ledger.master // 2**19
    (2, 4, 1)
    >>> ledger.state["params"]  # between steps: gathered whole from master in each step
    0
    >>> print(ledger)
    7.50 MiB per device in the step: params 2.00 MiB (whole, gathered from master in each step; 0 B kept between steps), grads 4.00 MiB (reduced, in the step only), master 512.00 KiB, opt_state 1.00 MiB
  """

  params: int
  grads: int
  master: int
  opt_state: int
  gathered_in_step: int = 0
  gathered_unit: int = 0
  host_master: int = 0
  host_opt_state: int = 0

  @property
  def host(self) -> int:
    """Bytes per device in host memory (`optimizer_cpu_offload`): host_master +
    host_opt_state."""
    return self.host_master + self.host_opt_state

  @property
  def total(self) -> int:
    """params + grads + master + opt_state."""
    return self.params + self.grads + self.master + self.opt_state

  def __str__(self) -> str:
    kept = self.params - self.gathered_in_step
    if self.gathered_in_step:
      params = f"whole, gathered from master in each step; {_size(kept)} kept between steps"
    elif self.gathered_unit:
      params = (
        "frozen and integer leaves; the trainable ones live in master, gathered a unit at "
        f"a time in the step: the largest {_size(self.gathered_unit)}, not in the total"
      )
    else:
      params = "whole, kept"
    return (
      f"{_size(self.total)} per device in the step: params {_size(self.params)} ({params}), "
      f"grads {_size(self.grads)} (reduced, in the step only), master {_size(self.master)}, "
      f"opt_state {_size(self.opt_state)}"
      + (
        f"; in host memory: master {_size(self.host_master)}, opt_state "
        f"{_size(self.host_opt_state)}"
        if self.host
        else ""
      )
    )

  @property
  def state(self) -> dict[str, int]:
    """What the `TrainState` holds between steps, what `measured_bytes` finds in it (all
    but the step counter): `params` less `gathered_in_step` (0 under `optim` and
    `optim_grads` with `overlap_param_gather`, whose steps gather the params whole), and
    no grads (they live only inside the step); `host` with offload (`host`)."""
    kept = {
      "params": self.params - self.gathered_in_step,
      "master": self.master,
      "opt_state": self.opt_state,
    }
    if self.host:  # offloaded: `measured_bytes` counts the host memory apart
      kept["host"] = self.host
    return kept


def _size(n: int) -> str:
  """Bytes as a reader says them: "0 B", "512 B", "2.00 MiB"."""
  if n < 1024:
    return f"{n} B"
  if n < 2**20:
    return f"{n / 1024:.2f} KiB"
  if n < 2**30:
    return f"{n / 2**20:.2f} MiB"
  return f"{n / 2**30:.2f} GiB"


def _nbytes(shape, dtype) -> int:
  return math.prod(shape) * np.dtype(dtype).itemsize


def _bucket_elements(
  bucket, dp: int, own, tp_ways, padded: bool = True, stacks: bool = False, sliced: bool = False
) -> int:
  """Elements of `bucket` one device reduces or gathers over the data axes, padding
  included: all its shards. A bucket that holds a tensor-parallel leaf of `own`
  (`collectives.holds_own`), and with `stacks` a bucket of stacked layers (`Bucket.stack`,
  a stacked FSDP unit's: one layer at a time, inside the scan), is reduced and gathered
  per param, no end padding: an `own` leaf moves the device's own slice (1/`tp_ways` of
  its rows padded to a multiple of dp); any other param moves its padded rows whole (a
  leaf split over "model" on its shard dim, a column-parallel bias, is gathered over
  "model" first), except that with `padded=False` (`no_shard`'s all-reduce, elementwise:
  no padding, no gather) each param of an `own` bucket moves 1/`tp_ways` of its size, and
  with `sliced` (the all-reduce of a reduce-scattered shard across "replica" or "expert",
  elementwise: the shard keeps its split over "model") 1/`tp_ways` of its padded rows."""
  # Three shapes of what moves: per param, elementwise (no_shard's all-reduce of a bucket
  # with tensor-parallel leaves: no padding), the whole padded bucket (`shard_size * dp`:
  # every device's shard, end padding included), or per param its padded rows
  # (`p.shard_size(dp) * dp`), 1/tp of them where the device moves its own slice.
  if holds_own(bucket, own) and not padded:
    return sum(p.size // tp_ways[p.index] for p in bucket.params)
  layered = bucket.stack is not None or any(p.layers for p in bucket.params)
  if not (holds_own(bucket, own) or (stacks and layered)):
    return bucket.shard_size * dp
  return sum(
    p.shard_size(dp) * dp // (tp_ways[p.index] if sliced or p.index in own else 1)
    for p in bucket.params
  )


def _state_split(path, x, layout: Layout, sharded: bool, shards: int, specs, ways) -> int:
  """How many ways an optax state leaf is split across devices, as `init_state` places it
  (`opt_state_specs`): a per-param leaf (Adam's `mu['w']`, `match_opt_leaf`) like its
  param, over `shards` data shards under a sharded strategy and over the axes its caller
  split the param over (`ways`); one under a param's path with another shape (factored
  moments) is replicated; a leaf under no param's path is split like the params of its
  shape where they are all split alike (the data shards: where it has a padded param
  shape), else replicated.
  """
  # The shapes the optimizer sees: padded rows under a sharded strategy, so that an optax
  # leaf of a param's padded shape is matched to it as `init_state` matches it
  seen = {p.index: (p.seen if sharded else p.shape) for p in trainable_leaves(layout)}
  match = match_opt_leaf(path, x.shape, layout.paths, seen)
  if match.param is not None:
    return (shards if sharded else 1) * ways[match.param]
  if match.under_param or not match.same_shape:
    return 1
  placements = {specs[i] for i in match.same_shape} if specs else {()}
  alike = len(placements) == 1
  return (shards if sharded else 1) * (ways[match.same_shape[0]] if alike else 1)


def _placed_mesh(params: PyTree, dp: int):
  """The mesh the caller split some leaf of `params` over (a `NamedSharding` on an array or
  a `jax.ShapeDtypeStruct` over an axis), or None where every leaf is whole on each device.

  Raises:
    ValueError: that mesh's "data" axis is not of size `dp`.
  """
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding) and any(e is not None for e in sharding.spec):
      mesh = sharding.mesh
      if mesh.shape.get(DATA) != dp:
        raise ValueError(
          f"params{jax.tree_util.keystr(path)} is placed {sharding.spec} on a mesh "
          f"{dict(mesh.shape)}, whose {DATA!r} axis is not dp={dp}; pass "
          f"dp={mesh.shape.get(DATA)}, or params placed on a mesh with {DATA!r} of size {dp}"
        )
      return mesh
  return None


def split_ways(
  model_specs: tuple[ModelSpec, ...], sizes: Mapping[str, int], skip: tuple[str, ...] = ()
) -> list[int]:
  """Per leaf: how many ways the mesh axes its caller split it over (tensor parallel
  "model", "expert"; `sizes`: the mesh's axis sizes) divide it, leaving out the axes in
  `skip`; 1 for a whole leaf."""
  return [
    math.prod(sizes[a] for axes in dims for a in axes if a not in skip) for dims in model_specs
  ]


def memory_ledger(
  params: PyTree,
  tx: optax.GradientTransformation | None,
  dp: int,
  config: DDPConfig,
  *,
  frozen: Frozen = None,
  fsdp: FSDPConfig | None = None,
) -> MemoryLedger:
  """Predicts the bytes per device of params, grads, master params and optimizer state.

  The numbers follow the layout `init_state` builds (each leaf's shard dim, the one that
  pads least, padded to a multiple of dp; buckets padded to `lcm(dp, 128)`; FSDP's unit
  buckets), so they equal what `measured_bytes` reads
  off the state, byte for byte. Params placed on a mesh with other axes than the data
  axes carry their split: a leaf placed `P(None, "model")` on a `("data", "model")` mesh
  counts 1/tp per device (and 1/(tp * dp) of its master and optimizer state under the
  sharded strategies), an expert leaf placed `P("expert", ...)` 1/ep, with the layout
  `init_state` builds on that mesh (each leaf's shard dim one the other axes leave whole,
  padded there).

  Args:
    params: the model params (arrays or `jax.ShapeDtypeStruct`s); those placed with a
      `NamedSharding` on a mesh (a placed array, a `ShapeDtypeStruct(sharding=...)`) over
      axes other than the data axes ("model", "expert") are counted as split over them.
    tx: the optax transformation; None: Adam (two moments in the master dtype).
    dp: size of the mesh's "data" axis (the shards; a "replica" axis holds copies, except
      under HFSDP, `outer_dp_sharding_strategy="optim"`, where the master and the
      optimizer state are sharded over it too: 1/(replicas * dp) each): the mesh the
      ledger predicts for need not exist; that of placed `params` must have a "data"
      axis of this size.
    config: the `DDPConfig` (its strategy, `grad_reduce_in_fp32`, buckets,
      `overlap_param_gather`, `fused_update`: a fused state holds its buckets' end padding
      too, `stacked`: those stacks' leaves are sharded on a dim of a layer).
    frozen: as in `init_state`.
    fsdp: the `FSDPConfig` of `optim_grads_params` (None: the default); its units are the
      buckets of a fused FSDP state, and its `param_dtype` the dtype of `gathered_unit`.

  Returns:
    A `MemoryLedger`.

  Raises:
    TypeError: `config` is not a `DDPConfig`.
    ValueError: `params` are placed on a mesh whose "data" axis is not of size `dp`, or
      in a way `init_state` refuses (`model_specs_of`).

  Examples:
    >>> import jax, jax.numpy as jnp, jaxdp
    >>> from jaxdp.inspect import memory_ledger
    >>> params = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)}  # psi = 2**20
    >>> configs = [jaxdp.DDPConfig(data_parallel_sharding_strategy=s)
    ...            for s in ("no_shard", "optim", "optim_grads")]
    >>> [round(memory_ledger(params, None, 8, c).total / 2**20, 3) for c in configs]
    [18.0, 7.5, 4.0]

    Tensor parallel: the same weight placed column-parallel on a (data=4, model=2) mesh
    is half on each device, its fp32 master and Adam's moments 1/8:

    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((4, 2), ("data", "model"))
    >>> w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16,
    ...                          sharding=NamedSharding(mesh, P(None, "model")))
    >>> ledger = memory_ledger({"w": w}, None, 4, configs[1])
    >>> ledger.params // 2**20, ledger.master // 2**19, ledger.opt_state // 2**20
    (1, 1, 1)
  """
  if not isinstance(config, DDPConfig):
    raise TypeError(
      f"config={config!r}: memory_ledger takes a jaxdp.DDPConfig, e.g. "
      "memory_ledger(params, tx, 8, jaxdp.DDPConfig(data_parallel_sharding_strategy='optim'))"
    )
  strategy = config.data_parallel_sharding_strategy
  sharded, fsdp_step = config.use_distributed_optimizer, config.shards_params
  if fsdp_step:
    fsdp = fsdp or FSDPConfig()
  # HFSDP: rows padded to replicas * dp; master and optimizer state 1/(replicas * dp)
  outer = config.outer_shards
  mesh = _placed_mesh(params, dp)
  if mesh is not None:
    # the caller split leaves over other axes: the layout `init_state` builds on that mesh
    specs = model_specs_of(params, mesh)
    if fsdp_step:
      layout = fsdp_lib.layout_for(params, mesh.shape, config, fsdp, frozen, specs)
    else:
      layout = ddp.layout_for(params, mesh, config, frozen, specs)
    # each device holds 1/ways of a leaf (expert params' buffers are one rank's already)
    sizes = dict(mesh.shape)
    ways, tp_ways = split_ways(specs, sizes), split_ways(specs, sizes, (EXPERT,))
    own = layout_own_specs(layout, specs, mesh)
  elif fsdp_step:  # the units' layout, each leaf on the dim that pads least
    specs, own = (), {}
    ways = tp_ways = [1] * len(jax.tree.leaves(params))
    layout = fsdp_lib.layout_for(params, {DATA: dp}, config, fsdp, frozen)
  else:
    specs, own = (), {}
    ways = tp_ways = [1] * len(jax.tree.leaves(params))
    size = config.bucket_size or default_bucket_size(dp, strategy, float_elements(params))
    size = size if config.overlap_grad_reduce else sys.maxsize
    layout = make_layout(
      params,
      dp=dp,
      bucket_size=size,
      frozen=frozen,
      grad_dtype=config.grad_dtype,
      scanned=config.stack_of if config.stacked else None,
      outer=outer,
      alone_over=alone_size(strategy, size, config.bucket_size),
    )
  leaves_ = trainable_leaves(layout)

  # [Note: bytes per device]
  # Every count below is a whole leaf's (or bucket's) bytes divided by the ways it is split
  # on one device: `ways[i]` for the caller's own axes ("model", "expert"), `dp` for the
  # "data" shards, `outer` for HFSDP's "replica" split of the master. The sizes divided are
  # the padded ones wherever the state stores padded rows (`x.seen`, `sharded_shape`,
  # buckets' `shard_size`), so that each quotient is what one device's `addressable_shards`
  # hold (`measured_bytes`).
  dtypes = [leaf.dtype for leaf in layout.leaves]
  model = sum(_nbytes(leaf.shape, leaf.dtype) // ways[leaf.index] for leaf in layout.leaves)
  trainable_model = sum(_nbytes(x.shape, dtypes[x.index]) // ways[x.index] for x in leaves_)
  if fsdp_step:  # trainable params live only in `master`; frozen float params are sharded too
    model = 0
    for leaf in layout.leaves:
      if leaf.trainable:
        continue
      if jnp.issubdtype(leaf.dtype, jnp.floating):
        # this device's rows, padding included
        shape = sharded_shape(layout, leaf.index)[0]
        model += _nbytes(shape, leaf.dtype) // (dp * ways[leaf.index])
      else:
        model += _nbytes(leaf.shape or (1,), leaf.dtype) // ways[leaf.index]
    if outer > 1:  # HFSDP: the trainable params' compute rows too, in their own dtype
      model += sum(_nbytes(x.seen, dtypes[x.index]) // (dp * ways[x.index]) for x in leaves_)
  # The reduced grads as the step holds them: whole buckets, padded under the sharded
  # strategies (the reduce-scatter's input), then 1/dp under `optim_grads` and FSDP
  # (`shards_grads`), which keep only their shard of each micro-batch's reduction
  grads = sum(
    _bucket_elements(b, dp, own, tp_ways, padded=sharded) * buf.grad_dtype.itemsize
    for buf in layout.buffers
    for b in buf.buckets
  )
  if config.shards_grads:
    grads //= dp

  opt_tree = [None] * len(layout.leaves)
  master = host_master = 0
  host_leaves = offloaded_leaves(layout, config)  # `optimizer_cpu_offload`: on the host
  # A master exists for every trainable param when sharded (the rows the optimizer updates)
  # and under no_shard only where the master dtype differs (bf16 params, fp32 master);
  # `opt_tree` is what `tx.init` sees, for the optax state's shapes
  for x in leaves_:
    i, dtype = x.index, master_dtype(dtypes[x.index])
    shape = x.seen if sharded else x.shape
    opt_tree[i] = jax.ShapeDtypeStruct(shape, dtype)
    if sharded and i in host_leaves and offloads_master(config):
      host_master += _nbytes(shape, dtype) // (dp * outer * ways[i])
    elif sharded:
      master += _nbytes(shape, dtype) // (dp * outer * ways[i])
    elif dtype != dtypes[i]:
      master += _nbytes(shape, dtype) // ways[i]
  if tx is None:
    tx = optax.scale_by_adam()
  chunked, gathered_unit = False, 0
  if fsdp_step:  # a fused FSDP state's buckets are its units' (`fsdp.layout_for`)
    chunked = bool(chunked_leaves(layout, fsdp))
    gathered_unit = max(
      sum(_bucket_elements(b, dp, own, tp_ways) * dtype.itemsize for b, dtype in u.gather)
      for u in units_of(layout, fsdp.param_dtype)
    )
  if use_fused(tx, layout, config, specs, chunked=chunked):  # flat buckets, end padding
    flat = {
      named.name: jax.ShapeDtypeStruct(
        (named.bucket.shard_size * dp,), master_dtype(named.buffer.param_dtype)
      )
      for named in bucket_names(layout)
    }
    host_names = offloaded_buckets(layout, config)
    if sharded:  # no_shard fuses only params that need no master
      master_host = host_names if offloads_master(config) else frozenset()
      master = sum(_nbytes(x.shape, x.dtype) // dp for k, x in flat.items() if k not in master_host)
      host_master = sum(
        _nbytes(x.shape, x.dtype) // dp for k, x in flat.items() if k in master_host
      )
    state = jax.eval_shape(tx.init, flat)
    sizes = {name: x.shape for name, x in flat.items()}
    split = lambda path, x: dp if sharded and is_flat_leaf(path, x, sizes) else 1
    host_sizes = {name: shape for name, shape in sizes.items() if name in host_names}
    on_host = lambda path, x: is_flat_leaf(path, x, host_sizes)
  else:
    state = jax.eval_shape(tx.init, jax.tree.unflatten(layout.treedef, opt_tree))
    split = functools.partial(
      _state_split, layout=layout, sharded=sharded, shards=dp * outer, specs=specs, ways=ways
    )
    seen = {x.index: opt_tree[x.index].shape for x in leaves_}
    on_host = lambda path, x: match_opt_leaf(path, x.shape, layout.paths, seen).param in host_leaves
  # Each optax leaf whole, divided by how the state splits it ([Note: bytes per device])
  opt = host_opt = 0
  for path, x in jax.tree_util.tree_leaves_with_path(state):
    if host_leaves and on_host(path, x):
      host_opt += _nbytes(x.shape, x.dtype) // split(path, x)
    else:
      opt += _nbytes(x.shape, x.dtype) // split(path, x)

  gathered = trainable_model if sharded and not fsdp_step and config.overlap_param_gather else 0
  return MemoryLedger(
    params=model,
    grads=grads,
    master=master,
    opt_state=opt,
    gathered_in_step=gathered,
    gathered_unit=gathered_unit,
    host_master=host_master,
    host_opt_state=host_opt,
  )


def measured_bytes(state, device=None) -> dict[str, int]:
  """Bytes that one device holds of each field of a `TrainState`.

  Sums `addressable_shards` on `device` (default: this process's first device of the
  state's mesh). Reads only this process's shards' sizes: no cross-process work.

  Returns:
    `{"step": .., "params": .., "master": .., "opt_state": ..}`, the device's memory, and
    `"host": ..` where the state keeps some of it in host memory (`optimizer_cpu_offload`).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> from jaxdp.inspect import measured_bytes, memory_ledger
    >>> params, tx = {"w": jnp.zeros((64, 32))}, optax.adam(1e-3)
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
    >>> state = jaxdp.init_state(params, tx, jax.make_mesh((8,), ("data",)), config)
    >>> measured_bytes(state)  # 1/8 of w, of mu and of nu; Adam's step count whole
    {'step': 4, 'params': 0, 'master': 1024, 'opt_state': 2052}
    >>> memory_ledger(params, tx, 8, config).state
    {'params': 0, 'master': 1024, 'opt_state': 2052}
  """
  leaves = [
    x
    for x in jax.tree.leaves(state.params) + jax.tree.leaves(state.master)
    if isinstance(x, jax.Array)
  ]
  if device is None:
    me = jax.process_index()
    device = min(
      (d for x in leaves for d in x.sharding.device_set if d.process_index == me),
      key=lambda d: d.id,
    )

  def field(tree, host=False):
    total = 0
    for x in jax.tree.leaves(tree):
      if isinstance(x, jax.Array) and (x.sharding.memory_kind == HOST) == host:
        total += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
    return total

  measured = {
    "step": field(state.step),
    "params": field(state.params),
    "master": field(state.master),
    "opt_state": field(state.opt_state),
  }
  host = field((state.master, state.opt_state), host=True)
  if host:  # offloaded (`optimizer_cpu_offload`): the host memory apart
    measured["host"] = host
  return measured


# ----------------------------------------------------------------------------- communication


def _bucket_bytes(
  layout, bucket, dtype, own=(), tp_ways=None, padded: bool = True, sliced: bool = False
) -> int:
  """Bytes of one bucket in `dtype` as its collectives move them on one device, padding
  and stacked layers included (`_bucket_elements`: a tensor-parallel bucket's own slices,
  a stack's per param)."""
  layers = max((p.layers for p in bucket.params), default=0) or 1
  elements = _bucket_elements(bucket, layout.dp, own, tp_ways, padded, True, sliced)
  return elements * layers * np.dtype(dtype).itemsize


def _outer_bytes(layout, bucket, dtype) -> int:
  """Bytes of HFSDP's reduce-scatter (and all-gather) of one bucket across "replica": each
  device's block of every param (`layout.outer_bucket`), no end padding."""
  # The buffer across "replica" is the device's 1/dp block over "data" (`p.shard_size(dp)`
  # per param), not the whole bucket: the "data" reduce-scatter has run already
  layers = max((p.layers for p in bucket.params), default=0) or 1
  return sum(p.shard_size(layout.dp) for p in bucket.params) * layers * np.dtype(dtype).itemsize


def ring_formula(state, *, fsdp=None, grad_accum_steps: int = 1) -> dict[str, float]:
  """Bytes each device should send per step, by collective kind (the table above).

  Computed from the state's layout (padding included) and its mesh:

  - "data": the table above, `N` the size of "data";
  - "replica" (`num_distributed_optimizer_instances` R > 1, HSDP): the sharded strategies
    all-reduce each reduce-scattered shard across "replica" (`2(R-1)/R · G/N`), once per
    step whatever `grad_accum_steps` (`optim_grads` and FSDP sum the micro-batches' shards
    first; FSDP's per-leaf state moves each bucket's blocks without its end padding); under HFSDP
    (`outer_dp_sharding_strategy="optim"`) a reduce-scatter of each device's block of every
    unit across "replica" after the backward (`(R-1)/R · G/N`) and an all-gather of the
    updated params across it (`(R-1)/R · P/N`) instead;
  - "expert": an expert bucket (`BufferLayout.expert`, one expert-parallel rank's slice) is
    reduced over the data axes but "expert"; a dense one over "expert" too (an all-reduce
    of its shard; under `no_shard` one all-reduce over every data axis of the bucket's);
  - tensor parallel: a bucket that holds a leaf the caller split over other axes on dims
    other than its shard dim (`collectives.holds_own`) is reduced and gathered per param,
    each device moving its own slice (1/tp of the param, no bucket-end padding); a leaf
    split over "model" on its shard dim (a column-parallel bias) is reduce-scattered and
    gathered whole over "data", its shard all-reduced across "replica" or "expert" on its
    1/tp slice. A bucket of several params raveled together counts whole; XLA may split
    one that holds only such a bias over "model" for that all-reduce (FSDP's unit of one
    bias), which the formula then over-counts.

  Small collectives of the step's metrics (the loss, norms) are not counted. The formula
  knows the state, not the loss: an FSDP step moves less where the loss casts a param
  before every use (it is gathered in the cast's dtype) and where a vocabulary table is
  computed by rows or by columns (`FSDPConfig(vocab_parallel=, lookups=)`: activations move
  instead of its gathers and reduce-scatter); `jaxdp.inspect.report` reads what a compiled
  step moves.

  Args:
    state: a `TrainState` from `jaxdp.init_state` (or its `jax.eval_shape`).
    fsdp: the `FSDPConfig` of an `optim_grads_params` state (None: the default, which
      reshards after forward: two all-gathers per unit; its `param_dtype` is the dtype the
      all-gathers move).
    grad_accum_steps: micro-batches per step (`optim_grads` reduce-scatters, and FSDP
      gathers and reduce-scatters, once per micro-batch, within the data axes but
      "replica").

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

    HSDP, two replicas of a ZeRO-1 state over 4 devices each: each 1/4 shard of the reduced
    grads is all-reduced across "replica" as well.

    >>> mesh = jax.make_mesh((2, 4), ("replica", "data"))
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim",
    ...                          num_distributed_optimizer_instances=2)
    >>> state = jaxdp.init_state(params, optax.sgd(0.1), mesh, config)
    >>> {k: v / 2**20 for k, v in ring_formula(state).items()}
    {'reduce-scatter': 0.75, 'all-reduce': 0.25, 'all-gather': 0.75}
  """
  # [Note: ring traffic]
  # Bytes a device sends with the ring algorithm (Patarasuk and Yuan, "Bandwidth optimal
  # all-reduce algorithms for clusters of workstations", JPDC 2009; NCCL's rings:
  # https://developer.nvidia.com/blog/massively-scale-deep-learning-training-nccl-2-4/):
  # the buffer B is cut into N chunks and each of the N-1 ring steps sends one chunk to the
  # next device, so a reduce-scatter or an all-gather sends (N-1)/N · B and an all-reduce,
  # a reduce-scatter followed by an all-gather, 2(N-1)/N · B (`inspect.ring_bytes`). B is
  # the full buffer: the reduce-scatter's input, the all-gather's output. A collective over
  # a group of one sends nothing (`add` skips it).
  layout, config = state.layout, state.config
  shape = dict(state.mesh_shape)
  n, replicas, ep = layout.dp, shape.get(REPLICA, 1), shape.get(EXPERT, 1)
  specs = state.model_specs
  shard_axes = {leaf.index: leaf.shard_axis for leaf in layout.leaves}
  own = own_specs(specs, shard_axes, data_axes_in(shape))
  tp_ways = split_ways(specs, shape, (EXPERT,)) if specs else None
  # the data axes a bucket is reduced over besides "data": "replica" (unless HFSDP sums
  # across it after the backward), "expert" for a dense bucket
  hsdp = replicas if layout.outer == 1 else 1
  other = lambda buf: hsdp * (1 if buf.expert else ep)
  out: dict[str, float] = {}

  def add(kind, nbytes, group, times=1):
    if group > 1 and nbytes:
      out[kind] = out.get(kind, 0.0) + times * ring_bytes(kind, nbytes, group)

  buckets = [(buf, b) for buf in layout.buffers for b in buf.buckets]
  # no_shard: one all-reduce over every data axis the bucket is reduced over
  if not config.use_distributed_optimizer:
    for buf, b in buckets:
      grad = _bucket_bytes(layout, b, buf.grad_dtype, own, tp_ways, padded=False)
      add("all-reduce", grad, n * other(buf))
    return out
  # Collectives per step: `optim_grads` and FSDP reduce every micro-batch, `optim` once
  k = grad_accum_steps if config.shards_grads else 1

  # A reduce-scattered shard's all-reduce across the other data axes: per micro-batch, or
  # with k > 1 on HSDP across "expert" per micro-batch and across "replica" once per step
  # ([Note: the sum across "replica" once per step] in collectives.py)
  def all_reduce_shard(shard, expert_group, outer_bytes=None):
    if k > 1 and hsdp > 1:
      add("all-reduce", shard, expert_group, k)
      add("all-reduce", shard if outer_bytes is None else outer_bytes, replicas)
    else:
      add("all-reduce", shard, hsdp * expert_group, k)

  # ZeRO-1/2: the reduce-scatter over "data" of the whole bucket, then its 1/n shard
  # all-reduced across the other data axes, and one all-gather of the updated params
  if not config.shards_params:
    for buf, b in buckets:
      add("reduce-scatter", _bucket_bytes(layout, b, buf.grad_dtype, own, tp_ways), n, k)
      shard = _bucket_bytes(layout, b, buf.grad_dtype, own, tp_ways, sliced=True) / n
      all_reduce_shard(shard, 1 if buf.expert else ep)
    for buf, b in buckets:
      add("all-gather", _bucket_bytes(layout, b, buf.param_dtype, own, tp_ways), n)
    return out
  # FSDP: per unit, the forward's all-gather (and the backward's again with
  # `reshard_after_forward`) and the reduce-scatter, each per micro-batch; an expert
  # unit's shard is not all-reduced over "expert"
  fsdp = fsdp or FSDPConfig()
  gathers = 2 if fsdp.reshard_after_forward else 1
  if k > 1 and not fsdp.reshard_after_backward:  # units gathered once, reduced once per step
    k, gathers = 1, 1
  experts = {leaf.index for leaf in layout.leaves if leaf.expert}
  for u in units_of(layout, fsdp.param_dtype, config.grad_dtype is not None):
    for b, dtype in u.gather:
      add("all-gather", _bucket_bytes(layout, b, dtype, own, tp_ways), n, k * gathers)
    for b, dtype in u.grad:
      add("reduce-scatter", _bucket_bytes(layout, b, dtype, own, tp_ways), n, k)
      shard = _bucket_bytes(layout, b, dtype, own, tp_ways, sliced=True) / n
      # a per-leaf state sums each bucket's blocks across "replica", not its padded shard
      blocks = None if state.fused else _outer_bytes(layout, b, dtype)
      all_reduce_shard(shard, 1 if b.params[0].index in experts else ep, blocks)
  if layout.outer > 1:  # HFSDP: once per step, after the backward and after the update
    for buf, b in buckets:
      add("reduce-scatter", _outer_bytes(layout, b, buf.grad_dtype), replicas)
      add("all-gather", _outer_bytes(layout, b, buf.param_dtype), replicas)
  return out


def _batch_bytes_per_device(batch: PyTree, dp: int) -> int:
  return sum(
    int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize // dp for x in jax.tree.leaves(batch)
  )


def memory_report(
  params: PyTree,
  tx,
  dp: int,
  config,
  *,
  loss_fn=None,
  batch: PyTree = None,
  frozen=None,
  fsdp=None,
) -> list[dict[str, Any]]:
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
    dp: data-parallel size (the "data" axis of the mesh the report is for; with
      `num_distributed_optimizer_instances` R > 1 a sharded state is measured and compiled
      on a `("replica", "data")` mesh of R x dp devices).
    config: the `jaxdp.DDPConfig` (its strategy, `grad_reduce_in_fp32`, buckets, ...).
    loss_fn: `loss_fn(params, batch)`, to compile the step for the GPU column.
    batch: one global batch (arrays or `jax.ShapeDtypeStruct`s).
    frozen: as in `init_state`.
    fsdp: the `FSDPConfig` of `optim_grads_params`.

  Returns:
    One dict per kind: `strategy`, `dp`, `kind` (`"params"`, `"master"`, `"opt_state"`:
    what `TrainState` holds; `"state"`: their sum with the step counter; `"grads"`: the
    reduced grads, alive only inside the step; `"gathered"`: params gathered inside the
    step, under FSDP the largest unit, `MemoryLedger.gathered_unit`; `"total"`: params + grads + master + opt_state, against the compiled peak),
    `predicted`, `measured`, `compiled` (bytes, or None where a source does not say).

  Examples:
    >>> import jax.numpy as jnp, optax, jaxdp
    >>> params = {"w": jnp.zeros((1024, 256), jnp.float32)}
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
    >>> rows = memory_report(params, optax.adam(1e-3), 8, config)
    >>> [(r["kind"], r["predicted"] // 1024, r["measured"] // 1024)
    ...  for r in rows if r["kind"] in ("master", "opt_state")]
    [('master', 128, 128), ('opt_state', 256, 256)]
  """
  strategy = config.data_parallel_sharding_strategy
  fsdp_step = config.shards_params
  ledger = memory_ledger(params, tx, dp, config, frozen=frozen, fsdp=fsdp if fsdp_step else None)
  # the step counter: one int32 scalar on every device
  predicted_state = {**ledger.state, "step": 4}

  measured = None
  # This process's own devices: the measured state never spans processes, so building it
  # needs no other process (in a multi-process job each measures on its own).
  cpus = jax.local_devices(backend="cpu")
  # a sharded optimizer's copies (HSDP, HFSDP) live on a "replica" axis of this size
  replicas = config.num_distributed_optimizer_instances if config.use_distributed_optimizer else 1
  if len(cpus) >= replicas * dp and all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)):
    devices = np.array(cpus[: replicas * dp])
    mesh = (
      jax.sharding.Mesh(devices.reshape(replicas, dp), (REPLICA, DATA))
      if replicas > 1
      else jax.sharding.Mesh(devices, (DATA,))
    )
    extra = {"fsdp": fsdp} if fsdp_step else {}
    state = train.init_state(params, tx, mesh, config, frozen=frozen, **extra)
    measured = measured_bytes(state)
    del state

  compiled = None
  if loss_fn is not None and batch is not None and aot.gpu_compile_unavailable() is None:
    target = aot.gpu_mesh((replicas, dp), (REPLICA, DATA)) if replicas > 1 else dp
    program = aot.compile_train_step(
      loss_fn, tx, target, config, params, batch, frozen=frozen, fsdp=fsdp if fsdp_step else None
    )
    stats = memory_stats(program)
    compiled = {
      "state": stats.argument_bytes - _batch_bytes_per_device(batch, replicas * dp),
      "total": stats.peak_bytes,
    }

  def row(kind, predicted, measured_value=None, compiled_value=None):
    return {
      "strategy": strategy,
      "dp": dp,
      "kind": kind,
      "predicted": int(predicted),
      "measured": measured_value,
      "compiled": compiled_value,
    }

  rows = [
    row(k, predicted_state[k], measured and measured[k]) for k in ("params", "master", "opt_state")
  ]
  rows.append(
    row(
      "state",
      sum(predicted_state.values()),
      measured and sum(measured.values()),
      compiled and compiled["state"],
    )
  )
  rows.append(row("grads", ledger.grads))
  rows.append(row("gathered", ledger.gathered_in_step + ledger.gathered_unit))
  rows.append(row("total", ledger.total, None, compiled and compiled["total"]))
  return rows
