"""`TrainState`, what each of its leaves is, and where the bucketed strategies place it.

The state is one pytree for every strategy; its static part (layout, config, mesh shape,
the caller's own shardings) says how to read the arrays. `match_opt_leaf` is the one rule
that ties an optax state leaf to its param: placement, the memory ledger and checkpoints
all use it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp._src.config import DDPConfig, FSDPConfig
from jaxdp._src.layout import Bucket, BufferLayout, Layout, is_function
from jaxdp._src.mesh import (
  DATA,
  ModelSpec,
  constrain_auto,
  data_axes_in,
  pspec,
  run_auto,
  with_data,
)

PyTree = Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpikeWindow:
  """The grad norms of the last steps the spike guard let through
  (`DDPConfig.skip_step_on_spikes`), replicated: a ring of `skip_step_interval` entries."""

  norms: jax.Array
  """float32[skip_step_interval]: norm `i` of those written is at `i % skip_step_interval`."""
  count: jax.Array
  """int32 scalar: how many norms were written (the ring holds the last of them)."""


# The meta fields are static, part of the treedef: two states of different layouts or
# configs are different pytrees, and `jit` retraces for them.
@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["step", "params", "master", "opt_state", "rng", "model_state", "spike_window"],
  meta_fields=["layout", "config", "mesh_shape", "model_specs", "fused", "fsdp"],
)
@dataclasses.dataclass(frozen=True)
class TrainState:
  """Everything a step reads and writes; a pytree whose static part is the layout.

  Leaves that a field does not hold are None (e.g. `master` of an f32 param under DDP).

  Examples:
    >>> import dataclasses, jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
    >>> state = jaxdp.init_state({"w": jnp.ones((12, 4))}, optax.adam(1e-3), mesh, config)
    >>> int(state.step), state.params["w"]  # gathered inside the next step
    (0, None)
    >>> state.fused, state.master["float32/bucket0"].shape  # adam: a flat array per bucket
    (True, (128,))
    >>> config = dataclasses.replace(config, fused_update=False)  # per-leaf update
    >>> state = jaxdp.init_state({"w": jnp.ones((12, 4))}, optax.adam(1e-3), mesh, config)
    >>> state.master["w"].shape, state.master["w"].sharding.spec  # rows padded to 16
    ((16, 4), P('data', None))
    >>> state.layout.num_buckets
    1
  """

  step: jax.Array
  """Number of optimizer steps taken (int32 scalar)."""
  params: PyTree
  """The model params, replicated over the data axes (over other axes as the caller placed
  them). Under a sharded strategy with `overlap_param_gather` the trainable leaves are
  None: they are gathered from `master` inside the next step. FSDP shards its frozen
  params over "data" (padded rows), and under HFSDP (`outer_dp_sharding_strategy="optim"`)
  its trainable ones too: the compute rows the units gather, the master's cast."""
  master: PyTree
  """The optimizer's copy of each trainable param ("main params"): sharded strategies
  hold each device's rows of the leaf's shard dim (`Layout.shard_axes`) sharded over
  "data" (HFSDP: over "data" and "replica"), in fp32 (or wider), or with the fused update
  (`fused`) one flat array per bucket; DDP holds fp32 copies of low-precision params
  only."""
  opt_state: PyTree
  """The optax state, built on `master`'s shapes and sharded like it."""
  layout: Layout
  config: DDPConfig
  mesh_shape: tuple[tuple[str, int], ...]
  model_specs: tuple[ModelSpec, ...] = ()
  """Per leaf in tree order: the mesh axes the caller sharded each dim of the param over
  (tensor or expert parallel; see `model_specs_of`); () = every leaf replicated."""
  rng: jax.Array | None = None
  """`init_state(..., rng=)`: the raw data (`uint32[2]`) of the key every step's keys are
  derived from (with the step counter and the data shard; see `make_train_step`), replicated;
  None: `loss_fn` gets no key."""
  model_state: PyTree = None
  """`init_state(..., model_state=)`: the model's mutable non-trainable state (BatchNorm
  running statistics), replicated, updated by every step; None: the step carries none."""
  fused: bool = False
  """The fused update (`DDPConfig.fused_update`): `opt_state` is the optax state of
  `{bucket name: flat}` (`bucket_names`), each bucket's `(dp * shard_size,)` elements in its
  shard-major order. Under `optim`/`optim_grads`/`optim_grads_params` (FSDP: a bucket per
  unit) `master` is that flat tree and both are sharded over "data" (`flat_master`); under
  `no_shard` they are replicated and `master`
  holds nothing (DDP fuses only params that need no fp32 copy).
  `distributed_optimizer.per_leaf_state` gives the per-leaf form every reader uses."""
  fsdp: FSDPConfig | None = None
  """`optim_grads_params`: the `FSDPConfig` `init_state` was given (None there: the default
  `FSDPConfig()`), which the step's must equal; None under the other strategies."""
  spike_window: SpikeWindow | None = None
  """`DDPConfig(skip_step_on_spikes=True)`: the recent grad norms the spike guard compares
  each step's with, updated by the step on the device; None otherwise."""


