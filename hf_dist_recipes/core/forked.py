"""Work split over forked processes, for the offline checkpoint writers (`checkpoint export --workers`,
`checkpoint dequantize --workers`): each task runs in a child forked from this process, so it shares the parent's
imported modules and memory-mapped files (no re-import, no copy), and sends its result back through a pipe."""

from __future__ import annotations

import traceback
from collections.abc import Callable


def run_forked(tasks: list[Callable[[], object]], name: str) -> tuple[list, dict[int, str]]:
    """Run each of `tasks` in a forked process of its own (named NAME-i), all at once. Returns (each task's result,
    None where it failed; {i: its traceback, or how the process ended} for each failed task). Each child computes
    with one torch thread: an OpenMP pool the parent used is not safe to grow again in a forked child."""
    import multiprocessing

    def run(task, conn) -> None:
        try:
            import torch

            torch.set_num_threads(1)
            conn.send(("ok", task()))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        finally:
            conn.close()

    ctx = multiprocessing.get_context("fork")
    procs = []
    for index, task in enumerate(tasks):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=run, args=(task, child), name=f"{name}-{index}")
        proc.start()
        child.close()  # the child holds the only write end: its death is an EOF here, not a wait forever
        procs.append((proc, parent))
    results, errors = [], {}
    for index, (proc, conn) in enumerate(procs):
        try:
            status, value = conn.recv()
        except EOFError:
            status, value = "error", "the process ended without a result (killed, out of memory?)"
        proc.join()
        results.append(value if status == "ok" else None)
        if status != "ok":
            errors[index] = value
    return results, errors
