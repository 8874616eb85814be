"""`comm.hang_report.diagnose` on the dumps of real 2-rank Gloo jobs that hang (one launch for every scenario:
tests/distributed/workers/hang_scenarios_worker.py): the diagnosis names the rank, the collective (op, sequence id,
sizes) and the user's line, the line found independently, from a `# HANG-MARK` comment in the worker's source. Also
the folder rules, unreadable files, the frame rule, the JSON schema and torch's analyser as _compat uses it."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import jsonschema
import pytest

from hf_dist_recipes._compat import torch as compat_torch
from hf_dist_recipes.comm.hang_files import find_dump_dir, frame_kind, parse_fatal
from hf_dist_recipes.comm.hang_report import HANG_SCHEMA, diagnose, rank_list
from tests.support.hang_dumps import WORKER, hang_dumps, marker_line

distributed = pytest.mark.distributed


@pytest.fixture(scope="module")
def dumps() -> Path:
    return hang_dumps()


def _at(frame) -> tuple[str, int]:
    return (frame.file, frame.line) if frame else ("", 0)


def _calls(divergence) -> dict:
    return {c.rank: c for c in divergence.calls}


@distributed
def test_rank_1_skips_the_collective_rank_0_makes(dumps):
    d = diagnose(dumps / "skip")
    first = d.first_divergence
    assert (d.status, d.exit_code(), d.world_size, d.ranks_without_files) == ("error", 1, 2, [])
    assert (first.kind, first.op, first.seq, first.group) == ("not_arrived", "all_reduce", 3, "0 (default_pg)")
    assert first.not_arrived == [1] and list(_calls(first)) == [0]
    assert _at(_calls(first)[0].user_frame) == (str(WORKER), marker_line("skip-r0"))
    rank0, rank1 = d.ranks
    assert (rank0.reason, rank1.reason) == ("timeout", "signal")
    assert "Timed out" in rank0.message or "Connection" in rank0.message
    assert rank1.last_call.seq == 2 and rank1.last_call.op == "all_reduce"  # the last one both made
    assert _at(rank1.stack_top) == (str(WORKER), marker_line("idle"))  # busy elsewhere, not in a collective
    assert _at(rank0.stack_top) == (str(WORKER), marker_line("skip-r0"))
    assert "#3" in d.summary and "rank 1: not arrived" in d.summary and f":{marker_line('skip-r0')}" in d.summary


@distributed
def test_all_gather_against_all_reduce_is_an_op_mismatch(dumps):
    d = diagnose(dumps / "op")
    first = d.first_divergence
    calls = _calls(first)
    assert (first.kind, first.seq, first.not_arrived) == ("op_mismatch", 3, [])
    assert (calls[0].op, calls[1].op) == ("all_reduce", "all_gather")
    assert _at(calls[0].user_frame) == (str(WORKER), marker_line("op-r0"))
    assert _at(calls[1].user_frame) == (str(WORKER), marker_line("op-r1"))
    assert calls[1].output_sizes == [[2, 4]] and calls[0].output_sizes == [[4]]
    assert "COLLECTIVE_TYPE_MISMATCH" in first.detail  # torch's analyser's verdict
    assert [r.reason for r in d.ranks] == ["timeout", "timeout"]
    assert _at(d.ranks[1].stack_top) == (str(WORKER), marker_line("op-r1"))


@distributed
def test_same_op_different_shapes_is_a_shape_mismatch(dumps):
    """Same bytes, different shapes: Gloo completes it (silently wrong); the dumps still show where ranks part."""
    d = diagnose(dumps / "shape")
    first = d.first_divergence
    calls = _calls(first)
    assert (first.kind, first.op, first.seq) == ("shape_mismatch", "all_reduce", 3)
    assert (calls[0].input_sizes, calls[1].input_sizes) == ([[2, 3]], [[6]])
    assert {_at(c.user_frame) for c in calls.values()} == {(str(WORKER), marker_line("shape"))}
    assert "SIZE_OR_SYNTAX_MISMATCH" in first.detail
    assert d.exit_code() == 1


@distributed
def test_a_size_mismatch_gloo_aborts_names_the_dead_rank_and_its_line(dumps):
    """Gloo aborts (SIGABRT) the rank that receives more bytes than it expects: no dump, only faulthandler's text
    (`fatal_rank_0.txt`, comm.flight_recorder.FatalStacks); the survivor's dump has the sizes."""
    d = diagnose(dumps / "size_abort")
    first = d.first_divergence
    assert d.ranks_without_files == [] and first.not_arrived == [0]
    assert (first.kind, first.op, first.seq) == ("aborted", "all_reduce", 3)
    assert _calls(first)[1].input_sizes == [[6]]
    assert _at(_calls(first)[1].user_frame) == (str(WORKER), marker_line("size_abort"))
    rank0 = d.ranks[0]
    assert (rank0.reason, rank0.message, rank0.has_recorder) == ("fatal_signal", "Fatal Python error: Aborted", False)
    assert _at(rank0.stack_top) == (str(WORKER), marker_line("size_abort"))
    assert "rank 0: died (Fatal Python error: Aborted)" in d.summary and "size or op mismatch" in first.detail
    assert d.advice.startswith("Gloo aborted the ranks that died here")