def leaves_of(tree, layout: Layout) -> list[Any]:
  """The leaves of `tree`, a tree of `layout`'s structure, in order, None included (a
  field's missing leaves are None). Flattened up to the layout's tree, so that a None the
  params themselves hold (an empty subtree: `eqx.partition`'s non-array fields) stays
  structure and a None where the layout has a leaf is a missing leaf."""
  return layout.treedef.flatten_up_to(tree)


def tree_of(layout: Layout, leaves) -> PyTree:
  """The param tree of `layout` holding `leaves` (tree order)."""
  return jax.tree.unflatten(layout.treedef, list(leaves))


def opt_params_of(layout: Layout, params: PyTree, master: PyTree) -> PyTree:
  """The tree the optax transformation sees: trainable leaves, None for the rest."""
  return tree_of(
    layout,
    [
      # the master where there is one (fp32 or row-sharded), else the param itself
      (m if m is not None else p) if leaf.trainable else None
      for leaf, p, m in zip(layout.leaves, leaves_of(params, layout), leaves_of(master, layout))
    ],
  )


class NamedBucket(NamedTuple):
  """A bucket under the name a fused state keys its flat arrays by."""

  name: str
  """`<buffer name>/bucket<index>`: a key of a fused state's `master`."""
  buffer: BufferLayout
  bucket: Bucket


def bucket_names(layout: Layout) -> list[NamedBucket]:
  """Every bucket, buffer by buffer, with its name: the keys of a fused state's `master`."""
  return [
    NamedBucket(f"{buf.name}/bucket{b.index}", buf, b)
    for buf in layout.buffers
    for b in buf.buckets
  ]


FLAT_SPEC = P(DATA)
"""Where a sharded fused state's flat buckets live: shard `d` of each on device `d` of
"data" (`no_shard`'s are replicated, `P()`)."""


def flat_master(state: TrainState) -> bool:
  """Is `state.master` the flat buckets (`{bucket name: flat}`)? A fused sharded state."""
  return state.fused and state.config.use_distributed_optimizer


def model_spec(state: TrainState, i: int, ndim: int) -> ModelSpec:
  """Leaf `i`'s own (tensor/expert parallel) sharding; all () for a state without any."""
  return state.model_specs[i] if state.model_specs else ((),) * ndim


# ----------------------------------------------------------------------------- placement


@dataclasses.dataclass(frozen=True)
class OptLeafMatch:
  """What `match_opt_leaf` found for one optax state leaf."""

  param: int | None
  """The param whose per-param state the leaf is (Adam's `mu['w']` for `['w']`), or None."""
  under_param: bool
  """The leaf's key path ends with some param's path, whatever its shape (adafactor's
  factored moments of that param when `param` is None)."""
  same_shape: tuple[int, ...]
  """The params whose shape the leaf has (the fallback for state that is not keyed by
  param path)."""


