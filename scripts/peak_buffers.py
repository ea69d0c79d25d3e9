"""The buffers alive at a compiled program's memory peak, read from an XLA dump.

Compile with `XLA_FLAGS=--xla_dump_to=DIR` (e.g. one `scripts/fsdp_memory.py` row), then

    python scripts/peak_buffers.py DIR            # the peak and what is alive there
    python scripts/peak_buffers.py DIR --every 8  # live bytes along the schedule

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


def _one(directory: str, suffix: str) -> str:
  files = sorted(glob.glob(f"{directory}/*after_optimizations-{suffix}.txt"))
  if not files:
    sys.exit(f"{directory}: no *after_optimizations-{suffix}.txt (compile with --xla_dump_to)")
  return open(files[-1]).read()  # the last module: the train step, after any probe programs


def live_bytes(directory: str):
  """`(schedule names, per step {(allocation, offset): (bytes, value)})`."""
  ranges_text = _one(directory, "live-range")
  sequence, rest = ranges_text.split("BufferLiveRange:")
  names = {int(i): n for i, n in re.findall(r"^    (\d+):(\S+)$", sequence, re.M)}
  ranges = {
    v.removesuffix("{}"): (int(a), int(b))
    for v, a, b in re.findall(r"^    (\S+):(\d+)-(\d+)$", rest.split("Live ranges at")[0], re.M)
  }
  values, alloc, skip = [], None, True
  for line in _one(directory, "buffer-assignment").splitlines():
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
  args = parser.parse_args()
  names, live = live_bytes(args.dump)
  total = [sum(s for s, _ in step.values()) for step in live]
  peak = max(range(len(total)), key=total.__getitem__)
  print(f"temporaries at the peak: {total[peak] / MiB:.1f} MiB, step {peak} ({names.get(peak)})")
  for size, name in sorted(live[peak].values(), reverse=True):
    if size >= args.min_mib * MiB:
      print(f"  {size / MiB:8.1f}  {name}")
  for t in range(0, len(total), args.every) if args.every else ():
    print(f"{t:6d} {total[t] / MiB:8.1f}  {names.get(t, '')}")


if __name__ == "__main__":
  main()
