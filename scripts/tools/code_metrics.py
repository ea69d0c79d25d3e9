"""How a Python source tree reads, in the numbers used to compare jaxdp with its anchors
(optax, equinox, PyTorch FSDP2, Megatron's DDP, haliax).

    python scripts/tools/code_metrics.py jaxdp/_src          # the table
    python scripts/tools/code_metrics.py jaxdp/_src --worst  # and the offenders

* comment-only lines per 100 code lines: a line whose first token is a `#` comment, against
  the lines that hold code (docstrings are neither);
* closures: functions defined inside a function (lambdas too, comprehensions not), by the
  free names they capture (`symtable`'s `get_frees`);
* positional returns: `return a, b, c` with three or more items (not a sequence built with
  `*`);
* short locals: function locals (parameters included) of one or two characters, as a share
  of all locals.
"""

from __future__ import annotations

import argparse
import ast
import io
import pathlib
import symtable
import tokenize
from typing import NamedTuple


class Closure(NamedTuple):
  where: str
  """`file:function`."""
  names: tuple[str, ...]


class Metrics(NamedTuple):
  code_lines: int
  comment_lines: int
  closures: list[Closure]
  positional_returns: list[str]
  """`file:line` of every `return` of three or more items."""
  locals_total: int
  locals_short: int


def _docstring_lines(tree: ast.AST) -> set[int]:
  lines = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
          lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    # attribute docstrings: a bare string right after an assignment in a class
    if isinstance(node, ast.ClassDef):
      for stmt in node.body[1:]:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
          lines.update(range(stmt.lineno, stmt.end_lineno + 1))
  return lines


def _line_kinds(source: str, tree: ast.AST) -> tuple[int, int]:
  """`(code lines, comment-only lines)`."""
  comment, code = set(), set()
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT and token.line.lstrip().startswith("#"):
      comment.add(token.start[0])
    elif token.type not in (
      tokenize.COMMENT,
      tokenize.NL,
      tokenize.NEWLINE,
      tokenize.INDENT,
      tokenize.DEDENT,
      tokenize.ENDMARKER,
    ):
      code.update(range(token.start[0], token.end[0] + 1))
  code -= _docstring_lines(tree)
  return len(code - comment), len(comment)


_COMPREHENSIONS = {"listcomp", "dictcomp", "setcomp", "genexpr"}


def _walk_tables(table: symtable.SymbolTable, name: str, depth: int):
  for child in table.get_children():
    yield child, f"{name}.{child.get_name()}" if name else child.get_name(), depth
    yield from _walk_tables(
      child, f"{name}.{child.get_name()}" if name else child.get_name(), depth + 1
    )


def measure_file(path: pathlib.Path) -> Metrics:
  source = path.read_text()
  tree = ast.parse(source)
  code, comment = _line_kinds(source, tree)
  closures, total, short = [], 0, 0
  top = symtable.symtable(source, str(path), "exec")
  for table, name, _ in _walk_tables(top, "", 0):
    # comprehensions are inlined into their function from Python 3.12: not closures
    if table.get_type() != "function" or table.get_name() in _COMPREHENSIONS:
      continue
    local_names = [s for s in table.get_locals() if not s.startswith(".")]
    total += len(local_names)
    short += sum(len(s) <= 2 and s != "_" for s in local_names)
    frees = table.get_frees()
    if frees:
      closures.append(Closure(f"{path.name}:{name}", tuple(sorted(frees))))
  returns = [
    f"{path.name}:{node.lineno}"
    for node in ast.walk(tree)
    if isinstance(node, ast.Return)
    and isinstance(node.value, ast.Tuple)
    and len(node.value.elts) >= 3
    # `(*shape[:axis], n, *shape[axis + 1:])` builds one value, a sequence
    and not any(isinstance(e, ast.Starred) for e in node.value.elts)
  ]
  return Metrics(code, comment, closures, returns, total, short)


def measure(root: pathlib.Path) -> Metrics:
  files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
  parts = [measure_file(f) for f in files]
  return Metrics(
    sum(m.code_lines for m in parts),
    sum(m.comment_lines for m in parts),
    [c for m in parts for c in m.closures],
    [r for m in parts for r in m.positional_returns],
    sum(m.locals_total for m in parts),
    sum(m.locals_short for m in parts),
  )


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("roots", nargs="+", type=pathlib.Path)
  parser.add_argument("--worst", action="store_true", help="list the offenders too")
  args = parser.parse_args()
  print(
    "| tree | comment-only / 100 code | closures capturing 5+ (max) | mean captured "
    "| positional returns of 3+ | locals of 1-2 chars |"
  )
  print("|---|---:|---:|---:|---:|---:|")
  for root in args.roots:
    m = measure(root)
    sizes = [len(c.names) for c in m.closures]
    print(
      f"| {root} | {100 * m.comment_lines / max(m.code_lines, 1):.1f} "
      f"| {sum(s >= 5 for s in sizes)} ({max(sizes, default=0)}) "
      f"| {sum(sizes) / max(len(sizes), 1):.1f} | {len(m.positional_returns)} "
      f"| {100 * m.locals_short / max(m.locals_total, 1):.0f}% |"
    )
    if args.worst:
      for c in sorted(m.closures, key=lambda c: -len(c.names)):
        if len(c.names) >= 5:
          print(f"  closure {c.where}: {len(c.names)} {', '.join(c.names)}")
      for r in m.positional_returns:
        print(f"  return {r}")


if __name__ == "__main__":
  main()