@distributed
def test_a_frozen_rank_is_named_and_the_survivor_waits_at_its_line(dumps):
    d = diagnose(dumps / "frozen")
    first = d.first_divergence
    assert d.ranks_without_files == [1] and first.not_arrived == [1]
    assert (first.op, first.seq) == ("all_reduce", 3)
    rank0 = d.ranks[0]
    assert rank0.reason == "timeout" and _at(rank0.stack_top) == (str(WORKER), marker_line("frozen-r0"))
    assert not d.ranks[1].has_recorder and not d.ranks[1].has_stack
    assert first.waited_s is not None and first.waited_s > 0


@distributed
def test_three_ranks_name_the_odd_one_and_keep_the_sub_group_apart(dumps):
    d = diagnose(dumps / "three")
    first = d.first_divergence
    assert d.world_size == 3 and [x.group for x in d.divergences] == ["0 (default_pg)"]  # the pair agreed
    assert (first.kind, first.op, first.seq, first.odd_ranks) == ("shape_mismatch", "all_reduce", 3, [2])
    assert {c.rank: c.input_sizes for c in first.calls} == {0: [[4]], 1: [[4]], 2: [[2, 2]]}
    assert {_at(c.user_frame) for c in first.calls} == {(str(WORKER), marker_line("three"))}
    assert [r.last_call.group for r in d.ranks] == ["0 (default_pg)"] * 3
    assert "ranks 0-1: all_reduce [[4]]" in d.summary and "rank 2: all_reduce [[2, 2]]" in d.summary


@distributed
def test_output_dir_logging_dir_and_the_folder_itself_give_one_diagnosis(dumps, tmp_path):
    job = tmp_path / "job"
    shutil.copytree(dumps / "op", job)
    (job / "runs" / "Dec04_host").mkdir(parents=True)
    same = {json.dumps(diagnose(p).to_dict(), sort_keys=True) for p in (job, job / "flight_recorder")}
    same.add(json.dumps(diagnose(job / "runs" / "Dec04_host").to_dict(), sort_keys=True))
    assert len(same) == 1


@distributed
def test_ranks_that_agree_exit_0(dumps, tmp_path):
    """The op scenario cut to the two collectives both ranks made alike: nothing to name."""
    shutil.copytree(dumps / "op" / "flight_recorder", tmp_path / "fr")
    for r in (0, 1):
        path = tmp_path / "fr" / f"rank_{r}"
        dump = pickle.loads(path.read_bytes())
        dump["entries"] = dump["entries"][:2]
        path.write_bytes(pickle.dumps(dump))
    d = diagnose(tmp_path / "fr")
    assert (d.status, d.exit_code(), d.first_divergence, d.divergences) == ("ok", 0, None, [])
    assert "agree" in d.summary


@distributed
def test_a_missing_highest_rank_is_counted_with_world_size(dumps):
    d = diagnose(dumps / "frozen", world_size=4)
    assert d.world_size == 4 and d.ranks_without_files == [1, 2, 3]


