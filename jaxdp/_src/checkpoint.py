"""Checkpoints that restore onto any mesh and any strategy, on orbax, moving shards.

A `TrainState` is laid out for one mesh and one strategy: sharded strategies hold master
params and per-param optimizer state as row shards padded on their shard dim, `no_shard`
holds full trees. A checkpoint stores each leaf *as the state holds it* (format 2), so that
every device writes only its own shards (orbax writes a sharded `jax.Array` shard by shard,
each process its addressable shards) and nothing is gathered:

* `params_<i>`: a frozen or integer leaf, and a trainable param whose dtype is already fp32
  or wider (it *is* its master: every strategy keeps the two bitwise equal), in the state's
  shape: padded rows included where the strategy pads it;
* `master_<i>`: the fp32 (or wider) master of a trainable low-precision param (the param is
  its cast);
* `opt_<j>`: every optax state leaf (a fused state's flat buckets are unravelled into the
  per-leaf form first, every device converting its own shard);
* `model_state_<j>` (BatchNorm statistics) and `rng` (the key's raw data), replicated, so
  that a resumed run draws the keys of the uninterrupted one;
* `spike_window_<j>`: the spike guard's recent grad norms (`TrainState.spike_window`),
  replicated; restored where `like` has a window of the same size, else `like`'s (empty)
  window is kept and the guard fills it again;
* the state's step counter and the caller's data position (any JSON value).

Each stored leaf holds its logical region first on every dim and padding rows after it, so
`restore` reads every leaf straight into `like`'s shape and sharding, shard by shard (orbax
cuts or zero-extends the stored array at the end of each dim), and takes the elements past
the logical region from `like` (what `init_state` put there), or from the checkpoint where
its shape is `like`'s very shape (a resume on the same mesh and strategy: bitwise). So a
checkpoint saved with dp=8 under `optim` restores with dp=4 under `optim_grads_params` or
with dp=2 under `no_shard`. Format 1 (every leaf stored in its logical shape, replicated)
restores through the same path.

Each checkpoint carries metadata (jaxdp version, strategy, dp, layout summary, the path,
shape and dtype of every stored leaf, the optax state structure); `restore` compares it to
`like` first and names the first leaf that does not fit, before any array is read.

Atomicity is orbax's: a step is written into `<step>.orbax-checkpoint-tmp` and renamed to
`<step>` only after every file (arrays and metadata) is written, and only renamed steps are
ever listed or restored, so a process killed mid-save leaves the previous checkpoint as the
latest. A manager that opens the directory removes leftover temporary directories in the
background (at the latest before its first save).

What is stored under which key, and the metadata records, are `checkpoint_format`'s; which
stored key fills each leaf of `like`, and the filling, are `checkpoint_restore`'s. This module
holds the manager (orbax's save and restore, the preemption signal) and `get_opt_state`.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import FixedIntervalPolicy
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp._src import __version__
from jaxdp._src import checks
from jaxdp._src.checkpoint_format import (
  FORMAT,
  Metadata,
  describe,
  first_mismatch,
  opt_forms,
  stored_arrays,
)
from jaxdp._src.checkpoint_restore import (
  LikeLeaves,
  abstract_fits,
  groups_of,
  is_abstract,
  read_args,
  same_flat_layout,
  targets_of,
)
from jaxdp._src.distributed_optimizer import per_leaf_state, unpad_view
from jaxdp._src.mesh import DATA, eager_program
from jaxdp._src.state import TrainState, memory_kinds, model_spec, to_device

PyTree = Any

_STATE, _META = "state", "meta"


# ----------------------------------------------------------------------------- optax state


def get_opt_state(state: TrainState, *, sharded: bool = False) -> PyTree:
  """The optax state of `state` as one device would hold it: per-param leaves in their
  param's shape (the sharded strategies' padding rows dropped) and placed as
  `get_params(state, sharded=sharded)` places their param, the rest as they are.

  What optax helpers that read the state need, on every strategy: `schedule_free`'s
  `optax.contrib.schedule_free_eval_params(jaxdp.get_opt_state(state),
  jaxdp.get_params(state))`, `inject_hyperparams`' `.hyperparams`. Fresh copies (they
  outlive the next donated step), placed for eager use as `get_params` places the params;
  the state itself is not changed.

  Args:
    state: a `TrainState` of any strategy.
    sharded: False: every leaf whole over the data axes (a tensor- or expert-parallel
      param's moments keep its own split, `P(None, "model")`, `P("expert")`). True: each
      per-param leaf also sharded over "data" as `get_params(state, sharded=True)` shards
      its param, so a device holds `1 / (dp x tp)` of a tensor-parallel weight's moment
      (for a big model).

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
    >>> state = jaxdp.init_state({"w": jnp.ones((30,))}, optax.adam(1e-3), mesh, config)
    >>> jax.tree.map(jnp.shape, state.opt_state[0].mu)  # fused: a flat array per bucket
    {'float32/bucket0': (128,)}
    >>> jax.tree.map(jnp.shape, jaxdp.get_opt_state(state)[0].mu)
    {'w': (30,)}
    >>> tp = jax.make_mesh((4, 2), ("data", "model"))  # w split over "model" by its caller
    >>> w = jax.device_put(jnp.ones((8, 64)), jax.NamedSharding(tp, jax.P(None, "model")))
    >>> state = jaxdp.init_state({"w": w}, optax.adam(1e-3), tp, config)
    >>> jaxdp.get_opt_state(state, sharded=True)[0].mu["w"].sharding.spec
    P('data', 'model')
  """
  checks.check_not_donated(state, "jaxdp.get_opt_state(state)")
  return _opt_state_program(state, state.step.sharding.mesh, bool(sharded))


@eager_program
def _opt_state_program(state: TrainState, mesh, sharded: bool) -> PyTree:
  """One program for the whole tree (never eager per-leaf ops: see `get_params`). A
  per-param leaf is placed as `get_params` places its param: over the param's own axes and,
  if `sharded`, over "data" on the dim `view_dims` picks (`unpad_view`)."""
  # an offloaded state (`DDPConfig.optimizer_cpu_offload`) is read on the device
  state = dataclasses.replace(
    state, master=to_device(state.master), opt_state=to_device(state.opt_state)
  )
  state = per_leaf_state(state, mesh)
  outer = state.layout.outer > 1  # HFSDP: over ("data", "replica")
  leaves, treedef = jax.tree.flatten(state.opt_state)
  out = []
  for x, form in zip(leaves, opt_forms(state)):
    if form.param is None and tuple(x.shape) == form.shape and not sharded:
      out.append(jnp.copy(x))  # a step count, a factored moment: as the state holds it
      continue
    dims = () if form.param is None else model_spec(state, form.param, len(form.shape))
    out.append(jnp.copy(unpad_view(x, form.shape, form.axis, mesh, dims, sharded, outer)))
  return jax.tree.unflatten(treedef, out)


# ----------------------------------------------------------------------------- preemption
#
# [Note: preemption] A scheduler that needs a job's machines back sends it a signal (SLURM,
# Kubernetes: SIGTERM) and kills it a grace period later. `CheckpointManager.
# reached_preemption(step)` turns that signal into one step at which every process saves:
#
# * One process (`jax.distributed` not running): a Python handler for the signal sets a
#   flag, and the first step boundary after it is the step.
# * Several processes: JAX's preemption sync manager, which `jax.distributed.initialize`
#   starts, catches SIGTERM itself (a C handler, not a Python one), tells the coordination
#   service, and every process reports the last step it asked about; the step is the
#   largest of those plus one (`multihost_utils.reached_preemption_sync_point`). So a
#   process signalled later than another, or never, still saves at the same step. A
#   Python handler for SIGTERM would replace JAX's handler and the other processes would
#   never hear, so none is installed for SIGTERM; another signal (SLURM's `--signal=USR1`)
#   gets a Python handler that raises SIGTERM in its own process, for JAX's handler.
#
# The handler is installed at the first `reached_preemption` call, not before: a loop that
# never asks keeps the signal's previous behaviour (SIGTERM ends the process), and before
# the first step boundary there is nothing newer than the restored state to save. One
# handler per signal serves every open manager that listens on it; the handler that was
# there before comes back when the last of them is closed (or collected).


@dataclasses.dataclass
class _Notice:
  """What one manager heard of its preemption signal."""

  received: bool = False
  """The signal arrived (one process; under `jax.distributed`, JAX keeps its own record)."""
  step: int | None = None
  """The step at which `reached_preemption` answered True."""


@dataclasses.dataclass
class _Listener:
  """The one Python handler of a signal, shared by the managers that listen on it."""

  previous: Any
  """The handler it replaced (`signal.signal`'s return value), put back by the last one."""
  notices: list[_Notice]
  forward_to_jax: bool
  """Raise SIGTERM on receipt, for JAX's preemption sync manager ([Note: preemption])."""


_listeners: dict[signal.Signals, _Listener] = {}


def _on_signal(signum: int, frame) -> None:
  sig = signal.Signals(signum)
  listener = _listeners.get(sig)
  if listener is None:  # removed while this signal was pending
    return
  if not listener.notices:  # its last manager was collected off the main thread
    _unlisten(sig, None)
    signal.raise_signal(sig)  # to the handler it had before
    return
  for notice in listener.notices:
    notice.received = True
  if listener.forward_to_jax:
    signal.raise_signal(signal.SIGTERM)


def _listen(sig: signal.Signals, notice: _Notice, forward_to_jax: bool) -> None:
  if sig not in _listeners:
    if threading.current_thread() is not threading.main_thread():
      raise ValueError(
        f"CheckpointManager(preemption_signal={sig.name}): Python handles signals in the "
        "main thread only; call reached_preemption from the main thread, or construct the "
        "manager with preemption_signal=None"
      )
    previous = signal.signal(sig, _on_signal)
    _listeners[sig] = _Listener(previous=previous, notices=[], forward_to_jax=forward_to_jax)
  _listeners[sig].notices.append(notice)


def _unlisten(sig: signal.Signals, notice: _Notice | None) -> None:
  """Stops `notice` hearing `sig`; with no notice left, puts the previous handler back (on
  the main thread: elsewhere the handler does it when the signal comes)."""
  listener = _listeners.get(sig)
  if listener is None:
    return
  listener.notices = [n for n in listener.notices if n is not notice]
  if listener.notices or threading.current_thread() is not threading.main_thread():
    return
  del _listeners[sig]
  # None: the previous handler was not set from Python; the default is what Python knew
  signal.signal(sig, signal.SIG_DFL if listener.previous is None else listener.previous)


def _check_signal(preemption_signal) -> signal.Signals | None:
  """`preemption_signal` as a `signal.Signals`, or a clear error."""
  if preemption_signal is None:
    return None
  if isinstance(preemption_signal, bool) or not isinstance(preemption_signal, int):
    raise TypeError(
      f"preemption_signal={preemption_signal!r}: expected a signal such as signal.SIGTERM "
      "or signal.SIGUSR1 (a signal.Signals or its number), or None to never stop for one"
    )
  try:
    sig = signal.Signals(preemption_signal)
  except ValueError:
    raise ValueError(
      f"preemption_signal={preemption_signal!r}: no such signal on this system; use one "
      "of signal.SIGTERM, signal.SIGUSR1, ..., or None"
    ) from None
  if sig in (signal.SIGKILL, signal.SIGSTOP):
    raise ValueError(
      f"preemption_signal={sig.name}: a process cannot catch {sig.name}; use the signal "
      "the scheduler sends first (SIGTERM, or the one given to SLURM's --signal)"
    )
  return sig


def _check_jax_hears(sig: signal.Signals) -> None:
  """Under `jax.distributed`: refuses what would keep JAX's preemption sync from hearing
  the signal ([Note: preemption])."""
  if not jax.config.jax_enable_preemption_service:
    raise ValueError(
      f"CheckpointManager(preemption_signal={sig.name}): the processes agree on the step "
      "to save at through JAX's preemption service, which is off "
      "(jax_enable_preemption_service=False); turn it on before jax.distributed starts, or "
      "pass preemption_signal=None"
    )
  if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
    raise ValueError(
      f"CheckpointManager(preemption_signal={sig.name}): a handler set from Python "
      f"({signal.getsignal(signal.SIGTERM)!r}) holds SIGTERM, in place of the one "
      "jax.distributed installs for its preemption sync, so no process would hear of a "
      "preemption; remove it (signal.signal(signal.SIGTERM, signal.SIG_DFL) before "
      "jax.distributed.initialize), or pass preemption_signal=None"
    )


# ----------------------------------------------------------------------------- manager


class CheckpointManager:
  """Saves and restores `TrainState`s in a topology-free form, asynchronously and atomically.

  A checkpoint saved on one mesh under one strategy restores on any other mesh (any dp)
  under any strategy: see the module docstring for what is stored.

  Args:
    directory: where the checkpoints go (one sub-directory per step); created if missing.
    max_to_keep: keep the newest this many checkpoints; None keeps all.
    save_interval_steps: `save` only writes steps that are multiples of this (unless
      `force=True`).
    save_concurrent_gb: at most this many GB (10^9 bytes) of arrays being written by this
      process at once (orbax's `save_concurrent_gb`): a bound on the host memory a save's
      writes hold, at the price of fewer writes in flight. None: orbax's default (no bound
      below the state's own size). Each device's shard of every array must be smaller,
      since a shard is written in one piece; `save` refuses a state with a larger one.
    preemption_signal: the signal a scheduler sends before it stops the job (SIGTERM by
      default; SLURM's `--signal=USR1@90`: `signal.SIGUSR1`); `reached_preemption` says
      at which step every process saves after it. None: never stop for a signal.

  Examples:
    >>> import tempfile, jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config, tx = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim"), optax.adam(1e-3)
    >>> state = jaxdp.init_state({"w": jnp.ones((5, 3))}, tx, mesh, config)
    >>> folder = tempfile.TemporaryDirectory()  # removed by folder.cleanup() below
    >>> mgr = jaxdp.CheckpointManager(folder.name, max_to_keep=2)
    >>> mgr.save(0, state, data_position=0)
    True
    >>> mgr.wait_until_finished()
    >>> small = jax.sharding.Mesh(jax.devices()[:2], ("data",))
    >>> like = jaxdp.init_state({"w": jnp.zeros((5, 3))}, tx, small, jaxdp.DDPConfig())
    >>> jaxdp.get_params(mgr.restore(like))["w"].sum()
    Array(15., dtype=float32)
    >>> mgr.data_position()
    0
    >>> mgr.close()

    On preemption, a loop saves at the next step boundary and stops (`reached_preemption`):

    >>> import os, signal
    >>> train_step = jaxdp.make_train_step(lambda p, b: jnp.sum(p["w"]) * jnp.mean(b), tx, mesh, config)
    >>> mgr = jaxdp.CheckpointManager(folder.name + "/run", save_interval_steps=100)
    >>> for step in range(1, 1000):
    ...   state, _ = train_step(state, jnp.ones((8, 3)))
    ...   if step == 3:
    ...     os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends
    ...   if mgr.reached_preemption(step):
    ...     saved = mgr.save(step, state, force=True)
    ...     break
    >>> mgr.wait_until_finished(); mgr.all_steps()
    [3]
    >>> mgr.close(); folder.cleanup()  # SIGTERM's previous handler is back
  """

  def __init__(
    self,
    directory,
    *,
    max_to_keep: int | None = None,
    save_interval_steps: int = 1,
    save_concurrent_gb: float | None = None,
    preemption_signal: int | signal.Signals | None = signal.SIGTERM,
  ):
    self.preemption_signal = _check_signal(preemption_signal)
    self._notice = _Notice()
    self._listening = False
    if max_to_keep is not None and (
      isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
    ):
      raise ValueError(f"max_to_keep={max_to_keep!r}: must be a positive integer or None")
    if (
      isinstance(save_interval_steps, bool)
      or not isinstance(save_interval_steps, int)
      or save_interval_steps < 1
    ):
      raise ValueError(f"save_interval_steps={save_interval_steps!r}: must be a positive integer")
    if save_concurrent_gb is not None and (
      isinstance(save_concurrent_gb, bool)
      or not isinstance(save_concurrent_gb, (int, float))
      or not save_concurrent_gb > 0
    ):
      raise ValueError(
        f"save_concurrent_gb={save_concurrent_gb!r}: must be a positive number of GB, or None"
      )
    self.save_concurrent_gb = save_concurrent_gb
    self.directory = os.path.abspath(os.fspath(directory))  # orbax takes absolute paths
    self._mgr = ocp.CheckpointManager(
      self.directory,
      item_handlers={
        _STATE: ocp.PyTreeCheckpointHandler(save_concurrent_gb=save_concurrent_gb),
        _META: ocp.JsonCheckpointHandler(),
      },
      options=ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        create=True,
        cleanup_tmp_directories=True,
        enable_async_checkpointing=True,
        # exactly the multiples (orbax's default also saves the first step it sees)
        save_decision_policy=FixedIntervalPolicy(save_interval_steps),
      ),
    )

  # -- save

  def save(
    self, step: int, state: TrainState, *, data_position: Any = None, force: bool = False
  ) -> bool:
    """Starts writing `state` as checkpoint `step`; returns once the arrays are on the host.

    The write finishes in the background (call `wait_until_finished` to block); until it
    does, the step is not listed and `restore` cannot see it. The state may be donated to the
    next train step as soon as `save` returns.

    Args:
      step: the checkpoint's number (usually the number of steps taken).
      state: a `TrainState` on any mesh, under any strategy.
      data_position: where the input pipeline is (any JSON value), given back by
        `data_position()`.
      force: save even if `step` is not a multiple of `save_interval_steps`.

    Returns:
      Whether a checkpoint was started (False: `step` is not a multiple of
      `save_interval_steps`, or not newer than the latest checkpoint).

    Raises:
      TypeError: `state` is not a `TrainState`.
      ValueError: the state was donated to a train step (save the state it returned).
    """
    _check_is_state(state, "state")
    checks.check_not_donated(state, "CheckpointManager.save(step, state)")
    step = int(step)
    if not force and not self._mgr.should_save(step):
      return False
    description = describe(state)
    arrays, flat = stored_arrays(state)
    if self.save_concurrent_gb is not None:
      _check_shards_fit(arrays, self.save_concurrent_gb)
    meta = Metadata(
      format=FORMAT,
      jaxdp_version=__version__,
      state_step=int(jax.device_get(state.step)),
      data_position=data_position,
      strategy=state.config.data_parallel_sharding_strategy,
      dp=state.layout.dp,
      mesh_shape=dict(state.mesh_shape),
      layout=state.layout.summary(),
      description=description,
      stored={key: tuple(array.shape) for key, array in arrays.items()},
      flat=flat or None,
    )
    return self._mgr.save(
      step,
      args=ocp.args.Composite(
        **{_STATE: ocp.args.PyTreeSave(arrays), _META: ocp.args.JsonSave(meta.to_json())}
      ),
      force=force,
    )

  def reached_preemption(self, step: int) -> bool:
    """Whether to save now and stop: True at the one step where every process saves after
    the `preemption_signal` reached any of them.

    Call it at every step boundary, on every process, with the step counter that `save`
    takes (increasing by one per step): after a signal, it answers True at one step, the
    same on every process (under `jax.distributed`, JAX's preemption sync point: the step
    after the furthest any process had asked about; alone, the first call after the
    signal), and False before and after it (docs/multi-host.md, "Preemption").

    The first call installs the handler (none for SIGTERM under `jax.distributed`, whose
    own handler hears it); `close` puts the previous one back. From then on the signal no
    longer ends the process: the loop must stop itself.

    Args:
      step: the step just taken.

    Returns:
      True: save `step` now (`save(step, state, force=True)`) and stop.

    Raises:
      ValueError: the handler cannot be installed here (not the main thread), or, under
        `jax.distributed`, JAX's preemption service could not hear the signal (turned off,
        or SIGTERM taken by a Python handler).
    """
    sig = self.preemption_signal
    if sig is None:
      return False
    step = int(step)
    synced = jax.distributed.is_initialized()
    if not self._listening:
      if synced:
        _check_jax_hears(sig)
      if not (synced and sig == signal.SIGTERM):
        _listen(sig, self._notice, forward_to_jax=synced)
        weakref.finalize(self, _unlisten, sig, self._notice)
      self._listening = True
    if self._notice.step is None:
      reached = (
        multihost_utils.reached_preemption_sync_point(step) if synced else self._notice.received
      )
      if reached:
        self._notice.step = step
    return self._notice.step == step

  def wait_until_finished(self) -> None:
    """Blocks until every started save is written and committed."""
    self._mgr.wait_until_finished()

  # -- read

  def all_steps(self) -> list[int]:
    """The committed checkpoints, oldest first (never a half-written one)."""
    self._mgr.reload()
    return sorted(self._mgr.all_steps())

  def latest_step(self) -> int | None:
    """The newest committed checkpoint, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def metadata(self, step: int | None = None) -> dict[str, Any]:
    """The checkpoint's metadata: jaxdp version, strategy, dp, layout, stored leaves."""
    step = self._step(step)
    return self._mgr.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[
      _META
    ]

  def data_position(self, step: int | None = None) -> Any:
    """The `data_position` saved with checkpoint `step` (default: the latest)."""
    return self.metadata(step)["data_position"]

  def restore(self, like: TrainState, step: int | None = None) -> TrainState:
    """Reads checkpoint `step` into a state laid out like `like`.

    The checkpoint is read in groups of leaves (about an eighth of the state each), each
    group straight into `like`'s shardings. Into `abstract_state(...)` each leaf is
    allocated as it is read: the restore holds one state. Into a state of `init_state`,
    each group is written into `like`'s own buffers, which are donated: one state's memory
    and an eighth of one, not two states.

    Args:
      like: the state of `abstract_state` (shapes only; the way at scale) or of
        `init_state`, for the *target* mesh, strategy and config. Its values are not used,
        except the padding rows of sharded leaves restored onto another dp (an abstract
        `like`'s are zeros). A state of `init_state` is consumed (its arrays are donated
        to the result): build it for this call. A restore that is refused leaves it as it
        was.
      step: the checkpoint to read; None: the latest.

    Returns:
      A `TrainState` with `like`'s layout, config and shardings, holding the checkpoint's
      params, master params, optimizer state, step counter, model state and key.

    Raises:
      FileNotFoundError: there is no committed checkpoint (at `step`).
      ValueError: the checkpoint does not fit `like` (another model, dtype, optimizer or
        `frozen` set); the message names the leaves only one of them has, or else the
        first leaf that differs. Nothing is read or written, and `like` is left as it
        was. Or `like` was donated (to a train step, or to an earlier restore).
    """
    _check_is_state(like, "like")
    is_abstract(like)
    checks.check_not_donated(like, "CheckpointManager.restore(like)")
    step = self._step(step)
    entries = self.metadata(step)
    # checked on the JSON itself: a newer format's metadata need not read as `Metadata`
    if entries.get("format", 0) > FORMAT:
      raise ValueError(
        f"checkpoint {step} in {self.directory} has format {entries['format']} (jaxdp "
        f"{entries.get('jaxdp_version')}); this jaxdp reads format {FORMAT} or older: "
        "upgrade jaxdp"
      )
    meta = Metadata.from_json(entries)
    if problem := first_mismatch(meta.description, describe(like)):
      raise ValueError(
        f"checkpoint {step} in {self.directory} does not fit `like`: {problem}. Build "
        f"`like` with init_state for the same model and optimizer (saved: "
        f"{meta.strategy}, dp={meta.dp}, jaxdp {meta.jaxdp_version})"
      )

    mesh = like.step.sharding.mesh
    kinds = memory_kinds(like)  # where `like` keeps each leaf: the restored state goes there
    same_flat = same_flat_layout(meta, like)
    targets = targets_of(meta, like, mesh, same_flat)
    if is_abstract(like) and (why := abstract_fits(like, targets, same_flat)):
      raise ValueError(
        f"checkpoint {step} in {self.directory} restores onto other padding than it was "
        f"saved with ({why}; saved: {meta.strategy}, dp={meta.dp}): the padding "
        "rows come from `like`'s values, which an abstract_state has not. Pass "
        "like=jaxdp.init_state(...) for this restore"
      )
    leaves = LikeLeaves(like, mesh, same_flat)
    for group in groups_of(targets):
      abstract = {}
      for target in group:
        # How orbax reads each key (step 1 of [Note: a leaf moved between layouts])
        if target.source is not None:  # its whole flat bucket, split over "data" if it divides
          length = target.source.bucket_length
          divides = length % mesh.shape[DATA] == 0
          shape, spec = (length,), P(DATA) if divides else P()
        elif len(target.shape) != len(target.stored) or not target.logical:  # a scalar
          shape, spec = target.stored, P()
        else:
          shape, spec = target.shape, target.spec
        abstract[target.read] = jax.ShapeDtypeStruct(
          shape, np.dtype(target.stored_dtype), sharding=NamedSharding(mesh, spec)
        )
      stored = self._mgr.restore(
        step,
        args=ocp.args.Composite(
          **{
            _STATE: ocp.args.PyTreeRestore(
              abstract, restore_args=read_args(abstract), partial_restore=True
            )
          }
        ),
      )[_STATE]
      leaves.fill(stored, group)
      del stored  # before the next group is read
    return _in_memory(leaves.state(meta.state_step), kinds)

  def _step(self, step: int | None) -> int:
    steps = self.all_steps()
    if step is None:
      if not steps:
        raise FileNotFoundError(f"no committed checkpoint in {self.directory}")
      return steps[-1]
    if int(step) not in steps:
      raise FileNotFoundError(
        f"no committed checkpoint {step} in {self.directory}; committed: {steps}"
      )
    return int(step)

  # -- lifetime

  def close(self) -> None:
    """Waits for pending saves, releases orbax's resources and gives the preemption signal
    back to the handler it had before `reached_preemption` was first called."""
    if self.preemption_signal is not None:
      _unlisten(self.preemption_signal, self._notice)
    self._mgr.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _in_memory(state: TrainState, kinds: TrainState) -> TrainState:
  """`state` with each leaf that `kinds` (`memory_kinds`) puts in host memory moved there,
  leaf by leaf, each device copy freed once moved, its sharding kept."""
  if not jax.tree.leaves(kinds):
    return state

  def place(x, kind):
    if kind is None or x.sharding.memory_kind == kind:
      return x
    moved = jax.device_put(x, x.sharding.with_memory_kind(kind))
    x.delete()  # the device copy, before the next leaf moves
    return moved

  return jax.tree.map(place, state, kinds, is_leaf=lambda x: x is None)


def _check_is_state(state, name: str):
  if not isinstance(state, TrainState):
    raise TypeError(
      f"{name}: expected the TrainState from jaxdp.init_state, got {type(state).__name__}"
    )


def _check_shards_fit(arrays: dict[str, jax.Array], concurrent_gb: float) -> None:
  """Raises unless each device's shard of every array is below `concurrent_gb` GB: orbax
  writes a shard in one piece, reserving its bytes first."""
  for key, x in arrays.items():
    shard = max((s.data.nbytes for s in x.addressable_shards), default=0)
    if shard >= concurrent_gb * 10**9:
      raise ValueError(
        f"CheckpointManager(save_concurrent_gb={concurrent_gb}): the stored array {key!r} "
        f"{x.shape} has a shard of {shard / 10**9:.3g} GB per device, which is written in "
        f"one piece; give save_concurrent_gb above {shard / 10**9:.3g}"
      )
