"""Every notebook in notebooks/ runs top to bottom and draws its figures.

Each notebook is executed once, with nbclient, in a fresh kernel whose environment has
8 simulated CPU devices (`JAX_PLATFORMS=cpu`, `--xla_force_host_platform_device_count=8`;
the notebooks also set `jax_num_cpu_devices` themselves) and whose working directory is
`notebooks/`, as when a user opens them in Jupyter. The notebooks are stored with their
outputs, so that their figures show on a repository browser without running anything;
`python scripts/tools/notebook_outputs.py` runs them and stores the outputs with the figures
re-encoded as small palette PNGs.

The GPU-target parts (02, 03, 04: train steps compiled for 8 H100s without a GPU) need
jax-cuda12-plugin/-pjrt (`pip install 'jaxdp[aot]'`, which `.ci/run` installs). Without
them the notebooks compile for the CPU mesh instead and say so; they still run and draw,
and only the check that they really compiled for the H100 target is left out.
"""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from jaxdp import inspect  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRINTS = {  # lines a notebook must print: the ledger equals the built state, per strategy
  "03_memory_ledger": [
    f"{s:20s} equal" for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")
  ],
}
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
IMAGES = {  # figures each notebook draws (at least)
  "01_buffers_and_buckets": 6,
  "02_overlap": 5,
  "03_memory_ledger": 5,
  "04_fsdp_units": 4,
  "05_flax_loop": 3,
}
GPU_TARGET = {"02_overlap", "03_memory_ledger", "04_fsdp_units"}
GPU_MARKER = "H100"  # what the first cell prints when it compiles for the GPU target
GPU_REASON = inspect.gpu_compile_unavailable()
TIMEOUT_S = 600  # per cell; a notebook takes well under 2 minutes on 2 cores

_executed: dict[str, nbformat.NotebookNode] = {}


def _kernel_env() -> dict[str, str]:
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  flags = env.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
  env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"  # not Agg: no images
  return env


def executed(path: pathlib.Path) -> nbformat.NotebookNode:
  """The notebook after running every cell (run once per pytest run)."""
  if path.stem not in _executed:
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
      nb,
      timeout=TIMEOUT_S,
      kernel_name="python3",
      resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute(env=_kernel_env())  # raises CellExecutionError naming the cell
    _executed[path.stem] = nb
  return _executed[path.stem]


def outputs(nb):
  for cell in nb.cells:
    if cell.cell_type == "code":
      yield from cell.outputs


def text_of(nb) -> str:
  return "".join(o.get("text", "") for o in outputs(nb) if o.output_type == "stream")


def test_every_notebook_is_listed():
  assert {p.stem for p in NOTEBOOKS} == set(IMAGES)


MAX_IMAGE_KIB = 120  # one stored figure (a 64-colour PNG at 100 dpi is 10-60 KiB)
MAX_NOTEBOOK_KIB = 400


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_with_their_figures(path):
  """The stored notebook shows its figures without running: every code cell has run, in
  order, without an error, and the figures are there and small."""
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  code = [c for c in nb.cells if c.cell_type == "code"]
  fix = "; run python scripts/tools/notebook_outputs.py " + str(path.relative_to(ROOT))
  assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), (
    f"{path.name}: not run top to bottom in one kernel{fix}"
  )
  assert not [o for o in outputs(nb) if o.output_type == "error"], f"{path.name}: error{fix}"
  images = [o.data["image/png"] for o in outputs(nb) if "image/png" in o.get("data", {})]
  assert len(images) >= IMAGES[path.stem], f"{path.name}: {len(images)} figures stored{fix}"
  for data in images:
    assert len(data) * 3 / 4 / 1024 <= MAX_IMAGE_KIB, f"{path.name}: a figure over the limit{fix}"
  assert path.stat().st_size / 1024 <= MAX_NOTEBOOK_KIB, path.name


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_runs_and_draws(path):
  nb = executed(path)
  errors = [o for o in outputs(nb) if o.output_type == "error"]
  assert not errors, f"{path.name}: {errors[0].ename}: {errors[0].evalue}"
  images = sum("image/png" in o.get("data", {}) for o in outputs(nb))
  assert images >= IMAGES[path.stem], (
    f"{path.name} drew {images} figures, expected at least {IMAGES[path.stem]}"
  )
  text = text_of(nb)
  for line in PRINTS.get(path.stem, ()):
    assert line in text, f"{path.name} did not print {line!r}:\n{text[:3000]}"
  # Checked here, not in a test of its own: another xdist worker would run the notebook again.
  if path.stem in GPU_TARGET and GPU_REASON is None:
    assert GPU_MARKER in text and "NO GPU TARGET" not in text, text[:2000]
