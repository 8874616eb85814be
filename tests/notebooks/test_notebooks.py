"""Every notebook runs top to bottom in a real kernel (its own asserts included), and is committed without outputs."""

import json

import nbformat
import pytest
from nbclient import NotebookClient

from tests.support.paths import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
DRAWS_FIGURES = {"02_parallel_configs.ipynb", "03_logs.ipynb"}


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
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "Traceback" not in text
    if path.name in DRAWS_FIGURES:  # a real figure (matplotlib, shown inline as a PNG), not a chart in text
        assert any("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
