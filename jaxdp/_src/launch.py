"""A local multi-process launcher: P processes of one script, joined by `jaxdp.initialize`.

For development and tests on one machine (torchrun's `--standalone` in spirit): each
process gets the `JAXDP_*` environment that `jaxdp.initialize` reads (coordinator on
`127.0.0.1`, its process id, its CPU device count), its output is streamed with a
`[pI]` prefix, and when one process fails the others are stopped: SIGTERM, then SIGKILL
after a grace period. The launcher exits 0 only if every process exits 0.

A SIGTERM to the launcher (a scheduler taking the machines back: Kubernetes signals only
the container's first process) is forwarded to every process, which may save a checkpoint
before it exits (`CheckpointManager.reached_preemption`); they have `preemption_grace_s`
for it, or until a second signal, before they are SIGKILLed. Ctrl-C (SIGINT) is forwarded
too, with the short `grace_period_s`.

A job that stops making progress is ended too: when no process has written any output or
started a train step (`jaxdp.make_train_step`'s steps touch the file named by
`JAXDP_HEARTBEAT`) for `hang_timeout_s` seconds, the launcher asks every process for its
Python stacks (SIGABRT, which `PYTHONFAULTHANDLER` turns into a dump of every thread),
stops them and names where each one was. A multi-process job that hangs (processes waiting
in different collectives) otherwise waits forever: nothing fails, nothing times out.

Each line a process writes is relayed whole, under its `[pI]` prefix; a line that a
progress bar redraws with carriage returns is relayed once, as its last redraw shows it.
Two kinds of line are left out as noise: the CUDA plugin's driver probe on a machine
without an NVIDIA driver (`cuda_probe`), and Gloo's line per device and communicator that
says it connected to every peer ("[Gloo] Rank 3 is connected to 7 peer ranks. Expected
number of connected peer ranks is : 7"). Gloo's threads write those at the same moment,
unsynchronised, so they come out of the process spliced mid-line ("[Gloo] Rank 1[Gloo]
Rank  is connected to ..."): a line made only of those lines' pieces is left out too, and a
line saying fewer peers than expected is kept.

The launcher itself never touches devices: importing JAX does not start its backend.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Callable, Sequence

from jaxdp._src import checks, cuda_probe, distributed

_POLL_S = 0.05
PROG = "python -m jaxdp.launch"
HANG_TIMEOUT_S = 300.0
"""Default `hang_timeout_s`: seconds without output or train step before a job counts as hung."""
PREEMPTION_GRACE_S = 120.0
"""Default `preemption_grace_s`: after a SIGTERM to the launcher, seconds the processes have
to save and exit before they are SIGKILLed (longer than a scheduler's own grace period, so
that the scheduler, not the launcher, decides when a save is cut short)."""
_DUMP_WAIT_S = 10.0  # How long a hung process may take to write its stacks and die.


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def describe_exit(returncode: int) -> str:
  """`Popen.returncode` in words: `exit code 3` or `signal SIGKILL`.

  Examples:
    >>> describe_exit(3), describe_exit(-9)
    ('exit code 3', 'signal SIGKILL')
  """
  if returncode < 0:
    try:
      name = signal.Signals(-returncode).name
    except ValueError:
      name = str(-returncode)
    return f"signal {name}"
  return f"exit code {returncode}"


def _shell_code(returncode: int) -> int:
  """The shell's convention: a death by signal N is 128 + N."""
  return 128 - returncode if returncode < 0 else returncode


@dataclasses.dataclass
class _Worker:
  index: int
  proc: subprocess.Popen
  threads: list[threading.Thread]
  stopped_by_launcher: bool = False
  stderr_lines: list[bytes] | None = None  # Kept from the stack dump request on.


_GLOO_CONNECTED = re.compile(
  rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
  rb"Expected number of connected peer ranks is : (\d+)"
)
# The pieces Gloo writes each connection line in, one at a time: a line of nothing but these
# is its connection lines spliced.
_GLOO_PIECES = re.compile(
  rb"(?:\[Gloo\] Rank |\d+| is connected to | peer ranks\. "
  rb"|Expected number of connected peer ranks is : )+"
)


