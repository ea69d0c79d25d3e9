"""Many processes: `jax.distributed` start-up and batches built from host-local data.

On a GPU cluster each host runs one process, and `jax.distributed` joins them into one set
of global devices (Megatron's `torch.distributed.init_process_group`). `initialize` finds
out how this process was started and connects it; `host_local_batch_to_global` turns the
slice of the global batch that this process loaded into global arrays that a jitted train
step takes as is.

Where the cluster description comes from, first match wins, field by field:

1. the arguments of `initialize`;
2. the environment: `JAXDP_COORDINATOR` (`host:port` of process 0),
   `JAXDP_NUM_PROCESSES`, `JAXDP_PROCESS_ID`, `JAXDP_LOCAL_DEVICES` (CPU devices per
   process), as set by `python -m jaxdp.launch`;
3. what JAX detects itself (SLURM, Open MPI, Kubernetes, Cloud TPU, `JAX_COORDINATOR_ADDRESS`).

With none of these, the process runs alone and `initialize` does not touch
`jax.distributed`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, PartitionSpec as P

from jaxdp._src.jaxprs import backends_started, cluster_types
from jaxdp._src.mesh import DATA

PyTree = Any

logger = logging.getLogger("jaxdp")

ENV_COORDINATOR = "JAXDP_COORDINATOR"
"""`host:port` of the coordinator (process 0)."""
ENV_NUM_PROCESSES = "JAXDP_NUM_PROCESSES"
"""Number of processes in the job."""
ENV_PROCESS_ID = "JAXDP_PROCESS_ID"
"""Index of this process, in `[0, num_processes)`."""
ENV_LOCAL_DEVICES = "JAXDP_LOCAL_DEVICES"
"""Number of CPU devices this process exposes (`jax_num_cpu_devices`)."""


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value is None or value == "":
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"{name}={value!r}: expected an integer") from None


def _backends_started() -> bool:
  # jax.distributed.initialize and jax_num_cpu_devices must both come before the backend.
  return backends_started()


def _detected_cluster() -> str | None:
  """Name of the cluster environment `jax.distributed.initialize()` would detect, if any."""
  if os.environ.get("JAX_COORDINATOR_ADDRESS"):
    return "JAX_COORDINATOR_ADDRESS"
  types = cluster_types()
  if types is None:  # JAX moved it: fall back to the common ones.
    if "OMPI_MCA_orte_hnp_uri" in os.environ:
      return "OmpiCluster"
    if all(v in os.environ for v in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID")):
      return "SlurmCluster"
    return None
  for env in types:
    if getattr(env, "opt_in_only_method", False):
      continue  # mpi4py: only when asked for by name (cluster_detection_method="mpi4py").
    if env.is_env_present():
      return env.__name__
  return None


def _set_local_device_count(count: int) -> None:
  if count < 1:
    raise ValueError(f"local_device_count={count}: must be at least 1")
  if _backends_started():
    have = len(jax.local_devices(backend="cpu"))
    if have != count:
      raise RuntimeError(
        f"local_device_count={count}, but JAX has already started with "
        f"{have} local CPU devices; call jaxdp.initialize() right after "
        "`import jax`, before anything that touches devices (jax.devices(), "
        "jnp arrays, jit calls)"
      )
    return
  jax.config.update("jax_num_cpu_devices", count)


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  local_device_count: int | None = None,
  *,
  fail_fast: bool = True,
  **kwargs: Any,
) -> None:
  """Joins this process to the others of its job through `jax.distributed`.

  Call it once, first thing, before anything that touches devices. It is idempotent:
  a second call (or a call after the user's own `jax.distributed.initialize`) only checks
  that its arguments agree with the running job.

  Each of the three cluster fields comes from the argument, else from the environment
  (`JAXDP_COORDINATOR`, `JAXDP_NUM_PROCESSES`, `JAXDP_PROCESS_ID`, as set by
  `python -m jaxdp.launch`), else from JAX's own detection (SLURM, Open MPI, ...,
  `JAX_COORDINATOR_ADDRESS`). With none of them, or with one process, the process runs
  alone and `jax.distributed` is not started. Multi-process CPU runs use gloo collectives.
  Once connected, it logs (logger `"jaxdp"`, INFO) the process index and count and the
  local and global device counts.

  Args:
    coordinator_address: `host:port` of process 0's coordination service.
    num_processes: number of processes in the job.
    process_id: index of this process, `0 <= process_id < num_processes`.
    local_device_count: CPU devices this process exposes (`jax_num_cpu_devices`), else
      `JAXDP_LOCAL_DEVICES`, else JAX's default. Has no effect on GPU or TPU devices; pick
      those with `local_device_ids` or `CUDA_VISIBLE_DEVICES`.
    fail_fast: in a multi-process job, an uncaught exception prints its traceback and
      ends this process at once (exit code 1; 130 for KeyboardInterrupt). Otherwise the
      process would wait at `jax.distributed`'s shutdown barrier (up to
      `shutdown_timeout_seconds`, 300 s by default) for processes that may be blocked
      in a collective waiting for it: the whole job hangs instead of failing. The
      launcher or the cluster scheduler then stops the others. (`sys.exit(code)` still
      goes through the barrier.)
    **kwargs: passed on to `jax.distributed.initialize` (`local_device_ids`,
      `initialization_timeout`, `heartbeat_timeout_seconds`,
      `cluster_detection_method`, ...).

  Raises:
    ValueError: a malformed environment variable, or part of the cluster description
      given (e.g. a coordinator) with the rest neither given nor detectable.
    RuntimeError: JAX's backend already started (devices were touched) before a
      multi-process `initialize`, or with a different local device count; or a second
      call that disagrees with the running job.

  Examples:
    Alone, with no cluster environment, nothing is started:

    >>> import jax, jaxdp
    >>> jaxdp.initialize()
    >>> jax.distributed.is_initialized()
    False
  """
  explicit = (coordinator_address, num_processes, process_id) != (None, None, None)
  coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
  if num_processes is None:
    num_processes = _env_int(ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _env_int(ENV_PROCESS_ID)
  from_env = not explicit and (coordinator_address, num_processes, process_id) != (None,) * 3
  if local_device_count is None:
    local_device_count = _env_int(ENV_LOCAL_DEVICES)

  if jax.distributed.is_initialized():
    _check_matches_running_job(num_processes, process_id)
    if local_device_count is not None:
      _set_local_device_count(local_device_count)
    logger.debug("jaxdp.initialize: jax.distributed is already initialized")
    return

  if local_device_count is not None:
    _set_local_device_count(local_device_count)

  if num_processes == 1:
    logger.debug("jaxdp.initialize: num_processes=1, running alone")
    return
  given = {
    "coordinator_address": coordinator_address,
    "num_processes": num_processes,
    "process_id": process_id,
  }
  # Without a cluster to detect, `jax.distributed.initialize` needs all three values: none
  # given means one process alone; some given, the rest is a mistake to name.
  cluster = _detected_cluster()
  if cluster is None and kwargs.get("cluster_detection_method") is None:
    if all(v is None for v in given.values()):
      logger.debug("jaxdp.initialize: no cluster environment found, running alone")
      return
    missing = [k for k, v in given.items() if v is None]
    if missing:
      env = {
        "coordinator_address": ENV_COORDINATOR,
        "num_processes": ENV_NUM_PROCESSES,
        "process_id": ENV_PROCESS_ID,
      }
      got = ", ".join(f"{k}={v!r}" for k, v in given.items() if v is not None)
      raise ValueError(
        f"jaxdp.initialize: got {got} but no {', '.join(missing)}, and no cluster "
        f"environment (SLURM, Open MPI, ...) to "
        f"detect it from; pass {', '.join(missing)} or set "
        f"{', '.join(env[k] for k in missing)} (python -m jaxdp.launch sets all three)"
      )

  if _backends_started():
    raise RuntimeError(
      "jaxdp.initialize: JAX's backend has already started, so this process can no longer "
      "join the others; call jaxdp.initialize() right after `import jax`, before anything "
      "that touches devices (jax.devices(), jnp arrays, jit calls)"
    )
  if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
    # Cross-process collectives on CPU devices need an implementation; gloo runs over TCP.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=coordinator_address,
    num_processes=num_processes,
    process_id=process_id,
    **kwargs,
  )
  if fail_fast:
    _exit_on_uncaught_exception()
  logger.info(
    "jaxdp.initialize: process %d of %d (%s), %d local devices, %d global devices (%s)",
    jax.process_index(),
    jax.process_count(),
    "arguments" if explicit else "JAXDP_* environment" if from_env else cluster,
    jax.local_device_count(),
    jax.device_count(),
    jax.default_backend(),
  )


_fail_fast_installed = False


def _exit_on_uncaught_exception() -> None:
  """Makes an uncaught exception end the process now, skipping the shutdown barrier."""
  global _fail_fast_installed
  if _fail_fast_installed:
    return
  previous = sys.excepthook

  # A normal exit runs `jax.distributed.shutdown` at interpreter exit, which waits at a
  # barrier for every process: one failed process would hang until the others fail too.
  # `os._exit` skips it (and every other exit handler), so the process ends now, and its
  # launcher (or the cluster) sees the failure and stops the rest.
  def hook(exc_type, exc, tb):
    previous(exc_type, exc, tb)
    code = 130 if issubclass(exc_type, KeyboardInterrupt) else 1  # the shell's codes
    try:
      print(
        f"jaxdp: process {jax.process_index()} of {jax.process_count()}: uncaught "
        f"{exc_type.__name__}; exiting with code {code} without waiting for the other "
        "processes (jaxdp.initialize(fail_fast=False) to wait)",
        file=sys.stderr,
      )
      logging.shutdown()
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(code)  # no exit handlers: flushed by hand above

  sys.excepthook = hook
  _fail_fast_installed = True


def _check_matches_running_job(num_processes: int | None, process_id: int | None) -> None:
  if num_processes is not None and num_processes != jax.process_count():
    raise RuntimeError(
      f"jaxdp.initialize: num_processes={num_processes}, but jax.distributed "
      f"is already running with {jax.process_count()} processes"
    )
  if process_id is not None and process_id != jax.process_index():
    raise RuntimeError(
      f"jaxdp.initialize: process_id={process_id}, but jax.distributed "
      f"is already running as process {jax.process_index()}"
    )


def _local_extent(mesh: Mesh, axes: str | tuple[str, ...]) -> int:
  """How many distinct positions along `axes` this process's devices occupy."""
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  me = jax.process_index()
  # this process's devices' mesh coordinates, projected onto `axes`: the distinct ones are
  # the positions its devices hold along them
  mine = np.vectorize(lambda d: d.process_index == me, otypes=[bool])(mesh.devices)
  coords = np.argwhere(mine)[:, [mesh.axis_names.index(a) for a in axes]]
  return len({tuple(c) for c in coords})


