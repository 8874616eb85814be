"""Folders import one way too: no two folders of hf_dist_recipes (comm/, environment/, parallel/, ...) import each
other, function-level imports included (tests/unit/test_one_way_imports.py holds modules to the same rule). When two
do, a piece sits on the wrong side; move it to the side that owns its concept (as `nccl_net`, the ports NCCL would
pick from this host's facts, moved from comm/ to environment/, now doctor/; the allocator setting from
parallel/zero_buffers.py to environment/alloc_defaults.py; and which ops a plan JIT-builds from
environment/extensions.py to what is now planning/generate.py). The modules at the top of the package (trainer.py,
arguments.py, ...) are no folder: the entry points; _compat/ holds the upstream shims, one module per upstream.

The folders also say who runs their code: parallel/ and environment/ hold what a training rank imports, planning/
and doctor/ what the command line plans and checks with (issue 30). No module a rank imports, function-level
imports included, is command-line code (`command_line_only`: planning/ with the memory estimate, doctor/, logs/, the
`checkpoint export` / `dequantize` modules; issue 39), and every module of parallel/ and environment/ is one a rank
imports."""

from __future__ import annotations

from collections.abc import Mapping

from tests.support.import_graph import MODULES, PACKAGE, all_imports, package_imports

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
    assert ("planning", "parallel") in edges and len(edges) > 20  # the scan sees the graph
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


# What runs inside a training rank: the entry points at the top (RecipeTrainer, the arguments, the callbacks, the
# runtime, the upstream shims), the checkpoint export `save_model` calls, the demo's per-rank script, and preflight's
# training check (a RecipeTrainer in every rank). Not preflight/worker.py: a preflight's ranks run the doctor and the
# plan check on each machine on purpose, the command line's checks launched there.
RANK_ENTRY_POINTS = (
    "trainer",
    "trainer_classes",
    "arguments",
    "argument_classes",
    "callbacks",
    "runtime",
    "_compat",
    "checkpoint.export",
    "demo.train",
    "preflight.training",
)
IN_RANK = ("parallel", "environment")
# What the command line alone runs: the planner and its memory estimate, the doctor, the offline readers of a run's
# logs, and `checkpoint export` / `checkpoint dequantize` (a rank's own export is checkpoint/export.py, and a resume in
# another layout reads the engine's files with checkpoint/zero_files.py).
CLI_FOLDERS = ("planning", "doctor", "logs")
CLI_CHECKPOINT = ("checkpoint.offline", "checkpoint.dequantize")


def rank_closure(
    imports: Mapping[str, Mapping[str, int]], entry_points=RANK_ENTRY_POINTS, package: str = PACKAGE.name
) -> set[str]:
    """Every module of `package` a rank can import from `entry_points`, function-level imports included."""
    seen: set[str] = set()
    todo = [f"{package}.{m}" for m in entry_points]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += imports.get(module, {})
    return seen


def command_line_only(modules, package: str = PACKAGE.name) -> list[str]:
    """The modules of `modules` only the command line may import (CLI_FOLDERS, CLI_CHECKPOINT), sorted."""
    return sorted(m for m in modules if folder(m) in CLI_FOLDERS or m in {f"{package}.{c}" for c in CLI_CHECKPOINT})


def test_the_folders_say_what_runs_inside_a_rank():
    closure = rank_closure(all_imports())
    assert {f"hf_dist_recipes.{m}" for m in ("parallel.plan_record", "checkpoint.zero_files", "monitoring")} <= closure
    leaked = command_line_only(closure)
    idle = sorted(m for m in MODULES if folder(m) in IN_RANK and m not in closure)
    assert not leaked, (
        "a rank imports command-line code (move the piece it uses to a module a rank owns, as check_not_fp8 moved "
        f"to environment/precision.py, or record the number in the plan record as config generate does): {leaked}"
    )
    assert not idle, (
        f"modules of parallel/ or environment/ that no rank imports (move them to planning/ or doctor/): {idle}"
    )


def test_the_rank_check_sees_command_line_code_behind_function_level_imports():
    """The trainer's three ways into command-line code before issue 39: the estimate quoted in a message (imported
    inside a function of plan_record), TensorBoard runs read back (logs/ inside monitoring's functions) and the FP8
    stop of checkpoint/dequantize.py. The command line importing rank code is no leak."""
    modules = {"p.trainer", "p.parallel.record", "p.planning.memory", "p.monitoring.tb", "p.logs.events", "p.cli.main"}
    modules |= {"p.checkpoint.dequantize", "p.checkpoint.zero_files"}
    trainer = "from p.parallel import record\nfrom p.monitoring import tb\nfrom p.checkpoint.dequantize import check\n"
    imports = {
        "p.trainer": package_imports(trainer, "p.trainer", modules),
        "p.parallel.record": package_imports(
            "def f():\n    from p.planning.memory import e\n", "p.parallel.record", modules
        ),
        "p.monitoring.tb": package_imports(
            "def read():\n    from p.logs.events import r\n", "p.monitoring.tb", modules
        ),
        "p.cli.main": package_imports("from p.planning import memory\nfrom p import trainer\n", "p.cli.main", modules),
    }
    leaked = ["p.checkpoint.dequantize", "p.logs.events", "p.planning.memory"]
    assert command_line_only(rank_closure(imports, ("trainer",), "p"), "p") == leaked
    imports["p.trainer"] = package_imports("from p.checkpoint.zero_files import to_hf_names\n", "p.trainer", modules)
    assert rank_closure(imports, ("trainer",), "p") == {"p.trainer", "p.checkpoint.zero_files"}
    assert command_line_only(rank_closure(imports, ("trainer",), "p"), "p") == []
