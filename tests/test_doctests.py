"""The docstring examples of every module under jaxdp/ and models/ run and hold.

One test per module, on the 8 simulated CPU devices conftest.py sets up. Modules whose
doctests another test file already runs are not run twice: `RUN_ELSEWHERE` names that
file, and `test_run_elsewhere_still_runs_them` checks that it still does.
"""

import doctest
import importlib
import io
import os
import pathlib
import pkgutil
import subprocess
import sys

import pytest

import jaxdp
from jaxdp._src.config import OFFLOAD_MIN_JAXLIB, jaxlib_version

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN_ELSEWHERE = {
  "jaxdp._src.aot": "test_inspect.py",
  "jaxdp._src.inspect": "test_inspect.py",
  "jaxdp._src.distributed_optimizer": "test_distributed_optimizer.py",
  "jaxdp._src.checkpoint": "test_checkpoint.py",
}
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
OFFLOAD_EXAMPLES = {"jaxdp._src.state", "jaxdp._src.offload"}
"""Modules whose examples build `DDPConfig(optimizer_cpu_offload=True)`, which a jaxlib
older than `OFFLOAD_MIN_JAXLIB` refuses (`tests/test_offload.py` checks the refusal)."""


def _modules() -> list[str]:
  names = ["jaxdp"] + [m.name for m in pkgutil.walk_packages(jaxdp.__path__, "jaxdp.")]
  names += [
    f"models.{p.stem}" for p in sorted((ROOT / "models").glob("*.py")) if p.stem != "__init__"
  ]
  return sorted(n for n in names if n not in RUN_ELSEWHERE)


MODULES = _modules()


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
  if name in OFFLOAD_EXAMPLES and jaxlib_version() < OFFLOAD_MIN_JAXLIB:
    pytest.skip(f"host offload needs jaxlib >= {OFFLOAD_MIN_JAXLIB}")
  module = importlib.import_module(name)
  runner = doctest.DocTestRunner(optionflags=FLAGS)
  out = io.StringIO()
  for test in doctest.DocTestFinder().find(module, name):
    runner.run(test, out=out.write)
  if "matplotlib.pyplot" in sys.modules:  # figures drawn by jaxdp.plot's examples
    sys.modules["matplotlib.pyplot"].close("all")
  result = doctest.TestResults(runner.failures, runner.tries)
  assert result.failed == 0, (
    f"{result.failed} of {result.attempted} examples failed in {name}:\n{out.getvalue()}"
  )


@pytest.mark.parametrize(
  "name",
  [
    "jaxdp._src.layout",
    "jaxdp._src.buffer",
    "jaxdp._src.train",
    "jaxdp._src.config",
    "jaxdp._src.mesh",
    "jaxdp._src.state",
    "jaxdp._src.units",
    "jaxdp._src.nnx",
    "jaxdp._src.plot",
    "jaxdp._src.eval",
  ],
)
def test_public_api_has_examples(name):
  module = importlib.import_module(name)
  tests = doctest.DocTestFinder().find(module, name)
  assert sum(len(t.examples) for t in tests) > 0, f"{name}: no docstring examples"


@pytest.mark.parametrize("name", sorted(RUN_ELSEWHERE))
def test_run_elsewhere_still_runs_them(name):
  text = (ROOT / "tests" / RUN_ELSEWHERE[name]).read_text()
  short = name.rsplit(".", 1)[-1]
  assert "testmod(" in text and short in text, (
    f"{RUN_ELSEWHERE[name]} no longer runs the doctests of {name}: take it out of "
    "RUN_ELSEWHERE in tests/test_doctests.py"
  )


def test_the_train_step_example_runs_on_the_devices_a_reader_has():
  """`help(jaxdp.make_train_step)`'s example, pasted on a laptop (one CPU device, no flag
  that simulates eight), runs as printed: it sizes its mesh and batch by
  `jax.device_count()`."""
  code = (
    "import doctest, jax, jaxdp\n"
    "assert jax.device_count() == 1, jax.devices()\n"
    "finder = doctest.DocTestFinder()\n"
    "runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)\n"
    "for test in finder.find(jaxdp.make_train_step, 'make_train_step', globs={}):\n"
    "  runner.run(test)\n"
    "print(runner.summarize(verbose=False))\n"
  )
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.run(
    [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "failed=0" in proc.stdout and "attempted=0" not in proc.stdout, proc.stdout
