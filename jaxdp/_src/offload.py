"""The optimizer update of an offloaded state, streamed through the device a piece at a time.

With `DDPConfig(optimizer_cpu_offload=True)` the master params and the optimizer state live
in host memory between steps. Copying all of them to the device for the update, as the
plain program does, puts the whole state back on the device at the update (the peak the
offload was for), and XLA starts those copies as early as it can, under the backward,
where they add to its peak too. `apply_streamed` runs the update instead as Megatron's
CPU-offloaded optimizer and DeepSpeed's ZeRO-Offload stream it: a piece at a time, each
piece copied in, updated and copied back before the next one is copied in.

How, on the update's jaxpr (`update(grads, carried) -> carried'`, traced once):

* **Groups.** The offloaded leaves an equation reads together are one group (AdamW: a
  param's master and its two moments; an update that mixes leaves, such as a norm over
  all params, makes one group of them all). The groups run one after another, each one's
  first copy waiting (an optimization barrier) for the group two before to be written
  back: one group copies in while the one before copies out.
* **Scalars first.** What does not read the offloaded state and is a scalar (the global
  grad norm a clip divides by, the step count, the learning rate) is computed first, once,
  with whatever reads only device leaves.
* **Pieces.** A group whose equations are elementwise on one shape (AdamW, Adam, SGD with
  momentum, Lion, clipping by a global norm) is split along a dim its leaves do not shard
  (a stacked layer axis: whole layers), in pieces of about `PIECE_BYTES` per device. Each
  piece of each offloaded leaf is read from the leaf's buffer after the piece before was
  written back into it (in place: the state is donated), so each copy in waits for the
  copy out before it and at most one piece per group is on the device. A group that is
  not elementwise, or has no unsharded dim, is updated whole, still after the group
  before.

The arithmetic is the update's own equations on each element, so the result is the plain
update's, bit for bit where the compiler fuses them the same (tests/test_offload.py). The
spike guards' select between the state before and after the update (`checks.guard_step`)
is streamed the same way: one more elementwise update, of two states.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax
from jax.extend import core as jcore
from jax.extend.core import primitives as prims
from jax.sharding import PartitionSpec as P

from jaxdp._src import loop
from jaxdp._src.jaxprs import bind, inline_jits, read

PyTree = Any

PIECE_BYTES = 512 * 2**20
"""Per device, the offloaded bytes (all of a group's leaves) one piece of a group brings to
the device: large enough that each copy runs near the host link's bandwidth, small next to
the device's memory."""

# Equations that act on each element alone (with scalars broadcast), by primitive name: a
# group made of these can be split into pieces.
ELEMENTWISE = frozenset(
  """abs add and atan2 cbrt ceil clamp convert_element_type copy copy_p cos div eq erf exp
  exp2 expm1 floor ge gt integer_pow is_finite le log log1p logistic lt max min mul ne neg
  nextafter not or pow reduce_precision rem round rsqrt select_n sign sin sqrt square sub
  tan tanh xor""".split()
)


def on_host(x) -> bool:
  """Is traced `x` in host memory?"""
  return x is not None and jax.typeof(x).memory_space == jax.memory.Space.Host


def update_offloaded(tx, grads, opt_state, opt_params, mesh, specs) -> tuple[PyTree, PyTree]:
  """`(new opt_params, new opt_state)`: `tx`'s update applied to `opt_params` (the master),
  as `loop.tx_update` and `optax.apply_updates` make them, the offloaded leaves of both
  streamed through the device (`apply_streamed`). `specs`: `(opt_state, opt_params)`'s
  `PartitionSpec`s."""
  loop.check_optimizer(tx, opt_state, opt_params)

  def update(grads, carried):
    opt_state, params = carried
    # cast here, where each piece casts its own rows (bf16 grads: no fp32 copy of them all)
    grads = loop.grads_as_params(grads, params)
    updates, opt_state = loop.call_update(tx, grads, opt_state, params)
    return opt_state, optax.apply_updates(params, updates)

  def streamed(grads, opt_state, params):
    return apply_streamed(update, grads, (opt_state, params), (None, specs), dict(mesh.shape))

  like = (opt_state, opt_params)
  opt_state, opt_params = loop.on_auto_axes(mesh, streamed, (grads, *like), like)
  return opt_params, opt_state


def apply_streamed(
  update: Callable,
  inputs: PyTree,
  carried: PyTree,
  specs: tuple[PyTree, PyTree],
  axis_sizes: dict,
) -> PyTree:
  """`update(inputs, carried)` (a tree like `carried`: e.g. the new optimizer state and
  params), the offloaded leaves (`on_host`) of both streamed through the device (see the
  module docstring); the new leaves of `carried`'s offloaded ones come back in host memory,
  written into their buffers, the others on the device.

  `specs`: a `PartitionSpec` per leaf of `inputs` and of `carried` (None where a leaf is
  None, or where `inputs` has no offloaded leaf); `axis_sizes`: the mesh's axis sizes, to
  count the bytes of a piece per device.
  """
  flat_in, in_def = jax.tree.flatten(inputs)
  flat, treedef = jax.tree.flatten(carried)
  if not any(on_host(x) for x in (*flat_in, *flat)):
    return update(inputs, carried)
  in_specs = [None] * len(flat_in) if specs[0] is None else in_def.flatten_up_to(specs[0])
  flat_specs = [*in_specs, *treedef.flatten_up_to(specs[1])]
  fetch = lambda leaves: [
    jax.device_put(x, jax.memory.Space.Device) if on_host(x) else x for x in leaves
  ]

  def body(in_leaves, carried_leaves):
    new = update(
      jax.tree.unflatten(in_def, fetch(in_leaves)),
      jax.tree.unflatten(treedef, fetch(carried_leaves)),
    )
    return treedef.flatten_up_to(new)

  closed = jax.make_jaxpr(body)(flat_in, flat)
  args = [*flat_in, *flat]
  closed = jax.make_jaxpr(lambda *a: inline_jits(closed.jaxpr, closed.consts, a))(*args)
  program = _Program.of(closed.jaxpr, len(flat_in), [on_host(x) for x in args])
  out = program.run(closed.consts, args, flat_specs, axis_sizes)
  return jax.tree.unflatten(treedef, out)


@dataclasses.dataclass(frozen=True)
class _Group:
  """Offloaded leaves an equation reads together, and what they make."""

  leaves: tuple[int, ...]  # positions among the update's arguments (inputs, then carried)
  outs: tuple[int, ...]  # the outputs (positions in `carried`) computed from them
  eqns: tuple  # the equations those outputs need that the scalars did not compute
  elementwise: bool  # every equation acts on each element alone: it can be split


@dataclasses.dataclass(frozen=True)
class _Program:
  """The update's jaxpr cut into the scalars and the groups (see the module docstring).
  Its arguments are the inputs' leaves, then the carried ones; output `k` is carried leaf
  `k`'s new value, written into argument `n_in + k`'s buffer."""

  jaxpr: Any
  n_in: int
  host: tuple[bool, ...]  # per argument: offloaded
  first: tuple  # the equations run before the groups
  groups: tuple[_Group, ...]

  @staticmethod
  def of(jaxpr, n_in: int, host: Sequence[bool]) -> _Program:
    leaf_of = {v: i for i, v in enumerate(jaxpr.invars) if host[i]}

    # What offloaded leaves each var depends on, and the groups: leaves read together.
    deps: dict = {v: frozenset([i]) for v, i in leaf_of.items()}
    parent = {i: i for i in leaf_of.values()}

    def root(i):
      while parent[i] != i:
        i = parent[i]
      return i

    for eqn in jaxpr.eqns:
      d = frozenset().union(*(deps.get(v, frozenset()) for v in _vars(eqn.invars)))
      if d:
        joined = root(min(d))
        for i in d:
          parent[root(i)] = joined
      for v in eqn.outvars:
        deps[v] = d
    outvars = jaxpr.outvars
    out_deps = [
      deps.get(v, frozenset()) if isinstance(v, jcore.Var) else frozenset() for v in outvars
    ]

    # The scalars and the outputs that read no offloaded leaf: run first.
    needed_first = {v for v, d in zip(outvars, out_deps) if not d and isinstance(v, jcore.Var)}
    by_group: dict[int, list[int]] = {}
    for k, d in enumerate(out_deps):
      if d:
        by_group.setdefault(root(min(d)), []).append(k)
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    cones = {g: _cone([outvars[k] for k in ks], producer) for g, ks in by_group.items()}
    for cone in cones.values():
      for eqn in cone:
        needed_first.update(
          v for v in _vars(eqn.invars) if not deps.get(v) and not v.aval.shape and v in producer
        )
    first_eqns = _cone(list(needed_first), producer)
    first_ids = {id(e) for e in first_eqns}

    groups = []
    for g, ks in sorted(by_group.items(), key=lambda item: min(item[1])):
      leaves = tuple(sorted(i for i in leaf_of.values() if root(i) == g))
      eqns = tuple(e for e in cones[g] if id(e) not in first_ids)
      shape = tuple(jaxpr.invars[leaves[0]].aval.shape)
      elementwise = all(_elementwise(e, shape, deps) for e in eqns) and all(
        tuple(outvars[k].aval.shape) == shape for k in ks
      )
      groups.append(_Group(leaves, tuple(ks), eqns, elementwise))
    return _Program(jaxpr, n_in, tuple(host), tuple(first_eqns), tuple(groups))

  def run(self, consts, args, specs, axis_sizes) -> list:
    jaxpr, n = self.jaxpr, self.n_in
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    _eval(self.first, env)
    outs: dict[int, Any] = {}
    # What each group's first copy waits for: the group two before, written back. One group
    # copies in while the one before copies out (the link's two directions, at once).
    written_back: list = [None, None]
    for group in self.groups:
      after = written_back[0]
      current = {i: args[i] for i in group.leaves}  # argument position -> its buffer now
      for k in group.outs:  # an output written in place into its argument's buffer
        current.setdefault(n + k, args[n + k])
      if after is not None:
        current, _ = jax.lax.optimization_barrier((current, after))
      axis = _split_axis(group, jaxpr.invars, n, specs) if group.elementwise else None
      if axis is None:
        written = self._whole(group, env, current)
      else:
        written = self._pieces(group, env, current, axis, specs, axis_sizes)
      outs.update(written)
      written_back = [written_back[1], [written[k] for k in group.outs]]
    return [outs[k] if k in outs else read(env, v) for k, v in enumerate(jaxpr.outvars)]

  def _whole(self, group: _Group, env: dict, current: dict) -> dict:
    local = dict(env)
    for i in group.leaves:
      local[self.jaxpr.invars[i]] = current[i]
    _eval(group.eqns, local)
    return {k: self._placed(k, read(local, self.jaxpr.outvars[k])) for k in group.outs}

  def _pieces(self, group: _Group, env, current: dict, axis: int, specs, axis_sizes) -> dict:
    invars, n = self.jaxpr.invars, self.n_in
    shape = invars[group.leaves[0]].aval.shape
    per_device = sum(_bytes_per_device(invars[i].aval, specs[i], axis_sizes) for i in group.leaves)
    pieces = max(1, min(shape[axis], math.ceil(per_device / PIECE_BYTES)))
    sizes = [len(p) for p in np.array_split(np.arange(shape[axis]), pieces)]
    bounds = np.cumsum([0, *sizes]).tolist()
    reads = {v for e in group.eqns for v in _vars(e.invars)} | {
      v for k in group.outs if isinstance(v := self.jaxpr.outvars[k], jcore.Var)
    }
    made = _defined(group.eqns)
    position = {v: i for i, v in enumerate(invars)}
    # what a piece reads whole-shaped and does not make: offloaded leaves and outputs'
    # arguments (from `current`, in place), grads and values the first equations made
    sliced = [v for v in reads if v not in made and v.aval.shape == shape]
    scalars = {v: env[v] for v in reads if v not in made and not v.aval.shape}
    for start, stop in zip(bounds[:-1], bounds[1:]):
      local = dict(scalars)
      for v in sliced:
        i = position.get(v)
        value = current[i] if i in current else env[v]
        local[v] = jax.lax.slice_in_dim(value, start, stop, axis=axis)
      _eval(group.eqns, local, piece_shape=_resized(shape, axis, stop - start))
      for k in group.outs:
        y = self._placed(k, read(local, self.jaxpr.outvars[k]))
        current[n + k] = jax.lax.dynamic_update_slice_in_dim(current[n + k], y, start, axis=axis)
    return {k: current[n + k] for k in group.outs}

  def _placed(self, k: int, y):
    """Output `k` where its argument lives: host memory for an offloaded leaf."""
    return jax.device_put(y, jax.memory.Space.Host) if self.host[self.n_in + k] else y


def _split_axis(group: _Group, invars, n_in: int, specs) -> int | None:
  """The first dim of the group's shape (of two or more) that no leaf shards, or None."""
  shape = invars[group.leaves[0]].aval.shape
  for axis, size in enumerate(shape):
    if size < 2:
      continue
    if all(_unsharded(specs[i], axis) for i in (*group.leaves, *(n_in + k for k in group.outs))):
      return axis
  return None


def _unsharded(spec, axis: int) -> bool:
  if spec is None:
    return True
  entries = tuple(spec) if isinstance(spec, P) else ()
  return axis >= len(entries) or entries[axis] is None


def _bytes_per_device(aval, spec, axis_sizes) -> float:
  shards = 1
  for entry in tuple(spec) if isinstance(spec, P) else ():
    for name in (entry,) if isinstance(entry, str) else (entry or ()):
      shards *= axis_sizes.get(name, 1)
  return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize / shards


def _resized(shape, axis: int, size: int) -> tuple:
  return (*shape[:axis], size, *shape[axis + 1 :])


def _elementwise(eqn, shape, deps) -> bool:
  """Does `eqn` act on each element of `shape` alone, its scalars read from the first
  equations?"""
  ins, outs = list(_vars(eqn.invars)), list(eqn.outvars)
  if any(v.aval.shape not in ((), shape) for v in ins + outs):
    return False
  if any(not v.aval.shape and deps.get(v) for v in ins):  # a scalar of the offloaded state
    return False
  if eqn.primitive is prims.device_put_p:
    return True
  if eqn.primitive is prims.broadcast_in_dim_p:
    return not eqn.invars[0].aval.shape and tuple(eqn.params["shape"]) == shape
  return eqn.primitive.name in ELEMENTWISE and all(v.aval.shape == shape for v in outs)


def _vars(atoms):
  return (v for v in atoms if isinstance(v, jcore.Var))


def _defined(eqns) -> set:
  return {v for e in eqns for v in e.outvars}


def _cone(targets, producer) -> list:
  """The equations `targets` are computed by, in program order."""
  seen, stack = {}, [v for v in targets if v in producer]
  while stack:
    eqn = producer[stack.pop()]
    if id(eqn) in seen:
      continue
    seen[id(eqn)] = eqn
    stack.extend(v for v in _vars(eqn.invars) if v in producer)
  order = {id(e): n for n, e in enumerate(producer.values())}
  return sorted(seen.values(), key=lambda e: order[id(e)])


def _eval(eqns, env: dict, piece_shape=None) -> None:
  """Runs `eqns` on `env`; with `piece_shape`, a broadcast makes a piece's shape."""
  for eqn in eqns:
    invals = [read(env, v) for v in eqn.invars]
    if piece_shape is not None and eqn.primitive is prims.broadcast_in_dim_p:
      outs = bind(eqn, invals, shape=piece_shape, sharding=None)
    else:
      outs = bind(eqn, invals)
    env.update(zip(eqn.outvars, outs))
