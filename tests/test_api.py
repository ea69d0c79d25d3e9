"""The public namespaces: what `__all__` lists is exactly what each one exports."""

import dataclasses
import inspect
import pydoc
import re
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


@pytest.mark.parametrize("config", [jaxdp.DDPConfig, jaxdp.FSDPConfig], ids=lambda c: c.__name__)
def test_help_of_a_config_lists_every_field(config):
  """`help(jaxdp.DDPConfig)` shows the class docstring, and attribute docstrings are not
  in it: its `Attributes:` section names every field, in order, each once."""
  doc = inspect.getdoc(config)
  section = doc.split("Attributes:\n", 1)[1].split("\n\n", 1)[0]
  listed = re.findall(r"^  (\w+): ", section, re.M)
  assert listed == [f.name for f in dataclasses.fields(config)], listed
  assert all(f"{name}:" in pydoc.render_doc(config) for name in listed)


@pytest.mark.parametrize("module", NAMESPACES, ids=lambda m: m.__name__)
def test_help_points_to_public_names_and_real_pages(module):
  """What `help()` shows of a public name never sends a user into `jaxdp._src` (private,
  may change), nor to a README section that is in docs/."""
  for name in module.__all__:
    obj = getattr(module, name)
    if isinstance(obj, types.ModuleType):
      continue
    members = (
      [obj]
      + [
        v
        for k, v in vars(obj).items()
        if not k.startswith("_") and (callable(v) or isinstance(v, property))
      ]
      if inspect.isclass(obj)
      else [obj]
    )
    for member in members:
      doc = inspect.getdoc(member) or ""
      assert "jaxdp._src" not in doc, (name, [line for line in doc.splitlines() if "_src" in line])
      assert "README" not in doc, (name, [line for line in doc.splitlines() if "README" in line])
