"""The package's import graph read from its source with `ast` (nothing imported): which modules each module imports,
at any depth of the file (function-level imports included), and the cycles in a graph. Used by
tests/unit/test_one_way_imports.py (modules) and tests/unit/test_folder_imports.py (folders)."""

from __future__ import annotations

import ast
from pathlib import Path

import hf_dist_recipes

PACKAGE = Path(hf_dist_recipes.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def import_targets(node: ast.AST, package: str) -> list[tuple[str, list[str]]]:
    """(module named, [names imported from it]) for an import statement, relative ones resolved against `package`."""
    if isinstance(node, ast.Import):
        return [(alias.name, []) for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        return [(target, [alias.name for alias in node.names])]
    return []


def package_imports(source: str, module: str, modules, *, is_package: bool = False) -> dict[str, int]:
    """The modules of `modules` that `source` (module `module`) imports, at any depth of the file, each with the line
    of its first import. `from a.b import c` counts as importing `a.b.c` when that is a module, else `a.b`; a name
    that is no module counts as its closest enclosing module."""
    package = module if is_package else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        for target, names in import_targets(node, package):
            for name in [f"{target}.{n}" if f"{target}.{n}" in modules else target for n in names] or [target]:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    found.setdefault(name, node.lineno)
    return found


def all_imports() -> dict[str, dict[str, int]]:
    """module -> {module of the package it imports: line of the first import}, for every module of the package."""
    return {
        module: package_imports(path.read_text(), module, MODULES, is_package=path.name == "__init__.py")
        for module, path in MODULES.items()
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import one another (strongly connected components of more than one module), each
    sorted, in sorted order (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return sorted(cycles)
