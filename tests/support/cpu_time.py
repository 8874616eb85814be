"""Where a pytest session's CPU time went, by test file, printed in its summary (tests/conftest.py): the suite is
CPU-bound on 2 cores (about 1.95 of them busy through `make test`), so its length follows its CPU-seconds, not its
seconds of wall time, and a file that waits on a timeout costs little while one that trains costs a lot.

Three parts, each per test and summed per file:
- "own": the test's own process (the pytest worker) between the test's start and end (setup, call, teardown);
- "fresh": the processes it started and waited for, with theirs (RUSAGE_CHILDREN over the same span: a fresh
  `accelerate launch` with its ranks, a command run with `sys.executable`);
- "warm": the ranks and launchers forked from the warm rank servers (tests.support.warm_ranks), which are no child of
  the test's process: each reaper reports its rank's own usage (`os.wait4`) with the test that launched it (the
  PYTEST_CURRENT_TEST the rank's environment carries) to `RANK_CPU_LOG` in the servers' folder.
Not counted: processes killed before anyone waited for them, the warm servers' own imports, pytest's own workers
between tests. So the sum is below the machine's CPU time; compare it with `/proc/stat` over the run."""

from __future__ import annotations

import json
import resource
from collections import defaultdict
from pathlib import Path

RANK_CPU_LOG = "rank_cpu.jsonl"  # in the warm servers' folder: a JSON line per warm process
REPORT_ENV = "HF_DIST_RECIPES_CPU_REPORT"  # a path: the session also writes each test's parts there, as JSON
PARTS = ("own", "fresh", "warm")
SHOWN = 8  # files named in the summary line


def usage() -> tuple[float, float]:
    """(this process's CPU seconds, its waited-for children's), user + system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def record_rank(folder: Path, test: str, rusage) -> None:
    """Append one warm process's CPU seconds (from `os.wait4`), charged to `test` (PYTEST_CURRENT_TEST's value)."""
    line = json.dumps({"test": test.rsplit(" (", 1)[0], "cpu": rusage.ru_utime + rusage.ru_stime})
    with open(folder / RANK_CPU_LOG, "a") as log:
        log.write(line + "\n")


def join_ranks(folder: Path, into: Path) -> None:
    """Add the warm processes recorded in `folder` (another set of servers: test_two_hosts_restart's, inside its
    network namespaces) to the record in `into` (the session's servers' folder), which the summary reads."""
    path = folder / RANK_CPU_LOG
    if path.exists():
        with open(into / RANK_CPU_LOG, "a") as log:
            log.write(path.read_text())


def warm_by_test(folder: Path) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    path = folder / RANK_CPU_LOG
    for line in path.read_text().splitlines() if path.exists() else []:
        entry = json.loads(line)
        out[entry["test"]] += entry["cpu"]
    return dict(out)


def by_file(tests: dict[str, dict[str, float]], warm: dict[str, float]) -> dict[str, dict[str, float]]:
    """{file: {"own": s, "fresh": s, "warm": s}} from the tests' own records and the warm processes' by test."""
    files: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(PARTS, 0.0))
    for test, parts in tests.items():
        for part, seconds in parts.items():
            files[test.split("::")[0]][part] += seconds
    for test, seconds in warm.items():
        files[test.split("::")[0]]["warm"] += seconds
    return dict(files)


def by_test(tests: dict[str, dict[str, float]], warm: dict[str, float]) -> dict[str, dict[str, float]]:
    """{test: {"own": s, "fresh": s, "warm": s}}: the report `REPORT_ENV` names, to find which test to cut."""
    out = {test: dict.fromkeys(PARTS, 0.0) | parts for test, parts in tests.items()}
    for test, seconds in warm.items():
        out.setdefault(test, dict.fromkeys(PARTS, 0.0))["warm"] += seconds
    return out


def summary_line(files: dict[str, dict[str, float]]) -> str:
    totals = {part: sum(f[part] for f in files.values()) for part in PARTS}
    ranked = sorted(files.items(), key=lambda item: -sum(item[1].values()))[:SHOWN]
    most = ", ".join(f"{Path(name).stem} {sum(parts.values()):.0f}" for name, parts in ranked)
    return (
        f"CPU seconds: {sum(totals.values()):,.0f} counted (tests' own processes {totals['own']:,.0f}, their fresh "
        f"subprocesses {totals['fresh']:,.0f}, warm ranks and launchers {totals['warm']:,.0f}); most: {most}"
    )
