"""A scanned unit: a `lax.scan` whose `xs` are the leaves of stacked units, run as one
`custom_vjp` over their layer shards `(layers, rows / dp, ...)` (`scan_unit`).

The forward loop gathers each layer, runs the scan's body on it and stacks the residuals
that depend on the carry or the other xs ([Note: saved and replayed residuals]); the
backward loop gathers each layer again, replays its vjp on those residuals and
reduce-scatters its gradients. Both loops run one layer ahead ([Note: a layer gathered one
iteration ahead]), and the forward gathers its first layer in two parts ([Note: the first
layer in two parts]). The consts and the shards are saved once, not per layer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.extend.core import primitives as prims

from jaxdp._src import fsdp_unit, ordering
from jaxdp._src.fsdp_unit import UnitIO, ct_or_none, stand_in, stand_ins
from jaxdp._src.jaxprs import (
  avals,
  eval_jaxpr,
  inner_jaxpr,
  is_float,
  reads,
  residual_masks,
  scan_params,
  swap,
  traced_avals,
)


def scan_unit(
  eqn,
  units: Sequence[UnitIO],
  operands: list,
  shard_pos: dict,
  shards: dict,
  tokens: list,
  *,
  reshard: bool,
  keep_last: bool,
):
  """A `lax.scan` over the layers of stacked `units`, as one `custom_vjp` over their layer
  shards (see the module docstring). `operands` are the scan's operands with the stacked
  params' `xs` left out (None); `shard_pos` maps an xs position to its leaf."""
  params = scan_params(eqn)
  n_consts, n_carry = params.consts, params.carry
  consts = operands[:n_consts]
  init = operands[n_consts : n_consts + n_carry]
  xs = operands[n_consts + n_carry :]
  other = [x for j, x in enumerate(xs) if j not in shard_pos]
  # [Note: trainable and frozen shards], stacked over the layers
  trainable = {i: shards[i] for u in units for i in u.trainable}
  frozen = {i: shards[i] for u in units for i in u.frozen}
  layer = _ScanLayer(params.body, n_carry, len(xs), shard_pos, tuple(units))
  init_avals = avals(init)
  other_avals = [jax.typeof(x).update(shape=jax.typeof(x).shape[1:]) for x in other]

  # What each iteration saves: the residuals that depend on the carry or the other xs
  # (None: all), from one trace of the body's vjp on one layer's types ([Note: saved and
  # replayed residuals]).
  keep = None
  if reshard:
    layer_0 = lambda tree: jax.tree.map(lambda a: a[0], tree)
    full = stand_ins(traced_avals(layer.gather, layer_0(trainable), layer_0(frozen)))
    args = (consts, stand_ins(init_avals), stand_ins(other_avals), full)
    (keep,) = residual_masks(layer, args, (False, True, True, False))

  scan = _ScanUnit(
    layer=layer,
    length=params.length,
    reverse=params.reverse,
    token_avals=avals(tokens),
    init_avals=init_avals,
    other_avals=other_avals,
    keep=keep,
    keep_last=keep_last,
  )
  call = jax.custom_vjp(scan.call)
  call.defvjp(scan.fwd, scan.bwd)
  (carry, ys), tokens = call(consts, init, other, trainable, frozen, tokens)
  return list(carry) + list(ys), tokens


