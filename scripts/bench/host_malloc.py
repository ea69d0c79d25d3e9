"""Run a benchmark process with a host allocator that keeps freed memory, as a GPU's does.

XLA:CPU allocates a program's temporaries as one block per execution. glibc serves a block
above its mmap threshold (dynamic, at most 32 MiB by default) with a fresh `mmap` and
unmaps it when freed, so every step page-faults the whole block in again: 8 simulated
devices x 40 MiB is ~80k page faults per step, on the 2 cores the devices share. A program
whose temporaries cross 32 MiB per device is then charged for the kernel zeroing pages,
one that stays below is not (GPT medium under jaxdp's `optim`: 40 MiB, 1.37-1.45 x
`gspmd_zero1`'s step; with the allocator below, 1.08). On a GPU, XLA's caching allocator
hands the same memory back every step and nothing of this happens, so the benchmarks run
both programs under a glibc told to keep freed memory (no mmap for large blocks, no trim):
it treats every program alike and models the device's allocator. `--system-malloc` in
the scripts runs with glibc's defaults instead.

glibc reads these settings when the process starts, so `keep_freed_memory` re-executes the
script with them in its environment (once; they are then set).
"""

import os
import sys

SETTINGS = {
  "MALLOC_MMAP_THRESHOLD_": str(2**30),  # blocks up to 1 GiB come from the heap, not mmap
  "MALLOC_TRIM_THRESHOLD_": str(2**32),  # freed heap memory is kept, not returned
}


def describe() -> str:
  """How this process's host allocator is set, for a benchmark's header."""
  if all(os.environ.get(k) == v for k, v in SETTINGS.items()):
    return (
      "glibc malloc keeping freed memory ("
      + ", ".join(f"{k}={v}" for k, v in SETTINGS.items())
      + ")"
    )
  return "glibc malloc with its defaults"


def keep_freed_memory() -> None:
  """Re-execute this script with `SETTINGS` in its environment, unless they are set."""
  if all(os.environ.get(k) == v for k, v in SETTINGS.items()):
    return
  sys.stdout.flush()
  os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **SETTINGS})


def add_flag(parser) -> None:
  """The scripts' `--system-malloc` flag (read by `apply`)."""
  parser.add_argument(
    "--system-malloc",
    action="store_true",
    help="glibc's default host allocator (default: one that keeps freed memory, as a GPU's "
    "does; see scripts/bench/host_malloc.py)",
  )


def apply(args) -> None:
  """Keeps freed memory (`keep_freed_memory`) unless `--system-malloc` was given."""
  if not args.system_malloc:
    keep_freed_memory()
