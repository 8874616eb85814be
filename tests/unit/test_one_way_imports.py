"""Imports go one way. The command line (hf_dist_recipes/cli/) uses the library; no library module imports it. No two
modules of the package import each other, directly or through others, counting the imports inside functions that
hide a cycle from Python (it only fails at the first call). The offline log reader (`logs summarize`:
monitoring/events.py, aggregate.py, report.py) runs without transformers or torch.distributed, checked in a fresh
interpreter."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

from tests.support.import_graph import MODULES, PACKAGE, all_imports, import_cycles, import_targets, package_imports

CLI = "hf_dist_recipes.cli"


def cli_imports(source: str, module: str, *, is_package: bool = False) -> list[str]:
    """The modules under hf_dist_recipes.cli that `source` (module `module`) imports, at any depth of the file
    (function-level imports included), absolute or relative."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        for target, names in import_targets(node, package):
            # `from hf_dist_recipes import cli` imports the package by a name in the list.
            candidates = [target] + [f"{target}.{name}" for name in names]
            found += [name for name in candidates if name == CLI or name.startswith(CLI + ".")]
    return sorted(set(found))


def test_no_module_outside_cli_imports_cli():
    offenders = {}
    for module, path in MODULES.items():
        if module == CLI or module.startswith(CLI + "."):
            continue
        found = cli_imports(path.read_text(), module, is_package=path.name == "__init__.py")
        if found:
            offenders[str(path.relative_to(PACKAGE.parent))] = found
    assert not offenders, f"library modules importing the command line: {offenders}"


def test_the_scan_finds_each_way_of_importing_cli():
    """The scan would catch the import `planning/shipped.py` used to make, and the other spellings of it."""
    module = "hf_dist_recipes.planning.shipped"
    assert cli_imports("def f():\n    from hf_dist_recipes.cli.main import main\n", module) == [
        "hf_dist_recipes.cli.main",
        "hf_dist_recipes.cli.main.main",
    ]
    assert cli_imports("import hf_dist_recipes.cli.config\n", module) == ["hf_dist_recipes.cli.config"]
    assert cli_imports("from hf_dist_recipes import cli\n", module) == ["hf_dist_recipes.cli"]
    assert cli_imports("from ..cli import main\n", module) == ["hf_dist_recipes.cli", "hf_dist_recipes.cli.main"]
    assert cli_imports("from .generate import write_configs\nimport hf_dist_recipes.client\n", module) == []


def test_no_import_cycles():
    imports = all_imports()
    assert len(imports) > 50 and "hf_dist_recipes.planning.memory" in imports["hf_dist_recipes.planning.fit"]
    cycles = import_cycles({module: set(found) for module, found in imports.items()})
    detail = [
        "; ".join(
            f"{a.removeprefix('hf_dist_recipes.')}:{imports[a][b]} imports {b.removeprefix('hf_dist_recipes.')}"
            for a in cycle
            for b in cycle
            if b in imports[a]
        )
        for cycle in cycles
    ]
    assert not cycles, "modules importing each other (move the shared piece into a module both import):\n" + "\n".join(
        detail
    )


def test_the_cycle_scan_sees_function_level_and_relative_imports():
    """The two cycles this test was written against: `commbench` imported `render` from `commbench_launch` inside
    main(), which imported `commbench` at its top; `planning.zero_buffers` imported `memory` inside functions."""
    modules = {"p.commbench", "p.commbench_launch", "p.planning", "p.planning.memory", "p.planning.zero_buffers"}
    launch = package_imports("from p.commbench import BenchSettings\n", "p.commbench_launch", modules)
    bench = package_imports(
        "def main():\n    if 1:\n        from p.commbench_launch import render\n", "p.commbench", modules
    )
    buffers = package_imports(
        "def zero_buffers():\n    from .memory import rank_elements\n", "p.planning.zero_buffers", modules
    )
    memory = package_imports("from p.planning import zero_buffers\n", "p.planning.memory", modules)
    assert (launch, bench) == ({"p.commbench": 1}, {"p.commbench_launch": 3})
    assert (buffers, memory) == ({"p.planning.memory": 2}, {"p.planning.zero_buffers": 1})
    graph = {
        "p.commbench": set(bench),
        "p.commbench_launch": set(launch),
        "p.planning.memory": set(memory),
        "p.planning.zero_buffers": set(buffers),
        "p.cli": {"p.commbench", "p.planning.memory"},  # importing into a cycle is no cycle
    }
    assert import_cycles(graph) == [
        ["p.commbench", "p.commbench_launch"],
        ["p.planning.memory", "p.planning.zero_buffers"],
    ]
    # A longer loop is one cycle; a chain is none.
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