def host_local_batch_to_global(batch: PyTree, mesh: Mesh, spec: PyTree = P(DATA)) -> PyTree:
  """Builds global arrays from the slice of the global batch this process holds.

  Process `i` of `n` holds rows `[i * b, (i + 1) * b)` of a global batch of
  `n * b` rows (for a mesh whose devices are ordered by process, as `jax.make_mesh`
  orders them); the result is that global batch, sharded by `spec`, ready for a jitted
  train step. With one process the local batch is the global batch. A thin,
  checked wrapper of `jax.experimental.multihost_utils.host_local_array_to_global_array`.

  Args:
    batch: pytree of host-local arrays (NumPy or JAX).
    mesh: the global mesh; each process's devices must form a contiguous block of it.
    spec: how the global arrays are sharded: one `PartitionSpec` for every leaf, or a
      pytree prefix of `batch` with one per subtree. Default: leading dim over `"data"`.

  Returns:
    The pytree of global `jax.Array`s; a leaf's sharded dims are the local dims times the
    number of processes along their mesh axes.

  Raises:
    ValueError: a leaf whose sharded dim does not divide evenly over this process's
      devices along the spec's mesh axes, or that has fewer dims than its spec.

  Examples:
    >>> import jax, jaxdp, numpy as np
    >>> n = jax.device_count()
    >>> mesh = jax.make_mesh((n,), ("data",))
    >>> local = {"x": np.ones((2 * jax.local_device_count(), 3), np.float32)}
    >>> batch = jaxdp.host_local_batch_to_global(local, mesh)
    >>> batch["x"].shape == (2 * n, 3)
    True
  """
  is_spec = lambda x: isinstance(x, P) or x is None
  specs = jax.tree.broadcast(spec, batch, is_leaf=is_spec)
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  spec_leaves = jax.tree.leaves(specs, is_leaf=is_spec)
  for (path, leaf), leaf_spec in zip(leaves, spec_leaves):
    leaf_spec = P() if leaf_spec is None else leaf_spec
    shape = np.shape(leaf)
    if len(leaf_spec) > len(shape):
      raise ValueError(
        f"batch{jax.tree_util.keystr(path)}: shape {shape} has fewer dims than its spec {leaf_spec}"
      )
    for dim, axes in enumerate(leaf_spec):
      if axes is None:
        continue
      extent = _local_extent(mesh, axes)
      if shape[dim] % extent:
        raise ValueError(
          f"batch{jax.tree_util.keystr(path)}: dim {dim} of the local batch is {shape[dim]}, "
          f"not divisible by the {extent} devices of process {jax.process_index()} along "
          f"mesh axis {axes!r}; give each process a multiple of {extent} rows"
        )
  # Only local copies to this process's own devices: no program, no cross-process work, so
  # it cannot interleave differently with the other processes' programs.
  return multihost_utils.host_local_array_to_global_array(batch, mesh, specs)
