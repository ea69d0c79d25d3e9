"""The CUDA plugin's noise, kept quiet on a machine without an NVIDIA driver.

With JAX's CUDA plugin installed (the `aot` extra), JAX writes three kinds of lines that say
nothing on a machine without an NVIDIA driver, where JAX runs on its CPU backend as it would
without the plugin:

1. `import jax` loads three of the plugin's libraries, and each, finding no CUDA driver,
   writes "Could not find cuda drivers on your machine, GPU will not be used." to fd 2 from
   C++ (absl logging, before any log level can be set; no environment variable silences
   it), after absl's own note that it logs to stderr.
2. When the backend starts with `JAX_PLATFORMS` unset, the plugin's CUDA version check fails
   and JAX logs it as an 18-line "Jax plugin configuration error" traceback ("Unable to
   load CUDA"); the CPU backend is used.
3. When the backend starts with `JAX_PLATFORMS` set without CUDA (`cpu`: what compiling GPU
   programs without a GPU needs, `jaxdp.inspect`), the plugin skips that check and JAX
   loads its PJRT library, whose load writes line 1 once more.

So jaxdp drops exactly these there (`quiet_cuda_plugin`): 1 in `import_jax` when jaxdp is
the first to import JAX (when JAX came first, the lines are out already), 2 with a filter on
JAX's log record, 3 by loading the plugin library during jaxdp's import under the same
filter as 1 (JAX's own load then finds it loaded, and nothing runs twice); and the launcher
drops 1 from its workers' output (`drop_probe_lines`).

What is kept: every other line, and the lines themselves wherever an NVIDIA driver is
present (a GPU machine whose driver fails to load still says so). Where no driver is
present, JAX's own warnings at backend start (a GPU that cannot be used) still come.
"""

import contextlib
import ctypes
import importlib.util
import logging
import os
import pathlib
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator

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


@contextlib.contextmanager
def _without_probe_lines() -> Iterator[None]:
  """Holds fd 2 in a temporary file meanwhile, then writes back every line but the probe's."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      for line in drop_probe_lines(held.read().splitlines(keepends=True)):
        os.write(2, line)


def import_jax() -> None:
  """Imports JAX; on a machine without an NVIDIA driver, without the probe's lines.

  Holds fd 2 in a temporary file while JAX imports, then writes back every line but the
  probe's (a failed import's traceback included). Does nothing more than `import jax`
  where JAX is already imported or a driver is present.
  """
  if "jax" in sys.modules or has_nvidia_driver():
    import jax  # noqa: PLC0415

    return
  with _without_probe_lines():
    import jax  # noqa: F401, PLC0415


class _NoCudaPluginError(logging.Filter):
  """Drops JAX's "Jax plugin configuration error" record of a CUDA plugin, nothing else."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith("Jax plugin configuration error") and "cuda" in message)


def _cuda_plugin_libraries() -> list[pathlib.Path]:
  """The PJRT libraries of the installed CUDA plugins (`jax_plugins.xla_cuda12`, ...)."""
  try:
    spec = importlib.util.find_spec("jax_plugins")
  except (ImportError, ValueError):
    return []
  folders = spec.submodule_search_locations if spec else None
  return sorted(
    library
    for folder in folders or ()
    for library in pathlib.Path(folder).glob("xla_cuda*/xla_cuda_plugin.so")
  )


def quiet_cuda_plugin() -> None:
  """On a machine without an NVIDIA driver, keeps JAX's CUDA plugin from saying so later.

  Call it after JAX is imported and before its backend starts. Filters JAX's "Jax plugin
  configuration error" record of a CUDA plugin (logger `jax._src.xla_bridge`), and where
  `jax_platforms` is set without CUDA (so that JAX will load the plugin's library when its
  backend starts), loads that library now, without its probe lines. Does nothing where a
  driver is present.
  """
  if has_nvidia_driver():
    return
  import jax  # noqa: PLC0415

  logging.getLogger("jax._src.xla_bridge").addFilter(_NoCudaPluginError())
  platforms = {p.strip() for p in (jax.config.jax_platforms or "").split(",") if p.strip()}
  if not platforms or platforms & {"cuda", "gpu"}:
    return  # JAX loads no plugin library (its check fails first), or a GPU is asked for.
  for library in _cuda_plugin_libraries():
    with _without_probe_lines():
      try:
        ctypes.CDLL(str(library))
      except OSError:
        pass  # JAX's own load will say what is wrong with it.
