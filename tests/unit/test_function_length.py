"""No function of the package is longer than MAX_LINES (issue 30: a function that long hides the steps a reader needs
named; split it into helpers that say what each step does). Counted from `def` to the last line, docstring
included, by the parsed source, so a test of a file that grew one fails here with the function's name."""

from __future__ import annotations

import ast

from tests.support.paths import REPO

MAX_LINES = 120


def _long_functions(source: str, name: str) -> list[str]:
    return [
        f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > MAX_LINES
    ]


def test_no_function_of_the_package_is_longer_than_max_lines():
    found = [
        long
        for path in sorted((REPO / "hf_dist_recipes").rglob("*.py"))
        for long in _long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    ]
    assert found == [], found


def test_the_count_sees_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))  # def line + MAX_LINES: one too many
    assert _long_functions(f"def f():\n{body}\n", "m.py") == [f"m.py:1 f ({MAX_LINES + 1} lines)"]
    assert _long_functions(f"def f():\n{body[: body.rindex(chr(10))]}\n", "m.py") == []
