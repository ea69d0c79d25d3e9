"""The commands of README.md and docs/, run as a reader runs them.

Python blocks (README, docs/guide.md, docs/sharded-job.md, docs/bring-your-model.md,
docs/multi-host.md) run from an empty folder with only the `jaxdp` package importable (what
`pip install -e .` packages: not `models/`, not `scripts/`), and the installed packages; a
block whose first line names a package no extra installs (`# requires: transformers<5`)
runs where that package is installed and is skipped elsewhere; bash blocks run where they can run on one machine (the local launcher stands in
for a cluster), and otherwise have their scripts, flags, extras and markers checked to exist
(docs/bench.md and docs/memory.md: the command beside each table).
"""

import functools
import glob
import inspect
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import importlib.util

import jax
import pytest
from packaging.version import Version

from jaxdp._src import cuda_probe

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MULTI_HOST = (ROOT / "docs" / "multi-host.md").read_text()
GUIDE = (ROOT / "docs" / "guide.md").read_text()
MEASURED = {
  name: (ROOT / "docs" / name).read_text() for name in ("bench.md", "memory.md", "sharded-job.md")
}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NO_GPU = not glob.glob("/dev/nvidia[0-9]*")


def blocks(text: str, lang: str) -> list[str]:
  return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def commands(text: str) -> list[list[str]]:
  """The commands of the bash blocks, split at `&&`; comments and #SBATCH lines dropped."""
  out = []
  for block in blocks(text, "bash"):
    for line in block.splitlines():
      line = line.split(" #")[0].strip()
      if not line or line.startswith("#"):
        continue
      out += [shlex.split(part) for part in line.split("&&")]
  return out


def reader_env(tmp_path: Path) -> dict:
  """A fresh shell's environment in which only the `jaxdp` package is importable."""
  site = tmp_path / "site"
  site.mkdir(exist_ok=True)
  if not (site / "jaxdp").exists():
    (site / "jaxdp").symlink_to(ROOT / "jaxdp")
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
  env["PYTHONPATH"] = str(site)
  if NO_GPU:  # the CUDA plugin of the [aot] extra would print that it found no GPU
    env["JAX_PLATFORMS"] = "cpu"
  return env


