"""XLA's HLO text, read: computations, instructions, shapes, device groups, what each op is.

`Parser` reads an HLO module's text (`compiled.as_text()`, scheduled, or the HLO before
optimization, `lowered.as_text(dialect="hlo")`) into its computations and their instructions
(`Instr`), says what each instruction is to a schedule (`Parser.classify`: a collective or a
half of one, a GEMM, another kernel, control flow, or nothing that runs) and walks them in run
order, loop and call bodies inlined (`Parser.walk`). A shape reads as its arrays and bytes
(`arrays`, `shape_bytes`), a collective's device groups in each form XLA prints them
(`parse_replica_groups`, `parse_mesh_groups`). `jaxdp._src.inspect` builds its schedules and
its time predictions on them.

The HLO forms handled are the ones XLA 0.10.2 prints (checked on CPU and on the deviceless H100
target, see tests/test_inspect.py):

- CPU: synchronous `all-reduce`, `reduce-scatter`, `all-gather`, `all-to-all`, `collective-permute`,
  possibly tuple-shaped (combined).
- GPU: `all-reduce-start`/`-done`, `all-gather-start`/`-done`, `collective-permute-start`/`-done`
  and the async-wrapped `reduce-scatter-start`/`-done` and `all-to-all-start`/`-done` (the printed
  sugar for `async-start`/`async-done`; the unsugared `async-start(...), calls=%wrapped` form is
  read too). A start whose `backend_config` says `"is_sync":true` is one XLA runs synchronously:
  nothing could overlap it.
- Collectives inside `while` bodies count `known_trip_count` times.

XLA's text changes with XLA: a line this module cannot read as an instruction stops the parse,
named, never a schedule that silently leaves an op out.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

COLLECTIVE_KINDS = (
  "all-reduce",
  "reduce-scatter",
  "all-gather",
  "all-to-all",
  "collective-permute",
)

# Ops that launch no kernel: nothing runs while they "execute".
_FREE_OPCODES = frozenset(
  {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "after-all",
    "add-dependency",
    "opt-barrier",
    "partition-id",
    "replica-id",
    "domain",
    "async-update",
    "copy-start",
    "copy-done",
    "send",
    "recv",
    "send-done",
    "recv-done",
  }
)
_CONTROL_OPCODES = frozenset({"while", "call", "conditional"})
_GEMM_TARGET = re.compile(r"gemm|matmul|\$conv", re.IGNORECASE)

# The `/*index=5*/` markers XLA prints inside long operand and tuple lists.
_COMMENT = re.compile(r"/\*.*?\*/")
# Names print with a "%" in compiled text and without one in pre-optimization HLO
# (`lowered.as_text(dialect="hlo")`, whose computations also have no signature).
# A computation's first line, `ENTRY %main.12 (p.0: f32[8]) -> f32[8] {` or `%region_0.3 {`:
# groups (ENTRY, name).
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{\s*$")
# An instruction, `  ROOT %add.3 = f32[8]{0} add(%a, %b), metadata={...}`: groups (ROOT,
# name, everything after the "=", which `_parse_instr` splits into shape, opcode, operands).
_INSTR = re.compile(r"^\s+(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
# An array in a shape, `bf16[8,1024]{1,0}`, `pred[]`, `s32[<=16]` (a dynamic dim: its bound):
# groups (element type, dims); a tuple shape holds several.
_ARRAY = re.compile(r"\b(pred|token|[a-z]+[0-9]+[a-z0-9]*)\[([^\]]*)\]")
# An operand named in compiled text: `%param.1`.
_NAME_REF = re.compile(r"%([\w.\-]+)")
# The trip count XLA knows for a `while`, in its backend_config: `"known_trip_count":{"n":"8"}`.
TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


# ----------------------------------------------------------------------------
# Sizes and device groups


def dtype_bits(name: str) -> int:
  """Bits of one element of an HLO element type (`f32`: 32, `pred`: 8, `token`: 0)."""
  if name == "pred":
    return 8
  if name == "token":
    return 0
  # the first number in the type's name: f32 -> 32, bf16 -> 16, f8e4m3fn -> 8, s4 -> 4
  m = re.match(r"[a-z]+?(\d+)", name)
  if not m:
    raise ValueError(f"unknown HLO element type {name!r}")
  return int(m.group(1))


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """The `(element type, dims)` of each array in a shape (several in a tuple shape)."""
  out = []
  for dtype, dims in _ARRAY.findall(shape):
    # a dynamic dim `<=16` counts at its bound: the buffer XLA allocates
    sizes = tuple(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())
    out.append((dtype, sizes))
  return out


def shape_bytes(shape: str) -> int:
  """Bytes of a shape: its arrays' together."""
  return sum(math.ceil(math.prod(dims) * dtype_bits(dtype) / 8) for dtype, dims in arrays(shape))


