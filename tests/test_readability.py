"""jaxdp/_src reads like the libraries it learns from (optax, equinox, PyTorch FSDP2,
Megatron's DDP): measured by `scripts/tools/code_metrics.py`, from the source alone.

- no nested function captures more than 7 names, and at most 5 capture 5 or more (what a
  step fixes is a field of a record, not a name a closure holds);
- a `return` of three or more values only where `jax.custom_vjp` fixes the shape (a
  primal's outputs, a backward's cotangents); everything else returns a typed record;
- comment lines, where the code is hard, at the anchors' density or above.
"""

import ast
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "jaxdp" / "_src"

_spec = importlib.util.spec_from_file_location(
  "code_metrics", ROOT / "scripts" / "tools" / "code_metrics.py"
)
code_metrics = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(code_metrics)

CUSTOM_VJP = {
  # collectives.py: the grad-ready hooks' backward (cotangents of leaves, sink, acc)
  "collectives.py:grad_ready_hook.bwd",
  "collectives.py:grad_ready_hook_each.bwd",
  # fsdp_program.py: a unit's primal (outputs, tokens, links) and its backward
  "fsdp_program.py:_UnitCall.call",
  "fsdp_program.py:_UnitCall.bwd",
  # fsdp_scan.py: a scanned unit's backward
  "fsdp_scan.py:_ScanUnit.bwd",
}
"""The functions whose 3+-value returns `jax.custom_vjp` requires."""


def _positional_returns() -> list[str]:
  """`file:Class.function` of every `return a, b, c` (no `*` items) in jaxdp/_src."""
  found = []
  for path in sorted(SRC.glob("*.py")):

    def visit(node, names):
      for child in ast.iter_child_nodes(node):
        inner = names
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
          inner = [*names, child.name]
        if (
          isinstance(child, ast.Return)
          and isinstance(child.value, ast.Tuple)
          and len(child.value.elts) >= 3
          and not any(isinstance(e, ast.Starred) for e in child.value.elts)
        ):
          found.append(f"{path.name}:{'.'.join(names)}")
        visit(child, inner)

    visit(ast.parse(path.read_text()), [])
  return found


def test_closures_capture_few_names():
  closures = code_metrics.measure(SRC).closures
  wide = sorted((c for c in closures if len(c.names) >= 5), key=lambda c: -len(c.names))
  assert all(len(c.names) <= 7 for c in closures), wide[:3]
  assert len(wide) <= 5, [f"{c.where}: {', '.join(c.names)}" for c in wide]


def test_positional_returns_only_where_custom_vjp_needs_them():
  assert set(_positional_returns()) <= CUSTOM_VJP, sorted(set(_positional_returns()) - CUSTOM_VJP)


def test_comment_density():
  metrics = code_metrics.measure(SRC)
  assert 100 * metrics.comment_lines / metrics.code_lines >= 8.0, (
    metrics.comment_lines,
    metrics.code_lines,
  )


# The params of JAX's call and control-flow primitives, which change between releases
# (jaxdp/_src/jaxprs.py's docstring): read nowhere but in the accessor module.
CALL_PARAMS = ("jaxpr", "call_jaxpr", "num_consts", "num_carry", "ft_in", "ft_out", "policy")


def test_call_and_scan_params_are_read_only_by_the_accessors():
  found = []
  for path in sorted(SRC.glob("*.py")):
    if path.name == "jaxprs.py":
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      key, target = None, None
      if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        key, target = node.slice.value, node.value
      elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and node.args
        and isinstance(node.args[0], ast.Constant)
      ):
        key, target = node.args[0].value, node.func.value
      reads_params = isinstance(target, ast.Attribute) and target.attr == "params"
      if key in CALL_PARAMS and reads_params:
        found.append(f"{path.name}:{node.lineno}: params[{key!r}]")
  assert not found, found
