"""The mesh: jaxdp's axis names, the data axes a step runs manual over, and placement.

jaxdp runs its step manual over the data axes (`data_axes`) and leaves every other mesh
axis (e.g. "model") to the compiler, Auto even where the mesh made it Explicit and a param
is sharded over it (`run_manual`). A param keeps the sharding its caller gave it over
those other axes (Megatron-style tensor parallel weights) and over "expert" (expert
params): its `ModelSpec`. jaxdp adds "data" on the leaf's shard dim where it shards
(master params and optimizer state of the sharded strategies, FSDP's params; FSDP picks a
dim the other axes do not split where there is one): after the leaf's manual axes, because a
bucket holds the slice that one expert-parallel rank sees, and before its automatic ones,
because inside the step the compiler splits the device's block further.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

PyTree = Any
ModelSpec = tuple[tuple[str, ...], ...]
"""One leaf's own sharding: per dim, the mesh axes it is split over (() = not split)."""

DATA = "data"
"""The mesh axis jaxdp shards buckets, optimizer state and FSDP units over."""
REPLICA = "replica"
"""Outer data-parallel axis: replicas of the sharded state (HSDP, partial distributed optimizer)."""
EXPERT = "expert"
"""Expert-parallel axis (MoE): dense params are data parallel over it like over "data"; expert
params are sharded over it (their leading dim), so their grads are reduced over the other data
axes only, the expert-data-parallel group (Megatron's `expert_parallel_bucket_groups`)."""


def data_axes(mesh) -> tuple[str, ...]:
  """The data-parallel axes present, `DATA` last: the axes the train step runs manual."""
  return data_axes_in(mesh.axis_names)


def data_axes_in(axis_names) -> tuple[str, ...]:
  """`data_axes` of a mesh with these axis names."""
  return tuple(a for a in (REPLICA, EXPERT) if a in axis_names) + (DATA,)


def dp_size(mesh) -> int:
  """The data-parallel size: the product of the data axes' sizes."""
  return math.prod(mesh.shape[a] for a in data_axes(mesh))