def match_opt_leaf(
  path, shape, paths: Sequence[str], shapes: Mapping[int, tuple[int, ...]]
) -> OptLeafMatch:
  """The one rule that matches an optax state leaf to the param it belongs to.

  optax keeps per-param state in trees shaped like the params, so a per-param leaf's key
  path ends with its param's path (`[0].mu['w']` for `['w']`) and it has the shape the
  optimizer sees for that param; of several such params the longest path wins. Placement
  (`opt_state_specs`), the memory ledger and checkpoints all ask this function.

  Args:
    path: the leaf's key path (from `jax.tree_util.tree_flatten_with_path`).
    shape: the leaf's shape.
    paths: every param's path (`Layout.paths`).
    shapes: the candidate params: leaf index -> the shape the optimizer sees for it.

  Examples:
    >>> import jax
    >>> path = jax.tree_util.tree_flatten_with_path({"mu": {"w": 0}})[0][0][0]
    >>> match_opt_leaf(path, (16, 4), ["['b']", "['w']"], {0: (16, 4), 1: (16, 4)}).param
    1
  """
  # optax nests per-param state under keys of its own (`[0].mu`, `.nu`), so a per-param
  # leaf's keystr ends with its param's keystr. A suffix alone is ambiguous (`['w']` is also
  # a suffix of `['a']['w']`'s state), hence the shape check and the longest path. `under`
  # without a shape match is per-param state of another shape (factored moments);
  # `same_shape` is the fallback for state not keyed by param path at all.
  name, shape = jax.tree_util.keystr(path), tuple(shape)
  under = [i for i in shapes if name.endswith(paths[i])]
  matches = [i for i in under if tuple(shapes[i]) == shape]
  return OptLeafMatch(
    max(matches, key=lambda i: len(paths[i])) if matches else None,
    bool(under),
    tuple(i for i, s in shapes.items() if tuple(s) == shape),
  )


def leaf_specs(state: TrainState) -> tuple[list[ModelSpec | None], list[ModelSpec | None]]:
  """`(params, master)`: each leaf's full spec as a `ModelSpec` (None where the leaf is;
  master all None in a fused state, whose master is not a param tree)."""
  # A sharded master is split over the data axes on the leaf's shard dim on top of the
  # caller's own axes; DDP's master (fp32 copies) is placed as its param.
  manual = data_axes_in(dict(state.mesh_shape))
  sharded = state.config.use_distributed_optimizer
  params = [
    None if x is None else model_spec(state, i, x.ndim)
    for i, x in enumerate(leaves_of(state.params, state.layout))
  ]
  if flat_master(state):
    return params, [None] * len(state.layout.leaves)
  master = [
    None
    if m is None
    else with_data(model_spec(state, leaf.index, len(leaf.shape)), manual, leaf.shard_axis)
    if sharded
    else model_spec(state, leaf.index, m.ndim)
    for leaf, m in zip(state.layout.leaves, leaves_of(state.master, state.layout))
  ]
  return params, master


def opt_state_specs(state: TrainState, master_specs: list[ModelSpec | None]) -> PyTree:
  """Each optax state leaf sharded like the param it belongs to.

  A per-param leaf (Adam's `mu['w']`) has its param's optimizer-side shape and a key path
  ending with the param's path; the longest such path wins. A leaf under a param's path with
  another shape (adafactor's factored moments) is replicated. Failing that, a leaf takes the
  spec that every param of its shape shares; anything else (step counts) is replicated.
  """
  layout = state.layout
  # The optimizer sees the master (padded rows under a sharded strategy) where there is one,
  # else the param; a per-param optax leaf is placed like it.
  views = {}  # trainable leaf -> (the shape the optimizer sees, its spec)
  for leaf, x, m in zip(
    layout.leaves, leaves_of(state.params, layout), leaves_of(state.master, layout)
  ):
    if leaf.trainable:
      views[leaf.index] = (
        (m if m is not None else x).shape,
        master_specs[leaf.index] if m is not None else model_spec(state, leaf.index, x.ndim),
      )

  def spec_of(path, x):
    shape = tuple(x.shape)
    match = match_opt_leaf(path, shape, layout.paths, {i: s for i, (s, _) in views.items()})
    if match.param is not None:
      return pspec(views[match.param][1])
    if match.under_param:
      # a per-param leaf of another shape (adafactor's factored moments): replicated
      return pspec(((),) * len(shape))
    # not keyed by param path: the spec every param of its shape shares, if they agree;
    # replicated otherwise
    specs = {views[i][1] for i in match.same_shape}
    return pspec(next(iter(specs)) if len(specs) == 1 else ((),) * len(shape))

  return jax.tree_util.tree_map_with_path(spec_of, state.opt_state)


