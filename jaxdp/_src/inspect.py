"""What a compiled program communicates, when, and what it overlaps.

jaxdp claims that its bucket collectives overlap backward compute and move exactly what the ring
formulas say. This module reads the *scheduled* HLO of a compiled program (`compiled.as_text()`) and
answers from it:

- `schedule` parses the program into a `Schedule`: every op of the entry computation in schedule
  order (while-loop bodies and `call`s inlined at the op that runs them) and every collective
  (`Collective`) with its kind, dtype, operand bytes, replica groups, ring bytes and, for
  asynchronous ones, the compute ops XLA scheduled between its `-start` and `-done`.
- `report` renders that as text; `Schedule.records` and `Schedule.timeline` give plain dicts to
  tabulate or plot.
- `memory_stats` reads `compiled.memory_analysis()` into a `MemoryStats` with the peak bytes per
  device.

The text is read by `jaxdp._src.hlo`, which lists the HLO forms it handles (those XLA 0.10.2
prints, on CPU and on the deviceless H100 target).

Byte counts are per device: an operand `f32[1024,1024]` is 4 MiB on every device of the group. Ring
bytes are what each device sends with the ring algorithm (`ring_bytes`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

import jax

from jaxdp._src import hlo
from jaxdp._src.compiler import COST_MODEL_OPTIONS


# ----------------------------------------------------------------------------
# Data


@dataclasses.dataclass(frozen=True)
class ScheduledOp:
  """One op of the program, in schedule order.

  Attributes:
    index: position in `Schedule.ops` (loop bodies inlined).
    name: HLO instruction name, e.g. `"all-reduce-start.3"`.
    opcode: HLO opcode, e.g. `"fusion"`, `"all-reduce-start"`.
    category: `"gemm"` (a dot, convolution, cuBLAS call or a fusion that contains one), `"compute"`
      (any other kernel), `"collective"` (a synchronous one), `"collective-start"`,
      `"collective-done"`, `"control"` (while/call/conditional: its body follows inlined) or
      `"free"` (no kernel: parameter, tuple, bitcast, ...).
    computation: the HLO computation it belongs to.
    trip_count: how many times it runs per program run (loop trip counts multiplied; 1 outside
      loops).
  """

  index: int
  name: str
  opcode: str
  category: str
  computation: str
  trip_count: int = 1


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective of the program.

  Attributes:
    name: HLO name of the op (the `-start` for an asynchronous one).
    kind: one of `hlo.COLLECTIVE_KINDS`.
    opcode: as printed, e.g. `"all-reduce"` or `"reduce-scatter-start"`.
    is_async: issued as a start/done pair that XLA may overlap with compute (False for a plain op
      and for a start marked `"is_sync":true`).
    done_name: HLO name of the `-done` (None for a synchronous op, or when the done could not be
      matched).
    computation: the HLO computation holding it (the entry or a loop body).
    trip_count: executions per program run.
    start_index: index of the op (or its start) in `Schedule.ops`.
    done_index: index of the done (equal to `start_index` when synchronous).
    dtypes: element types of the operands, e.g. `("bf16",)`.
    operand_shapes: the operands' array shapes, e.g. `("f32[1024,1024]",)`.
    operand_bytes: bytes of all operands, per device.
    result_bytes: bytes of the result, per device.
    replica_groups: the device groups (partition ids); empty for a collective-permute.
    group_size: devices per group, `N` in the ring formulas (for a collective-permute: number of
      devices that send).
    source_target_pairs: a collective-permute's (source, target) pairs.
    overlapped: names of the kernels scheduled between start and done.
    overlapped_gemms: those of them that are GEMMs.
  """

  name: str
  kind: str
  opcode: str
  is_async: bool
  done_name: str | None
  computation: str
  trip_count: int
  start_index: int
  done_index: int
  dtypes: tuple[str, ...]
  operand_shapes: tuple[str, ...]
  operand_bytes: int
  result_bytes: int
  replica_groups: tuple[tuple[int, ...], ...]
  group_size: int
  source_target_pairs: tuple[tuple[int, int], ...] = ()
  overlapped: tuple[str, ...] = ()
  overlapped_gemms: tuple[str, ...] = ()

  @property
  def buffer_bytes(self) -> int:
    """`B` of the ring formula: the full buffer (an all-gather's result)."""
    return self.result_bytes if self.kind == "all-gather" else self.operand_bytes

  @property
  def ring_bytes(self) -> float:
    """Bytes each device sends per execution with the ring algorithm."""
    return ring_bytes(self.kind, self.buffer_bytes, self.group_size)

  @property
  def overlaps_compute(self) -> bool:
    """Whether any kernel runs between its start and done."""
    return bool(self.overlapped)

  @property
  def overlaps_gemm(self) -> bool:
    """Whether a GEMM runs between its start and done."""
    return bool(self.overlapped_gemms)

  @property
  def exposed(self) -> bool:
    """True when nothing hides it: synchronous, or no kernel while in flight."""
    return not (self.is_async and self.overlapped)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A compiled program's schedule and collectives (see `schedule`).

  Attributes:
    module: HLO module name, e.g. `"jit_train_step"`.
    is_scheduled: whether the text was a scheduled module (op order = run order). Pre-optimization
      HLO is not.
    num_partitions: devices the SPMD program runs on.
    ops: every op in schedule order, loop and call bodies inlined.
    collectives: every collective in schedule order.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("data",))
    >>> f = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
    ...                   in_specs=P(), out_specs=P())
    >>> s = schedule(f, jnp.zeros((256,), jnp.float32))
    >>> (c,) = s.collectives  # an all-reduce of 1 KiB sends 2 (N-1)/N KiB per device
    >>> c.kind, c.group_size, c.ring_bytes, s.ops[c.start_index].category, c.exposed
    ('all-reduce', 8, 1792.0, 'collective', True)
    >>> s.comm_bytes()["all-reduce"]["count"]
    1
  """

  module: str
  is_scheduled: bool
  num_partitions: int
  ops: tuple[ScheduledOp, ...]
  collectives: tuple[Collective, ...]

  def comm_bytes(self) -> dict[str, dict[str, float]]:
    """Per kind: count, operand bytes and ring bytes per device per run.

    Loop trip counts are included. Keys are the kinds present, plus `"total"`.

    Returns:
      `{kind: {"count": n, "operand_bytes": b, "ring_bytes": r}}`.
    """
    out: dict[str, dict[str, float]] = {}
    total = {"count": 0, "operand_bytes": 0, "ring_bytes": 0.0}
    for c in self.collectives:
      row = out.setdefault(c.kind, {"count": 0, "operand_bytes": 0, "ring_bytes": 0.0})
      for r in (row, total):
        r["count"] += c.trip_count
        r["operand_bytes"] += c.operand_bytes * c.trip_count
        r["ring_bytes"] += c.ring_bytes * c.trip_count
    out["total"] = total
    return out

  def records(self) -> list[dict[str, Any]]:
    """The collectives as plain dicts (fields and properties), for tables."""
    rows = []
    for i, c in enumerate(self.collectives):
      row = {"index": i, **dataclasses.asdict(c)}
      for prop in ("buffer_bytes", "ring_bytes", "overlaps_compute", "overlaps_gemm", "exposed"):
        row[prop] = getattr(c, prop)
      rows.append(row)
    return rows

  def timeline(self) -> list[dict[str, Any]]:
    """Intervals in schedule steps, for plotting.

    One dict per kernel (`start == end == op index`) and one per collective (`start`/`end` = its
    start and done op index), each with `name`, `category` and `lane` (`"compute"` or `"comm"`).
    Plot lanes as rows and `start..end+1` as bars; an async collective's bar covers the kernels it
    overlaps.
    """
    rows = []
    for op in self.ops:
      if op.category in ("gemm", "compute"):
        rows.append(
          {
            "name": op.name,
            "category": op.category,
            "lane": "compute",
            "start": op.index,
            "end": op.index,
          }
        )
    for c in self.collectives:
      rows.append(
        {
          "name": c.name,
          "category": c.kind,
          "lane": "comm",
          "start": c.start_index,
          "end": c.done_index,
          "bytes": c.operand_bytes,
          "exposed": c.exposed,
        }
      )
    return rows


@dataclasses.dataclass(frozen=True)
class MemoryStats:
  """Per-device memory of a compiled program (from `memory_analysis()`).

  Attributes:
    argument_bytes: inputs resident during the call.
    output_bytes: outputs.
    temp_bytes: XLA's scratch (activations, gathered params, buffers).
    alias_bytes: outputs that reuse donated inputs' memory.
    generated_code_bytes: compiled code (0 on the deviceless GPU target).
    peak_bytes: what the device must hold while the program runs: XLA's peak of its buffers
      where it reports one, else `argument + output + temp - alias`. XLA's peak counts the
      buffers of every memory space, so for a program with host memory
      (`optimizer_cpu_offload`) it is the device's own sizes, `argument + output + temp -
      alias`, a bound on the device's peak.
    host_bytes: what the program keeps in host memory (arguments, outputs and scratch,
      donated outputs counted once).
  """

  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  generated_code_bytes: int
  peak_bytes: int
  host_bytes: int = 0


# ----------------------------------------------------------------------------
# Formulas and sizes


def ring_bytes(kind: str, buffer_bytes: float, group_size: int) -> float:
  """Bytes each device sends for one collective with the ring algorithm.

  Args:
    kind: one of `hlo.COLLECTIVE_KINDS`.
    buffer_bytes: `B`, the full buffer: an all-reduce's or reduce-scatter's input, an all-gather's
      output, an all-to-all's input, a collective-permute's input.
    group_size: `N`, devices in the group.

  Returns:
    all-reduce `2(N-1)/N·B`; reduce-scatter, all-gather, all-to-all `(N-1)/N·B`; collective-permute
    `B`.

  Raises:
    ValueError: for an unknown kind.

  Examples:
    >>> ring_bytes("all-reduce", 800, 8)
    1400.0
    >>> ring_bytes("reduce-scatter", 800, 8) + ring_bytes("all-gather", 800, 8)
    1400.0
  """
  if kind not in hlo.COLLECTIVE_KINDS:
    raise ValueError(f"ring_bytes: kind {kind!r} is not one of {hlo.COLLECTIVE_KINDS}")
  if kind == "collective-permute":
    return float(buffer_bytes)
  if group_size <= 1:
    return 0.0
  factor = 2 if kind == "all-reduce" else 1
  return factor * (group_size - 1) / group_size * buffer_bytes


# ----------------------------------------------------------------------------
# The schedule


def _schedule_of(parser: hlo.Parser) -> Schedule:
  """The `Schedule` of a module read by `parser`: its ops in run order, its collectives
  (an async one's start paired with its done)."""
  ops: list[ScheduledOp] = []
  open_starts: dict[tuple[str, str], dict[str, Any]] = {}
  found: list[dict[str, Any]] = []
  for instr, comp, trips in parser.walk():
    classified = parser.classify(instr)
    category, kind, role = classified.category, classified.kind, classified.role
    ops.append(ScheduledOp(len(ops), instr.name, instr.opcode, category, comp, trips))
    index = len(ops) - 1
    if role in ("sync", "start"):
      shapes = parser.operand_shapes(comp, instr)
      if instr.opcode.endswith("-start") or instr.opcode == "async-start":
        shapes = [s for s in shapes if hlo.arrays(s)]
      record = {
        "name": instr.name,
        "kind": kind,
        "opcode": instr.opcode,
        "is_async": role == "start" and '"is_sync":true' not in instr.attrs,
        "done_name": None,
        "computation": comp,
        "trip_count": trips,
        "start_index": index,
        "done_index": index,
        "shapes": shapes,
        "result": instr.shape,
        "attrs": parser.collective_attrs(instr),
      }
      found.append(record)
      if role == "start":
        open_starts[(comp, instr.name)] = record
    elif role == "done":
      start = next(
        (open_starts.pop((comp, o)) for o in instr.operands if (comp, o) in open_starts),
        None,
      )
      if start is not None:
        start.update(done_name=instr.name, done_index=index, result=instr.shape)
  collectives = tuple(_collective(parser, r, ops) for r in found)
  return Schedule(
    parser.module, parser.is_scheduled, parser.num_partitions, tuple(ops), collectives
  )


def _collective(parser: hlo.Parser, r: dict[str, Any], ops: list[ScheduledOp]) -> Collective:
  """The `Collective` of one record of `_schedule_of`: its bytes, groups and overlap."""
  arrays = [a for s in r["shapes"] for a in hlo.arrays(s)]
  dtypes = tuple(dict.fromkeys(d for d, _ in arrays))
  shapes = tuple(f"{d}[{','.join(map(str, dims))}]" for d, dims in arrays)
  operand_bytes = sum(hlo.shape_bytes(s) for s in r["shapes"])
  result_bytes = hlo.shape_bytes(r["result"])
  pairs: tuple[tuple[int, int], ...] = ()
  if r["kind"] == "collective-permute":
    # source_target_pairs={{0,1},{1,2},{2,3}}: (source, target) device pairs
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", r["attrs"])
    if m:
      pairs = tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)", m.group(1) + "}"))
    groups: tuple[tuple[int, ...], ...] = ()
    group_size = len({a for a, _ in pairs})
  else:
    groups = hlo.parse_replica_groups(r["attrs"]) or ()
    mesh_form = hlo.parse_mesh_groups(r["attrs"])
    if "replica_groups=" in r["attrs"] and not groups and mesh_form is None:
      if not re.search(r"replica_groups=\{\s*\}", r["attrs"]):  # `{}`: every device
        at = r["attrs"].index("replica_groups=")
        raise ValueError(
          f"HLO text: {r['name']}'s replica groups are in a form jaxdp cannot read (this "
          f"XLA prints something new): {r['attrs'][at : at + 120]!r}"
        )
    if mesh_form is not None:
      group_size, groups = mesh_form
    elif groups and groups[0]:
      group_size = len(groups[0])
    elif "use_global_device_ids=true" in r["attrs"] or parser.replica_count == 1:
      group_size = parser.num_partitions
    else:
      group_size = parser.replica_count
  between = ops[r["start_index"] + 1 : r["done_index"]] if r["is_async"] else []
  kernels = tuple(o.name for o in between if o.category in ("gemm", "compute"))
  gemms = tuple(o.name for o in between if o.category == "gemm")
  return Collective(
    name=r["name"],
    kind=r["kind"],
    opcode=r["opcode"],
    is_async=r["is_async"],
    done_name=r["done_name"],
    computation=r["computation"],
    trip_count=r["trip_count"],
    start_index=r["start_index"],
    done_index=r["done_index"],
    dtypes=dtypes,
    operand_shapes=shapes,
    operand_bytes=operand_bytes,
    result_bytes=result_bytes,
    replica_groups=groups,
    group_size=group_size,
    source_target_pairs=pairs,
    overlapped=kernels,
    overlapped_gemms=gemms,
  )


# ----------------------------------------------------------------------------
# Public functions


def _compiled(program: Any, args: tuple, kwargs: dict, compiler_options: dict[str, Any] | None):
  if isinstance(program, jax.stages.Compiled):
    return program
  if isinstance(program, jax.stages.Lowered):
    return program.compile(compiler_options=compiler_options)
  if callable(program):
    # A jitted function, or jaxdp's train step, lowers itself with its own options.
    fn = program if hasattr(program, "lower") else jax.jit(program)
    return fn.lower(*args, **kwargs).compile(compiler_options=compiler_options)
  raise TypeError(
    f"expected a compiled program, its as_text(), a Lowered, or a function "
    f"plus example arguments; got {type(program).__name__}"
  )


def schedule(
  program: Any,
  *args: Any,
  compiler_options: dict[str, Any] | None = None,
  **kwargs: Any,
) -> Schedule:
  """Parses a compiled program's schedule and collectives.

  Args:
    program: a `jax.stages.Compiled`; its `as_text()`; the HLO before optimization
      (`lowered.as_text(dialect="hlo")`: the collectives and dtypes the program asked for,
      unscheduled); a `jax.stages.Lowered` (compiled here); a `Schedule` (returned as is); or a
      function (jitted or not, or a jaxdp train step) to call with `args`/`kwargs`, e.g.
      `schedule(train_step, state, batch)`.
    *args: example arguments (arrays or `jax.ShapeDtypeStruct`) when `program` is a function.
    compiler_options: XLA options for the compile done here (a jitted function's own
      `compiler_options` apply as well).
    **kwargs: keyword arguments of the function.

  Returns:
    The `Schedule`.

  Raises:
    ValueError: if the text holds no HLO module (e.g. StableHLO).
    TypeError: for anything else.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> f = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
    ...                   in_specs=P(), out_specs=P())
    >>> s = schedule(f, jnp.zeros((256,), jnp.float32))
    >>> [(c.kind, c.dtypes, c.operand_bytes) for c in s.collectives]
    [('all-reduce', ('f32',), 1024)]
  """
  if isinstance(program, Schedule):
    return program
  if isinstance(program, str):
    return _schedule_of(hlo.Parser(program))
  compiled = _compiled(program, args, kwargs, compiler_options)
  return _schedule_of(hlo.Parser(compiled.as_text()))


def _fmt_bytes(n: float) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n:.0f} B"


def report(
  program: Any, *args: Any, expected: dict[str, float] | None = None, **kwargs: Any
) -> str:
  """A readable account of a program's collectives and their overlap.

  Args:
    program: anything `schedule` takes, e.g. a compiled program, or `train_step, state, batch`.
    *args: passed to `schedule`.
    expected: ring bytes per device per run by kind that the program should move, e.g.
      `jaxdp.inspect.ring_formula(state)` (docs/design.md's table); each kind's total is then
      printed next to it, with the ratio.
    **kwargs: passed to `schedule`.

  Returns:
    Lines: a summary; one row per collective in schedule order (kind, dtype,
    operand bytes, group size N, ring bytes per device, runs per step, and what it overlaps, or
    `EXPOSED`); totals per kind against the ring formula (and against `expected`).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> f = jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
    ...                   in_specs=P(), out_specs=P())
    >>> text = report(f, jnp.zeros((256,), jnp.float32))
    >>> print(text.splitlines()[0])  # doctest: +ELLIPSIS
    jit__lambda: 1 collective (0 async, 0 overlapping compute, 1 exposed), ...
    >>> "EXPOSED (sync)" in text
    True
  """
  s = schedule(program, *args, **kwargs)
  n_async = sum(c.is_async for c in s.collectives)
  n_over = sum(c.is_async and c.overlaps_compute for c in s.collectives)
  n_exposed = sum(c.exposed for c in s.collectives)
  plural = "" if len(s.collectives) == 1 else "s"
  lines = [
    f"{s.module}: {len(s.collectives)} collective{plural} ({n_async} async, "
    f"{n_over} overlapping compute, {n_exposed} exposed), "
    f"{s.num_partitions} partitions"
    + ("" if s.is_scheduled else ", NOT scheduled (order is text order)")
  ]
  if s.collectives:
    lines.append(
      f"  {'#':>3}  {'op':<28} {'kind':<18} {'dtype':<9} {'operands':>11} "
      f"{'N':>3} {'ring/dev':>11} {'runs':>4}  overlaps"
    )
  for i, c in enumerate(s.collectives):
    if not c.is_async:
      what = "EXPOSED (sync)"
    elif not c.overlapped:
      what = "EXPOSED (nothing between start and done)"
    else:
      n_gemm = len(c.overlapped_gemms)
      n_other = len(c.overlapped) - n_gemm
      what = (
        f"{n_gemm} GEMM{'s' if n_gemm != 1 else ''}, "
        f"{n_other} other kernel{'s' if n_other != 1 else ''}"
      )
      if c.overlapped_gemms:
        shown = ", ".join(c.overlapped_gemms[:3])
        more = ", ..." if n_gemm > 3 else ""
        what += f" ({shown}{more})"
    lines.append(
      f"  {i:>3}  {c.name:<28} {c.kind:<18} {','.join(c.dtypes):<9} "
      f"{_fmt_bytes(c.operand_bytes):>11} {c.group_size:>3} "
      f"{_fmt_bytes(c.ring_bytes):>11} {c.trip_count:>4}  {what}"
    )
  formula = {
    "all-reduce": "2(N-1)/N*B",
    "reduce-scatter": "(N-1)/N*B",
    "all-gather": "(N-1)/N*B of the gathered buffer",
    "all-to-all": "(N-1)/N*B",
    "collective-permute": "B",
  }
  volume = s.comm_bytes()
  if s.collectives:
    lines.append("  per device per run:")
  for kind, row in volume.items():
    if kind == "total":
      continue
    vs = ""
    if expected and expected.get(kind):
      vs = f"; expected {_fmt_bytes(expected[kind])} (x{row['ring_bytes'] / expected[kind]:.3f})"
    lines.append(
      f"    {kind:<18} x{row['count']:<4} operands "
      f"{_fmt_bytes(row['operand_bytes']):>11}, ring "
      f"{_fmt_bytes(row['ring_bytes']):>11}  ({formula[kind]}){vs}"
    )
  for kind in sorted(set(expected or ()) - set(volume)):
    lines.append(f"    {kind:<18} x0    MISSING: expected {_fmt_bytes(expected[kind])}")
  if len(volume) > 2:
    lines.append(
      f"    {'total':<18} x{volume['total']['count']:<4} operands "
      f"{_fmt_bytes(volume['total']['operand_bytes']):>11}, ring "
      f"{_fmt_bytes(volume['total']['ring_bytes']):>11}"
    )
  return "\n".join(lines)


def memory_stats(
  program: Any,
  *args: Any,
  compiler_options: dict[str, Any] | None = None,
  **kwargs: Any,
) -> MemoryStats:
  """Per-device memory of a compiled program.

  On the CPU backend the numbers mislead (no temp accounting of the GPU kind, gathers hoisted);
  compile for the GPU target (`jaxdp.inspect.compile_train_step` with a number of H100s) for
  memory claims.

  Args:
    program: a `jax.stages.Compiled`, a `Lowered`, or a function to compile with `args`/`kwargs`.
    *args: example arguments when `program` is a function.
    compiler_options: XLA options for a compile done here.
    **kwargs: keyword arguments of the function.

  Returns:
    The `MemoryStats`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> m = memory_stats(lambda x: x * 2, jnp.zeros((256,), jnp.float32))
    >>> m.argument_bytes, m.output_bytes
    (1024, 1024)
  """
  compiled = _compiled(program, args, kwargs, compiler_options)
  m = compiled.memory_analysis()
  if m is None:
    raise ValueError("memory_stats: this backend gives no memory_analysis()")
  peak = (
    m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
  )
  host = sum(
    getattr(m, f"host_{part}_size_in_bytes", 0) for part in ("argument", "output", "temp")
  ) - getattr(m, "host_alias_size_in_bytes", 0)
  # XLA's peak counts the buffers of every memory space, host memory's too
  reported = 0 if host else getattr(m, "peak_memory_in_bytes", 0)
  return MemoryStats(
    argument_bytes=int(m.argument_size_in_bytes),
    output_bytes=int(m.output_size_in_bytes),
    temp_bytes=int(m.temp_size_in_bytes),
    alias_bytes=int(m.alias_size_in_bytes),
    generated_code_bytes=int(m.generated_code_size_in_bytes),
    peak_bytes=int(reported or peak),
    host_bytes=int(host),
  )


# ----------------------------------------------------------------------------
# Predicted time


@dataclasses.dataclass(frozen=True)
class Interval:
  """One kernel or collective of a `StepPrediction`'s timeline, in microseconds.

  Attributes:
    name: HLO instruction name (a collective's `-start`, or the op itself when synchronous).
    kind: `"gemm"`, `"compute"` (any other kernel), a collective kind (`hlo.COLLECTIVE_KINDS`)
      or a host copy's direction (`"host-to-device"`, `"device-to-host"`).
    lane: `"compute"` (the stream kernels run on), `"comm"` (the collectives' stream) or
      `"host"` (the copies between host and device memory).
    start_us: when it starts, from the start of the program.
    end_us: when it ends.
    computation: the HLO computation holding it (the entry, or a loop body once per trip).
    exposed_us: for a collective, how long the compute stream waited for it (at most
      `end_us - start_us`); 0 for a kernel.
  """

  name: str
  kind: str
  lane: str
  start_us: float
  end_us: float
  computation: str
  exposed_us: float = 0.0


@dataclasses.dataclass(frozen=True)
class StepPrediction:
  """A compiled GPU program's time, from XLA's own cost model (see `predict_step`).

  Attributes:
    module: HLO module name, e.g. `"jit_step"`.
    step_us: predicted time of one run: kernels back to back on one stream plus the waits for
      collectives and host copies (`compute_us + exposed_us["total"]` +
      `host_exposed_us["total"]`).
    compute_us: time of the kernels (every loop trip counted).
    comm_us: time of the collectives per kind, and `"total"`.
    exposed_us: the part of `comm_us` the kernels wait for (not hidden under compute), per
      kind and `"total"`; never more than `comm_us`.
    timeline: every kernel and collective in run order, loops unrolled.
    unestimated: kernels XLA gave no estimate (counted as taking no time).
    unknown_trip_counts: `while` loops without a known trip count (counted as one trip).
  """

  module: str
  step_us: float
  compute_us: float
  comm_us: dict[str, float]
  exposed_us: dict[str, float]
  timeline: tuple[Interval, ...]
  unestimated: tuple[str, ...] = ()
  unknown_trip_counts: tuple[str, ...] = ()
  host_us: dict[str, float] = dataclasses.field(default_factory=dict)
  """Time of the copies between host and device memory (`"host-to-device"`,
  `"device-to-host"`, `"total"`; empty without any), at `HOST_LINK_BYTES_PER_S` each way."""
  host_exposed_us: dict[str, float] = dataclasses.field(default_factory=dict)
  """The part of `host_us` the kernels wait for, per direction and `"total"`."""

  @property
  def hidden_fraction(self) -> float:
    """Fraction of the communication time hidden under compute (1.0 without any)."""
    total = self.comm_us["total"]
    return 1.0 - self.exposed_us["total"] / total if total else 1.0

  def records(self) -> list[dict[str, Any]]:
    """The timeline as plain dicts, for tables and plots."""
    return [dataclasses.asdict(i) for i in self.timeline]

  def summary(self) -> str:
    """A few lines: step, compute, and each collective kind's time and exposure."""
    lines = [
      f"{self.module}: step {self.step_us:,.1f} us = compute {self.compute_us:,.1f} us "
      f"+ exposed communication {self.exposed_us['total']:,.1f} us "
      f"({100 * self.hidden_fraction:.0f}% of {self.comm_us['total']:,.1f} us hidden)"
    ]
    for kind, us in self.comm_us.items():
      if kind != "total":
        lines.append(f"  {kind:<18} {us:>12,.1f} us, exposed {self.exposed_us[kind]:>12,.1f} us")
    for kind, us in self.host_us.items():
      if kind != "total":
        lines.append(
          f"  {kind:<18} {us:>12,.1f} us, exposed {self.host_exposed_us[kind]:>12,.1f} us "
          f"(host link {HOST_LINK_BYTES_PER_S / 1e9:.0f} GB/s each way)"
        )
    if self.unestimated:
      lines.append(f"  {len(self.unestimated)} kernels without an estimate (counted as 0)")
    if self.unknown_trip_counts:
      lines.append(f"  loops without a known trip count (run once): {self.unknown_trip_counts}")
    return "\n".join(lines)


# XLA:GPU's cost model writes its estimates of an instruction into its backend_config:
# `"reification_cost":[{"name":"sol","exec_time_us":12.5,...}]` ("sol": speed of light, the
# analytical model's time for the kernel or the collective).
_REIFICATION = re.compile(r'"reification_cost":\[')


def _estimate_us(attrs: str) -> float | None:
  """XLA's speed-of-light estimate in an instruction's backend_config, if it has one."""
  m = _REIFICATION.search(attrs)
  if not m:
    return None
  text = attrs[m.end() - 1 : hlo.balanced(attrs, m.end() - 1)]
  try:
    entries = json.loads(text)
  except ValueError:
    return None
  times = [float(e.get("exec_time_us", 0.0)) for e in entries if e.get("name") == "sol"]
  return times[-1] if times else None


def _wrapped_estimates(compiled: jax.stages.Compiled) -> dict[str, float]:
  """Estimates of the collectives async-starts wrap, by start name.

  `as_text()` prints an async-wrapped collective as a sugared `reduce-scatter-start` with the
  start's own backend_config; the estimate is in the wrapped op's, which only the module's
  instructions give.
  """
  out: dict[str, float] = {}
  try:
    modules = compiled.runtime_executable().hlo_modules()
  except Exception:  # noqa: BLE001 - a backend without HLO modules: the text is all there is
    return out
  for computation in modules[0].computations() if modules else ():
    for instr in computation.instructions():
      if getattr(instr.opcode, "name", None) != "kAsyncStart":
        continue
      us = _estimate_us(instr.async_wrapped_root().to_string())
      if us is not None:
        out[instr.name] = us
  return out


@dataclasses.dataclass
class _Slot:
  name: str
  kind: str
  lane: str
  start: float
  end: float
  computation: str
  exposed: float = 0.0


HOST_LINK_BYTES_PER_S = 64e9
"""The host link of one GPU, each way: PCIe Gen5 x16 (an H100 SXM's). XLA's cost model
gives copies between host and device memory no time, nor does its H100 target description
name a host link, so `predict_step` times them at this rate."""


@dataclasses.dataclass(frozen=True)
class _HostCopy:
  direction: str  # "host-to-device" or "device-to-host"
  nbytes: int


# An array of a shape string with its layout: `f32[2,4096]{1,0:S(5)}` (S(5): host memory).
_PLACED_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")


def _host_copy(instr: hlo.Instr) -> _HostCopy | None:
  """A copy between host and device memory (memory space S(5)), or None for another op:
  a `copy-start` (its shape `(destination, source, context)`), or the async slice of a host
  array to the device or of a device array into one (`fusion-start` of a dynamic-slice or
  a dynamic-update-slice, its shape `((operands), result, context)`): its direction and
  the bytes it moves."""
  if instr.opcode not in ("copy-start", "fusion-start"):
    return None
  arrays = []
  for dtype, dims, layout in _PLACED_ARRAY.findall(instr.shape):
    sizes = tuple(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())
    nbytes = math.ceil(math.prod(sizes) * hlo.dtype_bits(dtype) / 8) if sizes else 0
    arrays.append((nbytes, "S(5)" in (layout or ""), bool(sizes)))
  if instr.opcode == "copy-start":
    if len(arrays) < 2 or arrays[0][1] == arrays[1][1]:
      return None
    return _HostCopy("device-to-host" if arrays[0][1] else "host-to-device", arrays[0][0])
  # fusion-start: the operands, the result, the context (a scalar)
  *operands, result, _ = arrays if len(arrays) >= 3 else ([], None, None)
  if result is None:
    return None
  if result[1] and any(not host and big for _, host, big in operands):  # into host memory
    return _HostCopy("device-to-host", sum(n for n, host, big in operands if big and not host))
  if not result[1] and any(host for _, host, _ in operands):  # out of it
    return _HostCopy("host-to-device", result[0])
  return None


class _Replay:
  """Runs a scheduled module on four streams with XLA's estimates (see `predict_step`).

  The compute stream runs the kernels of each computation in schedule order. A collective's
  start queues it on the communication stream (one collective at a time, in issue order); its
  done makes the compute stream wait until it has finished. A wait is charged to the
  collectives the communication stream runs meanwhile, so no collective is exposed for longer
  than it runs. Copies between host and device memory run the same way on a stream of their
  own per direction (the GPU's copy engines), at `HOST_LINK_BYTES_PER_S`.
  """

  def __init__(self, parser: hlo.Parser, wrapped: dict[str, float]):
    self.p = parser
    self.wrapped = wrapped  # async-start name -> estimate of the collective it wraps
    self.t = 0.0  # the compute stream's clock
    self.comm_free = 0.0  # when the communication stream is next idle
    self.slots: list[_Slot] = []
    self.comm: list[int] = []  # slots of the collectives, in stream order
    # the host copies' streams, one per direction: when each is next idle, and its slots
    self.host_free: dict[str, float] = {}
    self.host: dict[str, list[int]] = {}
    self.unestimated: dict[str, None] = {}
    self.unknown_trips: dict[str, None] = {}

  def cost(self, instr: hlo.Instr) -> float:
    us = _estimate_us(instr.attrs)
    if us is None:
      self.unestimated[instr.name] = None
      return 0.0
    return us

  def kernel(self, instr: hlo.Instr, kind: str, comp: str) -> None:
    end = self.t + self.cost(instr)
    self.slots.append(_Slot(instr.name, kind, "compute", self.t, end, comp))
    self.t = end

  def issue(self, instr: hlo.Instr, kind: str, comp: str) -> int:
    """Queues a collective on the communication stream: it starts once both its issue (the
    compute stream's clock) and the collective before it are done. Returns its slot."""
    us = _estimate_us(instr.attrs)
    if us is None:  # an async-start: the estimate is the collective's it wraps
      us = self.wrapped.get(instr.name)
    for called in hlo.called(instr) if us is None else ():  # unsugared: calls=%wrapped
      us = next((_estimate_us(i.attrs) for i in self.p.comps.get(called, [])[::-1]), None)
    if us is None:
      self.unestimated[instr.name] = None
    start = max(self.t, self.comm_free)
    self.comm_free = start + (us or 0.0)
    self.slots.append(_Slot(instr.name, kind, "comm", start, self.comm_free, comp))
    self.comm.append(len(self.slots) - 1)
    return len(self.slots) - 1

  def transfer(self, instr: hlo.Instr, copy: _HostCopy, comp: str) -> int:
    """Queues a host copy on its direction's stream, as `issue` a collective. Returns its
    slot."""
    direction, nbytes = copy.direction, copy.nbytes
    start = max(self.t, self.host_free.get(direction, 0.0))
    end = start + nbytes / HOST_LINK_BYTES_PER_S * 1e6
    self.host_free[direction] = end
    self.slots.append(_Slot(instr.name, direction, "host", start, end, comp))
    self.host.setdefault(direction, []).append(len(self.slots) - 1)
    return len(self.slots) - 1

  def wait(self, slot: int) -> None:
    """The compute stream waits for collective (or host copy) `slot` to finish (its done,
    or a synchronous collective): the wait, `[t, end]`, is exposed communication."""
    end = self.slots[slot].end
    if end <= self.t:
      return
    waited = self.slots[slot]
    stream = self.host[waited.kind] if waited.lane == "host" else self.comm
    # Charge the wait to the collectives that run in it, newest first: the stream runs one
    # at a time, so each is charged only its overlap with the wait, at most its own length.
    for i in reversed(stream):  # the stream is busy all through [t, end]
      s = self.slots[i]
      if s.end <= self.t:
        break
      s.exposed += max(0.0, min(s.end, end) - max(s.start, self.t))
    self.t = end

  def loop(self, instr: hlo.Instr, depth: int) -> None:
    body = re.search(r"\bbody=%?([\w.\-]+)", instr.attrs)
    cond = re.search(r"\bcondition=%?([\w.\-]+)", instr.attrs)
    n = hlo.TRIP_COUNT.search(instr.attrs)
    if n:  # XLA:GPU runs the body n times and never the condition (while_thunk.cc)
      for _ in range(int(n.group(1))):
        self.run(body.group(1), depth + 1)
      return
    self.unknown_trips[instr.name] = None
    for comp in (cond, body, cond):
      if comp:
        self.run(comp.group(1), depth + 1)

  def branches(self, instr: hlo.Instr, depth: int) -> None:
    """A conditional: the longest branch (each replayed from the same state)."""
    # the replay's state before the branches: both clocks, and how many slots exist
    before = (self.t, self.comm_free, len(self.slots), len(self.comm))
    longest = None
    for comp in hlo.called(instr):
      self.t, self.comm_free = before[:2]
      del self.slots[before[2] :], self.comm[before[3] :]
      self.run(comp, depth + 1)
      if longest is None or self.t > longest[0]:
        longest = (self.t, self.comm_free, self.slots[before[2] :], self.comm[before[3] :])
    if longest is not None:
      self.t, self.comm_free = longest[:2]
      del self.slots[before[2] :], self.comm[before[3] :]
      self.slots += longest[2]
      self.comm += longest[3]

  def run(self, comp: str, depth: int = 0) -> None:
    if depth > 64:
      raise ValueError(f"predict_step: computations nested over 64 deep at {comp}")
    in_flight: dict[str, int] = {}
    for instr in self.p.comps.get(comp, []):
      classified = self.p.classify(instr)
      category, kind, role = classified.category, classified.kind, classified.role
      copy = _host_copy(instr)
      if copy is not None:
        in_flight[instr.name] = self.transfer(instr, copy, comp)
      elif instr.opcode == "copy-done" or (
        instr.opcode == "fusion-done" and any(o in in_flight for o in instr.operands)
      ):
        slot = next((in_flight.pop(o) for o in instr.operands if o in in_flight), None)
        if slot is not None:
          self.wait(slot)
      elif role in ("sync", "start") and kind is not None:
        slot = self.issue(instr, kind, comp)
        if role == "sync":
          self.wait(slot)
        else:
          in_flight[instr.name] = slot
      elif role == "done":
        slot = next((in_flight.pop(o) for o in instr.operands if o in in_flight), None)
        if slot is not None:
          self.wait(slot)
      elif instr.opcode == "while":
        self.loop(instr, depth)
      elif instr.opcode == "conditional":
        self.branches(instr, depth)
      elif instr.opcode == "call":
        for called in hlo.called(instr):
          self.run(called, depth + 1)
      elif category in ("gemm", "compute"):
        self.kernel(instr, category, comp)

  def prediction(self) -> StepPrediction:
    comm: dict[str, float] = {}
    exposed: dict[str, float] = {}
    host: dict[str, float] = {}
    host_exposed: dict[str, float] = {}
    compute = 0.0
    for s in self.slots:
      if s.lane in ("comm", "host"):
        times, waits = (comm, exposed) if s.lane == "comm" else (host, host_exposed)
        times[s.kind] = times.get(s.kind, 0.0) + (s.end - s.start)
        waits[s.kind] = waits.get(s.kind, 0.0) + s.exposed
      else:
        compute += s.end - s.start
    comm["total"], exposed["total"] = sum(comm.values()), sum(exposed.values())
    if host:
      host["total"], host_exposed["total"] = sum(host.values()), sum(host_exposed.values())
    timeline = tuple(
      Interval(s.name, s.kind, s.lane, s.start, s.end, s.computation, s.exposed) for s in self.slots
    )
    return StepPrediction(
      module=self.p.module,
      step_us=self.t,
      compute_us=compute,
      comm_us=comm,
      exposed_us=exposed,
      timeline=timeline,
      unestimated=tuple(self.unestimated),
      unknown_trip_counts=tuple(self.unknown_trips),
      host_us=host,
      host_exposed_us=host_exposed,
    )


def predict_step(
  program: Any,
  *args: Any,
  compiler_options: dict[str, Any] | None = None,
  **kwargs: Any,
) -> StepPrediction:
  """Predicts a compiled GPU program's time from XLA's own cost model.

  XLA's GPU latency hiding scheduler orders a program with an estimate of every kernel and
  collective (on Hopper and Blackwell its analytical speed-of-light model: roofline kernels,
  measured tables for GEMMs and collectives). Compiled with `COST_MODEL_OPTIONS`, the program
  keeps those estimates; this replays its schedule with them. Kernels run back to back on one
  stream, every `while` body its known trip count of times; a collective starts on its own
  stream when issued (after the one before it) and its done waits for it. What the kernels
  wait is the exposed communication; the rest of each collective is hidden.

  Not modelled: kernels slowed by a collective running beside them (memory bandwidth, SMs), host
  overhead and launch latency, anything XLA gave no estimate (`unestimated`).

  Args:
    program: a `jax.stages.Compiled` compiled with `COST_MODEL_OPTIONS` (`compile_for_gpu` and
      `compile_train_step` add them); its `as_text()`; a `jax.stages.Lowered` or a function
      (jitted or not, or a jaxdp train step) with `args`/`kwargs`, compiled here with them.
    *args: example arguments (arrays or `jax.ShapeDtypeStruct`) when `program` is a function.
    compiler_options: more XLA options for the compile done here.
    **kwargs: keyword arguments of the function.

  Returns:
    The `StepPrediction`: step time, compute time, per collective kind the communication time
    and the exposed part of it, and the timeline in microseconds.

  Raises:
    ValueError: if the program carries no estimates: not a GPU program, or compiled without
      `COST_MODEL_OPTIONS`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from jaxdp import inspect
    >>> mesh = inspect.gpu_mesh((8,), ("data",))
    >>> x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    >>> p = inspect.predict_step(inspect.compile_for_gpu(lambda x: jnp.tanh(x @ x.T).sum(), x))
    >>> p.step_us > p.comm_us["all-gather"] >= p.exposed_us["all-gather"] >= 0
    True
    >>> sorted({i.lane for i in p.timeline})
    ['comm', 'compute']
  """
  if isinstance(program, StepPrediction):
    return program
  wrapped: dict[str, float] = {}
  if isinstance(program, str):
    text = program
  else:
    options = {**COST_MODEL_OPTIONS, **(compiler_options or {})}
    compiled = _compiled(program, args, kwargs, options)
    text, wrapped = compiled.as_text(), _wrapped_estimates(compiled)
  parser = hlo.Parser(text)
  if not _REIFICATION.search(text) or '"name":"sol"' not in text:
    raise ValueError(
      f"predict_step: {parser.module} carries no XLA:GPU cost estimates; pass a GPU program "
      "compiled with compiler_options=jaxdp.inspect.COST_MODEL_OPTIONS (compile_for_gpu and "
      "compile_train_step add them), or the function or Lowered to compile here"
    )
  replay = _Replay(parser, wrapped)
  replay.run(parser.entry)
  return replay.prediction()
