"""Save on preemption: `CheckpointManager.reached_preemption`, the launcher forwarding a
scheduler's SIGTERM, and `scripts/train.py` stopped by one and resumed bitwise."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxdp

ROOT = Path(__file__).resolve().parents[1]


def _job(tmp_path, **manager_options):
  mesh = jax.make_mesh((8,), ("data",))
  config = jaxdp.DDPConfig(data_parallel_sharding_strategy="optim")
  tx = optax.adam(1e-2)
  state = jaxdp.init_state({"w": jnp.ones((5, 3))}, tx, mesh, config)
  step = jaxdp.make_train_step(lambda p, b: jnp.sum(p["w"] ** 2) * jnp.mean(b), tx, mesh, config)
  mgr = jaxdp.CheckpointManager(tmp_path / "ckpt", save_interval_steps=100, **manager_options)
  return state, step, mgr


def test_signal_saves_at_the_next_step_boundary_and_gives_the_handler_back(tmp_path):
  """One process: the signal, sent in the middle of step 3, makes step 3 the one to save;
  steps before and after answer False. The handler is installed at the first call and the
  previous one is back after `close`."""
  before = signal.getsignal(signal.SIGTERM)
  state, train_step, mgr = _job(tmp_path)
  assert signal.getsignal(signal.SIGTERM) is before  # nothing installed before the loop asks
  answers = []
  for step in range(1, 6):
    state, _ = train_step(state, jnp.ones((8, 3)))
    if step == 3:
      os.kill(os.getpid(), signal.SIGTERM)  # the process survives it: the manager listens
    answers.append(mgr.reached_preemption(step))
    if step == 1:
      assert signal.getsignal(signal.SIGTERM) is not before
    if answers[-1]:
      assert mgr.save(step, state, data_position=step, force=True)
  assert answers == [False, False, True, False, False]
  assert mgr.reached_preemption(3)  # asked again about the same step: the same answer
  mgr.wait_until_finished()
  assert mgr.all_steps() == [3] and mgr.data_position() == 3
  mgr.close()
  assert signal.getsignal(signal.SIGTERM) is before


def test_managers_listening_on_one_signal_all_hear_it(tmp_path):
  """Two open managers share the handler; the previous one comes back with the last close.
  Another signal (SIGUSR1) works the same, and `None` never listens."""
  before = signal.getsignal(signal.SIGUSR1)
  first = jaxdp.CheckpointManager(tmp_path / "a", preemption_signal=signal.SIGUSR1)
  second = jaxdp.CheckpointManager(tmp_path / "b", preemption_signal=signal.SIGUSR1)
  deaf = jaxdp.CheckpointManager(tmp_path / "c", preemption_signal=None)
  assert not first.reached_preemption(1) and not second.reached_preemption(1)
  assert not deaf.reached_preemption(1)
  os.kill(os.getpid(), signal.SIGUSR1)
  assert first.reached_preemption(2) and second.reached_preemption(2)
  assert not deaf.reached_preemption(2)
  first.close()
  assert signal.getsignal(signal.SIGUSR1) is not before
  second.close()
  deaf.close()
  assert signal.getsignal(signal.SIGUSR1) is before


@pytest.mark.parametrize(
  "value, error, message",
  [
    ("SIGTERM", TypeError, "preemption_signal='SIGTERM': expected a signal such as"),
    (True, TypeError, "preemption_signal=True: expected a signal such as"),
    (12345, ValueError, "preemption_signal=12345: no such signal"),
    (signal.SIGKILL, ValueError, "preemption_signal=SIGKILL: a process cannot catch SIGKILL"),
  ],
)
def test_a_signal_that_is_not_one_is_refused(tmp_path, value, error, message):
  with pytest.raises(error, match=re.escape(message)):
    jaxdp.CheckpointManager(tmp_path, preemption_signal=value)


def test_listening_off_the_main_thread_is_refused(tmp_path):
  mgr = jaxdp.CheckpointManager(tmp_path, preemption_signal=signal.SIGUSR2)
  raised = []

  def ask():
    try:
      mgr.reached_preemption(1)
    except ValueError as e:
      raised.append(str(e))

  thread = threading.Thread(target=ask)
  thread.start()
  thread.join()
  mgr.close()
  assert raised and "main thread only" in raised[0] and "preemption_signal=None" in raised[0]


def test_a_manager_closed_off_the_main_thread_hands_the_signal_back(tmp_path):
  """`close` on another thread cannot put the handler back (Python sets handlers on the
  main thread only): the signal, when it comes, reaches the previous handler all the same."""
  heard = []
  mine = lambda signum, frame: heard.append(signum)
  before = signal.signal(signal.SIGUSR2, mine)
  try:
    mgr = jaxdp.CheckpointManager(tmp_path, preemption_signal=signal.SIGUSR2)
    assert not mgr.reached_preemption(1)
    closer = threading.Thread(target=mgr.close)
    closer.start()
    closer.join()
    os.kill(os.getpid(), signal.SIGUSR2)
    assert heard == [signal.SIGUSR2] and signal.getsignal(signal.SIGUSR2) is mine
    assert not mgr.reached_preemption(2)
  finally:
    signal.signal(signal.SIGUSR2, before)


# --- the launcher ------------------------------------------------------------------------


def test_launcher_forwards_sigterm_and_waits_for_the_save():
  """A SIGTERM to the launcher reaches every process, which takes longer than the grace
  period of a failure stop (1 s) to "save" (2 s) and exits 143 by itself."""
  worker = (
    "import os, signal, sys, time\n"
    "got = []\n"
    "signal.signal(signal.SIGTERM, lambda s, f: got.append(s))\n"
    "print('ready', flush=True)\n"
    "while not got: time.sleep(0.01)\n"
    "time.sleep(2.0)\n"
    "print('saved', flush=True)\n"
    "sys.exit(128 + signal.SIGTERM)\n"
  )
  proc = subprocess.Popen(
    [sys.executable, "-m", "jaxdp.launch", "-n", "2", "--grace-period", "1", "--", "-c", worker],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    assert "pids" in proc.stderr.readline()
    assert [proc.stdout.readline().split()[-1] for _ in range(2)] == ["ready", "ready"]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 128 + signal.SIGTERM, err
  assert sorted(out.split()) == ["[p0]", "[p1]", "saved", "saved"], out
  assert "received SIGTERM; forwarding it to every process" in err
  assert "after SIGTERM: p0 exit code 143, p1 exit code 143" in err, err
  assert "sending SIGKILL" not in err, err


# --- scripts/train.py, 2 processes -------------------------------------------------------

TINY = [
  "--n-layer",
  "1",
  "--n-head",
  "2",
  "--d-model",
  "32",
  "--block-size",
  "16",
  "--batch-size",
  "16",
  "--eval-every",
  "1000",
  "--save-every",
  "1000",
]
STEPS = 300  # enough that the job is still running a second or two after the signal


def _launch(out, *args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  command = [sys.executable, "-m", "jaxdp.launch", "-n", "2", "-d", "4", "--timeout", "600"]
  command += ["--", "scripts/train.py", *TINY, "--steps", str(STEPS), "--out", str(out), *args]
  return subprocess.Popen(
    command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )


def _finish(proc):
  out, err = proc.communicate(timeout=900)
  return proc.returncode, out, err


def _metrics(out):
  records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  keys = ("step", "loss", "grad_norm", "lr", "val_loss")  # time and throughput differ
  return [{k: r[k] for k in keys if k in r} for r in records]


def _stored(checkpoint):
  with ocp.PyTreeCheckpointer() as reader:
    tree = reader.metadata(checkpoint / "state")
    tree = getattr(tree, "item_metadata", tree)
    tree = getattr(tree, "tree", tree)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return reader.restore(checkpoint / "state", restore_args=args)


@pytest.mark.slow
def test_train_script_saves_on_sigterm_at_one_step_and_resumes_bitwise(tmp_path):
  """Process 1 alone gets a SIGTERM, the launcher another a moment later (forwarded to
  both): both processes save at the same step and exit 143; the resumed run ends with the
  stored state and metrics of an uninterrupted run, bitwise."""
  full, stopped = tmp_path / "full", tmp_path / "stopped"
  proc = _launch(stopped)
  started = proc.stderr.readline()
  pids = [int(p) for p in re.search(r"pids ([\d ]+)", started).group(1).split()]
  deadline = time.monotonic() + 600
  metrics = stopped / "metrics.jsonl"
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):  # step 3
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
    time.sleep(0.05)
  os.kill(pids[1], signal.SIGTERM)
  time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  code, out, err = _finish(proc)
  assert code == 128 + signal.SIGTERM, out[-3000:] + err[-3000:]
  said = re.findall(r"\[p(\d)\] preempted \(SIGTERM\): saved checkpoint (\d+) at step", out)
  assert sorted(p for p, _ in said) == ["0", "1"], out[-3000:]
  step = int(said[0][1])
  assert said[1][1] == str(step) and 3 <= step < STEPS, said
  assert "after SIGTERM: p0 exit code 143, p1 exit code 143" in err, err[-3000:]
  assert sorted(os.listdir(stopped / "checkpoints")) == [str(step)]

  code, out, err = _finish(_launch(stopped, "--resume"))
  assert code == 0, out[-3000:] + err[-3000:]
  assert f"resumed from checkpoint {step} (step {step})" in out
  code, _, err = _finish(_launch(full))
  assert code == 0, err[-3000:]

  assert _metrics(stopped) == _metrics(full)
  got, want = (
    _stored(stopped / "checkpoints" / str(STEPS)),
    _stored(full / "checkpoints" / str(STEPS)),
  )
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
