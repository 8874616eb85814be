"""Imports go one way: the command line (hf_dist_recipes/cli/) uses the library; no library module imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_dist_recipes

PACKAGE = Path(hf_dist_recipes.__file__).parent
CLI = "hf_dist_recipes.cli"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def cli_imports(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """The modules under hf_dist_recipes.cli that `source` (module `module`) imports, at any depth of the file
    (function-level imports included), absolute or relative."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from hf_dist_recipes import cli` imports the package by a name in the list.
            names = [target] + [f"{target}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [name for name in names if name == CLI or name.startswith(CLI + ".")]
    return sorted(set(found))


def test_no_module_outside_cli_imports_cli():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        if module == CLI or module.startswith(CLI + "."):
            continue
        found = cli_imports(path.read_text(), module, is_package=path.name == "__init__.py")
        if found:
            offenders[str(path.relative_to(PACKAGE.parent))] = found
    assert not offenders, f"library modules importing the command line: {offenders}"


def test_the_scan_finds_each_way_of_importing_cli():
    """The scan would catch the import `parallel/shipped.py` used to make, and the other spellings of it."""
    module = "hf_dist_recipes.parallel.shipped"
    assert cli_imports("def f():\n    from hf_dist_recipes.cli.main import main\n", module) == [
        "hf_dist_recipes.cli.main",
        "hf_dist_recipes.cli.main.main",
    ]
    assert cli_imports("import hf_dist_recipes.cli.config\n", module) == ["hf_dist_recipes.cli.config"]
    assert cli_imports("from hf_dist_recipes import cli\n", module) == ["hf_dist_recipes.cli"]
    assert cli_imports("from ..cli import main\n", module) == ["hf_dist_recipes.cli", "hf_dist_recipes.cli.main"]
    assert cli_imports("from .generate import write_configs\nimport hf_dist_recipes.client\n", module) == []
