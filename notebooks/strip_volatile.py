"""The notebooks are committed executed, outputs and figures included, without what changes on every execution.

What one execution differs from the next by, and says nothing about the code: the kernel's and language's
versions in the notebook's metadata, each cell's execution timestamps (nbclient's `execution`) and what editors add
(`ExecuteTime`, `collapsed`, `scrolled`), widget state, and where the kernel happened to cut a cell's printing into
several stream outputs (a cell's consecutive stdout chunks become one output), and stderr: the warnings of the
libraries and of the ranks, with the executing machine's paths, timestamps and thread ids (running the notebook shows
them). Outputs, figures and execution counts stay. The notebooks print paths relative to their own folder
(`runs/...`), never a temporary one.

    python notebooks/strip_volatile.py --execute notebooks/*.ipynb  # run each (2 CPU ranks), strip, write back
    python notebooks/strip_volatile.py notebooks/*.ipynb            # strip in place (after running in Jupyter)
    python notebooks/strip_volatile.py --check notebooks/*.ipynb    # exit 1 naming those not stripped

`--execute` runs each notebook top to bottom in a fresh kernel inside a temporary folder (their `runs/` lands there),
on the CPU as the tests do, and prints its seconds. tests/notebooks/test_notebooks.py checks that every committed
notebook is stripped (`is_stripped`), executed top to bottom and holds its figures, and that a fresh execution shows
what the committed one shows (`shown_text`: exactly, or with the numbers masked where a notebook trains).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import tempfile
import time
from pathlib import Path

import nbformat

CELL_METADATA_DROPPED = ("execution", "ExecuteTime", "collapsed", "scrolled", "widgets")
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
# What a kernel inherits to train its ranks on the CPU on any host (tests/support/launch.py::cpu_only_env), and
# DeepSpeed told so, as the recipe's arguments tell it in a rank (monitoring.console.quiet_the_stack): a kernel that
# imports DeepSpeed before any arguments exist (notebook 02) would print its "Setting accelerator to CPU" otherwise.
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "HF_DIST_RECIPES_USE_CPU": "1", "DS_ACCELERATOR": "cpu"}


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """`nb` without its volatile fields (changed in place and returned)."""
    language = nb.metadata.get("language_info", {}).get("name")
    nb.metadata.pop("widgets", None)
    if language:
        nb.metadata["language_info"] = {"name": language}
    for cell in nb.cells:
        for key in CELL_METADATA_DROPPED:
            cell.metadata.pop(key, None)
        if cell.cell_type == "code":
            cell.outputs = _merged_streams(cell.outputs)
            for output in cell.outputs:
                if WIDGET_MIME in output.get("data", {}):
                    del output.data[WIDGET_MIME]
    return nb


def _merged_streams(outputs: list) -> list:
    merged = []
    for output in outputs:
        if output.output_type == "stream" and output.name == "stderr":
            continue
        previous = merged[-1] if merged else None
        if (
            output.output_type == "stream"
            and previous is not None
            and previous.output_type == "stream"
            and previous.name == output.name
        ):
            previous.text += output.text
        else:
            merged.append(output)
    return merged


# What a re-execution changes in a cell's printed text without the code changing: wall-clock times and rates, the
# host's name (a straggler is named with its host), a run's id and a log line's time. Masked where outputs are
# compared (`shown_text`).
NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
VOLATILE = (
    (re.compile(r"run_id=\S+"), "run_id=<id>"),
    (re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\]", re.M), "[<time>]"),
)


# With the numbers masked: the lines a measurement decides, not the code. Which windows of a slowed rank are flagged
# (and recovered) depends on the machine's load: notebook 03's live events and the summary's straggler rows.
TIMED = re.compile(r"straggler rank #|\) recovered \(|^\s*#\s+#%\s+#\s*$")


def shown_text(nb: nbformat.NotebookNode, *, numbers: bool = True) -> list[str]:
    """Per code cell, what it showed as text (its stdout and its results' text/plain, after `strip`), with the
    host's name masked; `numbers=False` masks every number too and leaves out the `TIMED` lines (for a notebook that
    prints times or trains)."""
    shown = []
    for cell in strip(nb).cells:
        if cell.cell_type != "code":
            continue
        text = "".join(
            o.get("text", "") if o.output_type == "stream" else o.get("data", {}).get("text/plain", "")
            for o in cell.outputs
        ).replace(socket.gethostname(), "<host>")
        for pattern, mask in VOLATILE:
            text = pattern.sub(mask, text)
        if not numbers:
            # A table pads its columns to their widest number, so the padding changes with the digits masked (a
            # slower host's 4-digit tokens/s against the committed 5 digits): runs of spaces count as one.
            text = re.sub(r" {2,}", " ", NUMBER.sub("#", text))
            text = "".join(line for line in text.splitlines(True) if not TIMED.search(line))
        shown.append(text)
    return shown


def stripped_text(path: str | os.PathLike) -> str:
    """The file's text as committed: stripped, written the way nbformat writes notebooks."""
    return nbformat.writes(strip(nbformat.read(path, as_version=4))) + "\n"


def is_stripped(path: str | os.PathLike) -> bool:
    return Path(path).read_text(encoding="utf-8") == stripped_text(path)


def execute(
    path: str | os.PathLike, workdir: str | os.PathLike, timeout: int = 600, python: list[str] | None = None
) -> nbformat.NotebookNode:
    """Run the notebook top to bottom in a fresh kernel whose working folder is `workdir`; an error in any cell
    raises (nbclient's CellExecutionError). `python`: the interpreter command the kernel starts with instead of the
    kernel spec's (the tests give theirs, which forks the kernel from an interpreter that already imported torch)."""
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient

    class Kernel(AsyncKernelManager):
        def format_kernel_cmd(self, extra_arguments=None):
            cmd = super().format_kernel_cmd(extra_arguments)  # [python, -m, ipykernel_launcher, -f, file]
            return [*python, *cmd[1:]] if python else cmd

    nb = nbformat.read(path, as_version=4)
    saved = {k: os.environ.get(k) for k in CPU_ENV}
    os.environ.update(CPU_ENV)
    try:
        NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            kernel_manager_class=Kernel,
            resources={"metadata": {"path": os.fspath(workdir)}},
        ).execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="+", type=Path)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook is not stripped")
    mode.add_argument("--execute", action="store_true", help="execute each notebook first, then strip and write it")
    args = parser.parse_args(argv)
    unstripped = []
    for path in args.notebooks:
        if args.check:
            if not is_stripped(path):
                unstripped.append(path)
            continue
        if args.execute:
            started = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="notebook-") as workdir:
                nb = execute(path, workdir)
            print(f"{path}: executed in {time.perf_counter() - started:.1f} s")
        else:
            nb = nbformat.read(path, as_version=4)
        path.write_text(nbformat.writes(strip(nb)) + "\n", encoding="utf-8")
    for path in unstripped:
        print(f"{path}: not stripped; run: python notebooks/strip_volatile.py {path}", file=sys.stderr)
    return 1 if unstripped else 0


if __name__ == "__main__":
    sys.exit(main())
