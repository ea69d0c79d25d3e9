"""scripts/bench.py runs end to end at tiny sizes and writes its table, plot and samples."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ["gspmd", "psum_leaf", "psum_flat", "no_shard", "optim", "optim_grads_params"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  command = [
    sys.executable,
    os.path.join(ROOT, "scripts", "bench.py"),
    "--quick",
    "--dps",
    "8",
    "--out",
    str(out),
  ]
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  assert done.returncode == 0, done.stderr[-4000:]
  return out, done.stdout


@pytest.mark.slow
def test_bench_writes_table_plot_and_samples(bench):
  out, stdout = bench
  table = (out / "bench.md").read_text()
  assert table.startswith("Command: `python scripts/bench.py --quick --dps 8 --out ")
  assert table in stdout
  rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| tiny ")]
  assert [r[3].strip() for r in rows] == VARIANTS
  assert all(r[2].strip() == "8" for r in rows)
  assert rows[0][5].strip() == "1.00"  # the baseline's ratio to itself
  assert "At dp=8: no_shard " in table
  with open(out / "bench.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"

  results = {r["variant"]: r for r in json.loads((out / "bench.json").read_text())["results"]}
  assert list(results) == VARIANTS
  for r in results.values():
    assert len(r["times_ms"]) == 4 and r["step_ms"] > 0 and r["compile_s"] > 0
    assert r["ratio"] == pytest.approx(r["step_ms"] / results["gspmd"]["step_ms"])
  # What the table claims about each variant, from the compiled programs and the state:
  # every variant reduces the grads; jaxdp moves what one flat all-reduce moves (up to
  # padding); ZeRO-1 and FSDP keep about 1/8 of the replicated state on each device.
  assert all(r["collectives"] >= 1 for r in results.values())
  flat = results["psum_flat"]["comm_bytes"]
  assert results["no_shard"]["comm_bytes"] == pytest.approx(flat, rel=0.05)
  assert results["optim"]["comm_bytes"] == pytest.approx(flat, rel=0.05)
  full = results["gspmd"]["state_bytes"]
  assert results["no_shard"]["state_bytes"] == pytest.approx(full, abs=4)  # + step count
  for sharded in ("optim", "optim_grads_params"):
    assert results[sharded]["state_bytes"] == pytest.approx(full / 8, rel=0.25)


def table_rows(text):
  """The cells of the markdown table rows in `text` that start with a model size."""
  rows = []
  for line in text.splitlines():
    cells = [c.strip() for c in line.split("|")[1:-1]]
    if len(cells) > 3 and cells[0].split(" ")[0] in ("tiny", "small", "medium"):
      rows.append(cells)
  return rows


def test_readme_table_is_the_dp8_rows_of_docs_bench():
  readme = open(os.path.join(ROOT, "README.md")).read()
  docs = open(os.path.join(ROOT, "docs", "bench.md")).read()
  section = readme[readme.index("<!-- BEGIN benchmarks") : readme.index("<!-- END benchmarks")]
  command = docs[docs.index("Command: `") + 10 :].split("`")[0]
  assert f"\n{command}\n" in section  # the README names the command that made the table
  # README: size (params) | variant | step ms | ratio | collectives | comm | state
  ours = {(r[0].split(" ")[0], r[1]): r for r in table_rows(section)}
  # docs: size | params | dp | variant | step ms | ratio | compile s | collectives | comm | state
  dp8 = {(r[0], r[3]): r for r in table_rows(docs) if r[2] == "8"}
  assert ours.keys() == dp8.keys() and len(ours) >= 12
  for key, row in ours.items():
    want = dp8[key]
    assert float(row[2]) == pytest.approx(float(want[4]), abs=0.5), key  # step ms
    assert row[3:] == [want[5], want[7], want[8], want[9]], key  # ratio, coll, comm, state
