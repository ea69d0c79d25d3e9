"""The CUDA plugin's driver probe, kept quiet on a machine without an NVIDIA driver.

With JAX's CUDA plugin installed (the `aot` extra), `import jax` loads three of the
plugin's libraries, and each, finding no CUDA driver, writes "Could not find cuda drivers
on your machine, GPU will not be used." to fd 2 from C++ (absl logging, before any log
level can be set; no environment variable silences it), after absl's own note that it
logs to stderr. On a machine without an NVIDIA driver these lines say nothing: JAX runs on
its CPU backend, as it would without the plugin. So jaxdp's own processes drop exactly
these lines there: `import_jax` when jaxdp is the first to import JAX, and the launcher
for its workers' output (`drop_probe_lines`).

What is kept: every other line, and the lines themselves wherever an NVIDIA driver is
present (a GPU machine whose driver fails to load still says so). Where no driver is
present, JAX's own warnings at backend start (a GPU that cannot be used) still come.
"""

import os
import re
import sys
import tempfile
from collections.abc import Iterable

_PROBE = re.compile(
  rb"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not be used\."
)
_ABSL_NOTE = (
  b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
)
_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/dxg")  # Linux; WSL2


def has_nvidia_driver() -> bool:
  """Whether this machine shows an NVIDIA driver (Linux's, or WSL2's GPU device)."""
  return any(os.path.exists(p) for p in _DRIVER_PATHS)


def is_probe_line(line: bytes) -> bool:
  """Whether `line` is the plugin's "Could not find cuda drivers" line."""
  return _PROBE.search(line) is not None


def is_absl_note(line: bytes) -> bool:
  """Whether `line` is absl's note that it logs to stderr (written before each probe line)."""
  return line.rstrip(b"\r\n") == _ABSL_NOTE


def drop_probe_lines(lines: Iterable[bytes]) -> list[bytes]:
  """`lines` without the driver-probe lines and the absl note right before each one.

  Examples:
    >>> note = b"WARNING: All log messages before absl::InitializeLog() is called are "
    >>> note += b"written to STDERR\\n"
    >>> probe = b"I0000 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
    >>> probe += b"GPU will not be used.\\n"
    >>> drop_probe_lines([note, probe, b"real error\\n", note, b"other log\\n"])
    [b'real error\\n', b'WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n', b'other log\\n']
  """
  out: list[bytes] = []
  for line in lines:
    if is_probe_line(line):
      if out and is_absl_note(out[-1]):
        out.pop()
    else:
      out.append(line)
  return out


def import_jax() -> None:
  """Imports JAX; on a machine without an NVIDIA driver, without the probe's lines.

  Holds fd 2 in a temporary file while JAX imports, then writes back every line but the
  probe's (a failed import's traceback included). Does nothing more than `import jax`
  where JAX is already imported or a driver is present.
  """
  if "jax" in sys.modules or has_nvidia_driver():
    import jax  # noqa: PLC0415

    return
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      import jax  # noqa: F401, PLC0415
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      for line in drop_probe_lines(held.read().splitlines(keepends=True)):
        os.write(2, line)