def extra_specs(state: TrainState) -> dict[str, Any]:
  """The specs of the fields every strategy places alike: `rng`, `model_state` and
  `spike_window`, replicated."""
  return {
    "rng": None if state.rng is None else P(),
    "model_state": jax.tree.map(lambda _: P(), state.model_state),
    "spike_window": jax.tree.map(lambda _: P(), state.spike_window),
  }


def state_specs(state: TrainState) -> TrainState:
  """The PartitionSpec of every leaf of a bucketed (`no_shard`, `optim`, `optim_grads`) state
  (a tree like `state`)."""
  layout = state.layout
  params, master = leaf_specs(state)
  if state.fused:
    # Each flat bucket is `dp * shard_size` elements (see [Note: shard-major buckets] in
    # layout.py), split over "data" shard by shard when sharded. Per-element optax leaves
    # (`mu[name]`) go with them; everything else (counts) is replicated.
    flat = {named.name: (named.bucket.shard_size * layout.dp,) for named in bucket_names(layout)}
    spec = FLAT_SPEC if flat_master(state) else P()
    return dataclasses.replace(
      state,
      step=P(),
      params=tree_of(layout, [None if d is None else pspec(d) for d in params]),
      master={name: spec for name in flat}
      if flat_master(state)
      else tree_of(layout, [None if d is None else pspec(d) for d in master]),
      opt_state=jax.tree_util.tree_map_with_path(
        lambda path, x: spec if is_flat_leaf(path, x, flat) else pspec(((),) * x.ndim),
        state.opt_state,
      ),
      **extra_specs(state),
    )
  return dataclasses.replace(
    state,
    step=P(),
    params=tree_of(layout, [None if d is None else pspec(d) for d in params]),
    master=tree_of(layout, [None if d is None else pspec(d) for d in master]),
    opt_state=opt_state_specs(state, master),
    **extra_specs(state),
  )


def is_flat_leaf(path, x, flat: Mapping[str, tuple[int, ...]]) -> bool:
  """Is a fused state's optax leaf one bucket's per-element state (Adam's `mu[name]`)?"""
  # optax keeps per-element state in a tree like the one it updates, here
  # `{bucket name: flat}`: the leaf's last key is the bucket's name
  key = path[-1] if path else None
  name = getattr(key, "key", None)
  return name in flat and tuple(x.shape) == flat[name]


# ----------------------------------------------------------------------------- host offload

HOST = "pinned_host"
"""The memory kind an offloaded leaf lives in between steps (`DDPConfig.optimizer_cpu_offload`):
the host's page-locked memory, which the device copies to and from asynchronously."""


# [Note: which buckets are offloaded]
# `optimizer_offload_fraction` is Megatron's: the fraction of the optimizer state on the host.
# jaxdp offloads whole buckets (FSDP: whole units), the state's unit of update and transfer:
# a bucket's master and optimizer state are copied and updated together, and a fused state
# keys its flat arrays by bucket, so a partial bucket would split an array across memories.
# The buckets are taken in layout order (`bucket_names`), first ones first, until their
# elements reach the fraction. The layout puts the params in backward order, so the first
# buckets are those whose grads are reduced first in the backward: their copies to the
# device and their updates have the most of the step left to run under (an FSDP layout's
# units go in forward order; any order holds the same bytes).
def offloaded_buckets(layout: Layout, config: DDPConfig) -> frozenset[str]:
  """The names (`bucket_names`) of the buckets whose master and optimizer state live in host
  memory between steps (see [Note: which buckets are offloaded]); empty without
  `optimizer_cpu_offload`.

  Examples:
    >>> import jax.numpy as jnp, jaxdp
    >>> layout = jaxdp.layout.make_layout({"a": jnp.zeros(64), "b": jnp.zeros(64)}, dp=8,
    ...                                   bucket_size=64)
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim",
    ...                          optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    >>> sorted(offloaded_buckets(layout, config))
    ['float32/bucket0']
  """
  if not config.optimizer_cpu_offload:
    return frozenset()
  named = bucket_names(layout)
  sizes = [b.bucket.shard_size * layout.dp for b in named]
  wanted = config.optimizer_offload_fraction * sum(sizes)
  chosen, held = [], 0
  for b, size in zip(named, sizes):
    if held >= wanted:
      break
    chosen.append(b.name)
    held += size
  return frozenset(chosen)


