"""scripts/train.py --save-every / --resume: a resumed run redoes exactly the lost steps (with
dropout: the same masks)."""

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


def _train(out, *args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)  # the script sets its own device count
  proc = subprocess.run(
    [sys.executable, str(ROOT / "scripts" / "train.py"), *TINY, "--out", str(out), *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def _metrics(out):
  return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_resume_redoes_lost_steps_bitwise(tmp_path):
  full = tmp_path / "full"
  _train(full, "--strategy", "optim")
  assert sorted(os.listdir(full / "checkpoints")) == ["3", "6", "8"]

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
