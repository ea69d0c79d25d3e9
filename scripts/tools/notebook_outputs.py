"""Run the notebooks and store their outputs, so their pictures show without running them.

Each notebook in notebooks/ (or the ones named) runs top to bottom in a fresh kernel on 8
simulated CPU devices, as tests/test_notebooks.py runs them, and is written back with its
outputs. To keep the repository light every figure is re-encoded as a palette PNG
(`--colors` colours, default 64; a matplotlib line plot loses nothing visible) and long
text outputs are cut to `--max-lines` lines; a stream the kernel flushed in pieces is stored
as one. tests/test_notebooks.py checks that the stored text is what a fresh run shows, so
run this whenever a change moves what a notebook prints.

Usage:
    python scripts/tools/notebook_outputs.py                    # all notebooks
    python scripts/tools/notebook_outputs.py notebooks/02_overlap.ipynb
"""

import argparse
import base64
import io
import os
import pathlib

import nbclient
import nbformat
from PIL import Image

ROOT = pathlib.Path(__file__).resolve().parents[2]


def kernel_env() -> dict[str, str]:
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  flags = env.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
  env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
  return env


def small_png(data: str, colors: int) -> str:
  """A base64 PNG re-encoded with a `colors`-colour palette."""
  image = Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")
  out = io.BytesIO()
  image.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(out, "png", optimize=True)
  return base64.b64encode(out.getvalue()).decode()


def joined_streams(outputs: list) -> list:
  """`outputs` with each run of pieces of one stream (where the kernel flushed) as one."""
  joined: list = []
  for out in outputs:
    last = joined[-1] if joined else None
    if out.output_type == "stream" and last and last.output_type == "stream":
      if last.name == out.name:
        last.text += out.text
        continue
    joined.append(out)
  return joined


def shrink(nb, colors: int, max_lines: int) -> None:
  for cell in nb.cells:
    if cell.cell_type != "code":
      continue
    cell.outputs = joined_streams(cell.outputs)
    for out in cell.outputs:
      if "image/png" in out.get("data", {}):
        out.data["image/png"] = small_png(out.data["image/png"], colors)
      if out.output_type == "stream":
        lines = out.text.splitlines(keepends=True)
        if len(lines) > max_lines:
          out.text = "".join(lines[:max_lines]) + f"... ({len(lines) - max_lines} more lines)\n"


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  parser.add_argument(
    "notebooks",
    nargs="*",
    type=pathlib.Path,
    default=sorted((ROOT / "notebooks").glob("*.ipynb")),
    help="notebooks to run and store",
  )
  parser.add_argument("--colors", type=int, default=64, help="palette size of the figures")
  parser.add_argument("--max-lines", type=int, default=60, help="lines kept of each text output")
  parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
  args = parser.parse_args()
  for path in args.notebooks:
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(
      nb,
      timeout=args.timeout,
      kernel_name="python3",
      resources={"metadata": {"path": str(path.parent)}},
    ).execute(env=kernel_env())
    shrink(nb, args.colors, args.max_lines)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    print(f"{path}: {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
  main()