def offloaded_leaves(layout: Layout, config: DDPConfig) -> frozenset[int]:
  """The trainable leaves (indices) of the offloaded buckets."""
  names = offloaded_buckets(layout, config)
  return frozenset(
    p.index
    for b in bucket_names(layout)
    if b.name in names
    for p in b.bucket.params
    if layout.leaves[p.index].trainable
  )


def memory_kinds(state: TrainState) -> TrainState:
  """Where each leaf of `state` lives between steps: `HOST` for the per-param (per-element)
  optimizer state of the offloaded buckets (`offloaded_buckets`) and, where the step does
  not read it before its update (`offloads_master`), their master; None (the device) for
  every other leaf; a tree like `state`.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim",
    ...                          optimizer_cpu_offload=True, overlap_param_gather=False)
    >>> state = jaxdp.init_state({"w": jnp.ones((16, 4))}, optax.adam(1e-3), mesh, config)
    >>> kinds = memory_kinds(state)
    >>> kinds.master, kinds.opt_state[0].mu, kinds.opt_state[0].count
    ({'float32/bucket0': 'pinned_host'}, {'float32/bucket0': 'pinned_host'}, None)
    >>> state.opt_state[0].mu["float32/bucket0"].sharding.memory_kind
    'pinned_host'

    With `overlap_param_gather` (the default) the step gathers the params from the master
    at its start: the master stays on the device.

    >>> config = dataclasses.replace(config, overlap_param_gather=True)
    >>> memory_kinds(jaxdp.init_state({"w": jnp.ones((16, 4))}, optax.adam(1e-3), mesh,
    ...                               config)).master
    {'float32/bucket0': None}
  """
  layout = state.layout
  nothing = jax.tree.map(lambda _: None, state)
  names = offloaded_buckets(layout, state.config)
  if not names:
    return nothing
  if state.fused:
    flat = {named.name: (named.bucket.shard_size * layout.dp,) for named in bucket_names(layout)}
    host = {name: shape for name, shape in flat.items() if name in names}
    master = (
      {name: HOST if name in names else None for name in state.master}
      if flat_master(state) and offloads_master(state.config)
      else nothing.master
    )
    opt_state = jax.tree_util.tree_map_with_path(
      lambda path, x: HOST if is_flat_leaf(path, x, host) else None, state.opt_state
    )
    return dataclasses.replace(nothing, master=master, opt_state=opt_state)
  leaves = offloaded_leaves(layout, state.config)
  masters = leaves_of(state.master, layout)
  on_host = leaves if offloads_master(state.config) else frozenset()
  master = [
    None if m is None else HOST if leaf.index in on_host else None
    for leaf, m in zip(layout.leaves, masters)
  ]
  # a per-param optax leaf goes where its param's master goes (`match_opt_leaf`); anything
  # else (step counts, factored moments, state not keyed by param) stays on the device
  shapes = {
    leaf.index: tuple((m if m is not None else x).shape)
    for leaf, x, m in zip(layout.leaves, leaves_of(state.params, layout), masters)
    if leaf.trainable and (m is not None or x is not None)
  }

  def kind_of(path, x):
    match = match_opt_leaf(path, tuple(x.shape), layout.paths, shapes)
    return HOST if match.param in leaves else None

  opt_state = jax.tree_util.tree_map_with_path(kind_of, state.opt_state)
  return dataclasses.replace(nothing, master=tree_of(layout, master), opt_state=opt_state)