HEAVY = ("transformers", "torch.distributed")

# Run in a fresh interpreter: what `hf-dist-recipes logs summarize` does (read every rank's events, aggregate, write
# the report and the aggregate run), then which of HEAVY it loaded; then the same probe after importing a module that
# does import them, so the probe is shown able to see them.
_CHILD = """
import json, sys
from hf_dist_recipes.logs.aggregate import summarize_logs, write_aggregate_run
from hf_dist_recipes.logs.report import write_report
logs, out = sys.argv[1], sys.argv[2]
summary = summarize_logs(logs, workers=2)
write_aggregate_run(summary, out + "/aggregate")
write_report(summary, out)
heavy = sorted(m for m in {heavy!r} if m in sys.modules)
import hf_dist_recipes.comm.watchdog  # a live-job module: it imports transformers (TrainerCallback)
after = sorted(m for m in {heavy!r} if m in sys.modules)
print(json.dumps({{"ranks": summary.ranks, "heavy": heavy, "after": after}}))
"""


@pytest.fixture(scope="module")
def rank_logs(tmp_path_factory):
    """Two ranks' logs written by torch's SummaryWriter: a host line and ten step times each."""
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path_factory.mktemp("import_rule_logs")
    for r in range(2):
        w = SummaryWriter(str(root / "logs" / f"rank{r}"))
        w.add_text("run", f"host=h{r} rank={r}")
        for s in range(1, 11):
            w.add_scalar("rank/step_time_s", 1.0 + r, s)
        w.close()
    return root


def test_the_offline_log_reader_imports_neither_transformers_nor_torch_distributed(rank_logs, tmp_path):
    tmp_path = rank_logs
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD.format(heavy=HEAVY), str(tmp_path / "logs"), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ranks"] == [0, 1] and (tmp_path / "out" / "report.md").is_file()
    assert result["heavy"] == [], f"the offline log reader imported {result['heavy']}"
    assert "transformers" in result["after"], result


# What `logs summarize --no-report` has no use for (issue 21: ~1 s of a 3 s command was imports): torch, transformers,
# matplotlib (the report's plots), tensorboard's writer and its tensorflow stub (we write the aggregate run
# ourselves), and the other subcommands' modules (cli/main.py imports only the one that runs).
UNUSED_BY_SUMMARIZE = (
    "torch",
    "transformers",
    "matplotlib",
    "tensorboard.summary.writer",
    "tensorboard.compat.tensorflow_stub",
    "hf_dist_recipes.cli.config",
    "hf_dist_recipes.cli.demo",
    "hf_dist_recipes.cli.checkpoint",
    "hf_dist_recipes.cli.preflight",
)

# The whole command in a fresh interpreter, as `hf-dist-recipes` runs it; then another subcommand and a live-job
# module (transformers, so torch), so the probe is shown able to see them.
_CLI_CHILD = """
import json, sys
from hf_dist_recipes.cli.main import main
code = main(["logs", "summarize", sys.argv[1], "--out", sys.argv[2], "--no-report", "--json", "--workers", "2"])
loaded = sorted(m for m in {unused!r} if m in sys.modules)
import hf_dist_recipes.cli.demo, hf_dist_recipes.comm.watchdog
after = sorted(m for m in {unused!r} if m in sys.modules)
print(json.dumps({{"code": code, "loaded": loaded, "after": after}}))
"""


def test_logs_summarize_without_report_imports_only_what_it_uses(rank_logs, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _CLI_CHILD.format(unused=UNUSED_BY_SUMMARIZE),
            str(rank_logs / "logs"),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    summary = json.loads(proc.stdout[: proc.stdout.rindex("\n{")])
    assert result["code"] == 0 and summary["ranks"] == 2 and summary["hosts"] == {"0": "h0", "1": "h1"}
    assert list((tmp_path / "out" / "aggregate").glob("events.out.tfevents.*"))
    assert result["loaded"] == [], f"logs summarize --no-report imported {result['loaded']}"
    assert {"torch", "transformers", "hf_dist_recipes.cli.demo"} <= set(result["after"]), result