def parse_replica_groups(attrs: str) -> tuple[tuple[int, ...], ...] | None:
  """A collective's `replica_groups=` in the explicit or the iota form, or None."""
  # Explicit form: replica_groups={{0,1,2,3},{4,5,6,7}}, one {...} per group.
  m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
  if m:
    return tuple(
      tuple(int(x) for x in g.split(",") if x.strip())
      for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))
    )
  # Iota form: [groups,size]<=[dims] or [groups,size]<=[dims]T(perm): the device ids
  # 0 .. prod(dims) - 1 laid out as `dims`, transposed by `perm`, read row-major into
  # `groups` rows of `size` (e.g. [2,4]<=[4,2]T(1,0) is {{0,2,4,6},{1,3,5,7}}).
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if m:
    import numpy as np  # noqa: PLC0415

    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return tuple(tuple(int(x) for x in g) for g in ids.reshape(shape))
  return None


def parse_mesh_groups(attrs: str):
  """Shardy form `mesh['a'=4,'b'=2] {'a'}` -> (group size, groups).

  Devices are numbered row-major over the mesh axes (the form has no device list); groups are left
  empty when a sub-axis (`'a':(1)2`) is reduced.
  """
  at = attrs.find("replica_groups=mesh[")
  if at < 0:
    return None
  open_at = at + len("replica_groups=mesh")
  close = balanced(attrs, open_at)
  mesh = attrs[open_at + 1 : close - 1]
  # the mesh's devices, where not 0..n-1 row-major: `, device_ids=([2,4]T(1,0))` (iota form,
  # as replica groups have it) or `, device_ids=(0,4,1,5,...)`
  rest, ids_text = attrs[close:], None
  d = re.match(r",\s*device_ids=", rest)
  if d:
    end = balanced(rest, d.end())
    ids_text, rest = rest[d.end() + 1 : end - 1], rest[end:]
  # the axes reduced over, after the mesh: `{'a'}`, `{'a', 'b'}`
  m = re.match(r"\s*\{([^}]*)\}", rest)
  if not m:
    return None
  names_sizes = re.findall(r"'([^']+)'=(\d+)", mesh)  # [('a', '4'), ('b', '2')]
  names = [a for a, _ in names_sizes]
  sizes = [int(n) for _, n in names_sizes]
  # each reduced axis, or a sub-axis of one, `'a':(1)2` (pre-size 1, size 2): (name, pre, size)
  reduced = re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", m.group(1))
  size = 1
  for axis, _, sub in reduced:
    size *= int(sub) if sub else sizes[names.index(axis)]
  if any(sub for _, _, sub in reduced) or "device_ids" in mesh:
    return size, ()
  import numpy as np  # noqa: PLC0415

  ids = np.arange(math.prod(sizes))
  if ids_text is not None:
    ids = _device_ids(ids_text, ids.size)
  # A group is the devices that differ only in the reduced axes: move those axes last and
  # read the ids row-major in rows of `size`.
  axes = [names.index(a) for a, _, _ in reduced]
  kept = [i for i in range(len(names)) if i not in axes]
  ids = ids.reshape(sizes).transpose(kept + axes)
  groups = tuple(tuple(int(x) for x in g) for g in ids.reshape(-1, size))
  return size, groups


