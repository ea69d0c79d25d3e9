"""scripts/train.py end to end, as a user runs it: a subprocess on 8 simulated CPU devices."""

import glob
import json
import math
import re
import os
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
  "32",
  "--batch-size",
  "16",
  "--bucket-size",
  "4000",
  "--lr",
  "1e-2",
  "--warmup-steps",
  "2",
]


NO_GPU = not glob.glob("/dev/nvidia[0-9]*")


def run_train(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the script sets its own device count
  # Without a GPU the script picks the CPU itself, as for a user who sets nothing.
  if NO_GPU:
    env.pop("JAX_PLATFORMS", None)
  else:
    env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run(
    [sys.executable, str(ROOT / "scripts" / "train.py"), *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "strategy, extra", [("no_shard", []), ("optim_grads_params", ["--scan-layers"])]
)
def test_train_script_end_to_end(tmp_path, strategy, extra):
  steps = 16
  proc = run_train(
    "--strategy",
    strategy,
    "--steps",
    str(steps),
    "--eval-every",
    "8",
    "--out",
    str(tmp_path),
    *TINY,
    *extra,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  # No traceback and no CUDA notice where there is no GPU, though the [aot] extra installs
  # JAX's CUDA plugin; stderr holds the progress bar only.
  if NO_GPU:
    assert "Traceback" not in proc.stderr and "cuda" not in proc.stderr.lower(), proc.stderr

  # The layout is printed at start: 8 devices, several buckets (DDP: of >= 4000 elements;
  # FSDP: one per unit).
  assert f"devices: 8 x cpu | strategy: {strategy}" in proc.stdout
  assert "dp=8," in proc.stdout and "bucket 1:" in proc.stdout
  if strategy == "no_shard":
    assert "bucket_size=4,000 elements" in proc.stdout
  # The schedule is said; fewer than 20 steps: the summary's two means are of disjoint halves.
  assert "learning rate: warmup to 0.01 over 2 steps, cosine decay to 0.001 at step 16" in (
    proc.stdout
  )
  assert "done: 16 steps in" in proc.stdout
  assert "train loss, mean of 8 steps: " in proc.stdout
  assert "(steps 1-8) -> " in proc.stdout and "(steps 9-16) |" in proc.stdout
  # The progress bar shows throughput once there is one: not after step 1 (compilation).
  updates = [u for u in proc.stderr.replace("\r", "\n").splitlines() if "loss=" in u]
  assert "tok_s" not in updates[0] and "tok_s=" in updates[-1], updates

  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if "loss" in r]
  val = [r for r in records if "val_loss" in r]
  assert [r["step"] for r in train] == list(range(1, steps + 1))
  assert [r["step"] for r in val] == [0, 8, 16]
  for r in train:
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "time_s"} <= set(r)
    assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["tokens_per_s"] > 0
  # Untrained, the model is near uniform over 256 bytes; 16 steps must clearly beat that.
  assert abs(val[0]["val_loss"] - math.log(256)) < 0.3, val
  assert val[-1]["val_loss"] < val[0]["val_loss"] - 1.0, val
  assert sum(r["loss"] for r in train[-4:]) / 4 < train[0]["loss"] - 1.0, train

  png = (tmp_path / "loss.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


@pytest.mark.slow
def test_train_script_skips_steps_above_the_grad_norm_threshold(tmp_path):
  """`--grad-norm-skip-threshold` far below any norm: every step is skipped on the device,
  metrics.jsonl says so, and the model is the one it started from (the same val loss)."""
  proc = run_train(
    "--strategy", "optim", "--steps", "4", "--eval-every", "4", "--out", str(tmp_path),
    "--grad-norm-skip-threshold", "1e-9", *TINY,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if "loss" in r]
  val = [r["val_loss"] for r in records if "val_loss" in r]
  assert [r["skipped"] for r in train] == [True] * 4
  assert len(val) == 2 and val[0] == val[1]


# Each bad flag, and what argparse says about it (exit 2, a usage line, no traceback).
BAD_FLAGS = [
  (["--steps", "0"], "argument --steps: 0: must be at least 1"),
  (["--eval-every", "0"], "argument --eval-every: 0: must be at least 1"),
  (["--dropout", "1.5"], "argument --dropout: 1.5: use a rate in [0, 1)"),
  (["--n-head", "3"], "--n-head 3 does not divide --d-model 128"),
  (["--bucket-size", "0"], "argument --bucket-size: 0: must be at least 1"),
  (["--warmup-steps", "100", "--steps", "4"], "--warmup-steps 100 is more than half of --steps 4"),
  (["--lr", "0"], "argument --lr: 0: must be a finite number > 0"),
  (["--lr", "inf"], "argument --lr: inf: must be a finite number > 0"),
  (["--batch-size", "0"], "argument --batch-size: 0: must be at least 1"),
  (["--seed", "-1"], "argument --seed: -1: must be at least 0"),
  (["--save-every", "-1"], "argument --save-every: -1: must be at least 0"),
  (["--cpu-devices", "0"], "argument --cpu-devices: 0: must be at least 1"),
  (["--n-layer", "2.5"], "argument --n-layer: '2.5' is not an integer"),
  (
    ["--preemption-signal", "SIGFOO"],
    "argument --preemption-signal: 'SIGFOO' is not a signal; use a name such as SIGTERM",
  ),
  (["--preemption-signal", "KILL"], "argument --preemption-signal: SIGKILL cannot be caught"),
  (
    ["--grad-norm-skip-threshold", "0"],
    "argument --grad-norm-skip-threshold: 0: must be a finite number > 0",
  ),
]


@pytest.mark.parametrize(
  "flags, message", BAD_FLAGS, ids=lambda x: " ".join(x) if isinstance(x, list) else ""
)
def test_bad_flags_are_refused_before_jax_is_imported(tmp_path, flags, message):
  """argparse refuses each bad flag, and before anything heavy: a `jax` that cannot be
  imported stands first on the path, so a refusal that came after `import jax` would show
  its ImportError instead."""
  (tmp_path / "jax").mkdir()
  (tmp_path / "jax" / "__init__.py").write_text("raise ImportError('jax was imported')\n")
  env = {**os.environ, "PYTHONPATH": str(tmp_path)}
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
    [sys.executable, str(ROOT / "scripts" / "train.py"), *flags, "--out", str(tmp_path / "out")],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.startswith("usage: train.py"), proc.stderr
  assert f"train.py: error: {message}" in " ".join(proc.stderr.split()), proc.stderr
  assert "Traceback" not in proc.stderr and "jax was imported" not in proc.stderr
  assert not (tmp_path / "out").exists()


def test_train_script_rejects_indivisible_batch(tmp_path):
  proc = run_train("--batch-size", "12", "--steps", "1", "--out", str(tmp_path), timeout=300)
  assert proc.returncode != 0
  assert "--batch-size 12 does not divide by the 8 devices" in proc.stderr


def test_help_documents_every_flag_with_its_default():
  proc = run_train("--help", timeout=120)
  assert proc.returncode == 0, proc.stderr
  text = proc.stdout
  options = text[text.index("options:") :]
  entries = re.split(r"\n  (?=-)", options)[1:]  # one per flag, with its wrapped help
  flags = [e.split()[0].rstrip(",") for e in entries]
  assert len(flags) >= 18 and "--resume" in flags and "--out" in flags, flags
  for entry in entries:
    if entry.startswith("-h"):
      continue
    assert "(default:" in " ".join(entry.split()), entry
  flat = " ".join(text.split())
  assert "must divide by the device count" in flat
  assert "Writes to --out: metrics.jsonl" in flat and "loss.png" in flat
