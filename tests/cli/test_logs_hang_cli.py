"""`hf-dist-recipes logs hang DIR`: the text and --json diagnosis of a real 2-rank Gloo hang (all_gather on rank 1
where rank 0 all_reduces; the dumps made once per session by tests/support/hang_dumps.py), exit 1 when ranks are
named, 0 when the dumps agree, 2 and one line for a folder without dumps."""

from __future__ import annotations

import json
import pickle
import shutil

import jsonschema
import pytest

from hf_dist_recipes.cli.main import main
from hf_dist_recipes.comm.hang_report import HANG_SCHEMA
from tests.support.hang_dumps import WORKER, hang_dumps, marker_line

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def op_job(tmp_path_factory):
    """A job's output_dir holding the op-mismatch scenario's flight_recorder/."""
    job = tmp_path_factory.mktemp("cli_hang") / "job"
    shutil.copytree(hang_dumps() / "op", job)
    return job


def test_text_names_the_ranks_the_collective_and_the_lines(capsys, op_job):
    code = main(["logs", "hang", str(op_job)])
    out = capsys.readouterr().out
    assert code == 1
    assert out.splitlines()[1].startswith("ERROR  ranks part at collective #3 of group 0 (default_pg) (different ops)")
    assert "rank 0: all_reduce #3 of group 0 (default_pg) in=[[4]] out=[[4]]" in out
    assert "rank 1: all_gather #3 of group 0 (default_pg) in=[[4]] out=[[2, 4]]" in out
    assert f"called at {WORKER}:{marker_line('op-r0')} in scenario" in out
    assert f"called at {WORKER}:{marker_line('op-r1')} in scenario" in out
    assert "COLLECTIVE_TYPE_MISMATCH" in out
    assert f"stack top (MainThread thread): {WORKER}:{marker_line('op-r1')} in scenario" in out
    assert out.splitlines()[-1].startswith("next: the ranks reached different collectives")


def test_json_is_the_same_diagnosis_and_validates(capsys, op_job):
    code = main(["logs", "hang", str(op_job / "flight_recorder"), "--json"])
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, HANG_SCHEMA)
    assert code == data["exit_code"] == 1
    first = data["first_divergence"]
    assert (first["kind"], first["seq"], [c["op"] for c in first["calls"]]) == (
        "op_mismatch",
        3,
        ["all_reduce", "all_gather"],
    )
    assert [c["user_frame"]["line"] for c in first["calls"]] == [marker_line("op-r0"), marker_line("op-r1")]


def test_dumps_that_agree_exit_0(capsys, op_job, tmp_path):
    shutil.copytree(op_job / "flight_recorder", tmp_path / "flight_recorder")
    for r in (0, 1):
        path = tmp_path / "flight_recorder" / f"rank_{r}"
        dump = pickle.loads(path.read_bytes())
        dump["entries"] = dump["entries"][:2]  # the two collectives both ranks made alike
        path.write_bytes(pickle.dumps(dump))
    assert main(["logs", "hang", str(tmp_path)]) == 0
    assert "agree" in capsys.readouterr().out


def test_world_size_counts_ranks_that_wrote_nothing(capsys, op_job):
    assert main(["logs", "hang", str(op_job), "--json", "--world-size", "3"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert (data["world_size"], data["ranks_without_files"]) == (3, [2])
    assert main(["logs", "hang", str(op_job), "--world-size", "0"]) == 2
    assert "--world-size must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("make", ["missing", "empty", "truncated"])
def test_bad_dir_is_one_line_and_exit_2(capsys, tmp_path, make):
    target = tmp_path / "job"
    if make != "missing":
        target.mkdir()
    if make == "truncated":
        (target / "flight_recorder").mkdir()
        (target / "flight_recorder" / "rank_0").write_bytes(b"\x80\x04")
    code = main(["logs", "hang", str(target), "--json"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1 and captured.err.startswith("hf-dist-recipes logs: error: ")
    assert "Traceback" not in captured.err
