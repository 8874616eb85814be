"""Several runs in one launch: a worker's command line `ARGS [then ARGS]...` split into one argument list per run,
which the worker runs in order in the same processes (new arguments, model and trainer each time). Each rank
imports torch, transformers and DeepSpeed once for all of them. A run that stops the launch goes last."""

from __future__ import annotations

THEN = "then"


def split_runs(argv: list[str]) -> list[list[str]]:
    """`["a", "1", "then", "b", "2"]` -> `[["a", "1"], ["b", "2"]]`."""
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == THEN:
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs
