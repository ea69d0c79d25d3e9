"""Checkpoints that restore onto any mesh and any strategy, on orbax.

A `TrainState` is laid out for one mesh and one strategy: sharded strategies hold master
params and per-param optimizer state as row shards padded on their shard dim, `no_shard`
holds full trees. What a checkpoint stores is none of that. It stores the *canonical form*,
which depends only on the model and the optimizer:

* `params`: every leaf of the param tree in its own shape and dtype (frozen and integer
  leaves included), as `jaxdp.get_params` returns it;
* `master`: the fp32 (or wider) master copy of each trainable low-precision param, in the
  param's shape. A trainable param whose dtype is already fp32 or wider *is* its master
  (every strategy keeps the two bitwise equal), so it is stored once, under `params`;
* `opt_state`: every optax state leaf, per-param leaves unpadded to the param's shape;
* `model_state` (mutable model state: BatchNorm statistics) as it is (it is replicated), and
  the raw data of the state's key (`rng`), so that a resumed run draws the keys of the
  uninterrupted one;
* the state's step counter and the caller's data position (any JSON value).

So a checkpoint saved with dp=8 under `optim` restores with dp=4 under `optim_grads_params`
or with dp=2 under `no_shard`: restore pads the rows again (taking the padding rows from
`like`, exactly what `init_state` put there) and places every leaf with `like`'s sharding.

Each checkpoint carries metadata (jaxdp version, strategy, dp, layout summary, the path,
shape and dtype of every stored leaf, the optax state structure); `restore` compares it to
`like` first and names the first leaf that does not fit, before any array is read.

Atomicity is orbax's: a step is written into `<step>.orbax-checkpoint-tmp` and renamed to
`<step>` only after every file (arrays and metadata) is written, and only renamed steps are
ever listed or restored, so a process killed mid-save leaves the previous checkpoint as the
latest. A manager that opens the directory removes leftover temporary directories in the
background (at the latest before its first save).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import FixedIntervalPolicy
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdp._src import __version__
from jaxdp._src.distributed_optimizer import fused_state, per_leaf_state
from jaxdp._src.layout import master_dtype, sharded_shape
from jaxdp._src.mesh import constrain
from jaxdp._src.state import TrainState, leaves_of, match_opt_leaf
from jaxdp._src.train import whole_params

PyTree = Any

FORMAT = 1
"""Version of the stored layout; `restore` refuses checkpoints written by a newer format."""

_STATE, _META = "state", "meta"


# ----------------------------------------------------------------------------- shapes


def _sharded(state: TrainState) -> bool:
  return state.config.data_parallel_sharding_strategy != "no_shard"


def _stores_master(dtype) -> bool:
  """Is a trainable param of this dtype stored with a separate master copy."""
  return master_dtype(dtype) != np.dtype(dtype)


def _stored_masters(state: TrainState) -> list[int]:
  """Trainable leaves stored with a separate master copy (low-precision params)."""
  layout = state.layout
  return [
    i
    for i, (t, dtype) in enumerate(zip(layout.trainable, layout.dtypes))
    if t and _stores_master(dtype)
  ]


def _opt_forms(state: TrainState) -> list[tuple[tuple[int, ...], int]]:
  """`(full shape, padded axis)` of every optax state leaf, in `jax.tree.leaves` order.

  Under a sharded strategy a per-param leaf has the param's padded shape (`sharded_shape`).
  It is matched to its param by `match_opt_leaf` (its key path ends with the param's path,
  `[0].mu['w']` for `['w']`, and it has the param's padded shape). A leaf that matches no
  param is stored as it is (a dp change then shows up as a shape mismatch, never as a wrong
  value).
  """
  keyed = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
  shapes = [tuple(int(d) for d in np.shape(x)) for _, x in keyed]
  if not _sharded(state):
    return [(shape, 0) for shape in shapes]
  layout = state.layout
  padded = {i: sharded_shape(layout, i) for i, t in enumerate(layout.trainable) if t}
  seen = {i: pad for i, (pad, _) in padded.items()}
  out = []
  for (path, _), shape in zip(keyed, shapes):
    i = match_opt_leaf(path, shape, layout.paths, seen).param
    out.append((shape, 0) if i is None else (layout.shapes[i], padded[i][1]))
  return out


# ----------------------------------------------------------------------------- description


def _describe(state: TrainState) -> dict[str, Any]:
  """What a state's canonical form holds: the JSON metadata a checkpoint is checked by."""
  if state.fused:
    state = jax.eval_shape(functools.partial(per_leaf_state, mesh=state.step.sharding.mesh), state)
  layout = state.layout
  trainable = layout.trainable
  keyed = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
  return {
    "params": [
      [path, list(shape), dtype.name, t]
      for path, shape, dtype, t in zip(layout.paths, layout.shapes, layout.dtypes, trainable)
    ],
    "master": _stored_masters(state),
    "opt_state": [
      [jax.tree_util.keystr(path), list(shape), np.dtype(x.dtype).name]
      for (path, x), (shape, _) in zip(keyed, _opt_forms(state))
    ],
    "opt_state_structure": str(jax.tree.structure(state.opt_state)),
    "model_state": [
      [jax.tree_util.keystr(path), list(np.shape(x)), np.dtype(x.dtype).name]
      for path, x in jax.tree_util.tree_flatten_with_path(state.model_state)[0]
    ],
    "rng": state.rng is not None,
  }


def _first_mismatch(saved: dict[str, Any], want: dict[str, Any]) -> str | None:
  """A sentence naming the first leaf where a checkpoint and `like` disagree, or None."""

  def leaf(kind, got, exp):
    for a, b in zip(got, exp):
      if a[0] != b[0]:
        return f"{kind}{b[0]}: `like` has this leaf where the checkpoint has {kind}{a[0]}"
      for field, x, y in (("shape", a[1], b[1]), ("dtype", a[2], b[2])):
        if x != y:
          x, y = (tuple(x), tuple(y)) if field == "shape" else (x, y)
          return f"{kind}{a[0]}: {field} {x} in the checkpoint, {y} in `like`"
    if len(got) != len(exp):
      longer, where = (got, "the checkpoint") if len(got) > len(exp) else (exp, "`like`")
      return (
        f"{kind}{longer[min(len(got), len(exp))][0]}: only {where} has this leaf "
        f"({len(got)} {kind} leaves in the checkpoint, {len(exp)} in `like`)"
      )
    return None

  if msg := leaf("params", saved["params"], want["params"]):
    return msg
  for a, b in zip(saved["params"], want["params"]):
    if a[3] != b[3]:
      return (
        f"params{a[0]}: {'trainable' if a[3] else 'frozen'} in the checkpoint, "
        f"{'trainable' if b[3] else 'frozen'} in `like`; use the same `frozen`"
      )
  if msg := leaf("opt_state", saved["opt_state"], want["opt_state"]):
    return msg + " (another optimizer?)"
  if saved["opt_state_structure"] != want["opt_state_structure"]:
    return (
      "the optimizer state has the structure "
      f"{saved['opt_state_structure']} in the checkpoint but "
      f"{want['opt_state_structure']} in `like` (another optimizer?)"
    )
  if msg := leaf("model_state", saved.get("model_state", []), want["model_state"]):
    return msg + " (init_state(..., model_state=) for the same model?)"
  if saved.get("rng", False) != want["rng"]:
    return (
      "the checkpoint holds a key (init_state(..., rng=)) and `like` does not"
      if want["rng"] is False
      else "`like` holds a key (init_state(..., rng=)) and the "
      "checkpoint does not; build `like` without rng="
    )
  return None


# ----------------------------------------------------------------------------- conversion


def _rows(shape: tuple[int, ...], axis: int) -> int:
  return shape[axis] if len(shape) > axis else 1


def _unpad(x: jax.Array, shape: tuple[int, ...], axis: int, mesh) -> jax.Array:
  """Traced: a padded row-shard leaf back in its full shape, replicated (the rows do not
  divide)."""
  rows = (slice(None),) * axis + (slice(0, _rows(shape, axis)),)
  return constrain(constrain(x, mesh, P())[rows].reshape(shape), mesh, P())


def _canonical(state: TrainState) -> dict[str, jax.Array]:
  """The arrays a checkpoint stores, keyed `params_<i>`, `master_<i>`, `opt_<j>`."""
  # One program for the whole state, never eager per-leaf gathers: with several processes
  # each eager op on a global array is a program of its own, and dozens in flight hung
  # 2-process jobs on a busy machine (docs/design.md, "One program per call").
  return _canonical_program(state, state.step.sharding.mesh)


@functools.partial(jax.jit, static_argnums=1)
def _canonical_program(state: TrainState, mesh) -> dict[str, jax.Array]:
  state = per_leaf_state(state, mesh)
  layout = state.layout
  out = {f"params_{i}": x for i, x in enumerate(leaves_of(whole_params(state, mesh)))}
  masters = leaves_of(state.master)
  for i in _stored_masters(state):
    m, shape = masters[i], layout.shapes[i]
    out[f"master_{i}"] = (
      m if tuple(m.shape) == shape else _unpad(m, shape, sharded_shape(layout, i)[1], mesh)
    )
  for j, (x, (shape, axis)) in enumerate(zip(jax.tree.leaves(state.opt_state), _opt_forms(state))):
    out[f"opt_{j}"] = x if tuple(x.shape) == shape else _unpad(x, shape, axis, mesh)
  for j, x in enumerate(jax.tree.leaves(state.model_state)):
    out[f"model_state_{j}"] = x
  if state.rng is not None:
    out["rng"] = state.rng
  return out


def get_opt_state(state: TrainState) -> PyTree:
  """The optax state of `state` as one device would hold it: per-param leaves in their
  param's shape (the sharded strategies' padding rows dropped), the rest as they are.

  What optax helpers that read the state need, on every strategy: `schedule_free`'s
  `optax.contrib.schedule_free_eval_params(jaxdp.get_opt_state(state),
  jaxdp.get_params(state))`, `inject_hyperparams`' `.hyperparams`. The unpadded leaves are
  replicated copies (gathered for the view); the state itself is not changed.

  Examples:
    >>> import jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
    >>> state = jaxdp.init_state({"w": jnp.ones((30,))}, optax.adam(1e-3), mesh, config)
    >>> jax.tree.map(jnp.shape, state.opt_state[0].mu)  # fused: a flat array per bucket
    {'float32/bucket0': (128,)}
    >>> jax.tree.map(jnp.shape, jaxdp.get_opt_state(state)[0].mu)
    {'w': (30,)}
  """
  return _opt_state_program(state, state.step.sharding.mesh)


@functools.partial(jax.jit, static_argnums=1)
def _opt_state_program(state: TrainState, mesh) -> PyTree:
  """One program (see `_canonical`); copies, so the view outlives the next donated step."""
  state = per_leaf_state(state, mesh)
  leaves, treedef = jax.tree.flatten(state.opt_state)
  return jax.tree.unflatten(
    treedef,
    [
      jnp.copy(x) if tuple(x.shape) == tuple(shape) else _unpad(x, shape, axis, mesh)
      for x, (shape, axis) in zip(leaves, _opt_forms(state))
    ],
  )


def _pad_from(full: jax.Array, like: jax.Array, sharding: NamedSharding, axis: int) -> jax.Array:
  """Traced: `full` in `like`'s padded shape (rows padded on `axis`), on `sharding`.

  The padding rows are `like`'s own: what `init_state` put there (zeros, or e.g. Adagrad's
  initial accumulator, which must not become 0).
  """
  if tuple(full.shape) != tuple(like.shape):
    n = _rows(tuple(full.shape), axis)
    head = full.reshape(*like.shape[:axis], n, *like.shape[axis + 1 :]).astype(like.dtype)
    tail = constrain(like, sharding.mesh, P())[(slice(None),) * axis + (slice(n, None),)]
    full = jnp.concatenate([head, tail], axis=axis)
  return constrain(full.astype(like.dtype), sharding.mesh, sharding.spec)


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

  Examples:
    >>> import tempfile, jax, jax.numpy as jnp, optax, jaxdp
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> config, tx = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim"), optax.adam(1e-3)
    >>> state = jaxdp.init_state({"w": jnp.ones((5, 3))}, tx, mesh, config)
    >>> mgr = jaxdp.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2)
    >>> mgr.save(0, state, data_position=0)
    True
    >>> mgr.wait_until_finished()
    >>> small = jax.sharding.Mesh(jax.devices()[:2], ("data",))
    >>> like = jaxdp.init_state({"w": jnp.zeros((5, 3))}, tx, small, jaxdp.DDPConfig())
    >>> jaxdp.get_params(mgr.restore(like))["w"].sum()
    Array(15., dtype=float32)
    >>> mgr.data_position()
    0
  """

  def __init__(self, directory, *, max_to_keep: int | None = None, save_interval_steps: int = 1):
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
    self.directory = directory
    self._mgr = ocp.CheckpointManager(
      directory,
      item_names=(_STATE, _META),
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
    """
    _check_is_state(state, "state")
    step = int(step)
    if not force and not self._mgr.should_save(step):
      return False
    meta = {
      "format": FORMAT,
      "jaxdp_version": __version__,
      "state_step": int(jax.device_get(state.step)),
      "data_position": data_position,
      "strategy": state.config.data_parallel_sharding_strategy,
      "dp": state.layout.dp,
      "mesh_shape": dict(state.mesh_shape),
      "layout": state.layout.summary(),
      **_describe(state),
    }
    arrays = _canonical(state)
    return self._mgr.save(
      step,
      args=ocp.args.Composite(
        **{_STATE: ocp.args.StandardSave(arrays), _META: ocp.args.JsonSave(meta)}
      ),
      force=force,
    )

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

    Args:
      like: a state from `init_state` for the *target* mesh, strategy and config (its
        values are not used, except the padding rows of sharded leaves).
      step: the checkpoint to read; None: the latest.

    Returns:
      A `TrainState` with `like`'s layout, config and shardings, holding the checkpoint's
      params, master params, optimizer state, step counter, model state and key.

    Raises:
      FileNotFoundError: there is no committed checkpoint (at `step`).
      ValueError: the checkpoint does not fit `like` (another model, dtype, optimizer or
        `frozen` set); the message names the first leaf that differs. Nothing is read.
    """
    _check_is_state(like, "like")
    step = self._step(step)
    meta = self.metadata(step)
    if meta.get("format", 0) > FORMAT:
      raise ValueError(
        f"checkpoint {step} in {self.directory} has format {meta['format']} (jaxdp "
        f"{meta.get('jaxdp_version')}); this jaxdp reads format {FORMAT} or older: "
        "upgrade jaxdp"
      )
    if problem := _first_mismatch(meta, _describe(like)):
      raise ValueError(
        f"checkpoint {step} in {self.directory} does not fit `like`: {problem}. Build "
        f"`like` with init_state for the same model and optimizer (saved: "
        f"{meta['strategy']}, dp={meta['dp']}, jaxdp {meta['jaxdp_version']})"
      )

    given, mesh = like, like.step.sharding.mesh
    if like.fused:  # restored in the per-leaf form, then made flat again
      like = jax.jit(per_leaf_state, static_argnums=1)(like, mesh)
    layout = like.layout
    params, masters = leaves_of(like.params), leaves_of(like.master)
    opt = jax.tree.leaves(like.opt_state)
    replicated = NamedSharding(like.step.sharding.mesh, P())

    def place(shape, target):
      """Read a stored leaf straight into `target`'s sharding when no padding is in the way."""
      if target is not None and tuple(target.shape) == tuple(shape):
        return target.sharding
      return replicated

    abstract = {}
    for i, (path, shape, dtype, _) in enumerate(meta["params"]):
      target = params[i] if params[i] is not None else masters[i]
      abstract[f"params_{i}"] = (shape, dtype, place(shape, target))
    for i in meta["master"]:
      abstract[f"master_{i}"] = (
        meta["params"][i][1],
        master_dtype(meta["params"][i][2]).name,
        place(meta["params"][i][1], masters[i]),
      )
    for j, (path, shape, dtype) in enumerate(meta["opt_state"]):
      abstract[f"opt_{j}"] = (shape, dtype, place(shape, opt[j]))
    for j, (path, shape, dtype) in enumerate(meta.get("model_state", [])):
      abstract[f"model_state_{j}"] = (shape, dtype, replicated)
    if meta.get("rng"):
      abstract["rng"] = ((2,), "uint32", replicated)
    abstract = {
      k: jax.ShapeDtypeStruct(tuple(s), np.dtype(d), sharding=sh)
      for k, (s, d, sh) in abstract.items()
    }
    stored = self._mgr.restore(
      step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(abstract)})
    )[_STATE]

    stored_master = set(meta["master"])
    axes = [sharded_shape(layout, i)[1] for i in range(len(layout.shapes))]
    param_shardings = [None if p is None else p.sharding for p in params]
    master_shardings = [None if m is None else m.sharding for m in masters]
    opt_forms, opt_shardings = _opt_forms(like), [x.sharding for x in opt]

    def build(stored, like):
      new_params, new_master = [], []
      for i, (p, m) in enumerate(zip(leaves_of(like.params), leaves_of(like.master))):
        new_params.append(
          None if p is None else _pad_from(stored[f"params_{i}"], p, param_shardings[i], axes[i])
        )
        full = stored[f"master_{i}" if i in stored_master else f"params_{i}"]
        new_master.append(None if m is None else _pad_from(full, m, master_shardings[i], axes[i]))
      opt_leaves, treedef = jax.tree.flatten(like.opt_state)
      new_opt = [
        _pad_from(stored[f"opt_{j}"], x, opt_shardings[j], opt_forms[j][1])
        for j, x in enumerate(opt_leaves)
      ]
      ms_leaves, ms_def = jax.tree.flatten(like.model_state)
      return dataclasses.replace(
        like,
        step=jnp.asarray(meta["state_step"], like.step.dtype),
        params=jax.tree.unflatten(layout.treedef, new_params),
        master=jax.tree.unflatten(layout.treedef, new_master),
        opt_state=jax.tree.unflatten(treedef, new_opt),
        model_state=jax.tree.unflatten(
          ms_def, [stored[f"model_state_{j}"] for j in range(len(ms_leaves))]
        ),
        rng=stored["rng"] if like.rng is not None else None,
      )

    shardings = jax.tree.map(lambda x: x.sharding, like)
    out = jax.jit(build, out_shardings=shardings)(stored, like)
    if not given.fused:
      return out
    return jax.jit(fused_state, static_argnums=1)(out, mesh, given)

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
    """Waits for pending saves and releases orbax's resources."""
    self._mgr.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _check_is_state(state, name: str):
  if not isinstance(state, TrainState):
    raise TypeError(
      f"{name}: expected the TrainState from jaxdp.init_state, got {type(state).__name__}"
    )
