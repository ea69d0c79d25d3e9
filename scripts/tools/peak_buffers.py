"""The buffers alive at a compiled program's memory peak, read from an XLA dump.

Compile with `XLA_FLAGS=--xla_dump_to=DIR` (e.g. one `scripts/bench/fsdp_memory.py` row), then

    python scripts/tools/peak_buffers.py DIR            # the peak and what is alive there
    python scripts/tools/peak_buffers.py DIR --every 8  # live bytes along the schedule
    python scripts/tools/peak_buffers.py DIR --module jit_step  # only modules named so

It reads the optimized module's `*-live-range.txt` (each value's live range in the flattened
schedule, while bodies included) and `*-buffer-assignment.txt` (each value's allocation and
offset). XLA's own "Live ranges at N (peak)" list counts values that share memory (an
in-place dynamic-update-slice and its operand) once each; here values at the same
allocation and offset count once. Parameters and constants are left out: the result is the
temporaries only. It is a liveness bound: `memory_analysis().temp_size_in_bytes` can be
larger (heap packing).
"""

import argparse
import collections
import glob
import re
import sys

MiB = 2**20


def _modules(directory: str, name: str | None) -> list[str]:
  """The dump's module prefixes (whose file names contain `name`, if given)."""
  files = glob.glob(f"{directory}/*after_optimizations-live-range.txt")
  if name is not None:
    files = [f for f in files if name in f.rsplit("/", 1)[-1]]
  if not files:
    named = f" naming {name!r}" if name else ""
    sys.exit(
      f"{directory}: no *after_optimizations-live-range.txt{named} (compile with --xla_dump_to)"
    )
  return sorted(f.removesuffix("live-range.txt") for f in files)


def _one(module: str, suffix: str) -> str:
  return open(f"{module}{suffix}.txt").read()


def live_bytes(module: str):
  """`(schedule names, per step {(allocation, offset): (bytes, value)})` of a `_module` prefix."""
  ranges_text = _one(module, "live-range")
  sequence, rest = ranges_text.split("BufferLiveRange:")
  names = {int(i): n for i, n in re.findall(r"^    (\d+):(\S+)$", sequence, re.M)}
  ranges = {
    v.removesuffix("{}"): (int(a), int(b))
    for v, a, b in re.findall(r"^    (\S+):(\d+)-(\d+)$", rest.split("Live ranges at")[0], re.M)
  }
  values, alloc, skip = [], None, True
  for line in _one(module, "buffer-assignment").splitlines():
    m = re.match(r"allocation (\d+): size \d+(.*)", line)
    if m:
      alloc = int(m[1])
      skip = any(k in m[2] for k in ("parameter", "constant", "thread-local"))
      continue
    m = re.match(r" value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\)", line)
    if m and not skip and m[1].removesuffix("{}") in ranges:
      name = m[1].removesuffix("{}")
      values.append(((alloc, int(m[3])), int(m[2]), name, ranges[name]))
  steps = max(b for _, b in ranges.values()) + 1
  live = [collections.defaultdict(lambda: (0, "")) for _ in range(steps)]
  for slot, size, name, (lo, hi) in values:
    for t in range(lo, hi + 1):
      if size > live[t][slot][0]:
        live[t][slot] = (size, name)
  return names, live


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dump", help="the --xla_dump_to directory")
  parser.add_argument("--every", type=int, default=0, help="also print live MiB every N steps")
  parser.add_argument("--min-mib", type=float, default=1.0, help="list buffers of at least this")
  parser.add_argument(
    "--module",
    help="only modules whose file name contains this (default: all; the one with the most temporaries is read)",
  )
  args = parser.parse_args()
  # A dump holds every program the process compiled (probes, RNG seeding, conversions)
  # beside the train step: by default, the module with the most temporaries at its peak.
  found = []
  for module in _modules(args.dump, args.module):
    names, live = live_bytes(module)
    total = [sum(s for s, _ in step.values()) for step in live]
    found.append((max(total), module, names, live, total))
  _, module, names, live, total = max(found, key=lambda f: f[0])
  peak = max(range(len(total)), key=total.__getitem__)
  print(f"module: {module.rsplit('/', 1)[-1].removesuffix('_after_optimizations-')}")
  print(f"temporaries at the peak: {total[peak] / MiB:.1f} MiB, step {peak} ({names.get(peak)})")
  for size, name in sorted(live[peak].values(), reverse=True):
    if size >= args.min_mib * MiB:
      print(f"  {size / MiB:8.1f}  {name}")
  for t in range(0, len(total), args.every) if args.every else ():
    print(f"{t:6d} {total[t] / MiB:8.1f}  {names.get(t, '')}")


if __name__ == "__main__":
  main()