@dataclasses.dataclass(frozen=True, eq=False)
class _ScanLayer:
  """One iteration of a scanned unit's scan as `(consts, carry, other xs, full) -> (carry,
  ys)`: the scan's body with the layer's params `full` ({leaf: whole param}) in place of the
  stacked xs; `gather` gathers them from the layer's shards."""

  body: jcore.ClosedJaxpr
  n_carry: int
  n_xs: int
  shard_pos: Mapping[int, int]  # xs position -> leaf
  units: tuple[UnitIO, ...]

  @functools.cached_property
  def params(self) -> dict:
    """{leaf: the body's input var that takes its gathered layer}."""
    xs = self.body.jaxpr.invars[len(self.body.jaxpr.invars) - self.n_xs :]
    return {i: xs[j] for j, i in self.shard_pos.items()}

  @functools.cached_property
  def first_uses(self) -> dict[int, float]:
    """{leaf: where the layer's forward first uses it, as a fraction of its equations}."""
    order = _first_uses(self.body.jaxpr)
    return {i: order.get(v, 1.0) for i, v in self.params.items()}

  @functools.cached_property
  def head(self) -> frozenset[int]:
    """The leaves the layer's forward uses before its largest param (the first used of the
    largest): gathered first where nothing before the layer hides its gather ([Note: the
    first layer in two parts]). Never every leaf: the largest is not among them."""
    uses = self.first_uses
    largest = min(uses, key=lambda i: (-self.params[i].aval.size, uses[i]))
    return frozenset(i for i, at in uses.items() if at < uses[largest])

  @functools.cached_property
  def late(self) -> frozenset[int]:
    """The trainable leaves whose gradients the layer's backward computes late: those the
    forward first uses in its first half (by equation), whose gradients come in the
    backward's second half, with little of it left to hide their reduce-scatters under."""
    # (a unit that reduce-scatters a layer as one bucket, ZeRO's stack, keeps it whole)
    trainable = {
      i for u in self.units if u.collectives.scatter_each for i in u.trainable if i not in u.apart
    }
    return frozenset(i for i, at in self.first_uses.items() if i in trainable and at < 0.5)

  def __call__(self, consts, carry, x_other, full):
    # the body's xs in order: a stacked param's place takes its gathered layer
    other = iter(x_other)
    x = [full[self.shard_pos[j]] if j in self.shard_pos else next(other) for j in range(self.n_xs)]
    args = [*consts, *carry, *x]
    narrowed = [jnp.dtype(a.dtype) != v.aval.dtype for a, v in zip(args, self.body.jaxpr.invars)]
    outs = eval_jaxpr(self.body.jaxpr, self.body.consts, args, narrowed)
    return outs[: self.n_carry], outs[self.n_carry :]

  def gather(self, trainable, frozen, only=None):
    """One layer's params from its shards, one all-gather per param (`only`: of those
    leaves alone)."""
    return fsdp_unit.gather(
      self.units, {**trainable, **frozen}, layer_axis=False, each=True, only=only
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _ScanResiduals:
  """What a scanned unit's forward loop saves for its backward: the consts and the stacked
  shards once, the residuals of every layer stacked ([Note: saved and replayed residuals])."""

  consts: list
  saved: list  # each leaf `(layers, ...)`
  trainable: dict  # [Note: trainable and frozen shards]
  frozen: dict
  last: dict | None  # the last layer's gathered params, which the backward runs first


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _LayerGrads:
  """What one layer's backward hands on: the cotangents of its other xs, its reduce-scattered
  trainable gradients, and the whole-size gradients of its `late` leaves, which `scatter`
  reduce-scatters in the next iteration ([Note: a layer gathered one iteration ahead])."""

  d_other: list
  d_trainable: dict
  late: dict  # {} once scattered


@dataclasses.dataclass(frozen=True, eq=False)
class _ScanUnit:
  """A scanned unit's `custom_vjp` (`scan_unit`): what its two loops need, fixed before
  they are traced, and the loops."""

  layer: _ScanLayer
  length: int
  reverse: bool
  token_avals: list  # k prefetch tokens, then the "reduce-scatter done" token ([Note: token list])
  init_avals: list
  other_avals: list  # one iteration's other xs
  keep: list[bool] | None  # the residuals each iteration saves (None: all)
  keep_last: bool  # the last layer's gather kept for the backward (with `keep`)

  @property
  def k(self) -> int:  # the prefetch depth
    return len(self.token_avals) - 1

  def gather_at(self, trainable, frozen, pos, after=None, split=False):
    """Layer `pos`'s params, gathered from the stacked shards once the params `after` (the
    layer before's) exist (None: whenever); returns them and `after` (through the barrier
    that orders them). With `split` (the forward), a layer gathered whenever is gathered in
    two parts, and one gathered after another waits for the other's second part alone
    ([Note: the first layer in two parts])."""
    shards = (_at(trainable, pos), _at(frozen, pos))
    layer = self.layer
    if after is not None:
      tail = {i: x for i, x in after.items() if i not in layer.head} if split else {}
      landed, tail = ordering.landed(tail or after)
      return layer.gather(*ordering.after(shards, landed)), {**after, **tail}
    if not split or not layer.head:
      return layer.gather(*shards), after
    full = layer.gather(*shards, only=layer.head)
    landed, full = ordering.landed(full)  # the rest once the head has landed
    rest = frozenset(layer.params) - layer.head
    return {**full, **layer.gather(*ordering.after(shards, landed), only=rest)}, after

  def call(self, consts, init, other, trainable, frozen, tokens):
    def step(carry, pos, full, landed):
      return self.layer(consts, carry, _at(other, pos), full)

    gather = functools.partial(self.gather_at, trainable, frozen, split=True)
    looped = _layer_loop(self.length, self.reverse, gather, step, init, ahead=self.k > 0)
    return (looped.carry, looped.outs), stand_ins(self.token_avals)

  def fwd(self, consts, init, other, trainable, frozen, tokens):
    def step(carry, pos, full, landed):
      (carry, ys), vjp = jax.vjp(self.layer, consts, carry, _at(other, pos), full)
      leaves = jax.tree.leaves(vjp)
      saved = [r for r, s in zip(leaves, self.keep or [True] * len(leaves)) if s]
      return carry, (ys, saved)

    gather = functools.partial(self.gather_at, trainable, frozen, split=True)
    looped = _layer_loop(self.length, self.reverse, gather, step, init, ahead=self.k > 0)
    carry, (ys, saved), last = looped.carry, looped.outs, looped.last
    zeros = stand_ins(self.token_avals)
    # The last layer's params, kept for the backward, which runs it first ([Note: a layer
    # gathered one iteration ahead]); without resharding every residual holds them anyway.
    last = last if self.keep is not None and self.keep_last else None
    return ((carry, ys), zeros), _ScanResiduals(consts, saved, trainable, frozen, last)

  def bwd(self, res: _ScanResiduals, cts):
    consts, trainable, frozen = res.consts, res.trainable, res.frozen
    (d_carry, d_ys), ct_tokens = cts
    d_carry = [ct_or_none(a, d) for a, d in zip(self.init_avals, d_carry)]
    d_consts0 = [jnp.zeros_like(c) if is_float(c) else None for c in consts]
    # The first layer the backward gathers (the forward's last) is gathered once the
    # backward of the op k later has started (its token), or with k = 0 once this scan's
    # cotangents exist ([Note: token list]); its shards alone are tied so (a tie on the
    # stacked shards would copy them all).
    first = 0 if self.reverse else self.length - 1
    first_shards = (_at(trainable, first), _at(frozen, first))
    first_full = res.last
    if first_full is not None:  # kept from the forward: no gather; the next layer's
      # gather, chained after it, waits for this scan's cotangents
      first_shards = None
      first_full, d_carry = ordering.together(first_full, d_carry)
    elif self.k:
      first_shards = ordering.after(first_shards, ct_tokens[self.k - 1])
    else:
      first_shards, d_carry = ordering.together(first_shards, d_carry)

    full_avals = traced_avals(
      lambda trainable, frozen: self.gather_at(trainable, frozen, 0)[0], trainable, frozen
    )
    layers = _ScanBackward(
      scan=self,
      consts=consts,
      saved=res.saved,
      d_ys=d_ys,
      full_avals=full_avals,
      trainable=trainable,
      frozen=frozen,
      first=first,
      first_shards=first_shards,
      first_full=first_full,
    )
    # Only the params whose values the backward reads are gathered (a bias's gradient needs
    # none): the others are stand-ins, so that chaining each gather after the layer before
    # does not keep their gathers alive.
    read = reads(
      lambda full: layers.step((d_carry, d_consts0), 0, full, None), stand_ins(full_avals)
    )
    layers = dataclasses.replace(layers, read=read)

    # Without resharding the forward saved every residual, the gathered params included.
    gather = layers.gather if self.keep is not None else None
    looped = _layer_loop(
      self.length,
      not self.reverse,
      gather,
      layers.step,
      (d_carry, d_consts0),
      finish=self.scatter,
      ahead=self.k > 0,
    )
    (d_init, d_consts), grads = looped.carry, looped.outs
    # The carry's cotangent leaves once the op after has reduce-scattered; this scan's own
    # fresh token, made then, goes back in every position ([Note: token list]).
    d_init = list(ordering.after(dict(enumerate(d_init)), ct_tokens[self.k]).values())
    fresh, d_init = ordering.together(stand_in(self.token_avals[0]), d_init)
    # cotangents of (consts, init, other, trainable, frozen, tokens)
    return d_consts, d_init, grads.d_other, grads.d_trainable, None, [fresh] * (self.k + 1)

  def bwd_layer(self, consts, acc, full, saved_i, d_ys_i, landed=None, in_loop=True):
    """The backward of one layer: its vjp on the layer gathered again (`full`); the
    gradients it computes early are reduce-scattered here, the `late` ones by `scatter` in
    the next iteration (see [Note: a layer gathered one iteration ahead]). `in_loop`: run
    in a loop's iteration, not peeled out of it."""
    d_carry, d_consts = acc
    # the vjp replayed on stand-ins and the saved residuals ([Note: saved and replayed
    # residuals])
    init0, other0 = stand_ins(self.init_avals), stand_ins(self.other_avals)
    _, vjp = jax.vjp(self.layer, consts, init0, other0, full)
    keep_i = self.keep or [True] * len(saved_i)
    d_consts_i, d_carry, d_x, d_full = swap(vjp, saved_i, keep_i)((d_carry, d_ys_i))
    d_consts = [None if a is None else a + b for a, b in zip(d_consts, d_consts_i)]
    d_x = [ct_or_none(a, d) for a, d in zip(other0, d_x)]
    d_carry = [ct_or_none(a, d) for a, d in zip(init0, d_carry)]
    units, late = self.layer.units, self.layer.late
    early = [i for u in units for i in u.trainable if i not in late]
    if landed is not None:  # reduce-scattered once the next layer's gather has landed
      d_full = {**d_full, **ordering.after({i: d_full[i] for i in early if i in d_full}, landed)}
    d_trainable = fsdp_unit.scatter(units, d_full, layer_axis=False, each=True, only=early)
    # One reduce-scatter per param, not the unit's bucket: its ravel would copy the
    # layer's whole-size grads (the backward's peak). The barrier with the carry's
    # cotangent keeps these reduce-scatters in their own iteration: else XLA's collective
    # pipeliner moves them into the next one, which then holds two layers' grads.
    # Out of the loop, the last layer's reduce-scatters are left free to run under what
    # follows the scan (the update of the params it does not hold, at the step's end).
    if in_loop and d_trainable and any(u.collectives.scatter_each for u in units):
      d_trainable, d_carry = ordering.together(d_trainable, d_carry)  # (DDP's: per layer)
    grads = _LayerGrads(d_x, d_trainable, {i: d_full[i] for i in late if i in d_full})
    return (d_carry, d_consts), grads

  def scatter(self, pending: _LayerGrads) -> _LayerGrads:
    """The late gradients of a layer reduce-scattered, one collective per param."""
    late = fsdp_unit.scatter(self.layer.units, pending.late, False, each=True, only=self.layer.late)
    return _LayerGrads(pending.d_other, {**pending.d_trainable, **late}, {})


@dataclasses.dataclass(frozen=True, eq=False)
class _ScanBackward:
  """A scanned unit's backward loop as `_layer_loop` runs it: its `step` and `gather`, and
  what every iteration reads, fixed before the loop."""

  scan: _ScanUnit
  consts: list
  saved: list  # every layer's saved residuals, stacked
  d_ys: list  # the cotangents of every layer's ys, stacked
  full_avals: dict  # one layer's gathered params' types
  trainable: dict  # the stacked shards ([Note: trainable and frozen shards])
  frozen: dict
  first: int  # the position of the layer the backward runs first (the forward's last)
  first_shards: tuple | None  # its shards, `(trainable, frozen)`, tied to what releases them
  first_full: dict | None  # or its params, kept from the forward
  read: Any = None  # {leaf: whether the backward reads the gathered param's value}

  def step(self, acc, pos, full, landed):
    """Layer `pos`'s backward (`_ScanUnit.bwd_layer`) on its saved residuals."""
    if full is None:  # every residual saved: the params' values are not read
      full = stand_ins(self.full_avals)
    saved, d_ys = _at(self.saved, pos), _at(self.d_ys, pos)
    last = self.scan.length - 1 - self.first  # the layer the backward runs last
    in_loop = not (isinstance(pos, int) and pos == last)  # else peeled, after the loop
    return self.scan.bwd_layer(self.consts, acc, full, saved, d_ys, landed, in_loop)

  def gather(self, pos, after):
    """Layer `pos`'s params gathered again once `after` exists, those the backward does not
    read as stand-ins ([Note: stand-ins])."""
    if isinstance(pos, int) and pos == self.first:  # peeled, before the loop
      full = (
        self.first_full
        if self.first_full is not None
        else self.scan.layer.gather(*self.first_shards)
      )
    else:
      full, after = self.scan.gather_at(self.trainable, self.frozen, pos, after)
    return {i: x if self.read[i] else stand_in(jax.typeof(x)) for i, x in full.items()}, after


# [Note: a layer gathered one iteration ahead]
# A scanned unit's loops run each layer on params gathered in the iteration before: the
# loop's iteration for layer i starts the all-gather of layer i + 1 (in run order) and runs
# layer i on the params the previous iteration gathered, handed on in the loop's carry. The
# gather then has a whole layer's compute to hide under, where one started in its own
# iteration could only overlap the compute of the params before it (the first ones
# waited for). In the backward, the whole-size gradients of layer i's `late` params (those
# the forward uses in its first half, whose gradients the backward computes last) are
# handed on too and reduce-scattered in the iteration of layer i - 1, under its compute: in
# their own iteration they could only start at its end; the others are reduce-scattered in
# their own iteration. About two layers are gathered at once, as FSDP2's and
# Megatron-FSDP's prefetch of the next unit holds, and one layer's late gradients wait.
#
# In `_layer_loop`'s terms:
# * `gather(pos, after)` starts layer `pos`'s all-gather once `after` (the gathered params of
#   the layer before) exists: chained so (a zero made once they have landed, added to the
#   shards: `ordering.landed`, `ordering.after`), XLA's all-gather combiner cannot merge two layers'
#   gathers into one collective, which would hold both layers ahead.
# * `step(carry, pos, full, landed)` runs layer `pos` on `full`, gathered the iteration before.
# * `finish(out)` (the backward: `_ScanUnit.scatter`) runs one iteration later on what
#   `step` handed on (`pending`, the late gradients), once that iteration's gather has
#   landed. `landed` is a zero that exists then; `step`'s own reduce-scatters wait for it
#   too. On the GPU XLA runs one collective at a time, so that the gather goes first and the
#   next layer's compute is not kept waiting behind reduce-scatters.
# * Peeled: the first layer's gather and step run before the loop (it has nothing to
#   finish; the forward gathers it in two parts: [Note: the first layer in two parts]), the
#   last layer's step after the loop (with the last pending `out` finished before it), so
#   that no iteration gathers a layer nobody uses. The params the last layer ran on are
#   returned: the forward saves them for the backward, which runs that layer first, rather
#   than gather it again once the loss's backward is done
#   (`FSDPConfig(reshard_last_layer=)`). The backward's last layer, out of the loop, leaves
#   its reduce-scatters free of the carry (`_ScanUnit.bwd_layer(in_loop=False)`): they run
#   under what follows the scan, at the step's end the update of the other params.
# * Without `ahead` (`FSDPConfig(prefetch=0)`) each iteration gathers its own layer and
#   finishes its own `out`: no layer held ahead, nothing hidden but what XLA overlaps
#   within a layer.
# The outputs of each layer are written into buffers stacked over the layers, in place.
#
# [Note: the first layer in two parts]
# Nothing before a scanned unit's first layer hides its gather (at the step's start, only
# the embedding), and inside a layer the scheduler can start a GEMM only once every param
# it reads has landed: gathered as one collective, the whole layer is waited for. The
# forward gathers that layer in two parts (`_ScanUnit.gather_at(split=True)`): the `head`,
# the params the layer uses before its largest (a Llama's attention and norms, before the
# MLP's matrices), then the rest, chained after the head has landed (so that XLA's
# all-gather combiner does not merge them back), under the head's compute; the next
# layer's gather is chained after the rest alone, so that the head's compute does not wait
# for it either. By size, not by equation count: a Llama's `wv` is read after both RoPEs'
# many small equations, yet XLA fuses it into one GEMM with `wq` and `wk`.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _LoopState:
  """`_layer_loop`'s `fori_loop` carry at the start of an iteration."""

  carry: Any  # `step`'s carry
  full: Any  # this iteration's layer, gathered by the iteration before (None without `ahead`)
  pending: Any  # with `finish`: the layer before's `out`, to finish here; else None
  outs: Any  # the finished outs, stacked over the layers


class _Ahead(NamedTuple):
  """The next layer's gather, started (`_LayerLoop.ahead_of`)."""

  full_next: Any  # layer k + 1's params, gathered (None: the layers need no params)
  full: Any  # layer k's params, through the barrier that orders the gather after them
  landed: Any  # with `finish`: a zero that exists once `full_next` has landed; else None


def _no_gather(pos, after):
  """A `gather` for `_layer_loop` whose layers need no params."""
  return None, after


@dataclasses.dataclass(frozen=True, eq=False)
class _LayerLoop:
  """`_layer_loop`'s fixed parts: the iteration bodies of its `fori_loop`s ([Note: a layer
  gathered one iteration ahead])."""

  length: int
  reverse: bool
  gather: Callable  # (pos, after) -> (full, after)
  step: Callable  # (carry, pos, full, landed) -> (carry, out)
  finish: Callable | None  # out -> finished out, one iteration later; None: out as it is

  def position(self, k):
    """The layer the k-th iteration runs (in run order)."""
    return self.length - 1 - k if self.reverse else k

  def done(self, out):
    return out if self.finish is None else self.finish(out)

  def put(self, outs, out, pos):
    """`outs` with layer `pos`'s `out` written in, in place."""
    return jax.tree.map(lambda b, o: jax.lax.dynamic_update_index_in_dim(b, o, pos, 0), outs, out)

  def ahead_of(self, k, full) -> _Ahead:
    """Layer k + 1's gather, once layer k's has landed (chained: XLA's all-gather combiner
    cannot merge two layers' gathers), and with `finish` a zero that exists once it has
    landed."""
    full_next, full = self.gather(self.position(k + 1), full)
    if self.finish is None or full_next is None:
      return _Ahead(full_next, full, None)
    landed, full_next = ordering.landed(full_next)
    return _Ahead(full_next, full, landed)

  def body(self, k, state: _LoopState) -> _LoopState:
    """Layer k on the params gathered the iteration before; layer k + 1 gathered; with
    `finish`, layer k - 1 finished."""
    ahead = self.ahead_of(k, state.full)
    pending, outs = state.pending, state.outs
    if self.finish is not None:
      pending = pending if ahead.landed is None else ordering.after_alike(pending, ahead.landed)
      outs = self.put(outs, self.finish(pending), self.position(k - 1))
    carry, out = self.step(state.carry, self.position(k), ahead.full, ahead.landed)
    if self.finish is None:
      return _LoopState(carry, ahead.full_next, None, self.put(outs, out, self.position(k)))
    return _LoopState(carry, ahead.full_next, out, outs)

  def own(self, k, state: _LoopState) -> _LoopState:
    """Layer k, gathered and finished in its own iteration (without `ahead`)."""
    full = self.gather(self.position(k), None)[0]
    carry, out = self.step(state.carry, self.position(k), full, None)
    return _LoopState(carry, None, None, self.put(state.outs, self.done(out), self.position(k)))


class _Looped(NamedTuple):
  """What `_layer_loop` returns."""

  carry: Any  # the last carry
  outs: Any  # the (finished) outputs, stacked by position
  last: Any  # the params the last layer ran on (None without `ahead`)


def _layer_loop(
  length: int,
  reverse: bool,
  gather: Callable | None,
  step: Callable,
  carry,
  finish=None,
  ahead: bool = True,
):
  """`step(carry, pos, full, landed) -> (carry, out)` for each layer position `pos` in run
  order (`0 .. length - 1`, or reversed), `full` being layer `pos`'s params gathered one
  iteration ahead by `gather(pos, after) -> (full, after)`, once the layer before has landed
  (`after`: None without `gather`); with `finish`, each `out` is handed on and
  `finish(out)` runs in the next iteration, once the gather started in it has landed, and
  `landed` is a zero that exists then (a token for `step`'s own collectives; else None).
  See [Note: a layer gathered one iteration ahead]. Returns a `_Looped` (the outputs
  `(length, ...)` per leaf, position-indexed whatever the order). Without `ahead`
  (`FSDPConfig(prefetch=0)`) each iteration gathers its own layer and finishes its own
  `out`: no layer held ahead, nothing hidden behind a layer's compute but what XLA overlaps
  within it."""
  loop = _LayerLoop(length, reverse, gather or _no_gather, step, finish)
  position = loop.position
  # The stacked outputs' buffers, from one trace of the first layer's step (and finish).
  first_out = lambda carry, full: step(carry, position(0), full, None)[1]
  out0 = stand_ins(traced_avals(first_out, carry, loop.gather(position(0), None)[0]))
  stacked = jax.tree.map(
    lambda a: a.update(shape=(length, *a.shape)), traced_avals(loop.done, out0)
  )
  outs = stand_ins(stacked)

  if not ahead:
    state = jax.lax.fori_loop(0, length, loop.own, _LoopState(carry, None, None, outs))
    return _Looped(state.carry, state.outs, None)

  # Peeled first layer: gathered and run before the loop (it has nothing to finish).
  full, pending, first = loop.gather(position(0), None)[0], None, 0
  if length > 1:
    ahead_0 = loop.ahead_of(0, full)
    carry, out = step(carry, position(0), ahead_0.full, ahead_0.landed)
    if finish is None:
      outs = loop.put(outs, out, position(0))
    else:
      pending = out
    full, first = ahead_0.full_next, 1
  if length - 1 > first:
    state = jax.lax.fori_loop(first, length - 1, loop.body, _LoopState(carry, full, pending, outs))
    carry, full, pending, outs = state.carry, state.full, state.pending, state.outs
  # Peeled last layer: run after the loop, on the params its last iteration gathered.
  if pending is not None:
    outs = loop.put(outs, loop.done(pending), position(length - 2))
  carry, out = step(carry, position(length - 1), full, None)
  return _Looped(carry, loop.put(outs, loop.done(out), position(length - 1)), full)


def _first_uses(jaxpr: jcore.Jaxpr) -> dict:
  """{input var of `jaxpr`: where its first use is among the eqns, `jax.checkpoint`s and
  calls expanded, as a fraction of their number; a cast of it (`w.astype(jnp.bfloat16)`)
  counts as it, not as a use}."""
  seen: dict = {}
  count = [0]

  def walk(jaxpr, alias):
    for eqn in jaxpr.eqns:
      if eqn.primitive is prims.convert_element_type_p and eqn.invars[0] in alias:
        alias[eqn.outvars[0]] = alias[eqn.invars[0]]
        continue
      inner = inner_jaxpr(eqn) if eqn.primitive is not prims.scan_p else None
      if inner is not None:
        inner_alias = {
          w: alias[v]
          for v, w in zip(eqn.invars, inner.invars)
          if isinstance(v, jcore.Var) and v in alias
        }
        walk(inner, inner_alias)
        continue
      for v in eqn.invars:
        if isinstance(v, jcore.Var) and v in alias:
          seen.setdefault(alias[v], count[0])
      count[0] += 1

  walk(jaxpr, {v: v for v in jaxpr.invars})
  return {v: n / max(count[0], 1) for v, n in seen.items()}


def _at(tree, pos):
  """Every leaf of a stacked tree at layer `pos` (its leading dim)."""
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, pos, 0, keepdims=False), tree)
