"""Many processes: `initialize`, `host_local_batch_to_global` and ``python -m jaxdp.launch``.

The multi-process tests run 2 processes x 4 CPU devices through the launcher (gloo
collectives on 127.0.0.1) and compare with the same computation on this process's 8
devices. Launcher behaviour (prefixes, exit codes, stopping the others, Ctrl-C) is checked
with tiny `python -c` workers that do not import JAX.
"""

import contextlib
import doctest
import importlib.util
import io
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxdp
from jaxdp._src import checks, cuda_probe, distributed, train
from jaxdp._src import launch as launch_module
from jaxdp._src.launch import launch, main
from tests import mp_worker
from tests.tolerances import EPS32, AdamBound, rtol_sum

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKER = str(REPO / "tests" / "mp_worker.py")


def run_launcher(*args: str, timeout: float = 60.0) -> tuple[subprocess.CompletedProcess, float]:
  start = time.monotonic()
  result = subprocess.run(
    [sys.executable, "-m", "jaxdp.launch", *args],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  return result, time.monotonic() - start


@contextlib.contextmanager
def launcher_process(*args: str, deadline_s: float = 120.0, stderr=subprocess.PIPE):
  """``python -m jaxdp.launch ARGS`` as a text Popen, killed after `deadline_s` so that a
  hung launcher fails the test instead of hanging it."""
  proc = subprocess.Popen(
    [sys.executable, "-m", "jaxdp.launch", *args],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=stderr,
    text=True,
  )
  watchdog = threading.Timer(deadline_s, proc.kill)
  watchdog.start()
  try:
    yield proc
  finally:
    watchdog.cancel()
    if proc.poll() is None:
      proc.kill()
    proc.wait()


def launch_quiet(command, num_processes, **kwargs) -> tuple[int, str, str]:
  """`launch` in this process, its output captured."""
  out, err = io.BytesIO(), io.BytesIO()
  code = launch(command, num_processes, stdout=out, stderr=err, **kwargs)
  return code, out.getvalue().decode(), err.getvalue().decode()


# --- two processes x four devices, through the launcher ---------------------------------


def test_two_processes_psum_equals_single_process(tmp_path):
  result, elapsed = run_launcher(
    "--num-processes",
    "2",
    "--devices-per-process",
    "4",
    "--",
    WORKER,
    "psum",
    str(tmp_path),
    timeout=120,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  print(f"2 processes x 4 devices, psum: {elapsed:.1f} s")
  assert "process 0 of 2" in result.stderr and "process 1 of 2" in result.stderr
  assert "4 local devices, 8 global devices (cpu)" in result.stderr

  mesh = jax.make_mesh((8,), ("data",))
  batch = jaxdp.host_local_batch_to_global(mp_worker.global_batch(), mesh)
  want_rows, want_total = (np.asarray(a) for a in mp_worker.compute(batch, mesh))
  for p in range(2):
    got = np.load(tmp_path / f"psum.p{p}.npz")
    assert (int(got["process_count"]), int(got["device_count"])) == (2, 8)
    # Each row is computed on one device, identically: bitwise. The psum adds 8 partial
    # sums (each device's, the same in both runs) in an order gloo chooses: a sum of 8
    # terms of either sign moves by at most 7 eps32 times the sum of their magnitudes.
    np.testing.assert_array_equal(got["rows"], want_rows)
    np.testing.assert_allclose(
      got["total"], want_total, rtol=0, atol=8 * EPS32 * float(np.abs(want_rows).sum())
    )


@pytest.fixture(scope="module")
def trained_by_two_processes(tmp_path_factory):
  """Runs `mp_worker.py train` (every strategy, in turn) once.

  Returns `get(strategy) -> [npz of process 0, npz of process 1]`, which fails the
  calling test with the job's log if that strategy did not finish.
  """
  out = tmp_path_factory.mktemp("train")
  result, elapsed = run_launcher("-n", "2", "-d", "4", "--", WORKER, "train", str(out), timeout=180)
  print(f"2 processes x 4 devices, {len(mp_worker.STRATEGIES)} strategies: {elapsed:.1f} s")

  def get(strategy):
    files = [out / f"train.{strategy}.p{p}.npz" for p in range(2)]
    if not all(f.exists() for f in files):
      pytest.fail(
        f"{strategy}: the 2-process job did not finish it (launcher exit "
        f"{result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
      )
    return [dict(np.load(f)) for f in files]

  return get


@pytest.mark.slow
def test_two_processes_save_their_own_shards_and_restore(tmp_path):
  """Each process writes only the shards its devices hold (about half of the checkpoint's
  bytes each), and the restored state is bitwise the saved one, in the job and when the
  checkpoint is read back by one process on another dp."""
  result, elapsed = run_launcher(
    "-n", "2", "-d", "4", "--", WORKER, "checkpoint", str(tmp_path), timeout=240
  )
  print(f"2 processes x 4 devices, save and restore: {elapsed:.1f} s")
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
  for strategy in mp_worker.CHECKPOINT_STRATEGIES:
    got = [dict(np.load(tmp_path / f"ckpt.{strategy}.p{p}.npz")) for p in range(2)]
    for key in got[0]:
      np.testing.assert_array_equal(got[0][key], got[1][key], err_msg=key)
      if key.startswith("trained"):
        restored = "restored" + key[len("trained") :]
        np.testing.assert_array_equal(got[0][restored], got[0][key], err_msg=key)
    # the bytes each process wrote: its own OCDBT files
    state_dir = tmp_path / f"ckpt.{strategy}" / str(mp_worker.STEPS) / "state"
    written = [
      sum(f.stat().st_size for f in (state_dir / f"ocdbt.process_{p}").rglob("*") if f.is_file())
      for p in range(2)
    ]
    total = sum(written)
    # 2 MiB of random params (orbax compresses: the moments much): the arrays dominate
    assert total > 2**20, written
    assert all(0.4 < w / total < 0.6 for w in written), (strategy, written)
    # one process, dp = 2, another strategy: the same values
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    like = jaxdp.init_state(
      mp_worker.checkpoint_params, mp_worker.make_tx(), mesh, jaxdp.DDPConfig()
    )
    with jaxdp.CheckpointManager(tmp_path / f"ckpt.{strategy}") as mgr:
      state = mgr.restore(like)
    views = {"params": jaxdp.get_params(state), "opt": jaxdp.get_opt_state(state)}
    for path, x in jax.tree_util.tree_leaves_with_path(views):
      key = "trained" + jax.tree_util.keystr(path)
      np.testing.assert_array_equal(np.asarray(x), got[0][key], err_msg=key)


def _flat(params) -> dict[str, np.ndarray]:
  return {
    jax.tree_util.keystr(k): np.asarray(x) for k, x in jax.tree_util.tree_leaves_with_path(params)
  }


@pytest.mark.slow
@pytest.mark.xdist_group("two_process_train")  # one worker: the fixture's job runs once
@pytest.mark.parametrize("strategy", mp_worker.STRATEGIES)
def test_two_processes_train_equal_to_single_process(trained_by_two_processes, strategy):
  got = trained_by_two_processes(strategy)
  mesh = jax.make_mesh((8,), ("data",))
  params, losses = mp_worker.train(
    strategy, mesh, lambda b: jaxdp.host_local_batch_to_global(b, mesh)
  )
  # The 8 partial grads are summed by gloo in another order than in one process, and than
  # one device sums the whole batch: float32 rounding only, which Adam amplifies where a
  # gradient is near zero: the per-element Adam bound (tests/tolerances.py; the loss is a
  # mean over 16 x 2 outputs). Measured here: <= 6e-8 after 3 AdamW steps.
  bound = AdamBound(1e-2, 16 * 2, mp_worker.init_params(), clip=1.0)
  one_process, one_device = _flat(params), _flat(mp_worker.single_device_reference(bound))
  for key in one_process:
    np.testing.assert_array_equal(got[0][key], got[1][key], err_msg=key)  # The same arrays.
  two = {k: got[0][k] for k in one_process}
  bound.check(two, one_process, f"{strategy}: 2 processes vs 1 process: ")
  bound.check(two, one_device, f"{strategy}: 2 processes vs one device: ")
  # A mean of 16 x 2 squared errors (same sign): rtol_sum (tests/tolerances.py).
  np.testing.assert_allclose(got[0]["losses"], np.array(losses), rtol=rtol_sum(16 * 2))


@pytest.mark.parametrize("mode", ["crash", "raise"])
def test_failed_process_stops_the_job_and_is_named(tmp_path, mode):
  """Process 1 dies (SIGKILL, or an uncaught exception) while process 0 is blocked in a
  collective that needs it: the launcher stops process 0 and names process 1."""
  with launcher_process(
    "-n",
    "2",
    "-d",
    "4",
    "--grace-period",
    "3",
    "--",
    WORKER,
    mode,
    str(tmp_path),
    stderr=subprocess.STDOUT,
  ) as proc:
    log, failed_at = [], None
    for line in proc.stdout:  # Ends when the launcher exits.
      log.append(line)
      if failed_at is None and re.search(r"process 1: (SIGKILL myself|raise)", line):
        failed_at = time.monotonic()
    proc.wait(timeout=60)
    stopped_in = time.monotonic() - failed_at
    log = "".join(log)
  how = "signal SIGKILL" if mode == "crash" else "exit code 1"
  # The launcher exits with process 1's status, as the shell would say it.
  assert proc.returncode == (128 + signal.SIGKILL if mode == "crash" else 1), log
  assert stopped_in < 60, log
  print(f"launcher exited {stopped_in:.1f} s after process 1 failed")
  assert "process 0: entering a collective that cannot finish" in log  # p0 really blocked.
  assert f"failed with {how}; stopping the others" in log, log
  assert f"FAILED: process 1 failed with {how}" in log, log
  assert (
    "p0: signal SIGTERM (stopped by the launcher)" in log
    or "p0: signal SIGKILL (stopped by the launcher)" in log
  ), log
  if mode == "raise":
    assert "RuntimeError: process 1 fails on purpose" in log
    assert "process 1 of 2: uncaught RuntimeError; exiting with code 1" in log
  assert "unreachable" not in log


# --- launcher behaviour, with workers that do not import JAX ----------------------------

_PID = "int(os.environ['JAXDP_PROCESS_ID'])"


def test_launcher_sets_env_and_prefixes_output():
  code, out, err = launch_quiet(
    [
      "-c",
      "import os; e = os.environ; "
      "print(e['JAXDP_PROCESS_ID'], e['JAXDP_NUM_PROCESSES'], e['JAXDP_LOCAL_DEVICES'], "
      "e['JAXDP_COORDINATOR'], e['JAX_PLATFORMS']); "
      "import sys; print('to stderr', file=sys.stderr, end='')",
    ],
    3,
    devices_per_process=4,
    port=12345,
  )
  assert code == 0, err
  for p in range(3):
    assert f"[p{p}] {p} 3 4 127.0.0.1:12345 cpu\n" in out
    assert f"[p{p}] to stderr\n" in err  # Also a last line without a newline.
  assert "FAILED" not in err


def test_launcher_names_failed_process_and_its_exit_code():
  start = time.monotonic()
  code, _, err = launch_quiet(
    ["-c", f"import os, sys, time; pid = {_PID}; sys.exit(3) if pid == 1 else time.sleep(600)"],
    3,
    grace_period_s=2.0,
  )
  assert code == 3
  assert time.monotonic() - start < 10
  assert "process 1 (pid" in err and "failed with exit code 3" in err
  assert "p0: signal SIGTERM (stopped by the launcher)" in err


def test_launcher_sigkills_processes_that_ignore_sigterm():
  start = time.monotonic()
  code, _, err = launch_quiet(
    [
      "-c",
      f"import os, signal, sys, time; pid = {_PID}; "
      "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
      "print('ready', flush=True); "
      "(time.sleep(0.5), os.kill(os.getpid(), signal.SIGKILL)) if pid == 0 "
      "else time.sleep(600)",
    ],
    2,
    grace_period_s=1.0,
  )
  assert code == 128 + signal.SIGKILL
  assert time.monotonic() - start < 10
  assert "process 0 (pid" in err and "failed with signal SIGKILL" in err
  assert "process 1 (pid" in err and "sending SIGKILL" in err


def test_launcher_timeout():
  code, _, err = launch_quiet(
    ["-c", "import time; time.sleep(600)"], 2, timeout_s=0.5, grace_period_s=1.0
  )
  assert code == 124
  assert "timeout after 0.5 s with processes [0, 1] still running" in err


def test_ctrl_c_stops_the_job():
  with launcher_process(
    "-n",
    "2",
    "--grace-period",
    "3",
    "--",
    "-c",
    "import time; print('up', flush=True); time.sleep(600)",
    deadline_s=60,
  ) as proc:
    started = ""
    while "pids" not in started:  # The launcher's first line names the workers.
      started = proc.stderr.readline()
      assert started, "launcher exited before starting workers"
    pids = [int(p) for p in re.search(r"pids ([\d ]+)", started).group(1).split()]
    assert proc.stdout.readline().endswith("up\n")
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert time.monotonic() - start < 10
    assert proc.returncode == 128 + signal.SIGINT
    assert "received SIGINT" in proc.stderr.read()
  for pid in pids:
    with pytest.raises(ProcessLookupError):
      os.kill(pid, 0)  # Reaped by the launcher: gone.


def test_launcher_relays_whole_lines_of_each_process_never_mixed():
  """Each process writes its lines in pieces, all at once: every relayed line is one whole
  line of one process, under its prefix."""
  script = (
    "import os, time\n"
    f"p = {_PID}\n"
    "for k in range(200):\n"
    "  line = f'p{p} line {k} ' + 'x' * 200 + '\\n'\n"
    "  for piece in (line[:50], line[50:120], line[120:]):\n"
    "    os.write(1, piece.encode())\n"
    "    time.sleep(0.0002)\n"
  )
  code, out, err = launch_quiet(["-c", script], 3)
  assert code == 0, err
  expected = {f"[p{p}] p{p} line {k} " + "x" * 200 for p in range(3) for k in range(200)}
  lines = out.splitlines()
  assert len(lines) == len(expected) and set(lines) == expected


GLOO_OK = (
  "[Gloo] Rank {} is connected to 7 peer ranks. Expected number of connected peer ranks is : 7"
)


def test_launcher_leaves_out_gloo_connection_news_and_keeps_a_bar_last_state():
  """Gloo's connection lines (whole, or spliced mid-line by its threads) are left out, one
  that says a peer is missing is kept; a progress bar's redraws come as their last state."""
  spliced = (
    GLOO_OK.format(1).replace("Rank 1", "Rank 1[Gloo] Rank ", 1)
    + "\n2"
    + (GLOO_OK.format(2).split("Rank 2", 1)[1])
  )
  missing = GLOO_OK.format(3).replace("to 7", "to 5")
  script = (
    "import os\n"
    f"for line in ({GLOO_OK.format(0)!r}, {spliced!r}, {missing!r}, '1', '\\r 10%\\r 90%\\r100%'):\n"
    "  os.write(1, (line + '\\n').encode())\n"
  )
  code, out, err = launch_quiet(["-c", script], 1)
  assert code == 0, err
  assert out.splitlines() == [f"[p0] {missing}", "[p0] 1", "[p0] 100%"], out


def test_launcher_usage_names_every_option(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(["--help"])
  assert exit_info.value.code == 0
  text = capsys.readouterr().out
  usage = " ".join(text[: text.index("\n\n")].split())
  assert usage.startswith("usage: python -m jaxdp.launch") and usage.endswith("-- SCRIPT [ARGS...]")
  options = set(re.findall(r"^\s+(?:-\w(?: \w+)?, )?(--[\w-]+)", text, re.M))
  assert {"--num-processes", "--grace-period", "--timeout", "--hang-timeout"} <= options
  for option in options - {"--help", "--num-processes", "--devices-per-process"}:
    assert option in usage, (option, usage)
  assert "-n P" in usage and "[-d D]" in usage


def test_launcher_requires_a_script(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(["-n", "2"])
  assert exit_info.value.code == 2
  assert "no script: put it after `--`" in capsys.readouterr().err


# --- single process ------------------------------------------------------------------


def test_initialize_alone_is_a_no_op(monkeypatch):
  for name in (
    distributed.ENV_COORDINATOR,
    distributed.ENV_NUM_PROCESSES,
    distributed.ENV_PROCESS_ID,
    distributed.ENV_LOCAL_DEVICES,
  ):
    monkeypatch.delenv(name, raising=False)
  if distributed._detected_cluster() is not None:
    pytest.skip("running inside a cluster environment")
  jaxdp.initialize()
  jaxdp.initialize()  # Idempotent.
  jaxdp.initialize(num_processes=1, process_id=0)
  assert not jax.distributed.is_initialized()


def test_initialize_with_a_partial_cluster_description_says_what_is_missing(monkeypatch):
  if distributed._detected_cluster() is not None:
    pytest.skip("running inside a cluster environment")
  monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1234")
  monkeypatch.delenv(distributed.ENV_NUM_PROCESSES, raising=False)
  monkeypatch.delenv(distributed.ENV_PROCESS_ID, raising=False)
  with pytest.raises(
    ValueError,
    match=r"no num_processes, process_id.*set "
    r"JAXDP_NUM_PROCESSES, JAXDP_PROCESS_ID",
  ):
    jaxdp.initialize()


def test_initialize_rejects_a_malformed_env_var(monkeypatch):
  monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "two")
  with pytest.raises(ValueError, match="JAXDP_NUM_PROCESSES='two': expected an integer"):
    jaxdp.initialize()


def test_initialize_after_the_backend_started_cannot_change_the_device_count():
  jax.devices()  # The backend runs with conftest's 8 CPU devices.
  jaxdp.initialize(local_device_count=8)  # Agrees: fine.
  with pytest.raises(RuntimeError, match="already started with 8 local CPU devices"):
    jaxdp.initialize(local_device_count=4)


def test_host_local_batch_to_global_single_process():
  mesh = jax.make_mesh((8,), ("data",))
  local = {"x": np.arange(32, dtype=np.float32).reshape(16, 2), "w": np.ones(3, np.float32)}
  batch = jaxdp.host_local_batch_to_global(local, mesh, {"x": P("data"), "w": P()})
  np.testing.assert_array_equal(batch["x"], local["x"])
  assert batch["x"].sharding.spec == P("data") and batch["w"].sharding.spec == P()
  assert [s.data.shape for s in batch["x"].addressable_shards] == [(2, 2)] * 8
  with pytest.raises(
    ValueError,
    match=r"batch\['x'\]: dim 0 of the local batch is 12, not "
    r"divisible by the 8 devices",
  ):
    jaxdp.host_local_batch_to_global({"x": np.ones((12, 2))}, mesh)


def test_doctests_distributed():
  result = doctest.testmod(distributed, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0


def test_doctests_launch():
  result = doctest.testmod(launch_module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0 and result.failed == 0


# --- cross-process work: one program per call -------------------------------------------


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_get_params_is_one_program_and_outlives_the_next_step(strategy, caplog):
  """`get_params` compiles (and so runs) one program, however many leaves: eager per-leaf
  gathers hung 2-process jobs (docs/design.md, "One program per call"). Its arrays are its own: the next step donates the
  state, and the params read before it are still there, bitwise the initial params."""
  mesh = jax.make_mesh((8,), ("data",))
  config, tx = jaxdp.DDPConfig(data_parallel_sharding_strategy=strategy), mp_worker.make_tx()
  state = jaxdp.init_state(mp_worker.init_params(), tx, mesh, config)
  step = jaxdp.make_train_step(mp_worker.loss_fn, tx, mesh, config)
  train._params_program.clear_cache()  # Compiled by another test with the same state: again.
  with jax.log_compiles(), caplog.at_level("WARNING", logger="jax"):
    params = jaxdp.get_params(state)
  compiled = [
    r.getMessage().split(" ")[4]
    for r in caplog.records
    if r.getMessage().startswith("Finished XLA compilation of")
  ]
  assert compiled == ["jit(_params_program)"], compiled
  step(state, jaxdp.host_local_batch_to_global(mp_worker.global_batch(), mesh))  # Donates.
  for (path, x), want in zip(
    jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(mp_worker.init_params())
  ):
    assert not x.is_deleted(), f"{strategy}: params{jax.tree_util.keystr(path)} was donated"
    np.testing.assert_array_equal(np.asarray(x), want)  # A gather and a copy: exact.


# --- the launcher's hang guard ----------------------------------------------------------


def test_launcher_ends_a_hung_job_and_names_where_each_process_is():
  """Silent processes that never finish: after `hang_timeout_s` the launcher collects each
  one's Python stack, stops the job with 124 and says where each process was."""
  script = (
    "import time\ndef wait_forever():\n  time.sleep(600)\nprint('up', flush=True)\nwait_forever()\n"
  )
  start = time.monotonic()
  code, out, err = launch_quiet(["-c", script], 2, hang_timeout_s=2.0, grace_period_s=1.0)
  assert code == 124, err
  assert time.monotonic() - start < 30, err
  assert "[p0] up" in out and "[p1] up" in out
  assert "no output and no train step from any process for 2 s" in err
  assert "FAILED: the job hung" in err
  for p in (0, 1):
    assert f'[p{p}]   File "<string>", line 3 in wait_forever' in err, err  # The dump.
    assert re.search(
      rf"  p{p} \(pid \d+\): wait_forever \(<string>:3\) <- "
      rf"<module> \(<string>:5\)",
      err,
    ), err


def test_launcher_counts_output_and_train_steps_as_progress():
  """A process that keeps writing, or keeps touching its `JAXDP_HEARTBEAT` file (each train
  step does) while silent, is not hung; with the guard off nothing is ended either."""
  chatty = "import time\nfor _ in range(12):\n  print('.', end='', flush=True); time.sleep(0.25)"
  stepping = (
    "import os, time\nfor _ in range(12):\n"
    "  open(os.environ['JAXDP_HEARTBEAT'], 'a').close()\n"
    "  os.utime(os.environ['JAXDP_HEARTBEAT']); time.sleep(0.25)"
  )
  for script in (chatty, stepping):  # 3 s each, against a 1.5 s guard
    code, _, err = launch_quiet(["-c", script], 2, hang_timeout_s=1.5, grace_period_s=1.0)
    assert code == 0, err
  code, _, err = launch_quiet(["-c", "import time; time.sleep(2)"], 2, hang_timeout_s=0)
  assert code == 0, err


def test_train_step_touches_the_heartbeat_file(tmp_path, monkeypatch):
  beat = tmp_path / "beat"
  monkeypatch.setenv(checks.ENV_HEARTBEAT, str(beat))
  monkeypatch.setattr(checks, "_last_heartbeat", [-1e9])
  mesh = jax.make_mesh((8,), ("data",))
  config, tx = jaxdp.DDPConfig(), mp_worker.make_tx()
  state = jaxdp.init_state(mp_worker.init_params(), tx, mesh, config)
  step = jaxdp.make_train_step(mp_worker.loss_fn, tx, mesh, config)
  step(state, jaxdp.host_local_batch_to_global(mp_worker.global_batch(), mesh))
  assert beat.exists()


def test_launcher_names_the_collective_a_hung_jax_job_waits_in(tmp_path):
  """A real 2-process hang: process 1 never reaches a collective that process 0 waits in.
  The launcher's default guard (here 20 s) ends it and names both places. The guard counts
  from the last output, so it must outlast the workers' silent start (importing jaxdp and
  orbax, `jax.distributed.initialize`), which has taken over 8 s on a loaded 2-core machine
  beside the other test worker."""
  with launcher_process(
    "-n",
    "2",
    "-d",
    "4",
    "--hang-timeout",
    "20",
    "--grace-period",
    "2",
    "--",
    WORKER,
    "hang",
    str(tmp_path),
    stderr=subprocess.STDOUT,
    deadline_s=180,
  ) as proc:
    log = proc.stdout.read()
    proc.wait(timeout=60)
  assert proc.returncode == 124, log
  assert "process 0: entering a collective that cannot finish" in log, log
  assert re.search(
    r"  p0 \(pid \d+\): .*sync_global_devices \(jax/experimental/"
    r"multihost_utils.py:\d+\) <- main \(tests/mp_worker.py:\d+\)",
    log,
  ), log
  assert re.search(
    r"  p1 \(pid \d+\): wait_forever \(tests/mp_worker.py:\d+\) <- "
    r"main \(tests/mp_worker.py:\d+\)",
    log,
  ), log
  assert "unreachable" not in log


def test_launcher_names_frames_by_package_wherever_the_environment_lives(monkeypatch, tmp_path):
  """A stack line names a library's file from its site-packages (`jax/...`) whether the
  environment lies inside the working directory (a clone's .venv) or outside it, and the
  user's own files relative to the working directory."""
  monkeypatch.chdir(tmp_path)
  inside = tmp_path / ".venv" / "lib" / "python3.12" / "site-packages" / "jax" / "api.py"
  outside = pathlib.Path("/opt/env/lib/python3.12/site-packages/jax/api.py")
  assert launch_module._short_path(str(inside)) == os.path.join("jax", "api.py")
  assert launch_module._short_path(str(outside)) == os.path.join("jax", "api.py")
  assert launch_module._short_path(str(tmp_path / "tests" / "w.py")) == os.path.join(
    "tests", "w.py"
  )
  assert launch_module._short_path("/elsewhere/w.py") == "/elsewhere/w.py"
  assert launch_module._short_path("<string>") == "<string>"


# --- the CUDA plugin's driver probe on a machine without an NVIDIA driver ---------------

ABSL_NOTE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
PROBE = (
  "I0000 00:00:1.0 1 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU "
  "will not be used."
)
# A stand-in for JAX whose import writes what the plugin writes, then a real error, from
# fd 2 as C++ does, and then fails: nothing but the probe's lines may go missing.
FAKE_JAX = (
  "import os\n"
  f"for line in ({ABSL_NOTE!r}, {PROBE!r}, 'E real: libfoo.so not found', {ABSL_NOTE!r}, "
  "'W kept after a lone note'):\n"
  "  os.write(2, (line + '\\n').encode())\n"
  "raise ImportError('jax is broken here')\n"
)


@pytest.mark.skipif(cuda_probe.has_nvidia_driver(), reason="the lines are kept with a driver")
def test_jaxdp_imports_jax_without_the_probe_lines_and_keeps_the_rest(tmp_path):
  (tmp_path / "jax").mkdir()
  (tmp_path / "jax" / "__init__.py").write_text(FAKE_JAX)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
  proc = subprocess.run(
    [sys.executable, "-c", "import jaxdp"], env=env, capture_output=True, text=True, timeout=60
  )
  assert proc.returncode == 1
  assert "cudart_stub" not in proc.stderr, proc.stderr
  lines = proc.stderr.splitlines()
  assert lines[:3] == ["E real: libfoo.so not found", ABSL_NOTE, "W kept after a lone note"]
  assert "ImportError: jax is broken here" in proc.stderr


@pytest.mark.skipif(
  cuda_probe.has_nvidia_driver() or importlib.util.find_spec("jax_cuda12_plugin") is None,
  reason="the plugin writes its probe lines only where it is installed and finds no driver",
)
def test_importing_jaxdp_first_writes_nothing_on_a_cpu_machine():
  proc = subprocess.run(
    [sys.executable, "-c", "import jaxdp"],
    env={**os.environ, "PYTHONPATH": str(REPO)},
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.skipif(cuda_probe.has_nvidia_driver(), reason="the lines are kept with a driver")
def test_launcher_drops_its_workers_probe_lines_and_keeps_the_rest():
  script = (
    "import os\n"
    f"for line in ({ABSL_NOTE!r}, {PROBE!r}, 'E real', {PROBE!r}, {ABSL_NOTE!r}):\n"
    "  os.write(2, (line + '\\n').encode())\n"
  )
  code, _, err = launch_quiet(["-c", script], 1)
  assert code == 0, err
  lines = [line for line in err.splitlines() if not line.startswith("[jaxdp.launch]")]
  assert lines == ["[p0] E real", f"[p0] {ABSL_NOTE}"], err


# --- stress: scripts/train.py under the launcher on a busy machine -----------------------

# The two ways `get_params` gathers a sharded state: ZeRO's master rows (`optim_grads`
# gathers as `optim` does) and FSDP's units; `no_shard` gathers nothing.
STRESS_STRATEGIES = ("optim", "optim_grads_params")
STRESS_RUN_TIMEOUT_S = 240  # 4 jobs at once took about 2 min with the machine at load 10-20.
BUSY_LOOP = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end:\n  pass"


def stress_run(strategy: str, out: pathlib.Path, env: dict) -> subprocess.Popen:
  """`scripts/train.py` under the launcher, 2 processes x 4 devices, 2 steps with evaluation
  at steps 0, 1 and 2 and a checkpoint at step 2; its output goes to `out/launcher.log`."""
  out.mkdir()
  command = [sys.executable, "-m", "jaxdp.launch", "-n", "2", "-d", "4"]
  command += ["--timeout", str(STRESS_RUN_TIMEOUT_S), "--hang-timeout", "120", "--"]
  command += [str(REPO / "scripts" / "train.py"), "--strategy", strategy, "--out", str(out)]
  command += ["--steps", "2", "--eval-every", "1", "--save-every", "2", "--batch-size", "16"]
  command += ["--n-layer", "2", "--n-head", "2", "--d-model", "32", "--block-size", "16"]
  command += ["--bucket-size", "4000"]
  log = open(out / "launcher.log", "w")
  proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
  log.close()  # the launcher holds its own copy
  return proc


@pytest.mark.slow
def test_train_script_under_the_launcher_survives_a_busy_machine(tmp_path):
  """scripts/train.py as 2 processes x 4 devices, with evaluation (steps 0, 1 and 2) and a
  checkpoint (step 2), once per strategy of `STRESS_STRATEGIES`, the jobs at once (4
  processes, each starved of CPU by the others) while two busy loops keep both cores busy. With eager per-leaf gathers
  in get_params such runs hung after a train step (docs/design.md, "One program per call").
  Each run must finish inside its timeout; if one does not, the launcher's hang guard names
  where the processes were."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(2)]
  runs, times = {}, {}
  try:
    start = time.monotonic()
    for strategy in STRESS_STRATEGIES:
      runs[strategy] = stress_run(strategy, tmp_path / strategy, env)
    for strategy, proc in runs.items():
      out = tmp_path / strategy
      left = start + STRESS_RUN_TIMEOUT_S + 30 - time.monotonic()
      try:
        code = proc.wait(timeout=max(left, 1))
      except subprocess.TimeoutExpired:
        pytest.fail(
          f"{strategy} did not end in {STRESS_RUN_TIMEOUT_S + 30} s:\n"
          + (out / "launcher.log").read_text()[-6000:]
        )
      times[strategy] = time.monotonic() - start
      assert code == 0, (
        f"{strategy} failed after {times[strategy]:.0f} s:\n"
        + (out / "launcher.log").read_text()[-8000:]
      )
      lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
      assert [e["step"] for e in lines if "val_loss" in e] == [0, 1, 2], lines
      with jaxdp.CheckpointManager(out / "checkpoints") as mgr:
        assert mgr.latest_step() == 2
  finally:
    for p in busy:
      p.kill()
      p.wait()
    for p in runs.values():
      if p.poll() is None:
        p.send_signal(signal.SIGINT)  # the launcher stops its processes, then exits
        p.wait(timeout=60)
  print("runs (s): " + ", ".join(f"{s} {t:.0f}" for s, t in times.items()))
