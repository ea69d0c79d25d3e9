"""jaxdp.plot's layout pictures: a group keeps its colour from figure to figure, and a bucket
too narrow for its label goes unlabelled."""

import jax
import jax.numpy as jnp
import matplotlib
import pytest

import jaxdp
from jaxdp import plot

matplotlib.use("Agg")
plt = pytest.importorskip("matplotlib.pyplot")

PARAMS = {
  "blocks": [{"w": jnp.zeros((64, 16)), "b": jnp.zeros((16,))} for _ in range(4)],
  "wte": jnp.zeros((128, 16)),
  "ln_f": jnp.zeros((16,)),
}


def legend_colors(ax) -> dict[str, tuple]:
  legend = ax.get_legend()
  return {
    text.get_text(): tuple(handle.get_facecolor())
    for text, handle in zip(legend.get_texts(), legend.legend_handles)
  }


def test_a_group_has_one_colour_in_every_figure():
  """The whole model, its blocks alone (the rest frozen) and one bucket of it draw
  `['blocks'][3]`, `['wte']` alike, though each figure shows other groups beside them."""
  whole = plot.plot_layout(jaxdp.layout.make_layout(PARAMS, dp=8, bucket_size=3000))[0]
  frozen = jax.tree_util.tree_map_with_path(
    lambda path, _: "blocks" not in jax.tree_util.keystr(path), PARAMS
  )
  blocks = plot.plot_layout(jaxdp.layout.make_layout(PARAMS, dp=8, frozen=frozen))[0]
  bucket = plot.plot_bucket(jaxdp.layout.make_layout(PARAMS, dp=8, bucket_size=3000))
  colors = [legend_colors(ax) for ax in (whole, blocks, bucket)]
  assert "['blocks'][3]" in colors[1] and "['wte']" not in colors[1]
  assert {"['wte']", "['blocks'][3]"} <= set(colors[2]) and "['blocks'][0]" not in colors[2]
  for label in ("['blocks'][3]", "['wte']"):
    seen = {c[label] for c in colors if label in c}
    assert len(seen) == 1, (label, seen)
  # Within a figure every group has a colour of its own.
  for c in colors:
    assert len(set(c.values())) == len(c), c
  plt.close("all")


def test_a_bucket_too_narrow_for_its_label_goes_unlabelled():
  params = {"a_tiny": jnp.zeros((8,)), "b_big": jnp.zeros((8000,))}  # buckets of 8000, 128
  layout = jaxdp.layout.make_layout(params, dp=8, bucket_size=4000)
  assert layout.num_buckets == 2
  (ax,) = plot.plot_layout(layout)
  assert [t.get_text() for t in ax.texts] == ["b0"]
  plt.close("all")