def run(args, cwd, env, timeout=300):
  return subprocess.run(
    [sys.executable if a == "python" else a for a in args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


@functools.cache  # one `--help` per script: a doc names each script many times
def help_flags(script: str) -> frozenset[str]:
  proc = subprocess.run(
    [sys.executable, str(ROOT / script), "--help"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert proc.returncode == 0, proc.stderr
  return frozenset(re.findall(r"--[\w-]+", proc.stdout))


# ----------------------------------------------------------------------------- README


@pytest.mark.parametrize("i", range(len(blocks(README, "python"))))
def test_readme_python_block_runs_from_any_folder(tmp_path, i):
  code = blocks(README, "python")[i]
  (tmp_path / "snippet.py").write_text(code)
  proc = run(["python", "snippet.py"], tmp_path, reader_env(tmp_path))
  assert proc.returncode == 0, f"README python block {i}:\n{code}\n{proc.stderr[-3000:]}"


def test_readme_bash_blocks_name_what_exists():
  extras = set(PYPROJECT["project"]["optional-dependencies"])
  markers = {m.split(":")[0] for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
  seen = set()
  for args in commands(README):
    if args[:3] == ["pip", "install", "-e"]:
      m = re.fullmatch(r"\.(?:\[([\w,]+)\])?", args[3])
      assert m, args
      assert set(filter(None, (m.group(1) or "").split(","))) <= extras, args
    elif args[:1] == ["python"] and args[1].startswith("scripts/"):
      flags = {a.split("=")[0] for a in args[2:] if a.startswith("--")}
      assert flags <= help_flags(args[1]), (args, flags - help_flags(args[1]))
    elif args[:3] == ["python", "-m", "pytest"]:
      if "-m" in args[3:]:
        expr = args[args.index("-m", 3) + 1]
        assert set(re.findall(r"\w+", expr)) - {"not", "and", "or"} <= markers, expr
    elif args[:1] == ["ruff"]:  # the lint step: ruff is pinned in dev, and CI runs it
      assert any(
        d.startswith("ruff==") for d in PYPROJECT["project"]["optional-dependencies"]["dev"]
      )
      assert " ".join(args) in (ROOT / ".ci" / "run").read_text(), args
    else:
      pytest.fail(f"README: a command this test does not know how to check: {args}")
    seen.add(" ".join(args[:2]))
  assert {"pip install", "python scripts/train.py"} <= seen


def stderr_lines(proc: subprocess.CompletedProcess) -> list[str]:
  """Its stderr's lines, absl's timestamp and thread id (`I0000 00:00:1796.5  123 `) blanked."""
  return [
    re.sub(r"^([IWE]\d{4}) [\d:.]+\s+\d+ ", r"\1 ", line) for line in proc.stderr.splitlines()
  ]


@pytest.mark.skipif(
  cuda_probe.has_nvidia_driver() or importlib.util.find_spec("jax_cuda12_plugin") is None,
  reason="JAX's CUDA plugin speaks only where it is installed and finds no NVIDIA driver",
)
def test_readme_example_prints_nothing_jaxdp_could_prevent(tmp_path):
  """With the [aot] extra on a machine without a GPU, README's example (which imports jax
  before jaxdp) writes to stderr only what `import jax` alone writes (the CUDA plugin's
  driver probe, before jaxdp runs); imported first, jaxdp leaves that out too, with or
  without `JAX_PLATFORMS=cpu` (what docs/first-hour.md says to set)."""
  env = reader_env(tmp_path)
  env.pop("JAX_PLATFORMS", None)  # a user who sets nothing
  code = blocks(README, "python")[0]
  assert code.startswith("import jax, jax.numpy as jnp, optax, jaxdp\n"), code[:100]
  (tmp_path / "readme.py").write_text(code)
  import_jax = run(["python", "-c", "import jax"], tmp_path, env)
  readme = run(["python", "readme.py"], tmp_path, env)
  assert readme.returncode == 0, readme.stderr[-3000:]
  # jaxlib 0.10's plugin probes the driver three times, two lines each; 0.12's writes nothing
  probe = [line for line in stderr_lines(import_jax) if "Could not find cuda drivers" in line]
  assert len(stderr_lines(import_jax)) == 2 * len(probe), import_jax.stderr
  assert stderr_lines(readme) == stderr_lines(import_jax), readme.stderr

  jaxdp_first = code.replace(
    "import jax, jax.numpy as jnp, optax, jaxdp\n",
    "import jaxdp\nimport jax, jax.numpy as jnp, optax\n",
  )
  (tmp_path / "jaxdp_first.py").write_text(jaxdp_first)
  for platforms in (None, "cpu"):
    env_now = env if platforms is None else {**env, "JAX_PLATFORMS": platforms}
    proc = run(["python", "jaxdp_first.py"], tmp_path, env_now)
    assert proc.returncode == 0 and proc.stderr == "", (platforms, proc.stderr)
    assert "loss " in proc.stdout


def test_readme_links_exist():
  for link in re.findall(r"\]\(((?:docs|notebooks)/[^)#]*|[\w-]+\.md)\)", README):
    assert (ROOT / link).exists(), link


# ----------------------------------------------------------------------------- docs/


DOC_BLOCKS = [
  (name, code)
  for name in ("guide.md", "sharded-job.md", "bring-your-model.md", "first-hour.md")
  for code in blocks((ROOT / "docs" / name).read_text(), "python")
]


def skip_unless_installed(name: str, code: str) -> None:
  """Skips a block whose first line names a package no extra installs,
  `# requires: transformers<5` (docs/bring-your-model.md says why), where that package
  (below that version) is not installed; it runs where it is."""
  m = re.match(r"# requires: ([\w-]+)(?:<([\d.]+))?", code)
  if m is None:
    return
  why = f"docs/{name}: {code.splitlines()[0]}"
  module = pytest.importorskip(m.group(1), reason=why)
  if m.group(2) and Version(module.__version__) >= Version(m.group(2)):
    pytest.skip(f"{why}; {m.group(1)} {module.__version__} is installed")


@pytest.mark.parametrize("i", range(len(DOC_BLOCKS)))
def test_guide_python_block_runs_from_any_folder(tmp_path, i):
  name, code = DOC_BLOCKS[i]
  skip_unless_installed(name, code)
  (tmp_path / "snippet.py").write_text(code)
  proc = run(["python", "snippet.py"], tmp_path, reader_env(tmp_path))
  assert proc.returncode == 0, f"docs/{name} python block {i}:\n{code}\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_measurement_commands_name_real_scripts_and_flags(name):
  """Every table of docs/bench.md and docs/memory.md comes with the command that made it:
  a script of scripts/ with flags it takes, writing inside the repository (no scratch
  folders)."""
  found = commands(MEASURED[name])
  assert found, name
  for args in found:
    if args[0] == "bash":
      assert (ROOT / args[1]).is_file(), args
      continue
    assert args[0] == "python" and args[1].startswith("scripts/"), args
    flags = {a.split("=")[0] for a in args[2:] if a.startswith("--")}
    assert flags <= help_flags(args[1]), (args, flags - help_flags(args[1]))
    assert not any(a.startswith("/tmp") for a in args), args


def test_loops_doc_names_tests_that_exist():
  """Every test docs/loops.md cites for a habit is a test of the suite."""
  defined = {
    name
    for path in (ROOT / "tests").glob("test_*.py")
    for name in re.findall(r"^def (test_\w+)", path.read_text(), re.M)
  }
  cited = set(re.findall(r"`(test_\w+)`", (ROOT / "docs" / "loops.md").read_text()))
  assert cited and cited <= defined, sorted(cited - defined)


# ----------------------------------------------------------------------------- multi-host


def launcher_commands(script: str) -> list[list[str]]:
  return [
    a for a in commands(MULTI_HOST) if a[:3] == ["python", "-m", "jaxdp.launch"] and script in a
  ]


def replace_out(args, old, new):
  return [new if a == old else a for a in args]


@pytest.mark.slow
def test_multi_host_check_job_runs_under_the_launcher(tmp_path):
  """check_job.py, the doc's Python block, as the doc runs it: 2 processes x 4 devices."""
  (code,) = blocks(MULTI_HOST, "python")
  (tmp_path / "check_job.py").write_text(code)
  (args,) = launcher_commands("check_job.py")
  args = replace_out(args, "/tmp/jaxdp-check", str(tmp_path / "ckpt"))
  proc = run(args, tmp_path, reader_env(tmp_path), timeout=400)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  for p in (0, 1):
    assert f"[p{p}] process {p}/2: 4 local of 8 cpu devices" in proc.stdout
    assert f"[p{p}] process {p}: global loss" in proc.stdout
    assert "checkpoint ok" in proc.stdout


@pytest.mark.slow
def test_multi_host_rehearsal_runs_under_the_launcher(tmp_path):
  (args,) = launcher_commands("scripts/train.py")
  args = replace_out(args, "/tmp/jaxdp-rehearsal", str(tmp_path / "out"))
  proc = run(args, ROOT, reader_env(tmp_path), timeout=500)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "[p0] devices: 8 x cpu" in proc.stdout and "[p1] devices: 8 x cpu" in proc.stdout
  assert (tmp_path / "out" / "metrics.jsonl").exists()
  # Each process says it joined; process 0 alone says the rest, once. Gloo's connection
  # lines are left out by the launcher.
  assert "[p1] devices: 8 x cpu | process 1 of 2, 4 local\n" in proc.stdout
  assert "[p0] devices: 8 x cpu | process 0 of 2, 4 local | strategy: " in proc.stdout
  for line in ("done: 4 steps in ", "step 2: loss ", "buffer float32", "learning rate: "):
    assert ("[p1] " + line) not in proc.stdout, line
  assert proc.stdout.count("done: 4 steps in ") == 1 and "[p0] done: 4 steps in " in proc.stdout
  assert "[Gloo]" not in proc.stdout + proc.stderr


def test_multi_host_cluster_commands_use_real_flags_and_arguments():
  """What cannot run here (sbatch, srun, a Kubernetes Job) names flags and arguments that
  exist."""
  train_flags = help_flags("scripts/train.py")
  srun = [a for a in commands(MULTI_HOST) if a[:1] == ["srun"]]
  job = re.findall(r'"bash", "-c", "(.*?)"\]', MULTI_HOST)
  assert srun and job
  for args in srun + [shlex.split(j) for j in job]:
    flags = {a for a in args if a.startswith("--")}
    assert flags <= train_flags, flags - train_flags
  for match in re.findall(r"#SBATCH (--[\w-]+)", MULTI_HOST):
    assert match in {"--job-name", "--nodes", "--ntasks-per-node", "--gpus-per-node", "--time"}, (
      match
    )
  # The timeouts table names jax.distributed.initialize's arguments and their defaults.
  params = inspect.signature(jax.distributed.initialize).parameters
  for name, default in re.findall(r"\| `(\w+)` \| (\d+) s \|", MULTI_HOST):
    assert params[name].default == int(default), name
  for name in re.findall(r"`(JAXDP_\w+)`", MULTI_HOST):
    from jaxdp._src import distributed

    assert name in {
      distributed.ENV_COORDINATOR,
      distributed.ENV_NUM_PROCESSES,
      distributed.ENV_PROCESS_ID,
      distributed.ENV_LOCAL_DEVICES,
    }, name


def test_ci_runs_the_suite_from_a_clone_at_a_fresh_path():
  """CI tests a clone elsewhere, with its environment inside it, so no test may lean on
  where the developer's checkout or environment lives."""
  lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
  clone = next(i for i, line in enumerate(lines) if line.startswith("git clone"))
  cd = lines.index('cd "$clone"')
  assert any("mktemp -d" in line for line in lines[:clone]), lines
  assert (
    clone < cd < lines.index("python -m venv .venv") < lines.index('pip install -e ".[dev,aot]"')
  )


def test_ci_runs_the_readme_test_command_exactly():
  ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
  assert ci in [line.strip() for block in blocks(README, "bash") for line in block.splitlines()]
  pytest_args = ci.split("pytest", 1)[1].split()
  assert "-m" not in pytest_args, "CI runs the whole suite, slow tests included"
