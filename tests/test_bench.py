"""scripts/bench/bench.py runs end to end at tiny sizes and writes its table, plot and samples."""

import json
import os
import subprocess
import sys

import pytest

from jaxdp import inspect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSPMD = ["gspmd", "gspmd_zero1", "gspmd_fsdp", "gspmd_fsdp_unconstrained"]
VARIANTS = GSPMD + ["no_shard", "optim", "optim_grads_params"]
BASELINES = GSPMD + ["gspmd", "gspmd_zero1", "gspmd_fsdp"]
SIZES = ["tiny", "mlp32x2"]
# the docs' table: size | params | dp | variant | baseline | step ms | ratio | ratio to gspmd
# | compile s | compile ratio | collectives | comm MiB/dev | state MiB/dev
COLUMNS = 13


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  command = [
    sys.executable,
    os.path.join(ROOT, "scripts", "bench", "bench.py"),
    "--quick",
    "--dps",
    "8",
    "--out",
    str(out),
  ]
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  assert done.returncode == 0, done.stderr[-4000:]
  return out, done.stdout


def table_rows(text, sizes=("tiny", "mlp32x2", "small", "medium", "mlp512x8", "mlp256x4")):
  """The cells of the markdown table rows in `text` that start with a model size."""
  rows = []
  for line in text.splitlines():
    cells = [c.strip() for c in line.split("|")[1:-1]]
    if len(cells) > 3 and cells[0].split(" ")[0] in sizes:
      rows.append(cells)
  return rows