@distributed
def test_json_validates_against_the_schema_from_the_dataclasses(dumps):
    for scenario in sorted(p.name for p in dumps.iterdir()):
        data = json.loads(json.dumps(diagnose(dumps / scenario).to_dict()))
        jsonschema.validate(data, HANG_SCHEMA)
    assert HANG_SCHEMA["additionalProperties"] is False and "exit_code" in HANG_SCHEMA["properties"]


def test_no_dumps_and_unreadable_files_are_one_value_error(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        diagnose(tmp_path / "nope")
    with pytest.raises(ValueError, match="no hang dumps"):
        diagnose(tmp_path)
    (tmp_path / "flight_recorder").mkdir()
    (tmp_path / "flight_recorder" / "rank_0").write_bytes(b"\x80\x04truncated")
    with pytest.raises(ValueError, match="rank_0: not a readable flight-recorder dump"):
        diagnose(tmp_path)
    assert find_dump_dir(tmp_path) == tmp_path / "flight_recorder"


def test_faulthandler_text_gives_the_main_thread_frames_innermost_first():
    text = (
        "Fatal Python error: Aborted\n\nThread 0x00007f01 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
        "Thread 0x00007f00 (most recent call first):\n"
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3245 in all_reduce\n'
        '  File "/home/me/train.py", line 12 in step\n  File "/home/me/train.py", line 40 in <module>\n\n'
        "Extension modules: torch._C (total: 1)\n"
    )
    fatal = parse_fatal(text)
    assert (fatal.error, fatal.thread) == ("Fatal Python error: Aborted", "0x00007f00")
    assert [(f.line, f.kind) for f in fatal.frames] == [(3245, "torch"), (12, "user"), (40, "user")]
    assert parse_fatal("") is None


def test_the_frame_rule():
    assert frame_kind("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py") == "torch"
    assert frame_kind("/usr/lib/python3.11/threading.py") == "stdlib"
    assert frame_kind("<frozen runpy>") == "stdlib"
    assert frame_kind("/venv/lib/python3.11/site-packages/transformers/trainer.py") == "library"
    assert frame_kind("/work/main/hf_dist_recipes/trainer.py") == "library"
    assert frame_kind("/work/main/hf_dist_recipes/comm/flight_recorder.py") == "dumper"
    assert frame_kind("/home/me/train.py") == "user"
    assert rank_list([0, 1, 2, 5]) == "ranks 0-2, 5" and rank_list([3]) == "rank 3"


@distributed
def test_compat_torch_analyser_still_has_what_we_use(dumps):
    """_compat.torch.fr_match_collectives: torch's builder on real Gloo dumps, with the groups rebuilt. Fails when
    torch's `Collective` loses a field we read or its matching stops flagging the op mismatch."""
    from torch.distributed.flight_recorder.components.types import Collective

    assert set(compat_torch.FR_COLLECTIVE_FIELDS) <= set(Collective._fields)
    entries = {
        r: pickle.loads((dumps / "op" / "flight_recorder" / f"rank_{r}").read_bytes())["entries"] for r in (0, 1)
    }
    collectives = compat_torch.fr_match_collectives(entries, {"0": ("default_pg", [0, 1])}, "2.10")
    assert [c.pass_check for c in collectives] == [True, True, False]
    mismatch = collectives[-1].mismatch_collectives[1]
    assert mismatch.type_of_mismatch.state.name == "COLLECTIVE_TYPE_MISMATCH"
    assert len(entries[0]) == 3  # copied, not consumed


@distributed
def test_compat_gloo_dumps_still_lack_their_groups(dumps):
    """Why hang_report rebuilds the groups: a Gloo dump's pg_config does not name the groups its entries use. When
    this fails, torch fills it in: try its pg_config before the rebuilt groups."""
    dump = pickle.loads((dumps / "op" / "flight_recorder" / "rank_0").read_bytes())
    names = {e["process_group"][0] for e in dump["entries"]}
    assert not names & set(dump["pg_config"]), dump["pg_config"]
