"""The floor plan of jaxdp/_src holds: layers, no cycles, no borrowed private names.

Read from the source (AST), without importing anything, so imports inside functions count
as much as those at the top. Three rules, each a test:

- the modules form the layers of `LAYERS`: a module imports only modules of lower layers
  (so there is no import cycle, and the strategies `ddp` and `fsdp` never import each
  other);
- no module takes a private name of another: neither `from jaxdp._src.x import _y` nor
  `x._y` on an imported module;
- every `jax.lax` collective is called in `collectives.py` (docstring examples, being
  strings, do not count).
"""

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "jaxdp" / "_src"
PACKAGE = "jaxdp._src"
COLLECTIVES = frozenset({"psum", "pmean", "psum_scatter", "all_gather", "all_to_all", "pcast"})

LAYERS = (
  ("config", "cuda_probe", "jaxprs", "hlo"),
  ("mesh",),
  ("compiler",),
  ("layout",),
  ("buffer",),
  ("collectives",),
  ("loop",),
  ("state", "offload"),
  ("checks",),
  ("distributed_optimizer",),
  ("units", "fsdp_unit", "step"),
  ("ordering",),
  ("fsdp_scan", "fsdp_tables"),
  ("fsdp_program",),
  ("ddp", "fsdp"),
  ("train",),
  ("aot", "inspect", "distributed", "eval"),
  ("checkpoint_format",),
  ("checkpoint_restore",),
  ("ledger", "checkpoint", "nnx", "launch", "plot"),
)
"""Bottom to top; the modules of one layer are peers and import none of each other."""


def _modules() -> dict[str, ast.Module]:
  return {
    p.stem: ast.parse(p.read_text(), str(p))
    for p in sorted(SRC.glob("*.py"))
    if p.stem != "__init__"
  }


def _imports(tree: ast.Module) -> list[tuple[int, str, str | None, str | None]]:
  """`(line, module, imported name or None, local name)` of every jaxdp._src import."""
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith(PACKAGE + "."):
          module = a.name[len(PACKAGE) + 1 :].split(".")[0]
          out.append((node.lineno, module, None, a.asname))
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module == PACKAGE:  # from jaxdp._src import ddp [as x]
        for a in node.names:
          out.append((node.lineno, a.name, None, a.asname or a.name))
      elif node.module.startswith(PACKAGE + "."):  # from jaxdp._src.ddp import x [as y]
        module = node.module[len(PACKAGE) + 1 :].split(".")[0]
        for a in node.names:
          out.append((node.lineno, module, a.name, a.asname or a.name))
  return out


MODULES = _modules()


def test_every_module_has_a_layer():
  placed = {m for layer in LAYERS for m in layer}
  assert set(MODULES) == placed, (
    f"not in LAYERS: {sorted(set(MODULES) - placed)}; in LAYERS but gone: "
    f"{sorted(placed - set(MODULES))}. Place a new module in the layer it belongs to"
  )


def test_layers_import_only_downward():
  level = {m: n for n, layer in enumerate(LAYERS) for m in layer}
  bad = []
  for name, tree in MODULES.items():
    for line, module, _, _ in _imports(tree):
      if module in level and name in level and level[module] >= level[name]:
        kind = "a peer" if level[module] == level[name] else "a higher layer"
        bad.append(f"{name}.py:{line} imports {module} ({kind})")
  assert not bad, "imports that go sideways or up (a cycle waits there):\n" + "\n".join(
    dict.fromkeys(bad)
  )


def test_no_import_cycle():
  graph = {
    name: {m for _, m, _, _ in _imports(tree) if m in MODULES and m != name}
    for name, tree in MODULES.items()
  }
  seen, stack, cycles = set(), [], []

  def visit(node):
    if node in stack:
      cycles.append(" -> ".join(stack[stack.index(node) :] + [node]))
      return
    if node in seen:
      return
    seen.add(node)
    stack.append(node)
    for nxt in sorted(graph[node]):
      visit(nxt)
    stack.pop()

  for node in sorted(graph):
    visit(node)
  assert not cycles, "import cycles in jaxdp/_src:\n" + "\n".join(cycles)


def test_no_private_name_of_another_module():
  bad = []
  for name, tree in MODULES.items():
    imported_modules = set()
    for line, module, what, local in _imports(tree):
      if what is None:
        imported_modules.add(local or module)
      elif what.startswith("_") and not what.startswith("__"):
        bad.append(f"{name}.py:{line}: from jaxdp._src.{module} import {what}")
    for node in ast.walk(tree):
      if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in imported_modules
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
      ):
        bad.append(f"{name}.py:{node.lineno}: {node.value.id}.{node.attr}")
  assert not bad, (
    "private names taken from another module (make the name public in its "
    "module, or move the code):\n" + "\n".join(bad)
  )


def test_collectives_only_in_collectives_py():
  bad = []
  for name, tree in MODULES.items():
    if name == "collectives":
      continue
    for node in ast.walk(tree):
      if isinstance(node, ast.Call):
        f = node.func
        called = (
          f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        )
        if called in COLLECTIVES:
          bad.append(f"{name}.py:{node.lineno}: {called}(...)")
      elif isinstance(node, ast.ImportFrom) and node.module in ("jax.lax", "jax._src.lax"):
        bad += [
          f"{name}.py:{node.lineno}: from {node.module} import {a.name}"
          for a in node.names
          if a.name in COLLECTIVES
        ]
  assert not bad, "collectives outside collectives.py (ask collectives.py for them):\n" + "\n".join(
    bad
  )


@pytest.mark.parametrize(
  "source,expect",
  [
    ("from jaxdp._src.ddp import _leaves", "private"),
    ("def f():\n  from jaxdp._src import ddp\n  return ddp._tree", "private"),
    ("import jax\njax.lax.pmean(1, 'data')", "collective"),
    ("'''>>> jax.lax.psum(x, \"data\")'''", None),
  ],
)
def test_the_checks_catch(source, expect):
  """The rules see what they are meant to (and leave docstring examples alone)."""
  tree = ast.parse(source)
  private = any(what and what.startswith("_") for _, _, what, _ in _imports(tree)) or any(
    isinstance(n, ast.Attribute) and n.attr.startswith("_") for n in ast.walk(tree)
  )
  collective = any(
    isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in COLLECTIVES
    for n in ast.walk(tree)
  )
  assert (expect == "private") == private and (expect == "collective") == collective
