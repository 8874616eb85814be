"""Every notebook runs top to bottom in a real kernel (its own asserts included), and is committed without outputs."""

import ast
import base64
import json
import struct

import nbformat
import pytest
from nbclient import NotebookClient

from tests.support.paths import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
DRAWS_FIGURES = {"02_parallel_configs.ipynb", "03_logs.ipynb"}
PARALLEL = "02_parallel_configs.ipynb"
# Appended to notebook 02 when the test runs it (the file is unchanged): the bars its figure `fig` drew, read back
# from matplotlib's own objects, one JSON line.
FIGURE_PROBE = """
import json
print("BARS " + json.dumps([
    {
        "labels": [t.get_text() for t in ax.get_yticklabels()],
        "widths": {c.get_label(): [bar.get_width() for bar in c] for c in ax.containers},
        "lines": [float(line.get_xdata()[0]) for line in ax.lines],
    }
    for ax in fig.axes
]))
"""


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:1] == ["01_quickstart.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, f"{path.name}: strip outputs"


@pytest.mark.notebook
@pytest.mark.distributed
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path, monkeypatch):
    # The notebooks train 2 CPU processes; the kernel inherits this environment, so they do on a GPU host too.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("HF_DIST_RECIPES_USE_CPU", "1")  # the explicit CPU request (tests.support.launch.cpu_only_env)
    nb = nbformat.read(path, as_version=4)
    if path.name == PARALLEL:
        nb.cells.append(nbformat.v4.new_code_cell(FIGURE_PROBE))
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "Traceback" not in text
    if path.name in DRAWS_FIGURES:  # a real figure (matplotlib, shown inline as a PNG), not a chart in text
        assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    if path.name == PARALLEL:
        check_parallel_figure(nb)


def check_parallel_figure(nb) -> None:
    """Notebook 02's figure is a real PNG, and its bars are the library's estimates: two layouts computed here,
    independently of the notebook's kernel, segment by segment (GiB per GPU by kind, offloaded kinds 0)."""
    from dataclasses import replace

    from hf_dist_recipes.core.sizes import GIB
    from hf_dist_recipes.parallel.memory import estimate
    from hf_dist_recipes.parallel.models import introspect
    from hf_dist_recipes.parallel.plan import ParallelPlan

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    png = base64.b64decode(next(o["data"]["image/png"] for o in outputs if "image/png" in o.get("data", {})))
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and width >= 600 and height >= 400, (png[:8], width, height)
    probe = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    axes = json.loads(probe.split("BARS ", 1)[1])
    bars = [(label, {k: w[i] for k, w in ax["widths"].items()}) for ax in axes for i, label in enumerate(ax["labels"])]
    assert len(axes) == 2 and len(bars) >= 8, bars
    assert all(ax["lines"] == [80.0] for ax in axes), "each panel draws the GPU's 80 GiB"
    picks = [gib for label, gib in bars if label.endswith("(pick)")]
    assert len(picks) == 1 and sum(picks[0].values()) <= 80, picks  # the recipe's pick is marked, and fits

    model = introspect("deepseek-v3")
    base = ParallelPlan(nodes=8, procs_per_node=8, ep=16, seq_len=4096, micro_batch=1, activation_checkpointing=True)
    layouts = {
        "ZeRO-1 TP 1 EP 16 mb 1": (estimate(replace(base, zero_stage=1), model), ()),
        "ZeRO-3 TP 1 EP 16 off:opt mb 1": (
            estimate(replace(base, offload_optimizer=True), model),
            ("grads", "optimizer"),
        ),
    }
    for label, (e, offloaded) in layouts.items():
        want = {
            k: 0.0 if k in offloaded else getattr(e, k) / GIB
            for k in ("params", "grads", "optimizer", "gathered", "activations", "other")
        }
        drawn = [gib for shown, gib in bars if shown == label]
        assert drawn and all(gib == pytest.approx(want, rel=1e-9) for gib in drawn), (label, drawn, want)
        assert sum(want.values()) == pytest.approx(e.device_total / GIB, rel=1e-12)


def test_notebook_02_calls_the_library_not_the_cli():
    """Notebook 02 shows the library: `hf_dist_recipes.parallel` and `.planning` functions, no CLI `main`, argv or
    shell."""
    nb = nbformat.read(REPO / "notebooks" / PARALLEL, as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code"]
    assert not [line for src in cells for line in src.splitlines() if line.lstrip().startswith(("!", "%"))]
    tree = ast.parse("\n".join(cells))
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    called = {
        n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "")
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
    }
    assert not [m for m in modules if m.startswith("hf_dist_recipes.cli") or m in ("subprocess", "os", "runpy")]
    assert not called & {"main", "system", "run", "Popen", "check_output"}, called
    used = {
        m.rsplit(".", 1)[-1]
        for m in modules
        if m.startswith(("hf_dist_recipes.parallel.", "hf_dist_recipes.planning."))
    }
    assert used >= {"models", "plan", "fit", "suggest", "memory", "generate", "lint"}, used
    assert {"introspect", "check_fit", "suggest", "estimate", "write_configs", "lint_file"} <= called
