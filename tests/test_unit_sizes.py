"""Units a reader can hold: no function over 80 lines and no class over 300 lines in the package (hetpipe/,
server/, worker/), counted from the `def` or `class` line to the end of its body."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("hetpipe", "server", "worker")
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 300


def oversized(source: str, where: str) -> list[str]:
    """`where:line kind name (n lines)` for each function or class of `source` over its limit."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            kind, limit = "function", MAX_FUNCTION_LINES
        elif isinstance(node, ast.ClassDef):
            kind, limit = "class", MAX_CLASS_LINES
        else:
            continue
        lines = node.end_lineno - node.lineno + 1
        if lines > limit:
            found.append(f"{where}:{node.lineno} {kind} {node.name} ({lines} lines, at most {limit})")
    return found


def test_no_function_or_class_in_the_package_is_over_its_limit() -> None:
    found = [
        problem
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        for problem in oversized(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert found == []


def test_the_count_runs_from_the_def_line_to_the_end_of_the_body() -> None:
    short = "def f():\n" + "    x = 1\n" * 79
    long = "def g():\n" + "    x = 1\n" * 80 + "\n\nclass C:\n" + "    y = 1\n" * 300
    assert oversized(short, "m.py") == []
    assert oversized(long, "m.py") == [
        "m.py:1 function g (81 lines, at most 80)",
        "m.py:84 class C (301 lines, at most 300)",
    ]
