"""The public namespaces: what `__all__` lists is exactly what each one exports."""

import types

import pytest

import jaxdp
import jaxdp.inspect
import jaxdp.layout
import jaxdp.plot

NAMESPACES = [jaxdp, jaxdp.inspect, jaxdp.layout, jaxdp.plot]


@pytest.mark.parametrize("module", NAMESPACES, ids=lambda m: m.__name__)
def test_all_lists_every_public_name(module):
  # Submodules are left out: importing one (`jaxdp.launch`, `jaxdp._src`) sets an attribute.
  public = {
    name
    for name, value in vars(module).items()
    if not name.startswith("_") and not isinstance(value, types.ModuleType)
  }
  names = {n for n in module.__all__ if not isinstance(getattr(module, n), types.ModuleType)}
  assert names == public, names ^ public
  for name in module.__all__:
    assert getattr(module, name) is not None, name


def test_the_top_level_holds_the_training_api_only():
  """The layout's types live in `jaxdp.layout`, beside `jaxdp.inspect` and `jaxdp.plot`."""
  assert {"inspect", "layout", "plot"} <= set(jaxdp.__all__)
  for name in ("Bucket", "BufferLayout", "Layout", "ParamSpec", "make_layout", "ravel"):
    assert not hasattr(jaxdp, name), name
    assert hasattr(jaxdp.layout, name), name
  for name in ("gather_unit", "scan_unit"):
    assert not hasattr(jaxdp, name), name
