"""Compile for GPU without a GPU.

With `jax-cuda12-plugin` and `jax-cuda12-pjrt` installed (`pip install 'jaxdp[aot]'`), `gpu_mesh`
builds a mesh of *compile-only* H100 devices from the target description shipped in
`jaxdp/_src/data` and `compile_for_gpu` compiles a program for it. No GPU is needed; the result
cannot run, but its scheduled HLO (`as_text()`) and `memory_analysis()` are the GPU program's. This
works with `JAX_PLATFORMS=cpu`.

Facts checked with jax/jaxlib 0.10.2 (see tests/test_inspect.py):

- Without the plugin, `get_topology_desc(platform="cuda")` raises
  `NotImplementedError('topology not implemented for cuda')`.
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from jaxdp._src import train
from jaxdp._src.compiler import COST_MODEL_OPTIONS, GPU_OPTIONS, GPU_PLATFORMS
from jaxdp._src.mesh import DATA, data_axes
from jaxdp._src.state import TrainState, memory_kinds

PyTree = Any

_TARGET_CONFIG_FILE = "h100_target_config.txtpb"


def h100_target_config() -> str:
  """The H100 target description jaxdp ships (a `GpuTargetConfigProto` text).

  Returns:
    The text, as passed to `get_topology_desc(target_config=...)`.

  Examples:
    >>> "NVIDIA H100" in h100_target_config()
    True
  """
  path = importlib.resources.files("jaxdp._src").joinpath("data", _TARGET_CONFIG_FILE)
  return path.read_text()


@functools.cache
def gpu_compile_unavailable() -> str | None:
  """Why GPU programs cannot be compiled here, or None when they can.

  Returns:
    None when `gpu_topology` works; otherwise one line saying what is missing and how to get it.
    Tests skip their GPU cases with this reason.

  Examples:
    >>> reason = gpu_compile_unavailable()
    >>> reason is None or "jax-cuda12" in reason
    True
  """
  # A compile-only CUDA client needs both halves of JAX's CUDA plugin: the kernels' Python
  # package and the PJRT plugin that XLA:GPU compiles through. No GPU is needed.
  for module, package in (
    ("jax_cuda12_plugin", "jax-cuda12-plugin"),
    ("jax_plugins.xla_cuda12", "jax-cuda12-pjrt"),
  ):
    try:
      found = importlib.util.find_spec(module) is not None
    except ImportError:
      found = False
    if not found:
      return (
        f"{package}=={jax.__version__} is not installed; "
        f"pip install 'jaxdp[aot]' to compile GPU programs without a GPU"
      )
  try:
    _topology(1, 1, None)
  except Exception as e:  # noqa: BLE001 - any failure means "unavailable".
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return (
      f"jax-cuda12-plugin is installed but no cuda topology can be built "
      f"({type(e).__name__}: {first}); without a GPU and its CUDA libraries, "
      f"set JAX_PLATFORMS=cpu before JAX starts (the plugin then skips its "
      f"CUDA checks), and check that jax-cuda12-plugin, jax-cuda12-pjrt and "
      f"jaxlib are all version {jax.__version__}"
    )
  return None


@functools.cache
def _topology(num_hosts: int, per_host: int, target_config: str | None):
  from jax.experimental import topologies  # noqa: PLC0415 - optional path.

  # A topology built from a target description (`GpuTargetConfigProto`: the device's
  # compute capability, memory, bandwidths) rather than from the devices of this machine:
  # XLA compiles for it as for those GPUs. `topology` is "slices x hosts x devices per host".
  return topologies.get_topology_desc(
    platform="cuda",
    target_config=target_config or h100_target_config(),
    topology=f"1x{num_hosts}x{per_host}",
  )


def gpu_topology(
  num_devices: int = 8, *, num_hosts: int = 1, target_config: str | None = None
) -> tuple[jax.Device, ...]:
  """Compile-only GPU devices (H100 unless `target_config` says otherwise).

  Args:
    num_devices: total number of GPUs.
    num_hosts: hosts they are spread over (topology `1 x hosts x per host`).
    target_config: a `GpuTargetConfigProto` text; default: the H100 one (`h100_target_config`).

  Returns:
    `num_devices` devices that programs can be lowered and compiled for, but not run on.

  Raises:
    ValueError: if `num_devices` is not a positive multiple of `num_hosts`.
    RuntimeError: if GPU programs cannot be compiled here (`gpu_compile_unavailable` says why).

  Examples:
    >>> devices = gpu_topology(8)
    >>> len(devices), devices[0].device_kind
    (8, 'NVIDIA H100 80GB HBM3')
  """
  if num_devices < 1 or num_hosts < 1 or num_devices % num_hosts:
    raise ValueError(
      f"gpu_topology: num_devices={num_devices} must be a positive multiple "
      f"of num_hosts={num_hosts}"
    )
  reason = gpu_compile_unavailable()
  if reason is not None:
    raise RuntimeError(f"gpu_topology: {reason}")
  topo = _topology(num_hosts, num_devices // num_hosts, target_config)
  return tuple(topo.devices)


def gpu_mesh(
  axis_shapes: Sequence[int] = (8,),
  axis_names: Sequence[str] = ("data",),
  *,
  num_hosts: int = 1,
  target_config: str | None = None,
  axis_types: Sequence[jax.sharding.AxisType] | None = None,
) -> jax.sharding.Mesh:
  """A mesh over compile-only GPU devices, like `jax.make_mesh` for a GPU.

  Args:
    axis_shapes: mesh shape; its product is the number of GPUs.
    axis_names: one name per axis.
    num_hosts: hosts the GPUs are spread over.
    target_config: a `GpuTargetConfigProto` text; default: H100.
    axis_types: one `jax.sharding.AxisType` per axis (default: Auto); Explicit axes let
      `compile_train_step` read tensor-parallel placements from abstract params.

  Returns:
    A `jax.sharding.Mesh` to build shardings and `shard_map`s on.

  Raises:
    ValueError: if shapes and names differ in length.
    RuntimeError: if GPU programs cannot be compiled here.

  Examples:
    >>> dict(gpu_mesh((4, 2), ("data", "model")).shape)
    {'data': 4, 'model': 2}
  """
  from jax.experimental import mesh_utils  # noqa: PLC0415

  axis_shapes, axis_names = tuple(axis_shapes), tuple(axis_names)
  if len(axis_shapes) != len(axis_names):
    raise ValueError(
      f"gpu_mesh: axis_shapes {axis_shapes} and axis_names {axis_names} must have the same length"
    )
  n = 1
  for s in axis_shapes:
    n *= s
  devices = gpu_topology(n, num_hosts=num_hosts, target_config=target_config)
  grid = mesh_utils.create_device_mesh(axis_shapes, list(devices))
  types = {} if axis_types is None else {"axis_types": tuple(axis_types)}
  return jax.sharding.Mesh(grid, axis_names, **types)


def abstract_like(tree: PyTree, mesh: jax.sharding.Mesh) -> PyTree:
  """`ShapeDtypeStruct`s of `tree`'s leaves, placed on `mesh`.

  Each leaf keeps its `PartitionSpec` when it has a `NamedSharding` (the mesh axis names must exist
  on `mesh`) and is replicated otherwise. Use it to compile a step for a GPU mesh from arrays (or
  abstract values) built for a CPU mesh with the same axis names.

  Args:
    tree: a pytree of arrays or `jax.ShapeDtypeStruct`s.
    mesh: the target mesh, e.g. `gpu_mesh`.

  Returns:
    The same pytree of `jax.ShapeDtypeStruct` with `NamedSharding`s on `mesh`.

  Examples:
    >>> import jax.numpy as jnp
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> abstract_like({"w": jnp.zeros((2, 3))}, mesh)["w"].shape
    (2, 3)
  """

  def one(leaf):
    sharding = getattr(leaf, "sharding", None)
    spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

  return jax.tree.map(one, tree)


def _platforms_of(tree: PyTree) -> set[str]:
  platforms = set()
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.sharding.Sharding):
      sharding = leaf
    else:
      sharding = getattr(leaf, "sharding", None)
    # (a sharding on the mesh's abstract form, an offloaded leaf's (`_placed`), has no devices)
    if sharding is not None and not isinstance(getattr(sharding, "mesh", None), AbstractMesh):
      platforms |= {d.platform for d in sharding.device_set}
  return platforms


def compile_for_gpu(
  fn: Callable[..., Any],
  *args: Any,
  compiler_options: dict[str, Any] | None = None,
  **kwargs: Any,
) -> jax.stages.Compiled:
  """Lowers and compiles `fn(*args, **kwargs)` for GPU with jaxdp's options.

  Args:
    fn: a function, a `jax.jit`-wrapped one or a jaxdp train step (its own `compiler_options` are
      kept; jaxdp's and then `compiler_options` are merged on top).
    *args: arguments; arrays or `jax.ShapeDtypeStruct`s whose shardings are on a GPU mesh
      (`gpu_mesh`, `abstract_like`).
    compiler_options: extra or overriding XLA options, e.g. the default combine thresholds back
      (`{"xla_gpu_all_reduce_combine_threshold_bytes": 30 * 2**20}`).
    **kwargs: keyword arguments of `fn`.

  Returns:
    The compiled GPU program: `as_text()` is its scheduled HLO,
    `memory_analysis()` its per-device memory. It cannot be executed.

  Raises:
    ValueError: if the arguments or the compiled program live on non-GPU devices (the program would
      have been compiled for that platform).

  Examples:
    >>> import jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = gpu_mesh((8,), ("data",))
    >>> x = jax.ShapeDtypeStruct((64, 32), jnp.float32,
    ...                          sharding=NamedSharding(mesh, P("data")))
    >>> compiled = compile_for_gpu(lambda x: jnp.sin(x).sum(), x)
    >>> "all-reduce-start" in compiled.as_text()
    True
  """
  if not hasattr(fn, "lower"):  # a jitted function, or jaxdp's train step, lowers itself
    fn = jax.jit(fn)
  platforms = _platforms_of((args, kwargs))
  if platforms - {"gpu"}:
    raise ValueError(
      f"compile_for_gpu: arguments are placed on {sorted(platforms)} devices; "
      f"give them shardings on a GPU mesh: "
      f"args = abstract_like(args, gpu_mesh(...))"
    )
  # The caller's options win, then the cost model's (estimates written into the compiled
  # text for `inspect.predict_step`), then jaxdp's GPU defaults.
  options = {**GPU_OPTIONS, **COST_MODEL_OPTIONS, **(compiler_options or {})}
  compiled = fn.lower(*args, **kwargs).compile(compiler_options=options)
  # A function that places nothing on a GPU mesh itself compiles for the default backend
  # (CPU here) without a word: the compiled shardings tell.
  compiled_platforms = _platforms_of((compiled.input_shardings, compiled.output_shardings))
  if compiled_platforms - {"gpu"}:
    raise ValueError(
      f"compile_for_gpu: the program was compiled for "
      f"{sorted(compiled_platforms)}, not GPU: no argument and no mesh in "
      f"fn was on a GPU mesh; pass args = abstract_like(args, gpu_mesh(...))"
    )
  return compiled


def _placed(mesh: jax.sharding.Mesh, spec: PartitionSpec, kind: str | None) -> NamedSharding:
  """`spec` on `mesh`, in memory `kind` (None: the device's). A compile-only device lists no
  memories, and a `NamedSharding` on its mesh drops the kind; on the mesh's abstract form
  the kind stays, and the program compiled for those devices takes that argument in host
  memory (`optimizer_cpu_offload`)."""
  sharding = NamedSharding(mesh, spec, memory_kind=kind)
  if kind is None or sharding.memory_kind == kind:
    return sharding
  return NamedSharding(mesh.abstract_mesh, spec, memory_kind=kind)


def placed_abstract_state(params, tx, mesh, config, *, frozen=None, fsdp=None) -> TrainState:
  """The state `init_state` makes of `params` (arrays or `jax.ShapeDtypeStruct`s) on `mesh`,
  shapes only: each leaf a `jax.ShapeDtypeStruct` placed where `init_state` places it, an
  offloaded one (`DDPConfig.optimizer_cpu_offload`) in host memory. What
  `compile_train_step` compiles the step for, and any other program of the job."""
  extra = {"fsdp": fsdp} if config.shards_params else {}
  # A leaf placed on `mesh` keeps its placement (tensor-parallel params): `init_state` reads
  # it from the traced leaf's type, which carries it where the mesh's axes are Explicit.
  explicit = {
    a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Explicit
  }

  def shape_of(x):
    sharding = getattr(x, "sharding", None)
    keep = isinstance(sharding, NamedSharding) and sharding.mesh == mesh
    if keep and any(sharding.spec) and explicit != set(mesh.axis_names):
      raise ValueError(
        f"a param is placed {sharding.spec} on a mesh with Auto axes "
        f"{sorted(set(mesh.axis_names) - explicit)}, whose placement the abstract state "
        "cannot read; build the mesh with Explicit axes (gpu_mesh(..., axis_types="
        "(jax.sharding.AxisType.Explicit,) * len(axis_names)), jax.make_mesh's default)"
      )
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding if keep else None)

  state = jax.eval_shape(
    lambda p: train.init_state(p, tx, mesh, config, frozen=frozen, **extra),
    jax.tree.map(shape_of, params),
  )
  specs = train.state_specs(state)
  return jax.tree.map(
    lambda x, s, kind: (
      None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_placed(mesh, s, kind))
    ),
    state,
    specs,
    memory_kinds(state),
    is_leaf=lambda x: x is None,
  )


def compile_train_step(
  loss_fn: Callable[[PyTree, PyTree], jax.Array],
  tx: Any,
  mesh: jax.sharding.Mesh | int,
  config: Any,
  params: PyTree,
  batch: PyTree,
  *,
  frozen: Any = None,
  fsdp: Any = None,
  grad_accum_steps: int = 1,
  compiler_options: dict[str, Any] | None = None,
) -> jax.stages.Compiled:
  """Compiles jaxdp's train step for a mesh without building its state.

  The state's shapes and shardings come from `jax.eval_shape` of `jaxdp.init_state` (nothing is
  allocated), so a step can be compiled for `dp` H100s on a machine without a GPU, or for a CPU
  mesh, from the params alone. Read the result with `jaxdp.inspect.report` /
  `jaxdp.inspect.schedule` / `jaxdp.inspect.memory_stats`.

  Args:
    loss_fn: `loss_fn(params, batch) -> scalar`, as for `make_train_step`.
    tx: the optax transformation.
    mesh: the mesh to compile for, or a number `n`: `gpu_mesh((n,))`, n H100s on one
      `"data"` axis (no GPU needed).
    config: the `jaxdp.DDPConfig`.
    params: the model params (arrays or `jax.ShapeDtypeStruct`s).
    batch: one global batch (arrays or `jax.ShapeDtypeStruct`s); its leading dim is split over the
      data axes.
    frozen: as in `jaxdp.init_state`.
    fsdp: the `FSDPConfig` of `optim_grads_params` (None: the default).
    grad_accum_steps: as in `jaxdp.make_train_step`.
    compiler_options: extra or overriding XLA options.

  Returns:
    The compiled train step (for a compile-only GPU mesh it cannot run).

  Raises:
    RuntimeError: `mesh` is a number and GPU programs cannot be compiled here
      (`gpu_compile_unavailable` says why).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
    >>> params = {"w": jax.ShapeDtypeStruct((256, 256), jnp.float32)}
    >>> batch = {"x": jax.ShapeDtypeStruct((64, 256), jnp.float32)}
    >>> compiled = compile_train_step(loss_fn, optax.sgd(0.1), 8, jaxdp.DDPConfig(),
    ...                               params, batch)
    >>> "all-reduce-start" in compiled.as_text()
    True
  """
  if isinstance(mesh, int) and not isinstance(mesh, bool):
    mesh = gpu_mesh((mesh,), (DATA,))
  elif not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(
      f"mesh={mesh!r}: pass a jax.sharding.Mesh, or a number n to compile for n H100s "
      "(jaxdp.inspect.gpu_mesh((n,)))"
    )
  extra = {"fsdp": fsdp} if config.shards_params else {}
  state = placed_abstract_state(params, tx, mesh, config, frozen=frozen, fsdp=fsdp)
  axes = data_axes(mesh)  # the step's own: ("replica", "expert", "data") where present
  batch_sharding = NamedSharding(mesh, PartitionSpec(axes))
  batch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding), batch
  )
  step = train.make_train_step(
    loss_fn, tx, mesh, config, grad_accum_steps=grad_accum_steps, **extra
  )
  # The step carries its strategy's XLA options (`compiler.compiler_options`, FSDP's); the
  # cost model's are added, and the caller's on top.
  platform = mesh.devices.flat[0].platform
  gpu = COST_MODEL_OPTIONS if platform in GPU_PLATFORMS else {}
  options = {**gpu, **(compiler_options or {})}
  return step.lower(state, batch).compile(compiler_options=options or None)
