"""Several runs in one launch: a worker's command line `ARGS [then ARGS]...` split into one argument list per run,
which the worker runs in order in the same processes (new arguments, model and trainer each time). Each rank
imports torch, transformers and DeepSpeed once for all of them. A run that stops the launch goes last.

Runs that differ only in their DeepSpeed JSON share a launch too (`use_deepspeed_json`): `accelerate launch` hands the
ranks the YAML's `deepspeed_config_file` as one environment variable, and each run's arguments are built from it."""

from __future__ import annotations

import os
import sys

from hf_dist_recipes._compat import accelerate as compat_accelerate

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


def use_deepspeed_json(path: str) -> None:
    """Give the next run of this launch its own DeepSpeed JSON, as `accelerate launch` would have from a YAML naming
    `path` (accelerate 1.16 `utils/launch.py` exports it as ACCELERATE_DEEPSPEED_CONFIG_FILE). Call it before the
    run's arguments: transformers 5.25 `TrainingArguments` resets accelerate's state and builds its DeepSpeed plugin
    from the variable (`_compat.accelerate.launcher_deepspeed_config` reads the same one). The YAML of such a launch
    must differ from the run's only in that path (`tests.support.launch.write_cpu_deepspeed_yaml`)."""
    os.environ[compat_accelerate.ACCELERATE_DEEPSPEED_CONFIG_FILE] = path


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
