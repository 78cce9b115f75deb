"""No function in edgemoe/ is longer than MAX_LINES lines (from its `def` line to its last line, decorators
not counted) unless its docstring says why in a sentence with the marker "Long because" (e.g. "Long because
the option stack is declarative: ..."). Split a long function into well-named helpers; keep the marker for
code whose length is declarative (a click option stack, a table). Reads the sources with ast only."""

from __future__ import annotations

import ast
from pathlib import Path

PKG_DIR = Path(__file__).resolve().parents[1] / "edgemoe"
MAX_LINES = 80
MARKER = "Long because"


def long_functions(source: str, name: str) -> list[str]:
    """`name:line function (N lines)` for each function of `source` over MAX_LINES lines without the marker."""
    out = []
    for node in ast.walk(ast.parse(source, name)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        span = (node.end_lineno or node.lineno) - node.lineno + 1
        if span > MAX_LINES and MARKER not in (ast.get_docstring(node) or ""):
            out.append(f"{name}:{node.lineno} {node.name} ({span} lines)")
    return out


def test_no_function_in_edgemoe_is_over_80_lines_without_saying_why() -> None:
    found = [
        hit
        for path in sorted(PKG_DIR.rglob("*.py"))
        for hit in long_functions(path.read_text(), str(path.relative_to(PKG_DIR.parent)))
    ]
    assert found == [], f"split these into helpers, or say in the docstring why they are long ({MARKER} ...)"


def _function(n_lines: int, doc: str) -> str:
    body = "".join(f"    x{i} = {i}\n" for i in range(n_lines - 2))
    return f'def f() -> None:\n    """{doc}"""\n{body}'


def test_the_check_counts_lines_and_reads_the_marker() -> None:
    assert long_functions(_function(MAX_LINES, "Short."), "m.py") == []
    assert long_functions(_function(MAX_LINES + 1, "Short."), "m.py") == ["m.py:1 f (81 lines)"]
    assert long_functions(_function(MAX_LINES + 1, "Long because it is a table."), "m.py") == []
    nested = "class C:\n    " + _function(MAX_LINES + 1, "No reason.").replace("\n", "\n    ")
    assert long_functions(nested, "m.py") == ["m.py:2 f (81 lines)"]
