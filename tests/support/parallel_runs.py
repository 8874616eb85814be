"""`make test` (pytest-xdist `-n 3`, `JOBS` in the Makefile): which tests share a worker process, and in which order
files start.

- A file is one unit of work (its module-scoped fixtures launch once, in one worker), and so are the files that share
  a process-wide launch: `hang_dumps` (tests/support/hang_dumps.py) serves two files, launched once if they meet.
- Under xdist, files that launch processes start first and the unit files fill the end: a 60 s launch picked up
  last would otherwise run alone on an idle machine. A serial run (`make test JOBS=`) keeps pytest's order.

Measured on the 2-core machine (2026-12-04, whole suite, serial 1,143 s): `-n 3` by file with xdist's order (most
tests first, so the launches came last), 916 s. The ranks of one launch already keep both cores busy most of the
time; the gain is the idle waits (timeouts, stopped ranks, launcher start-up) that another file's work fills.
2026-12-05, launching files first: serial 815 s, `-n 3` 574 s, `-n 4` 622 s with both ops built from scratch;
then with the warm servers' gc.freeze and no FusedAdam build, `-n 4` 474 s."""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

# Files that must share a worker: a process-wide cache of one launch (name -> files).
SHARED_SCOPES = {
    "hang_dumps": ("tests/cli/test_logs_hang_cli.py", "tests/unit/test_hang_report.py"),
}
LAUNCHING_MARKS = frozenset({"distributed", "notebook", "slow"})


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the shared scope that lists the file."""
    path = nodeid.split("::", 1)[0]
    for name, files in SHARED_SCOPES.items():
        if path in files:
            return name
    return path


class ByFile(LoadFileScheduling):
    """xdist's by-file scheduling with `scope_of` as the unit, in collection order (`launching_first`)."""

    def __init__(self, config, log=None) -> None:
        # xdist's default puts the files with the most tests first: the unit files, leaving the launches for last.
        config.option.loadscopereorder = False
        super().__init__(config, log)

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)


def launching_first(items: list) -> None:
    """Reorder `items` in place: files with a test marked distributed, notebook or slow first, each file's tests
    kept together and in their order (the sort is stable)."""
    launching = {scope_of(item.nodeid) for item in items if LAUNCHING_MARKS & {m.name for m in item.iter_markers()}}
    items.sort(key=lambda item: scope_of(item.nodeid) not in launching)
