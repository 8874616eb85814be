"""MkDocs hook: the page of every error message (errors.md), generated at build time from the package's source.

Each `raise ValueError(...)` / `raise RuntimeError(...)` under hf_dist_recipes/ is read with `ast` (nothing is
imported): its message with the `{placeholders}` of its f-string, grouped by module. The CLI prints a ValueError as
one line, `hf-dist-recipes COMMAND: error: MESSAGE`, exit status 2; the library raises it from the call that was
given the bad value. The messages name their fix, so the page doubles as the troubleshooting index;
docs/troubleshooting.md explains the ones users meet most (tests/unit/test_docs.py checks its quotes against
`messages()`).
"""

from __future__ import annotations

import ast
from pathlib import Path

PAGE = "errors.md"
PACKAGE = Path(__file__).resolve().parents[2] / "hf_dist_recipes"
RAISED = ("ValueError", "RuntimeError", "SchedulerKwargError")  # the last: a ValueError (and TypeError), by name

INTRO = """# Every error message

Generated from the source when this site is built (`docs/hooks/error_index.py`): every `ValueError` and
`RuntimeError` the package raises, with `{...}` where the message names a value. Each names its fix. The command
line prints them as one line, `hf-dist-recipes COMMAND: error: MESSAGE`, with exit status 2; the ones users meet
most are explained in [Troubleshooting](troubleshooting.md).
"""


def _text(node: ast.expr) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{...}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left) + _text(node.right)
    return "{...}"  # a message built elsewhere (a variable, a join)


def messages(package: Path = PACKAGE) -> dict[str, list[tuple[int, str]]]:
    """Per module path (relative to the repository), the (line, message) of each raise, in line order."""
    found: dict[str, list[tuple[int, str]]] = {}
    for path in sorted(package.rglob("*.py")):
        rows = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                continue
            func = node.exc.func
            if getattr(func, "id", getattr(func, "attr", None)) in RAISED:
                rows.append((node.lineno, " ".join(_text(node.exc.args[0]).split())))
        if rows:
            found[str(path.relative_to(package.parent))] = sorted(rows)
    return found


def render() -> str:
    """The whole page as Markdown."""
    parts = [INTRO]
    for module, rows in messages().items():
        body = "\n".join(f"{line}: {text}" for line, text in rows)
        parts.append(f"## `{module}`\n\n```text\n{body}\n```\n")
    return "\n".join(parts)


def on_files(files, config):
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files
