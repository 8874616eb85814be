"""preflight: a training check that failed and left hang dumps points at `hf-dist-recipes logs hang` for its run."""

from __future__ import annotations

from hf_dist_recipes.comm.flight_recorder import dump_rank_state
from hf_dist_recipes.preflight.result import ERROR, OK, CheckResult
from hf_dist_recipes.preflight.worker import _with_hang_report


def test_a_failed_run_with_dumps_names_the_command_and_one_without_is_unchanged(tmp_path):
    results = [
        CheckResult("training", ERROR, "the run failed on rank(s) 0: RuntimeError: Timed out", fix="fix the error"),
        CheckResult("failure_paths", OK, "resumed"),
    ]
    assert _with_hang_report(results, tmp_path) == results  # no dumps: nothing to point at
    dump_rank_state(tmp_path / "training", "timeout", "Timed out waiting 300000ms", rank=1)
    hinted = _with_hang_report(results, tmp_path)
    command = f"`hf-dist-recipes logs hang {tmp_path / 'training'}`"
    assert hinted[0].fix == f"fix the error; where the ranks waited: {command}"
    assert hinted[1] == results[1]  # an ok row needs no fix
