"""The preflight names the rank that failed first, read from torch elastic's failure table, not the first rank the
table lists. When one rank dies (a SIGABRT in its teardown, after every check passed), the launcher SIGTERMs the
ranks still running, and its table lists those (exit code -15) before the root cause. Seen in a real launch (rank 2
made to abort at exit): the report said "rank 0 failed" for a rank 0 the launcher had killed."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from hf_dist_recipes.preflight.launch import _Progress, _unfinished
from hf_dist_recipes.preflight.result import CHECKS, ERROR, CheckResult, PreflightReport


def _table(root: int, terminated: list[int], root_exit: int) -> str:
    """The table torch elastic prints for this launch, made by torch's own formatter: the root cause first in the
    failures (as the agent records it, before it terminates the others), all in the same second."""
    failures = {}
    for rank, exitcode in [(root, root_exit)] + [(r, -15) for r in terminated]:
        failures[rank] = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file="<N/A>")
        failures[rank].timestamp = 1_800_000_000
    return str(ChildFailedError("hf_dist_recipes.preflight.worker", failures))


def _after_all_checks(table: str) -> CheckResult:
    progress = _Progress(on_line=lambda line: None)
    for line in table.splitlines():
        progress.feed(line)
    report = PreflightReport(config_file="x.yaml", world_size=4, results=[CheckResult(c, "ok", "") for c in CHECKS])
    (result,) = _unfinished(report, progress, 1, False, 600.0, Path("preflight_launch.log"))
    return result


def test_the_table_lists_the_terminated_ranks_before_the_root_cause():
    table = _table(root=2, terminated=[0, 1, 3], root_exit=-6)
    assert table.index("rank      : 0 (local_rank: 0)") < table.index("rank      : 2 (local_rank: 2)")
    assert table.index("Root Cause") < table.index("rank      : 2 (local_rank: 2)")


def test_a_rank_aborting_in_its_teardown_is_named_with_its_signal():
    result = _after_all_checks(_table(root=2, terminated=[0, 1, 3], root_exit=-6))
    assert result.name == CHECKS[-1] and result.status == ERROR and result.ranks == (2,)
    assert "rank 2 (exit code -6, SIGABRT) failed or was lost" in result.detail, result.detail
    assert "rank 0" not in result.detail


def test_a_python_exception_on_the_last_rank_is_named_with_its_exit_code():
    result = _after_all_checks(_table(root=3, terminated=[0, 1, 2], root_exit=1))
    assert result.ranks == (3,) and "rank 3 (exit code 1) failed or was lost" in result.detail, result.detail