def constrain(x, mesh, spec):
  """Places a traced value on `spec` (a reshard on Explicit meshes, a constraint on Auto)."""
  sharding = NamedSharding(mesh, spec)
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def model_specs_of(params: PyTree, mesh) -> tuple[ModelSpec, ...]:
  """The caller's own sharding of each param (tensor/expert parallel), read from its placement.

  A leaf placed with a `NamedSharding` on `mesh` keeps its spec; anything else (host arrays,
  single-device arrays) is replicated.

  Raises:
    ValueError: a leaf sharded over a data axis ("data", "replica": jaxdp shards over those
      itself), over "expert" on a dim other than its leading one, on a dim its axes do not
      divide, or with a non-trivial sharding on another mesh.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((4, 2), ("data", "model"))
    >>> w = jax.device_put(jnp.zeros((4, 6)), NamedSharding(mesh, P(None, "model")))
    >>> model_specs_of({"w": w, "b": jnp.zeros(6)}, mesh)
    (((),), ((), ('model',)))
  """
  keyed = jax.tree_util.tree_flatten_with_path(params)[0]
  out = []
  for path, x in keyed:
    name = "params" + jax.tree_util.keystr(path)
    ndim = len(np.shape(x))
    # A tracer (under `jax.eval_shape`, as `abstract_state` runs) has its placement in its
    # type, on an abstract mesh, where the mesh's axes are Explicit.
    traced = isinstance(x, jax.core.Tracer)
    sharding = jax.typeof(x).sharding if traced else getattr(x, "sharding", None)
    entries = sharding.spec if isinstance(sharding, NamedSharding) else P()
    # One tuple of axis names per dim (`ModelSpec`): a spec's None, "model" and ("a", "b")
    # become (), ("model",), ("a", "b"), and a short spec is padded with unsharded dims.
    dims = tuple(
      () if e is None else (e,) if isinstance(e, str) else tuple(e)
      for e in tuple(entries) + (None,) * (ndim - len(entries))
    )
    if not any(dims):
      out.append(((),) * ndim)
      continue
    # A sharded leaf must be on the train mesh: the step's `shard_map` places it by spec
    # alone. A traced leaf's mesh is abstract, with no devices to compare.
    other = sharding.mesh
    if (
      tuple(other.axis_names) != tuple(mesh.axis_names)
      or tuple(other.axis_sizes) != tuple(mesh.axis_sizes)
      or (not traced and [d.id for d in other.devices.flat] != [d.id for d in mesh.devices.flat])
    ):
      raise ValueError(
        f"{name} is sharded {sharding.spec} on another mesh ({dict(other.shape)}) than the "
        f"train mesh ({dict(mesh.shape)}); place it on the train mesh, e.g. "
        "jax.device_put(x, NamedSharding(mesh, spec))"
      )
    for d, axes in enumerate(dims):
      if REPLICA in axes or DATA in axes:
        raise ValueError(
          f"{name} is sharded {sharding.spec}: over a data axis. jaxdp shards over "
          f"{DATA!r} and {REPLICA!r} itself; place params replicated over them (e.g. "
          "P(None, 'model') for a column-parallel weight)"
        )
      if EXPERT in axes and (d != 0 or axes != (EXPERT,)):
        raise ValueError(
          f"{name} is sharded {sharding.spec}: expert params are sharded over {EXPERT!r} "
          f"on their leading (expert) dim alone; place them with P({EXPERT!r}, ...)"
        )
      ways = math.prod(mesh.shape[a] for a in axes)
      if np.shape(x)[d] % ways:
        raise ValueError(
          f"{name} is sharded {sharding.spec}, but its dim {d} ({np.shape(x)[d]}) does not "
          f"divide over {' x '.join(map(repr, axes))} ({ways} devices); give that dim a "
          f"multiple of {ways}, or split another dim"
        )
    out.append(dims)
  return tuple(out)


def pspec(dims: ModelSpec) -> P:
  """Full-length spec (`P(None, None)`, not `P()`): jit's cache key tells the two apart."""
  return P(*[None if not a else a[0] if len(a) == 1 else a for a in dims]) if dims else P()


def with_data(
  dims: ModelSpec, manual: tuple[str, ...], axis: int = 0, outer: bool = False
) -> ModelSpec:
  """A leaf's spec with `DATA` added on its shard dim `axis` (after its manual axes, before
  its automatic ones); a scalar becomes one padded dim. `outer`: `(DATA, REPLICA)`, each
  device's block over "data" split again over "replica" (HFSDP's master and optimizer
  state)."""
  dims = dims or ((),)
  on = dims[axis]
  ours = (DATA, REPLICA) if outer else (DATA,)
  return (
    *dims[:axis],
    tuple(a for a in on if a in manual) + ours + tuple(a for a in on if a not in manual),
    *dims[axis + 1 :],
  )


def manual_spec(dims: ModelSpec, manual: tuple[str, ...]) -> P:
  """The part of a spec over the step's manual axes: a `shard_map` in/out spec."""
  return pspec(tuple(tuple(a for a in axes if a in manual) for axes in dims))


def own_axes(dims: ModelSpec, manual: tuple[str, ...]) -> tuple[str, ...]:
  """The manual axes a leaf is itself sharded over (e.g. "expert")."""
  return tuple(a for axes in dims for a in axes if a in manual)


def experts_of(model_specs: tuple[ModelSpec, ...]) -> list[bool]:
  """Per leaf: is it an expert param (sharded over "expert")?"""
  return [any(EXPERT in axes for axes in dims) for dims in model_specs]