def _device_ids(text: str, n: int):
  """A mesh's `device_ids=(...)`: the iota form `[2,4]T(1,0)` (the ids 0..n-1 laid out as
  [2,4], transposed by (1,0), read row-major) or an explicit list `0,4,1,5,...`."""
  import numpy as np  # noqa: PLC0415

  m = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
  if m:
    dims = [int(x) for x in m.group(1).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(2):
      ids = ids.transpose([int(x) for x in m.group(2).split(",")])
    ids = ids.ravel()
  elif re.fullmatch(r"[\d,\s]+", text):
    ids = np.array([int(x) for x in text.split(",") if x.strip()])
  else:
    raise ValueError(f"HLO text: a mesh's device_ids jaxdp cannot read: {text[:120]!r}")
  if ids.size != n:
    raise ValueError(f"HLO text: a mesh of {n} devices with {ids.size} device_ids: {text!r}")
  return ids


# ----------------------------------------------------------------------------
# HLO text


@dataclasses.dataclass
class Instr:
  """One instruction of a computation: `name = shape opcode(operands), attrs`."""

  name: str
  shape: str
  opcode: str
  operands: list[str]
  attrs: str


def balanced(text: str, start: int) -> int:
  """Index just past the bracket group opening at text[start]."""
  # A stack of the closers expected; brackets inside a quoted string (a backend_config's
  # JSON, a metadata op_name) do not count, nor an escaped quote inside one.
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack = []
  in_str = False
  i = start
  while i < len(text):
    ch = text[i]
    if in_str:
      if ch == "\\":
        i += 1
      elif ch == '"':
        in_str = False
    elif ch == '"':
      in_str = True
    elif ch in pairs:
      stack.append(pairs[ch])
    elif stack and ch == stack[-1]:
      stack.pop()
      if not stack:
        return i + 1
    i += 1
  return len(text)


def _names(text: str) -> list[str]:
  """Instruction names in an operand list: `%a, %b` or (pre-optimization) `a, b`."""
  if "%" in text:
    return _NAME_REF.findall(text)
  # Pre-optimization operands may carry their shapes (`f32[8]{0} Arg_0.1, f32[8]{0} b.2`):
  # the name is the last word of each comma-separated part at bracket depth 0.
  names, depth, start = [], 0, 0
  for i, ch in enumerate(text + ","):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      part = text[start:i].split()
      if part and re.fullmatch(r"[\w.\-]+", part[-1]):
        names.append(part[-1])
      start = i + 1
  return names


def _parse_instr(line: str) -> Instr | None:
  m = _INSTR.match(line)
  if not m:
    return None
  # `rest` is `shape opcode(operands), attrs`: a tuple shape `(f32[8], s32[])` runs to its
  # closing parenthesis, an array shape `f32[8]{0}` to the first space.
  name, rest = m.group(2), m.group(3)
  if rest.startswith("("):
    end = balanced(rest, 0)
  else:
    end = rest.find(" ")
    end = len(rest) if end < 0 else end
  shape, rest = rest[:end], rest[end:].lstrip()
  m = re.match(r"([\w\-]+)\(", rest)
  if not m:
    return None
  opcode = m.group(1)
  close = balanced(rest, m.end() - 1)
  operands = _names(rest[m.end() : close - 1])
  attrs = rest[close:]
  return Instr(name, shape, opcode, operands, attrs)


@dataclasses.dataclass(frozen=True)
class _Module:
  """An HLO module's text, parsed (`_parse_module`)."""

  header: str
  """The `HloModule` line."""
  comps: dict[str, list[Instr]]
  """Each computation's instructions, in the text's (the schedule's) order."""
  entry: str
  """The ENTRY computation's name."""


@dataclasses.dataclass(frozen=True)
class _Classified:
  """What an instruction is to the schedule (`Parser.classify`)."""

  category: str
  """"collective", "collective-start", "collective-done", "free", "control", "gemm" or
  "compute"."""
  kind: str | None = None
  """A collective's kind ("all-gather", ...)."""
  role: str | None = None
  """A collective's part: "sync" (one instruction), "start" or "done"."""


def _parse_module(text: str) -> _Module:
  # Line by line: a computation opens with a header line ending in "{" and closes with a
  # line starting "}"; in between, one instruction per line.
  text = _COMMENT.sub("", text)
  comps: dict[str, list[Instr]] = {}
  entry = None
  header = ""
  current = None
  for line in text.splitlines():
    if line.startswith("HloModule"):
      header = line
      continue
    if current is None:
      m = _HEADER.match(line)
      if m:
        current = m.group(2)
        comps[current] = []
        if m.group(1):
          entry = current
      continue
    if line.startswith("}"):
      current = None
      continue
    instr = _parse_instr(line)
    if instr is not None:
      comps[current].append(instr)
    elif line.strip():
      # XLA's text changes with XLA: a line read as nothing would drop its op from every
      # count and prediction, so one jaxdp cannot read stops the parse, named.
      raise ValueError(
        f"HLO text: a line of computation {current!r} jaxdp cannot read as an instruction "
        f"(this XLA prints something new): {line.strip()[:200]!r}"
      )
  if entry is None:
    raise ValueError(
      "schedule: no ENTRY computation found; pass compiled.as_text() (the "
      "optimized HLO) or lowered.as_text(dialect='hlo') (before optimization), "
      "not StableHLO (lowered.as_text())"
    )
  return _Module(header, comps, entry)


def called(instr: Instr) -> list[str]:
  """The computations `instr` calls, named in its attributes."""
  names = []
  # one computation: `to_apply=%add.1`, `body=%region_2.5`
  for key in ("calls", "to_apply", "body", "condition", "true_computation", "false_computation"):
    m = re.search(rf"\b{key}=%?([\w.\-]+)", instr.attrs)
    if m:
      names.append(m.group(1))
  # several: `branch_computations={%branch_0, %branch_1}`, a fusion's `calls={...}`
  for key in ("branch_computations", "calls"):
    m = re.search(rf"\b{key}=\{{([^}}]*)\}}", instr.attrs)
    if m:
      names += _names(m.group(1))
  return names


def _collective_kind(opcode: str) -> tuple[str, str] | None:
  """-> (kind, "sync" | "start" | "done") for a collective opcode."""
  for kind in COLLECTIVE_KINDS:
    if opcode == kind:
      return kind, "sync"
    if opcode == kind + "-start":
      return kind, "start"
    if opcode == kind + "-done":
      return kind, "done"
  return None


class Parser:
  """An HLO module's text, read: its computations, what each instruction is, the run order."""

  def __init__(self, text: str):
    module = _parse_module(text)
    header, self.comps, self.entry = module.header, module.comps, module.entry
    m = re.match(r"HloModule\s+([\w.\-]+)", header)
    self.module = m.group(1) if m else "unknown"
    self.is_scheduled = "is_scheduled=true" in header
    m = re.search(r"num_partitions=(\d+)", header)
    self.num_partitions = int(m.group(1)) if m else 1
    m = re.search(r"replica_count=(\d+)", header)
    self.replica_count = int(m.group(1)) if m else 1
    self.shapes = {c: {i.name: i.shape for i in instrs} for c, instrs in self.comps.items()}
    self._gemm_cache: dict[str, bool] = {}

  def has_gemm(self, comp: str, seen: frozenset = frozenset()) -> bool:
    if comp in self._gemm_cache:
      return self._gemm_cache[comp]
    if comp in seen or comp not in self.comps:
      return False
    found = any(
      self.is_gemm(i) or any(self.has_gemm(c, seen | {comp}) for c in called(i))
      for i in self.comps[comp]
    )
    self._gemm_cache[comp] = found
    return found

  def is_gemm(self, instr: Instr) -> bool:
    if instr.opcode in ("dot", "convolution"):
      return True
    if instr.opcode == "custom-call":
      m = re.search(r'custom_call_target="([^"]*)"', instr.attrs)
      return bool(m and _GEMM_TARGET.search(m.group(1)))
    if instr.opcode == "fusion":
      return any(self.has_gemm(c) for c in called(instr))
    return False

  def wrapped_collective(self, instr: Instr) -> Instr | None:
    """The collective an unsugared async-start wraps (its kind and its replica groups are
    that instruction's, not the start's)."""
    for comp in called(instr):
      for inner in self.comps.get(comp, []):
        kind = _collective_kind(inner.opcode)
        if kind and kind[1] == "sync":
          return inner
    return None

  def collective_attrs(self, instr: Instr) -> str:
    """A collective's attributes (replica groups, pairs): an unsugared async-start's are
    those of the collective it wraps, with its own (`is_sync`, a backend_config) after."""
    if instr.opcode != "async-start":
      return instr.attrs
    inner = self.wrapped_collective(instr)
    return instr.attrs if inner is None else inner.attrs + instr.attrs

  def classify(self, instr: Instr) -> _Classified:
    kind = _collective_kind(instr.opcode)
    if kind is None and instr.opcode in ("async-start", "async-done"):
      role = "start" if instr.opcode == "async-start" else "done"
      inner = self.wrapped_collective(instr) if role == "start" else None
      wrapped = _collective_kind(inner.opcode)[0] if inner is not None else None
      kind = (wrapped, role) if (wrapped or role == "done") else None
    if kind is not None:
      collective, role = kind
      category = "collective" if role == "sync" else f"collective-{role}"
      return _Classified(category, collective, role)
    if instr.opcode in _FREE_OPCODES:
      return _Classified("free")
    if instr.opcode in _CONTROL_OPCODES:
      return _Classified("control")
    if self.is_gemm(instr):
      return _Classified("gemm")
    return _Classified("compute")

  def walk(self) -> Iterator[tuple[Instr, str, int]]:
    """Instrs in schedule order, while/call/conditional bodies inlined."""

    def go(comp: str, trips: int, depth: int):
      if depth > 64:
        return
      for instr in self.comps.get(comp, []):
        yield instr, comp, trips
        if instr.opcode == "while":
          # `body=%region_1.2`, and the trip count XLA knows, in the while's backend_config
          # (`"known_trip_count":{"n":"8"}`); unknown: counted once
          m = re.search(r"\bbody=%([\w.\-]+)", instr.attrs)
          n = TRIP_COUNT.search(instr.attrs)
          if m:
            yield from go(m.group(1), trips * (int(n.group(1)) if n else 1), depth + 1)
        elif instr.opcode in ("call", "conditional"):
          for c in called(instr):
            yield from go(c, trips, depth + 1)

    yield from go(self.entry, 1, 0)

  def operand_shapes(self, comp: str, instr: Instr) -> list[str]:
    table = self.shapes[comp]
    return [table[o] for o in instr.operands if o in table]