@pytest.mark.slow
def test_bench_writes_table_plot_and_samples(bench):
  out, stdout = bench
  table = (out / "bench.md").read_text()
  assert table.startswith("Command: `python scripts/bench/bench.py --quick --dps 8 --out ")
  assert table in stdout
  rows = [r for r in table_rows(table) if len(r) == COLUMNS]
  assert [(r[0], r[3], r[4]) for r in rows] == [
    (size, v, b) for size in SIZES for v, b in zip(VARIANTS, BASELINES)
  ]
  assert all(r[2] == "8" for r in rows)
  for r in rows:
    if r[3].startswith("gspmd"):  # a baseline's ratio (step and compile) to itself
      assert r[6] == r[9] == "1.00", r
  assert "Targets at dp=8" in table
  targets = [r for r in table_rows(table) if len(r) == 4]  # size + one cell per strategy
  assert [r[0] for r in targets] == SIZES
  assert all(("met" in c or "missed" in c) for r in targets for c in r[1:])
  with open(out / "bench.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"

  report = json.loads((out / "bench.json").read_text())
  # Each GSPMD baseline was checked after its steps: every leaf sharded as asked, and
  # device 0 holds the formula's bytes (bench.py raises otherwise). ZeRO-1 shards every
  # optimizer state leaf but Adam's step count (each has a dim that 8 divides). FSDP
  # (MaxText's rule) shards each weight on its dim of the model's width: all of the MLP's;
  # of the GPT's 28, not the biases of c_attn (3 d) and c_fc (4 d), one each per layer.
  # The unconstrained extra shards every leaf on its first dim that 8 divides.
  checks = report["gspmd_checks"]
  assert len(checks) == 8 and all("(= the formula)" in c for c in checks)
  assert "tiny dp=8 gspmd_fsdp: params 24/28 leaves" in checks[2]
  assert "opt state 48/57 leaves sharded" in checks[2]
  assert "tiny dp=8 gspmd_fsdp_unconstrained: params 28/28 leaves" in checks[3]
  assert "opt state 56/57 leaves sharded" in checks[3]
  assert "mlp32x2 dp=8 gspmd_zero1: params 0/4 leaves" in checks[5]
  assert "opt state 8/9 leaves sharded" in checks[5]
  assert "gspmd_fsdp: params 4/4 leaves" in checks[6]
  assert "gspmd_fsdp_unconstrained: params 4/4 leaves" in checks[7]
  for size in SIZES:
    results = {r["variant"]: r for r in report["results"] if r["size"] == size}
    assert list(results) == VARIANTS
    for r in results.values():
      base = results[r["baseline"]]
      assert len(r["times_ms"]) == 4 and r["step_ms"] > 0 and r["compile_s"] > 0
      assert r["ratio"] == pytest.approx(r["step_ms"] / base["step_ms"])
      assert r["ratio_gspmd"] == pytest.approx(r["step_ms"] / results["gspmd"]["step_ms"])
      assert r["compile_ratio"] == pytest.approx(r["compile_s"] / base["compile_s"])
    # What the table claims about each variant, from the compiled programs and the state:
    # every variant reduces the grads; jaxdp's DDP and ZeRO-1 send what one ring
    # all-reduce of the f32 grads sends, 2 (N - 1) / N * 4 bytes per param (up to the
    # loss, the norm scalars and padding rows to a multiple of 8: < 5% here).
    assert all(r["collectives"] >= 1 for r in results.values())
    ring = 2 * 7 / 8 * 4 * results["gspmd"]["params"]
    assert results["no_shard"]["comm_bytes"] == pytest.approx(ring, rel=0.05)
    assert results["optim"]["comm_bytes"] == pytest.approx(ring, rel=0.05)
    # State per device: replicated = params + Adam's two moments (+ the step count);
    # ZeRO-1 programs keep the params and 1/8 of the moments, FSDP programs 1/8 of both
    # but GSPMD FSDP's replicated biases, held whole (jaxdp pads rows to a multiple of 8,
    # none here: every dim is one).
    params = 4 * results["gspmd"]["params"]
    full = results["gspmd"]["state_bytes"]
    assert full == pytest.approx(3 * params, abs=16)
    assert results["no_shard"]["state_bytes"] == pytest.approx(full, abs=16)
    assert results["gspmd_zero1"]["state_bytes"] == pytest.approx(params + 2 * params / 8, abs=16)
    whole = 3 * 4 * 2 * (3 + 4) * 32 if size == "tiny" else 0  # 2 layers' biases, d 32
    assert results["gspmd_fsdp"]["state_bytes"] == pytest.approx(full / 8 + whole * 7 / 8, abs=16)
    unconstrained = results["gspmd_fsdp_unconstrained"]["state_bytes"]
    assert unconstrained == pytest.approx(full / 8, abs=16)
    for sharded in ("optim", "optim_grads_params"):
      assert results[sharded]["state_bytes"] == pytest.approx(full / 8, rel=0.25)


def test_docs_bench_table_has_every_variant_of_its_command():
  """docs/bench.md's table is what its command produces: one row per size and variant the
  command names, each against the baseline bench.py pairs it with."""
  docs = open(os.path.join(ROOT, "docs", "bench.md")).read()
  command = docs[docs.index("Command: `") + 10 :].split("`")[0]
  assert f"\n{command}\n" in docs  # also in a bash block, as a reader copies it
  assert "--out" not in command  # it writes to bench.py's own default folder
  variants = command.split("--variants ")[1].split()[0].split(",")
  rows = [r for r in table_rows(docs) if len(r) == COLUMNS]
  assert {r[0] for r in rows} == {"small", "medium", "mlp512x8", "mlp256x4"}
  for size in {r[0] for r in rows}:
    assert [r[3] for r in rows if r[0] == size] == variants, size
  for r in rows:
    base = r[3].partition("+")[0]
    want = {"no_shard": "gspmd", "optim": "gspmd_zero1", "optim_grads_params": "gspmd_fsdp"}
    assert r[4] == want.get(base, r[3]), r


def test_step_breakdown_puts_each_instruction_in_a_phase(tmp_path):
  """scripts/bench/step_breakdown.py profiles the steps and finds each strategy's collectives."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  command = [
    sys.executable,
    os.path.join(ROOT, "scripts", "bench", "step_breakdown.py"),
    "--size",
    "mlp32x2",
    "--variants",
    "gspmd,gspmd_zero1,optim",
    "--rounds",
    "1",
    "--profile-steps",
    "1",
    "--out",
    str(tmp_path),
  ]
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-4000:]
  table = (tmp_path / "breakdown.md").read_text()
  assert table in done.stdout
  rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")]
  assert rows[0] == "phase" and "**step (wall ms)**" in rows and "waiting for other devices" in rows
  results = json.loads((tmp_path / "breakdown.json").read_text())["results"]
  phases = {v: {p for p, ms in r["phases"].items() if ms > 0} for v, r in results.items()}
  # What the compiled programs hold, whatever the timings: every step runs its loss and
  # gradient and an optimizer update; replicated jit reduces the grads and gathers
  # nothing; ZeRO-1 (GSPMD's and jaxdp's) gathers the updated params.
  for variant in results:
    assert {"forward+backward", "grad reductions", "optimizer update"} <= phases[variant]
  assert "param gathers" not in phases["gspmd"]
  assert "param gathers" in phases["gspmd_zero1"] and "param gathers" in phases["optim"]
  for r in results.values():
    assert r["wall_ms"] > 0 and r["instructions_per_step"] > 10
    waiting = r["phases"]["waiting for other devices"]  # split off the collectives' events
    assert sum(i["ms"] for i in r["instructions"].values()) + waiting == pytest.approx(r["sum_ms"])


def test_predict_scaling_writes_its_table_and_predictions(tmp_path):
  """scripts/bench/predict_scaling.py compiles for the H100 target and writes its table, a row
  per program, and the predictions behind it."""
  if inspect.gpu_compile_unavailable():
    pytest.skip(inspect.gpu_compile_unavailable())
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  script = os.path.join(ROOT, "scripts", "bench", "predict_scaling.py")
  command = [sys.executable, script, "--quick", "--sweeps", "prefetch", "--prefetch", "1"]
  done = subprocess.run(
    command + ["--out", str(tmp_path)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert done.returncode == 0, done.stderr[-4000:]
  table = (tmp_path / "predict_scaling.md").read_text()
  assert table in done.stdout
  rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()]
  assert [r[:2] for r in rows if r and r[0] == "optim_grads_params"] == [
    ["optim_grads_params", "1"]
  ]
  predictions = json.loads((tmp_path / "predict_scaling.json").read_text())["prefetch"]
  (row,) = predictions.values()
  assert 0 <= row["exposed_us"]["total"] <= row["comm_us"]["total"] < row["step_us"] + 1e-6


def fsdp_overlap(tmp_path, *args):
  """Runs scripts/bench/fsdp_overlap.py: (its stdout, its json's results of the one depth)."""
  if inspect.gpu_compile_unavailable():
    pytest.skip(inspect.gpu_compile_unavailable())
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  script = os.path.join(ROOT, "scripts", "bench", "fsdp_overlap.py")
  command = [sys.executable, script, "--quick", "--json", str(tmp_path / "o.json"), *args]
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-4000:]
  (results,) = json.loads((tmp_path / "o.json").read_text())["results"].values()
  return done.stdout, results


def overlap_rows(text):
  """The program rows of fsdp_overlap.py's table: label, then (value, ratio) per column."""
  rows = []
  for line in text.splitlines():
    cells = [c.strip() for c in line.split("|")[1:-1]]
    if len(cells) == 6 and cells[0] not in ("program", "---"):
      rows.append((cells[0], [tuple(c[:-1].split(" (")) for c in cells[1:]]))
  return rows


@pytest.mark.slow
def test_fsdp_overlap_table_is_against_the_maxtext_program(tmp_path):
  """scripts/bench/fsdp_overlap.py --quick: one table, a row per program in the documented
  order, each cell a number and its ratio to the MaxText-style program's in the same run
  (1.00x in that program's own row); the numbers are XLA's prediction, as the header says."""
  stdout, results = fsdp_overlap(tmp_path)
  assert "XLA's cost model" in stdout and "8 x H100 over 1 host" in stdout
  rows = overlap_rows(stdout)
  assert [label for label, _ in rows] == [
    "GSPMD FSDP, MaxText-style",
    "GSPMD FSDP, no activation constraints",
    'jaxdp FSDP `FSDPConfig(stacked=["blocks"])`',
    "+ `grad_reduce_dtype=bf16`",
    "+ `lookups=[embed]`",
    "+ `vocab_parallel=False`",
    "+ `chunks={table: 16}`",
  ]
  assert list(results) == [
    "maxtext",
    "unconstrained",
    "jaxdp",
    "bf16_grads",
    "lookups",
    "gathered",
    "chunks",
  ]
  assert all(ratio == "1.00x" for _, ratio in rows[0][1])
  columns = ("peak GiB", "step ms", "compute ms", "comm ms", "exposed ms")
  base = results["maxtext"]
  for (label, cells), numbers in zip(rows, results.values()):
    for (value, ratio), column in zip(cells, columns):
      assert float(value) == pytest.approx(numbers[column], rel=0.05, abs=0.01), label
      if base[column] > 0:
        assert float(ratio[:-1]) == pytest.approx(numbers[column] / base[column], abs=0.006)
    # predict_step's own identity: the step is the kernels plus the exposed communication
    assert numbers["step ms"] == pytest.approx(numbers["compute ms"] + numbers["exposed ms"])
    assert 0 <= numbers["exposed ms"] <= numbers["comm ms"] + 1e-9 and numbers["peak GiB"] > 0
    assert 0 < numbers["gemm ms"] <= numbers["compute ms"] + 1e-9  # the matmuls' share


def test_fsdp_overlap_adds_the_baseline_and_skips_what_a_model_lacks(tmp_path):
  """--rows without the baseline still compiles the MaxText-style program first; the MLP has
  no vocabulary table, so no gathered or chunks row."""
  stdout, results = fsdp_overlap(
    tmp_path, "--model", "mlp", "--rows", "jaxdp", "gathered", "chunks"
  )
  assert list(results) == ["maxtext", "jaxdp"]
  assert [label for label, _ in overlap_rows(stdout)] == [
    "GSPMD FSDP, MaxText-style",
    'jaxdp FSDP `FSDPConfig(stacked=["blocks"])`',
  ]


@pytest.mark.slow
def test_hsdp_accumulation_crosses_replica_as_the_ring_formula_says(tmp_path):
  """scripts/bench/hsdp_accumulation.py --quick on 64 GPUs over 8 hosts, k = 4: what the
  compiled ZeRO-2 and FSDP steps move across hosts is `ring_formula`'s all-reduce (the grads'
  shards summed across "replica" once per step) plus the loss-and-norm scalars, a few
  collectives per step; compared with itself, the table says nothing was saved."""
  if inspect.gpu_compile_unavailable():
    pytest.skip(inspect.gpu_compile_unavailable())
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  script = os.path.join(ROOT, "scripts", "bench", "hsdp_accumulation.py")
  saved = tmp_path / "rows.json"
  command = [sys.executable, script, "--quick", "--save", str(saved), "--compare", str(saved)]
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-4000:]
  rows = json.loads(saved.read_text())["rows"]
  assert list(rows) == ["optim_grads", "fsdp"]
  for numbers in rows.values():
    assert numbers["replica MiB"] == pytest.approx(numbers["formula all-reduce MiB"], rel=1e-3)
    assert numbers["replica runs"] <= 8  # one per bucket (unit bucket) and the scalars
  lines = [line for line in done.stdout.splitlines() if line.startswith("| ")]
  assert len(lines) == 3 and all(line.endswith("| 0.00 ms (0%) |") for line in lines[1:])