def to_host(tree: PyTree, kinds: PyTree) -> PyTree:
  """Traced: each leaf of `tree` whose kind (`memory_kinds`) is `HOST` copied to host
  memory, in place (its sharding kept); the others as they are."""
  return jax.tree.map(
    lambda x, kind: x if kind is None else jax.device_put(x, jax.memory.Space.Host),
    tree,
    kinds,
    is_leaf=lambda x: x is None,
  )


def to_device(tree: PyTree) -> PyTree:
  """Traced: every leaf of `tree` that lives in host memory copied to the device (its
  sharding kept); the others, the same values. Where nothing is offloaded this adds
  nothing to the program."""

  def fetch(x):
    if jax.typeof(x).memory_space == jax.memory.Space.Host:
      return jax.device_put(x, jax.memory.Space.Device)
    return x

  return jax.tree.map(fetch, tree)


def check_offload(mesh, config: DDPConfig) -> None:
  """Raises unless `mesh`'s devices have the host memory `optimizer_cpu_offload` puts the
  state in. Compile-only devices (`jaxdp.inspect.gpu_mesh`), which list no memories, pass:
  the program compiled for them holds the copies a GPU would run.

  Raises:
    ValueError: offload asked for on devices without a `pinned_host` memory.
  """
  if not config.optimizer_cpu_offload:
    return
  device = mesh.devices.flat[0]
  try:
    kinds = {m.kind for m in device.addressable_memories()}
  except Exception:  # noqa: BLE001 - a backend that cannot list its memories has none
    kinds = set()
  if kinds and HOST not in kinds:
    raise ValueError(
      f"optimizer_cpu_offload=True keeps the optimizer state in {HOST!r} memory, but the "
      f"mesh's {device.platform} devices have only {sorted(kinds)}; run on a backend with "
      f"host memory (GPU, TPU, CPU), or set optimizer_cpu_offload=False"
    )


def reads_master_forward(config: DDPConfig) -> bool:
  """Does a step read `master` before its update? FSDP's units gather it, and the sharded
  strategies' `overlap_param_gather` gathers the params from it at the step's start."""
  return config.shards_params or (config.use_distributed_optimizer and config.overlap_param_gather)


def offloads_master(config: DDPConfig) -> bool:
  """Does `optimizer_cpu_offload` put the master in host memory too? Not where the step
  reads it before its update (`reads_master_forward`): the forward needs all of it on the
  device, so keeping it there costs the step's peak nothing and saves copying it in and
  out every step (Megatron's offload keeps the params on the GPU too)."""
  return config.optimizer_cpu_offload and not reads_master_forward(config)


# ----------------------------------------------------------------------------- init


@dataclasses.dataclass(frozen=True)
class InitSource:
  """Where `init_state`'s params come from: arrays (host or device), or a function of no
  arguments that returns them (the model's init), run under `jit` so that each device
  computes only its shards."""

  abstract: PyTree
  """The params' shapes and dtypes (`jax.ShapeDtypeStruct`s for a function)."""
  fn: Callable[[], PyTree] | None = None

  def run(
    self, build, opt_params, tx, mesh, layout: Layout, views: Sequence[P], state_specs
  ) -> TrainState:
    """The state of `build(params)` (every field but `opt_state`) and then its optimizer
    state, `tx.init(opt_params(state))`, each leaf placed on `state_specs(state)`; each
    param leaf enters on `views` (per leaf in tree order): a host array is sent to the
    devices slice by slice, a function's params are computed there shard by shard.

    Two programs, so that the params as they came in are freed before the optimizer state
    is allocated: the peak is the state itself (or the master params and the params)."""

    def program(params):
      # a copy: the state never shares a buffer with the caller's arrays, which the
      # transfer below may alias, and the next step donates the state
      leaves = [
        jnp.copy(constrain_auto(x, mesh, v)) for x, v in zip(jax.tree.leaves(params), views)
      ]
      return build(tree_of(layout, leaves))

    def whole(params):
      state = build(params)
      return dataclasses.replace(state, opt_state=tx.init(opt_params(state)))

    # every leaf's placement, read off the abstract state: nothing is computed
    specs = state_specs(jax.eval_shape(whole, self.abstract))
    if self.fn is None:  # each device receives its slice of each host array, nothing more
      leaves = [
        jax.device_put(x, NamedSharding(mesh, v))
        for x, v in zip(jax.tree.leaves(self.abstract), views)
      ]
    else:  # computed where they go: each device runs the init of its shards only
      shardings = [NamedSharding(mesh, v) for v in views]
      leaves = jax.jit(lambda: jax.tree.leaves(self.fn()), out_shardings=shardings)()
    # Program 1: the state without its optimizer state. The arrays sent in for it are dropped
    # before program 2 runs `tx.init` on the state, so that they are not alive beside the
    # optimizer state (unless the caller keeps them).
    state_program = run_auto(program, mesh, dataclasses.replace(specs, opt_state=None))
    opt_program = run_auto(lambda s: tx.init(opt_params(s)), mesh, specs.opt_state)
    # Offloaded leaves (`memory_kinds`) are written to host memory by the programs that make
    # them, so that no device holds the whole offloaded state at once.
    kinds = memory_kinds(jax.eval_shape(whole, self.abstract))
    if jax.tree.leaves(kinds):
      state_program = _offloaded(state_program, dataclasses.replace(kinds, opt_state=None))
      opt_program = _offloaded(opt_program, kinds.opt_state, fetch_master=True)
    state = jax.jit(state_program)(tree_of(layout, leaves))
    del leaves  # (the caller's arrays, where the transfer kept them, stay the caller's)
    # keep_unused: an init that reads no value (zeros like the params) still runs on `mesh`
    opt_state = jax.jit(opt_program, keep_unused=True)(state)
    return dataclasses.replace(state, opt_state=opt_state)