def is_gloo_chatter(line: bytes) -> bool:
  """Whether `line` is only Gloo's news of connecting to every peer, whole or spliced.

  A line saying fewer peers than expected is not; nor is one of digits alone.

  Examples:
    >>> ok = b"[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected "
    >>> ok += b"peer ranks is : 7"
    >>> is_gloo_chatter(ok + b"\\n"), is_gloo_chatter(ok.replace(b"to 7", b"to 5"))
    (True, False)
    >>> spliced = b"[Gloo] Rank 1[Gloo] Rank  is connected to 1 peer ranks. "
    >>> is_gloo_chatter(spliced), is_gloo_chatter(b"1"), is_gloo_chatter(b"[Gloo] Rank 0 hi")
    (True, False, False)
  """
  line = line.rstrip(b"\r\n")
  if line.isdigit() or _GLOO_PIECES.fullmatch(line) is None:
    return False
  return all(m[1] == m[2] for m in _GLOO_CONNECTED.finditer(line))


def last_redraw(line: bytes) -> bytes:
  """`line` as a terminal shows it: what follows its last carriage return (a progress bar
  redraws itself with them), with the line end kept.

  Examples:
    >>> last_redraw(b"\\r 10%\\r 20%\\r 30%\\n"), last_redraw(b"done\\r\\n")
    (b' 30%\\n', b'done\\r\\n')
  """
  return line[line.rstrip(b"\r\n").rfind(b"\r") + 1 :]


def _pump(
  pipe: IO[bytes],
  prefix: bytes,
  sink: IO[bytes],
  lock: threading.Lock,
  on_line: Callable[[bytes], None] = lambda line: None,
  drop_probe: bool = False,
) -> None:
  """Copies `pipe` to `sink` line by line, each line prefixed, until EOF.

  Only whole lines are written, each in one write under `lock`, so that the lines of
  several processes never mix; a line is written as its last carriage-return redraw shows
  it (`last_redraw`), and Gloo's connection news is left out (`is_gloo_chatter`).
  `on_line` sees every line, and also every chunk that ends without a newline (a progress
  bar's ``\r`` updates), so that any byte a process writes counts as progress.
  `drop_probe`: leave out the CUDA plugin's "Could not find cuda drivers" lines and absl's
  note before each (`cuda_probe`), for a machine without an NVIDIA driver.
  """

  def write(line: bytes) -> None:
    with lock:
      try:
        sink.write(prefix + line)
        sink.flush()
      except (BrokenPipeError, ValueError):  # Our own stdout went away: keep draining.
        pass

  held: list[bytes] = []  # absl's note, until the next line says whether a probe follows.

  def copy(line: bytes) -> None:
    on_line(line)
    line = last_redraw(line)
    if is_gloo_chatter(line):
      return
    if drop_probe:
      if cuda_probe.is_probe_line(line):
        held.clear()
        return
      for h in held:
        write(h)
      held.clear()
      if cuda_probe.is_absl_note(line):
        held.append(line)
        return
    write(line)

  # `os.read` returns what the pipe holds now (a buffered `readline` would wait for a whole
  # line), so a progress bar's partial line still counts as output for the hang check.
  pending = b""
  while chunk := os.read(pipe.fileno(), 65536):
    # the chunk's whole lines; the bytes after its last newline wait for the next chunk
    *lines, pending = (pending + chunk).split(b"\n")
    if not lines:
      on_line(b"")  # Output, but no complete line yet.
    for line in lines:
      copy(line + b"\n")
  if pending:
    copy(pending + b"\n")
  for h in held:
    write(h)
  pipe.close()


class _TextSink:
  """Lets a text stream without a binary `.buffer` (e.g. `io.StringIO`) take bytes."""

  def __init__(self, stream: IO[str]):
    self._stream = stream

  def write(self, data: bytes) -> None:
    self._stream.write(data.decode(errors="replace"))

  def flush(self) -> None:
    self._stream.flush()


