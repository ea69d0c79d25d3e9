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

The text a stored notebook shows is the text a fresh run shows: the run `test_runs_and_draws`
makes anyway is compared with the stored outputs, cell by cell (`shown_text`). Compared as a
reader sees them: each stream's text whole (where the kernel happened to flush splits it
into pieces), the CUDA plugin's driver-probe lines left out (printed only where a machine has
an NVIDIA driver, and then kept by jaxdp), wall-clock times (`(6 s)`) and memory addresses
blanked, text past `notebook_outputs.py`'s cut counted, not compared. Words and integers
(counts, bytes, shapes) must be equal; a float may differ by 1e-4 + 0.2% (`FLOAT_TOLERANCE`):
XLA:CPU's kernels follow the host's vector units, so a loss or a difference printed at full
precision can move in its last digits from one machine to another.
"""

import os
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from jaxdp import inspect  # noqa: E402
from jaxdp._src import cuda_probe  # noqa: E402

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


MAX_LINES = 60  # scripts/tools/notebook_outputs.py --max-lines: stored text is cut there
CUT = re.compile(r"\.\.\. \((\d+) more lines\)\n?$")  # the cut's last line
SECONDS = re.compile(r"\d+(?:\.\d+)?(?= ?m?s\b)")  # "(6 s)", "2.5s/it", "12 ms"
ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
FLOAT = re.compile(r"[-+]?(?:\d[\d,]*)?\.\d+(?:[eE][-+]?\d+)?|[-+]?\d+[eE][-+]?\d+")
FLOAT_TOLERANCE = (1e-4, 2e-3)  # absolute, relative


def normalised(text: str) -> str:
  """`text` as compared: no probe lines, times and addresses blanked, past the cut counted."""
  lines = [
    line.decode() for line in cuda_probe.drop_probe_lines(text.encode().splitlines(keepends=True))
  ]
  total = len(lines)
  if lines and (cut := CUT.match(lines[-1])):  # stored already cut: count what was left out
    lines, total = lines[:-1], len(lines) - 1 + int(cut[1])
  kept = "".join(lines[:MAX_LINES])
  if total > MAX_LINES:
    kept += f"<{total} lines>\n"
  return ADDRESS.sub("0x<address>", SECONDS.sub("<t>", kept))


def shown_text(nb) -> list[dict[str, str]]:
  """Per code cell, the text it shows: each stream's whole text (`stdout`, `stderr`) and its
  results' `text/plain` (a figure's `<Figure size 900x300 with 1 Axes>`), normalised."""
  cells = []
  for cell in (c for c in nb.cells if c.cell_type == "code"):
    streams: dict[str, str] = {}
    results = []
    for out in cell.outputs:
      if out.output_type == "stream":
        streams[out.name] = streams.get(out.name, "") + out.text
      elif "text/plain" in out.get("data", {}):
        results.append(normalised(out.data["text/plain"]))
    shown = {name: normalised(text) for name, text in streams.items()}
    cells.append({name: text for name, text in shown.items() if text} | {"results": results})
  return cells


def same_text(stored: str, fresh: str) -> bool:
  """Equal but for floats within `FLOAT_TOLERANCE` of each other."""
  if FLOAT.sub("<float>", stored) != FLOAT.sub("<float>", fresh):
    return False
  absolute, relative = FLOAT_TOLERANCE
  for a, b in zip(FLOAT.findall(stored), FLOAT.findall(fresh)):
    a, b = float(a.replace(",", "")), float(b.replace(",", ""))
    if abs(a - b) > absolute + relative * max(abs(a), abs(b)):
      return False
  return True


def first_difference(stored: str, fresh: str) -> str:
  pairs = zip(stored.splitlines() + ["<end>"], fresh.splitlines() + ["<end>"])
  for a, b in pairs:
    if not same_text(a, b):
      return f"stored: {a!r}\n  fresh: {b!r}"
  return "(the texts differ in their line count)"


def assert_stored_text_is_fresh(path: pathlib.Path, fresh_nb) -> None:
  stored, fresh = shown_text(nbformat.read(path, as_version=4)), shown_text(fresh_nb)
  fix = f"; run python scripts/tools/notebook_outputs.py {path.relative_to(ROOT)}"
  assert len(stored) == len(fresh), f"{path.name}: {len(stored)} code cells stored{fix}"
  for i, (s, f) in enumerate(zip(stored, fresh), start=1):
    where = f"{path.name}, code cell {i}"
    assert s.keys() == f.keys(), f"{where}: shows {sorted(s)}, a fresh run {sorted(f)}{fix}"
    assert len(s["results"]) == len(f["results"]), f"{where}: results differ{fix}"
    for name in s:
      pairs = zip(s[name], f[name]) if name == "results" else [(s[name], f[name])]
      for a, b in pairs:
        assert same_text(a, b), f"{where}, {name}:\n  {first_difference(a, b)}{fix}"


@pytest.mark.parametrize(
  "stored, fresh, same",
  [
    ("loss 0.980 (6 s)\n", "loss 0.981 (4 s)\n", True),  # a float's last digit, a time
    ("max diff 1.2e-07\n", "max diff 2.4e-07\n", True),  # rounding noise
    ("bucket_size=40,000,000 elements\n", "bucket_size=16,000,000 elements\n", False),
    ("842,496 params\n", "842,497 params\n", False),  # an integer is exact
    ("step 1,034.6 us\n", "step 1,134.6 us\n", False),
    ("at 0x7f3a2c1b9e50>\n", "at 0x7f00aa001234>\n", True),
    ("8 devices: cpu\n", "8 devices: gpu\n", False),
  ],
)
def test_the_comparison_blanks_only_what_varies(stored, fresh, same):
  assert same_text(normalised(stored), normalised(fresh)) is same


def test_the_comparison_drops_probe_lines_and_counts_cut_text():
  probe = (
    "I0000 00:00:1796039648.958215   29013 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.\n"
  )
  assert normalised(probe + "8 devices: cpu\n") == "8 devices: cpu\n"
  lines = [f"line {i}\n" for i in range(100)]
  cut = "".join(lines[:MAX_LINES]) + "... (40 more lines)\n"  # as notebook_outputs.py stores it
  assert normalised(cut) == normalised("".join(lines)) != normalised("".join(lines[:99]))


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
  # The stored text is this run's (the GPU-target notebooks were stored with the target).
  if path.stem not in GPU_TARGET or GPU_REASON is None:
    assert_stored_text_is_fresh(path, nb)