def _offloaded(program, kinds, fetch_master: bool = False):
  """`program` (of a state) writing its offloaded outputs (`kinds`) to host memory; with
  `fetch_master`, reading its input state's master from the device (`to_device`)."""

  def offloaded(state):
    if fetch_master:
      state = dataclasses.replace(state, master=to_device(state.master))
    return to_host(program(state), kinds)

  return offloaded


def init_source(params) -> InitSource:
  """`init_state`'s `params` argument: a pytree of arrays, or a function of no arguments
  returning one (traced once here, by `jax.eval_shape`, to read its shapes).

  A function is what `layout.is_function` says: a `def`, `lambda`, bound method, jitted
  function or `functools.partial`, never a pytree node. Any pytree node is params, callable
  or not (an `eqx.Module`, whose `__call__` is its forward, is never called), so that
  every pytree `jax.grad` and optax take is taken here too.

  Raises:
    TypeError: the function takes arguments, or returns something that is not a pytree of
      arrays; or `params` is a callable pytree node without array leaves, which could be
      either (wrap an init object in a lambda, or pass the params).
  """
  if not is_function(params):
    _refuse_ambiguous(params)
    return InitSource(params)
  fix = (
    "init_state(params=...): a function must take no arguments and return the param pytree "
    "(e.g. lambda: model.init(key, x)['params'])"
  )
  try:
    abstract = jax.eval_shape(params)
  except TypeError as e:
    raise TypeError(f"{fix}; tracing it failed: {e}") from e
  for path, x in jax.tree_util.tree_flatten_with_path(abstract)[0]:
    if not isinstance(x, jax.ShapeDtypeStruct):
      raise TypeError(
        f"{fix}; it returned params{jax.tree_util.keystr(path)}, a {type(x).__name__}"
      )
  return InitSource(abstract, params)


def _refuse_ambiguous(params) -> None:
  """Raises for a callable pytree node none of whose leaves is an array: an init object
  (an `eqx.Module` whose `__call__()` builds the params) or params without arrays (an
  empty or all-None partition); jaxdp does not guess which."""
  if not callable(params):
    return
  leaves = jax.tree.leaves(params)
  if any(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves):
    return
  raise TypeError(
    f"init_state(params=...): got {type(params).__name__}, a callable pytree without array "
    "leaves: it could be an init function or a params tree, and jaxdp takes a pytree for "
    "params and never calls one. For an init function pass a function that calls it "
    "(`lambda: init()`, or functools.partial); for params pass the arrays (e.g. "
    "eqx.partition(model, eqx.is_inexact_array)[0])"
  )