def _binary(stream: IO) -> IO[bytes]:
  if hasattr(stream, "buffer"):
    return stream.buffer
  if isinstance(stream, io.TextIOBase):
    return _TextSink(stream)
  return stream


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
  """Sends `sig` to the process group the worker leads (it and its children)."""
  try:
    # The worker was started with `start_new_session=True`: its pid is its group's id.
    os.killpg(proc.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass  # the group has exited already (or only a zombie is left of its leader)


# Runs first in each worker (Linux): ask the kernel to SIGKILL it when the launcher dies,
# even by SIGKILL, then exec the real command. (A `preexec_fn` would do the same but makes
# subprocess fork() a multithreaded process, which JAX warns against.)
_BOOT = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
# The death signal is armed only from here on: a launcher that died before it would leave
# this process orphaned (reparented, so its parent is no longer the launcher's pid).
if os.getppid() != int(sys.argv[1]):
    sys.exit("jaxdp.launch: the launcher died before this process started")
os.execv(sys.executable, [sys.executable] + sys.argv[2:])
"""


def launch(
  command: Sequence[str],
  num_processes: int,
  devices_per_process: int | None = None,
  *,
  port: int | None = None,
  grace_period_s: float = 5.0,
  preemption_grace_s: float = PREEMPTION_GRACE_S,
  timeout_s: float | None = None,
  hang_timeout_s: float | None = HANG_TIMEOUT_S,
  stdout: IO | None = None,
  stderr: IO | None = None,
) -> int:
  """Runs `python COMMAND...` as `num_processes` local processes of one JAX job.

  Args:
    command: what follows `python`: `["train.py", "--steps", "3"]` or
      `["-m", "pkg.mod", ...]`. Run with this interpreter (`sys.executable`).
    num_processes: processes to start.
    devices_per_process: CPU devices each process exposes (`JAXDP_LOCAL_DEVICES`);
      None leaves JAX's default.
    port: coordinator port on 127.0.0.1; None picks a free one.
    grace_period_s: after SIGTERM (or SIGINT on Ctrl-C), how long a process may take
      to exit before it is SIGKILLed.
    preemption_grace_s: after a SIGTERM to the launcher, forwarded to every process, how
      long they may take to save and exit before they are SIGKILLed (a second signal
      SIGKILLs them at once).
    timeout_s: stop everything and fail if the job runs longer than this; None: no limit.
    hang_timeout_s: stop everything and fail if no process writes any output or starts a
      train step for this long; the launcher first collects every process's Python stacks
      (its stderr shows them, prefixed) and names where each one was. None or 0: never.
    stdout: where the processes' prefixed stdout goes (default `sys.stdout`).
    stderr: where their prefixed stderr and the launcher's own messages go (default
      `sys.stderr`).

  Returns:
    0 if every process exited 0. Otherwise the first failure's code (128 + N for a
    death by signal N), 124 on timeout or hang, 130 on Ctrl-C (SIGINT), 143 on SIGTERM.

  Raises:
    ValueError: `num_processes` or `devices_per_process` below 1, or an empty command.

  Examples:
    >>> import io
    >>> out, err = io.StringIO(), io.StringIO()
    >>> launch(["-c", "import os; print(os.environ['JAXDP_PROCESS_ID'])"], 2,
    ...        stdout=out, stderr=err)
    0
    >>> sorted(out.getvalue().splitlines())
    ['[p0] 0', '[p1] 1']

    Process 1 fails while process 0 still runs: process 0 is stopped.

    >>> script = ("import os, sys, time; pid = os.environ['JAXDP_PROCESS_ID']; "
    ...           "time.sleep(60) if pid == '0' else sys.exit(3)")
    >>> launch(["-c", script], 2, stdout=out, stderr=err)
    3
    >>> print(err.getvalue().splitlines()[-1])  # doctest: +NORMALIZE_WHITESPACE
    [jaxdp.launch] FAILED: process 1 failed with exit code 3;
    others: p0: signal SIGTERM (stopped by the launcher)
  """
  if num_processes < 1:
    raise ValueError(f"num_processes={num_processes}: must be at least 1")
  if devices_per_process is not None and devices_per_process < 1:
    raise ValueError(f"devices_per_process={devices_per_process}: must be at least 1")
  if preemption_grace_s < 0:
    raise ValueError(f"preemption_grace_s={preemption_grace_s}: must be 0 or more")
  if hang_timeout_s is not None and hang_timeout_s < 0:
    raise ValueError(f"hang_timeout_s={hang_timeout_s}: must be positive (0 or None: off)")
  if not command:
    raise ValueError("no command: give the script to run, e.g. `-- train.py --steps 3`")
  out = _binary(stdout or sys.stdout)
  err = _binary(stderr or sys.stderr)
  lock = threading.Lock()

  def say(message: str) -> None:
    with lock:
      err.write(f"[jaxdp.launch] {message}\n".encode())
      err.flush()

  port = port or free_port()
  base_env = dict(os.environ)
  base_env.setdefault("JAX_PLATFORMS", "cpu")  # A local launcher: CPU unless told otherwise.
  base_env["PYTHONUNBUFFERED"] = "1"
  # The processes import the same jaxdp as the launcher, installed or not.
  package_root = str(pathlib.Path(__file__).resolve().parents[2])
  base_env["PYTHONPATH"] = os.pathsep.join(
    p for p in (package_root, base_env.get("PYTHONPATH")) if p
  )
  base_env[distributed.ENV_COORDINATOR] = f"127.0.0.1:{port}"
  base_env[distributed.ENV_NUM_PROCESSES] = str(num_processes)
  if devices_per_process is not None:
    base_env[distributed.ENV_LOCAL_DEVICES] = str(devices_per_process)
  # A hung process answers SIGABRT with the Python stacks of all its threads.
  base_env.setdefault("PYTHONFAULTHANDLER", "1")
  heartbeats = pathlib.Path(tempfile.mkdtemp(prefix="jaxdp-launch-"))
  quiet_probe = not cuda_probe.has_nvidia_driver()
  last_output = [time.monotonic()]

  def saw(worker: _Worker, stream: str) -> Callable[[bytes], None]:
    def on_line(line: bytes) -> None:
      last_output[0] = time.monotonic()
      if stream == "stderr" and worker.stderr_lines is not None and line:
        worker.stderr_lines.append(line)

    return on_line

  # SIGINT/SIGTERM to the launcher: stop the job (not the launcher mid-cleanup).
  received: list[int] = []
  in_main_thread = threading.current_thread() is threading.main_thread()
  previous_handlers = {}
  if in_main_thread:
    # The handler only records the signal; the poll loop below acts on it, so that the
    # stop runs once, in `finally`, and never inside a handler that interrupted it.
    for sig in (signal.SIGINT, signal.SIGTERM):
      previous_handlers[sig] = signal.signal(sig, lambda s, _: received.append(s))

  workers: list[_Worker] = []
  hung = False
  try:
    for i in range(num_processes):
      env = dict(
        base_env,
        **{distributed.ENV_PROCESS_ID: str(i), checks.ENV_HEARTBEAT: str(heartbeats / f"p{i}")},
      )
      # Own process group: a signal to the group reaches the worker and its children.
      argv = [sys.executable, *command]
      if sys.platform == "linux":
        argv = [sys.executable, "-c", _BOOT, str(os.getpid()), *command]
      proc = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
      )
      worker = _Worker(i, proc, [])
      # One thread per pipe: a worker blocked writing a full stderr pipe while the launcher
      # read only its stdout would never finish.
      worker.threads = [
        threading.Thread(
          target=_pump,
          args=(pipe, f"[p{i}] ".encode(), sink, lock, saw(worker, stream)),
          kwargs={"drop_probe": stream == "stderr" and quiet_probe},
          daemon=True,
        )
        for pipe, sink, stream in ((proc.stdout, out, "stdout"), (proc.stderr, err, "stderr"))
      ]
      for t in worker.threads:
        t.start()
      workers.append(worker)
    say(
      f"started {num_processes} processes (coordinator 127.0.0.1:{port}"
      + (f", {devices_per_process} devices each" if devices_per_process else "")
      + f"): pids {' '.join(str(w.proc.pid) for w in workers)}"
    )

    # Poll every worker until all exit 0, one fails (the others are then stopped: a
    # collective would wait for the failed one forever), a signal arrives, or time runs out.
    start = time.monotonic()
    failed: _Worker | None = None
    code = 0
    while True:
      if received:
        sig = received[0]
        if sig == signal.SIGTERM:
          say(
            f"received SIGTERM; forwarding it to every process, which may save before it "
            f"exits (SIGKILL in {preemption_grace_s:g} s, or at a second signal)"
          )
        else:
          say(f"received {signal.Signals(sig).name}; stopping all processes")
        code = 128 + sig
        break
      for w in workers:
        rc = w.proc.poll()
        if rc is not None and rc != 0:
          failed = w
          break
      if failed is not None:
        code = _shell_code(failed.proc.returncode)
        say(
          f"process {failed.index} (pid {failed.proc.pid}) failed with "
          f"{describe_exit(failed.proc.returncode)}; stopping the others"
        )
        break
      if all(w.proc.poll() == 0 for w in workers):
        break
      if timeout_s is not None and time.monotonic() - start > timeout_s:
        running = [w.index for w in workers if w.proc.poll() is None]
        say(f"timeout after {timeout_s:g} s with processes {running} still running; stopping them")
        code = 124
        break
      if (
        hang_timeout_s
        and time.monotonic() - _last_progress(last_output[0], heartbeats) > hang_timeout_s
      ):
        hung, code = True, 124
        _report_hang(workers, hang_timeout_s, say)
        break
      time.sleep(_POLL_S)
  finally:
    preempted = bool(received) and received[0] == signal.SIGTERM
    _stop(
      workers,
      signal.SIGINT if signal.SIGINT in received else signal.SIGTERM,
      preemption_grace_s if preempted else grace_period_s,
      say,
      received,
    )
    if preempted:
      say(
        "after SIGTERM: "
        + ", ".join(f"p{w.index} {describe_exit(w.proc.returncode)}" for w in workers)
      )
    shutil.rmtree(heartbeats, ignore_errors=True)
    for sig, handler in previous_handlers.items():
      signal.signal(sig, handler)

  for w in workers:
    for t in w.threads:
      t.join(timeout=2.0)  # A grandchild that escaped the group may hold the pipe open.
  if hung:
    say(
      f"FAILED: the job hung: no output and no train step for {hang_timeout_s:g} s. "
      "Where each process was (innermost frame first; full stacks above, prefixed [pI]):\n"
      + "\n".join(
        f"  p{w.index} (pid {w.proc.pid}): {_where(w.stderr_lines or [])}" for w in workers
      )
    )
  if code and failed is not None:
    others = [
      f"p{w.index}: {describe_exit(w.proc.returncode)}"
      + (" (stopped by the launcher)" if w.stopped_by_launcher else "")
      for w in workers
      if w is not failed
    ]
    say(
      f"FAILED: process {failed.index} failed with {describe_exit(failed.proc.returncode)}"
      + (f"; others: {', '.join(others)}" if others else "")
    )
  return code


def _last_progress(last_output: float, heartbeats: pathlib.Path) -> float:
  """`time.monotonic()` of the latest output line or train step of any process."""
  latest = last_output
  now_wall, now = time.time(), time.monotonic()
  for beat in heartbeats.iterdir():  # one file per process, touched at each train step
    try:
      # an mtime is wall-clock time: moved onto the monotonic clock by its age
      latest = max(latest, now - (now_wall - beat.stat().st_mtime))
    except OSError:
      pass
  return latest


def _report_hang(workers: Sequence[_Worker], hang_timeout_s: float, say) -> None:
  """Asks every running worker for its Python stacks (SIGABRT) and waits for the dumps."""
  running = [w for w in workers if w.proc.poll() is None]
  say(
    f"no output and no train step from any process for {hang_timeout_s:g} s: the job looks "
    f"hung; asking processes {[w.index for w in running]} for their Python stacks (SIGABRT)"
  )
  for w in running:
    w.stderr_lines = []
  for w in running:  # All at once: one death makes the others' coordination clients abort.
    try:
      w.proc.send_signal(signal.SIGABRT)  # The worker itself, not its children.
    except ProcessLookupError:
      pass
  deadline = time.monotonic() + _DUMP_WAIT_S
  while any(w.proc.poll() is None for w in running) and time.monotonic() < deadline:
    time.sleep(_POLL_S)
  for w in running:
    for t in w.threads:  # Let the pumps pass on the rest of the dump.
      t.join(timeout=2.0)


_FRAME = re.compile(rb'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _short_path(path: str) -> str:
  """`path` relative to its site-packages if under one (wherever the environment lives,
  inside the working directory too: `jax/...`), else to the working directory."""
  if not os.path.isabs(path):
    return path  # "<string>", "<frozen runpy>"
  site, sep, rest = path.rpartition("site-packages" + os.sep)
  if sep:
    return rest
  relative = os.path.relpath(path)
  return path if relative.startswith(os.pardir) else relative


def _where(stderr_lines: Sequence[bytes]) -> str:
  """The main thread's frames from a faulthandler dump, innermost first, on one line."""
  blocks: list[tuple[bool, list[str]]] = []  # (the signalled thread?, frames)
  for line in stderr_lines:
    if re.match(rb"^(Current thread|Thread) 0x[0-9a-f]+", line):
      blocks.append((line.startswith(b"Current"), []))
    elif (match := _FRAME.match(line)) and blocks:
      path = _short_path(match["file"].decode(errors="replace"))
      blocks[-1][1].append(
        f"{match['func'].decode(errors='replace')} ({path}:{match['line'].decode()})"
      )
  # The main thread is the one running the script (`<module>` outermost); the signal may
  # have landed on another thread.
  main = [frames for _, frames in blocks if frames and frames[-1].startswith("<module> ")]
  current = [frames for signalled, frames in blocks if signalled and frames]
  frames = (main or current or [frames for _, frames in blocks if frames] or [[]])[0]
  if not frames:
    return (
      "no Python stack came back (not a Python process, or its SIGABRT handler is "
      "not faulthandler's)"
    )
  return " <- ".join(frames)


