"""Several runs in one launch: a worker's command line `ARGS [then ARGS]...` split into one argument list per run,
which the worker runs in order in the same processes (new arguments, model and trainer each time). Each rank
imports torch, transformers and DeepSpeed once for all of them. A run that stops the launch goes last."""

from __future__ import annotations

import sys

THEN = "then"
RUN_END = "=== end of run {} ==="  # rank 0's line on stdout and stderr after each run but the last


def split_runs(argv: list[str]) -> list[list[str]]:
    """`["a", "1", "then", "b", "2"]` -> `[["a", "1"], ["b", "2"]]`."""
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == THEN:
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


def mark_run_end(index: int, rank: int) -> None:
    """Rank 0 writes `RUN_END` to both streams, flushed, so a test can split the launch's output by run."""
    if rank == 0:
        for stream in (sys.stdout, sys.stderr):
            print(RUN_END.format(index), file=stream, flush=True)


def output_of_run(text: str, index: int) -> str:
    """The part of one stream of a launch (`text`) that run `index` (0-based) wrote: between the end markers. Only
    rank 0's lines are placed exactly; another rank's can cross a marker."""
    start = 0 if index == 0 else text.index(RUN_END.format(index - 1)) + len(RUN_END.format(index - 1))
    end = text.find(RUN_END.format(index))
    return text[start : None if end < 0 else end]