def view_dims(shape: tuple[int, ...], dims: ModelSpec, dp: int, prefer: int = 0) -> ModelSpec:
  """A leaf in its own shape, sharded over `DATA` as well as over its own axes `dims`: on dim
  `prefer` if dp divides it, else on the first other dim that dp divides and no other axis
  splits; not over `DATA` (replicated) if there is none. What a sharded view of a big model
  holds: each device about `1 / dp` of every leaf that has such a dim.

  Examples:
    >>> view_dims((50257, 768), ((), ()), 8), view_dims((7, 3), ((), ()), 8)
    (((), ('data',)), ((), ()))
  """
  dims = tuple(dims) if dims else ((),) * len(shape)
  # `prefer` first, then every other dim in order
  order = [prefer] + [d for d in range(len(shape)) if d != prefer] if shape else []
  for d in order:
    if shape[d] % dp == 0 and not dims[d]:
      return (*dims[:d], (DATA,), *dims[d + 1 :])
  return dims


def explicit_axes(mesh) -> tuple[str, ...]:
  """The mesh's axes of type Explicit (`jax.make_mesh`'s default)."""
  return tuple(
    a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit
  )


def run_auto(fn, mesh, out_specs):
  """`fn` with the mesh's Explicit axes made Auto, as if on a mesh with Auto axes: the
  compiler propagates shardings and picks the collectives, so that ops on sharded values
  (pads, reshapes, random init) need no sharding types; its outputs are placed on
  `out_specs` (a tree of PartitionSpecs like its output). Inside, place values with
  `constrain_auto`."""
  explicit = explicit_axes(mesh)
  if not explicit:
    return lambda *a: jax.tree.map(lambda x, s: constrain(x, mesh, s), fn(*a), out_specs)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), out_specs)
  return jax.sharding.auto_axes(fn, axes=explicit, out_sharding=shardings)


def auto_mesh(mesh):
  """`mesh` with every axis Auto: the mesh a program under `run_auto` runs on."""
  return jax.sharding.Mesh(
    mesh.devices, mesh.axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
  )


def eager_program(fn: Callable) -> EagerProgram:
  """Decorator: `fn(tree, mesh, *static)` (traceable, `static` hashable) as one jitted
  program per call, its output arrays placed for the caller's own code (`EagerProgram`)."""
  return EagerProgram(fn)


class EagerProgram:
  """A jitted view of a train state whose arrays the caller uses as any other.

  The outputs live on the mesh the caller gave (the state's), axis types included, as
  arrays the caller placed there with `jax.device_put` would: so the caller's own
  `jax.jit` takes them beside a batch placed on that mesh. (An eager model call on arrays
  of a mesh with Explicit axes is a different matter: JAX refuses some eager ops there
  outside `jax.set_mesh`; `on_auto_mesh` re-wraps arrays for it, as `nnx_merge` does for a
  model's variables.)

  On a mesh whose axes are all Explicit, the outputs' specs are read once per state
  structure (`jax.eval_shape`) and the program is jitted with `out_shardings` on the mesh,
  so that every output carries it; elsewhere the program runs as it is.
  """

  _MAX_PROGRAMS = 64

  def __init__(self, fn: Callable):
    self._fn = fn
    self._programs: dict[Any, Callable] = {}
    functools.update_wrapper(self, fn)

  def __call__(self, tree, mesh, *static):
    leaves, treedef = jax.tree.flatten(tree)
    # One program per mesh, static arguments, tree structure and leaf types (shardings
    # included): `_build` fixes the outputs' shardings for them.
    key = (
      mesh,
      static,
      treedef,
      tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves),
    )
    program = self._programs.get(key)
    if program is None:
      if len(self._programs) >= self._MAX_PROGRAMS:  # a bound on what the cache holds
        self._programs.clear()
      program = self._programs[key] = self._build(tree, mesh, static)
    return program(tree)

  def _build(self, tree, mesh, static) -> Callable:
    fn = self._fn

    @functools.wraps(fn)  # compiled as jit(<fn's name>)
    def program(tree):
      return fn(tree, mesh, *static)

    explicit = explicit_axes(mesh)
    if len(explicit) < len(mesh.axis_names):
      return jax.jit(program)
    out = jax.eval_shape(program, tree)
    shardings = jax.tree.map(lambda x: NamedSharding(mesh, x.sharding.spec), out)
    return jax.jit(program, out_shardings=shardings)

  def clear_cache(self) -> None:
    """Forgets every compiled program (the next call compiles again)."""
    self._programs.clear()


