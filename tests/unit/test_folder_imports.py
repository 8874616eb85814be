"""Folders import one way too: no two folders of hf_dist_recipes (comm/, environment/, parallel/, ...) import each
other, function-level imports included (tests/unit/test_one_way_imports.py holds modules to the same rule). When two
do, a piece sits on the wrong side; move it to the side that owns its concept (as `nccl_net`, the ports NCCL would
pick from this host's facts, moved from comm/ to environment/; the allocator setting from parallel/zero_buffers.py
to environment/alloc_defaults.py; and which ops a plan JIT-builds from environment/extensions.py to
parallel/generate.py). The modules at the top of the package (trainer.py, arguments.py, _compat.py, ...) are no
folder: the entry points and the shared upstream shims."""

from __future__ import annotations

from collections.abc import Mapping

from tests.support.import_graph import MODULES, all_imports, package_imports

Edges = dict[tuple[str, str], list[str]]


def folder(module: str) -> str | None:
    """The folder of `module` ("hf_dist_recipes.preflight.training.run" -> "preflight"); None at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else None


def folder_edges(imports: Mapping[str, Mapping[str, int]], packages: set[str] = frozenset()) -> Edges:
    """(folder, folder it imports) -> the imports that make the edge, as "module:line -> module". `packages`: the
    modules that are folders' __init__ (their folder is themselves, not the one above)."""
    edges: Edges = {}
    for module, found in imports.items():
        for target, line in found.items():
            a = module.split(".")[1] if module in packages else folder(module)
            b = target.split(".")[1] if target in packages else folder(target)
            if a and b and a != b:
                edges.setdefault((a, b), []).append(f"{module}:{line} -> {target}")
    return edges


def two_cycles(edges: Edges) -> list[tuple[str, str]]:
    """The pairs of folders that import each other, each once, sorted."""
    return sorted((a, b) for a, b in edges if a < b and (b, a) in edges)


def test_no_two_folders_import_each_other():
    imports = all_imports()
    packages = {m for m, path in MODULES.items() if path.name == "__init__.py" and m.count(".") == 1}
    edges = folder_edges(imports, packages)
    assert ("parallel", "environment") in edges and len(edges) > 20  # the scan sees the graph
    cycles = two_cycles(edges)
    detail = [f"{a} <-> {b}: " + "; ".join(edges[(a, b)] + edges[(b, a)]) for a, b in cycles]
    assert not cycles, "folders importing each other (move the piece to the folder that owns it):\n" + "\n".join(detail)


def test_the_scan_sees_a_cycle_through_a_function_level_import():
    """The shape of environment <-> parallel before the fix: a module-level import one way, one inside a function
    the other way; a top-level module importing both folders (and imported by them) makes no cycle."""
    modules = {"p.env.alloc", "p.env.ext", "p.par.zero", "p.par.generate", "p.trainer"}
    imports = {
        "p.env.alloc": package_imports("from p.par.zero import ALLOC_CONF\n", "p.env.alloc", modules),
        "p.par.generate": package_imports(
            "def write():\n    from p.env.ext import header\n", "p.par.generate", modules
        ),
        "p.trainer": package_imports("import p.env.alloc\nimport p.par.zero\n", "p.trainer", modules),
        "p.env.ext": package_imports("from p import trainer\n", "p.env.ext", modules),
    }
    edges = folder_edges(imports)
    assert edges[("par", "env")] == ["p.par.generate:2 -> p.env.ext"]
    assert two_cycles(edges) == [("env", "par")]
    del imports["p.env.alloc"]
    assert two_cycles(folder_edges(imports)) == []
