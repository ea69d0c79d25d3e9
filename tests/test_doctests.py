"""The docstring examples of every module under jaxdp/ and models/ run and hold.

One test per module, on the 8 simulated CPU devices conftest.py sets up. Modules whose
doctests another test file already runs are not run twice: `RUN_ELSEWHERE` names that
file, and `test_run_elsewhere_still_runs_them` checks that it still does.
"""

import doctest
import importlib
import io
import pathlib
import pkgutil
import sys

import pytest

import jaxdp

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN_ELSEWHERE = {
  "jaxdp._src.aot": "test_inspect.py",
  "jaxdp._src.inspect": "test_inspect.py",
  "jaxdp._src.distributed_optimizer": "test_distributed_optimizer.py",
  "jaxdp._src.checkpoint": "test_checkpoint.py",
}
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules() -> list[str]:
  names = ["jaxdp"] + [m.name for m in pkgutil.walk_packages(jaxdp.__path__, "jaxdp.")]
  names += [
    f"models.{p.stem}" for p in sorted((ROOT / "models").glob("*.py")) if p.stem != "__init__"
  ]
  return sorted(n for n in names if n not in RUN_ELSEWHERE)


MODULES = _modules()


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
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