def on_auto_mesh(tree: PyTree) -> PyTree:
  """`tree` with each array on a mesh with Explicit axes re-wrapped onto `auto_mesh` of it:
  the same buffers (no copy, no program), every axis Auto.

  For eager code: outside `jax.set_mesh`, JAX refuses some eager ops on arrays whose type
  carries Explicit axes (`x.imag`, `x.at[i].set(...)`, the causal mask a Flax attention
  layer broadcasts against its weights) with "Length of device assignment 1 is not equal
  to the size of the mesh"; on the Auto twin they run as on one device. The price: a
  `jax.jit` that mixes them with arrays on the Explicit mesh is refused ("Mesh for all
  inputs should be equal")."""

  twins = {}

  def rewrap(x):
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not explicit_axes(sharding.mesh):
      return x
    if sharding.mesh not in twins:
      twins[sharding.mesh] = auto_mesh(sharding.mesh)
    twin = twins[sharding.mesh]
    auto = NamedSharding(twin, sharding.spec)
    # The same per-device buffers under a new sharding: the twin mesh has the same devices
    # in the same order, so each shard is where the new sharding expects it.
    return jax.make_array_from_single_device_arrays(
      x.shape, auto, [s.data for s in x.addressable_shards]
    )

  return jax.tree.map(rewrap, tree)


def constrain_auto(x, mesh, spec):
  """`constrain` inside `run_auto`: a sharding constraint on the mesh with Auto axes."""
  if not explicit_axes(mesh):
    return constrain(x, mesh, spec)
  return jax.lax.with_sharding_constraint(x, NamedSharding(auto_mesh(mesh), spec))


def runs_auto(mesh, model_specs) -> bool:
  """Does a step on `mesh` run its `shard_map` with every axis Auto (`run_manual`)? Where
  some param is sharded (`model_specs`, one `ModelSpec` per leaf) over an Explicit axis
  that is not a data axis: a tensor-parallel leaf on `jax.make_mesh`'s default axes.

  Examples:
    >>> mesh = jax.make_mesh((4, 2), ("data", "model"))
    >>> runs_auto(mesh, [((), ("model",))]), runs_auto(mesh, [((), ())])
    (True, False)
  """
  other = set(explicit_axes(mesh)) - set(data_axes(mesh))
  return any(a in other for dims in model_specs for axes in dims for a in axes)


def run_manual(fn, mesh, in_specs, out_specs, placed=None):
  """`jax.shard_map(fn)` manual over the data axes, every other mesh axis left to the
  compiler: `in_specs`/`out_specs` name the data axes only.

  On a mesh with an Explicit axis besides the data axes (`jax.make_mesh((4, 2), ("data",
  "model"))`) the values inside carry it in their types, and a ravel, pad or reshape of a
  leaf sharded over it (a bucket, a unit) or a loss written for one device would need an
  `out_sharding`. With `placed` (a tree like the output of full PartitionSpecs, data and
  other axes; see `runs_auto`) the call therefore runs under `run_auto`, exactly as on a
  mesh with Auto axes (the compiler picks the tensor-parallel collectives), and its
  outputs come back placed there.
  """
  axes = data_axes(mesh)
  # `axis_names`: manual over the data axes alone; every other axis stays the compiler's.
  if placed is None or not explicit_axes(mesh):
    return jax.shard_map(
      fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes)
    )
  inner = jax.shard_map(
    fn, mesh=auto_mesh(mesh), in_specs=in_specs, out_specs=out_specs, axis_names=set(axes)
  )
  return run_auto(inner, mesh, placed)