def _stop(
  workers: Sequence[_Worker], first_signal: int, grace_period_s: float, say, received: list[int]
) -> None:
  """Signals every running worker, then SIGKILLs what is left after the grace period.

  A signal to the launcher while it waits (a second Ctrl-C) cuts the grace period short.
  """
  running = [w for w in workers if w.proc.poll() is None]
  for w in running:
    w.stopped_by_launcher = True
    _signal_group(w.proc, first_signal)
  signals_before = len(received)
  deadline = time.monotonic() + grace_period_s
  while (
    any(w.proc.poll() is None for w in running)
    and time.monotonic() < deadline
    and len(received) == signals_before
  ):
    time.sleep(_POLL_S)
  for w in running:
    if w.proc.poll() is None:
      say(
        f"process {w.index} (pid {w.proc.pid}) still running after "
        f"{'a second signal' if len(received) > signals_before else f'{grace_period_s:g} s'}"
        "; sending SIGKILL"
      )
    # Also reaps children a worker left behind in its group.
    _signal_group(w.proc, signal.SIGKILL)
  for w in running:
    w.proc.wait()


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog=PROG,
    description="Run SCRIPT as P local processes of one JAX job (CPU, gloo collectives). "
    "Each process reads its place in the job from JAXDP_COORDINATOR, "
    "JAXDP_NUM_PROCESSES, JAXDP_PROCESS_ID and JAXDP_LOCAL_DEVICES through "
    "jaxdp.initialize(). If one process fails, the others are stopped and the "
    "launcher exits non-zero naming it.",
  )
  parser.add_argument("-n", "--num-processes", type=int, required=True, metavar="P")
  parser.add_argument(
    "-d",
    "--devices-per-process",
    type=int,
    default=None,
    metavar="D",
    help="CPU devices per process (default: JAX's default, 1)",
  )
  parser.add_argument(
    "--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)"
  )
  parser.add_argument(
    "--grace-period",
    type=float,
    default=5.0,
    metavar="SECONDS",
    help="after SIGTERM, seconds before SIGKILL (default: 5)",
  )
  parser.add_argument(
    "--preemption-grace",
    type=float,
    default=PREEMPTION_GRACE_S,
    metavar="SECONDS",
    help="after a SIGTERM to the launcher, forwarded to every process, seconds they have "
    f"to save and exit before SIGKILL (default: {PREEMPTION_GRACE_S:g})",
  )
  parser.add_argument(
    "--timeout",
    type=float,
    default=None,
    metavar="SECONDS",
    help="fail if the job runs longer than this (default: no limit)",
  )
  parser.add_argument(
    "--hang-timeout",
    type=float,
    default=HANG_TIMEOUT_S,
    metavar="SECONDS",
    help="fail if no process writes output or starts a train step for this "
    "long, naming where each process is (its Python stack); 0: never "
    f"(default: {HANG_TIMEOUT_S:g})",
  )
  # argparse's own usage line names every option; the script and its arguments follow `--`.
  parser.usage = parser.format_usage().removeprefix("usage: ").rstrip() + " -- SCRIPT [ARGS...]"
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Command line entry: `python -m jaxdp.launch -n P -d D -- SCRIPT ARGS...`."""
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = _parser()
  if "--" in argv:
    cut = argv.index("--")
    options, command = argv[:cut], argv[cut + 1 :]
  else:
    options, command = argv, []
  args = parser.parse_args(options)
  if not command:
    parser.error("no script: put it after `--`, e.g. `-- train.py --steps 3`")
  try:
    return launch(
      command,
      args.num_processes,
      args.devices_per_process,
      port=args.port,
      grace_period_s=args.grace_period,
      preemption_grace_s=args.preemption_grace,
      timeout_s=args.timeout,
      hang_timeout_s=args.hang_timeout,
    )
  except ValueError as e:
    parser.error(str(e))
    return 2  # Unreachable: parser.error exits.
