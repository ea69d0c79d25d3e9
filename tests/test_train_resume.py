"""scripts/train.py --save-every / --resume: a resumed run redoes exactly the lost steps (with
dropout: the same masks), and keeps the learning-rate schedule the run started with."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
  "--steps",
  "8",
  "--eval-every",
  "4",
  "--save-every",
  "3",
  "--dropout",
  "0.1",
]


def _run(out, *args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)  # the script sets its own device count
  return subprocess.run(
    [sys.executable, str(ROOT / "scripts" / "train.py"), *TINY, "--out", str(out), *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )


def _train(out, *args):
  proc = _run(out, *args)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def _metrics(out):
  return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_resume_redoes_lost_steps_bitwise(tmp_path):
  """Also, on the uninterrupted run's last checkpoint: a resume with a larger --steps goes on
  with the run's own schedule (the steps past its end train at its final rate, lr / 10); a
  changed --lr is refused, naming the run's; a checkpoint at --steps has nothing to train.
  (One test: the runs are the slow part, and these reuse the first one.)"""
  full = tmp_path / "full"
  first = _train(full, "--strategy", "optim")
  assert sorted(os.listdir(full / "checkpoints")) == ["3", "6", "8"]
  # The default warmup of 30 steps is capped at half of --steps 8, and says so.
  assert "learning rate: warmup to 0.003 over 4 steps (the default 30, capped at half of " in (
    first
  )

  # A crash right after checkpoint 3: later checkpoints and metrics never happened.
  crashed = tmp_path / "crashed"
  shutil.copytree(full, crashed)
  shutil.rmtree(crashed / "checkpoints" / "6")
  shutil.rmtree(crashed / "checkpoints" / "8")
  out = _train(crashed, "--strategy", "optim", "--resume")
  assert "resumed from checkpoint 3 (step 3)" in out

  def losses(records):  # time and throughput differ; the numbers must not
    return [
      {k: r[k] for k in ("step", "loss", "grad_norm", "lr", "val_loss") if k in r} for r in records
    ]

  assert losses(_metrics(crashed)) == losses(_metrics(full))

  before = {r["step"]: r["lr"] for r in _metrics(full) if "lr" in r}
  proc = _run(full, "--strategy", "optim", "--resume", "--steps", "10", "--lr", "0.01")
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "--lr 0.01: the run in " in proc.stderr and "started with --lr 0.003" in proc.stderr
  proc = _run(full, "--strategy", "optim", "--resume")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "checkpoint 8 is at --steps 8 or past it: nothing to train" in proc.stdout

  resumed = _train(full, "--strategy", "optim", "--resume", "--steps", "10")
  assert "resumed from checkpoint 8 (step 8)" in resumed
  assert "steps 9-10 train at 0.0003" in resumed
  assert "done: steps 9-10 (2 steps) in " in resumed
  after = {r["step"]: r["lr"] for r in _metrics(full) if "lr" in r}
  assert {k: after[k] for k in before} == before  # the first 8 steps as they were
  assert after[9] == after[10] == pytest.approx(0.0003, rel=1e-6)
