"""tests.support.cpu_time: the session summary's CPU seconds by file, from the tests' own records and the warm
ranks' (the reaper's side: tests/distributed/test_warm_ranks.py)."""

from __future__ import annotations

import resource

from tests.support import cpu_time


def test_files_sum_their_tests_and_the_warm_ranks_they_started(tmp_path):
    usage = resource.struct_rusage((1.5, 0.5) + (0,) * 14)  # 1.5 s user + 0.5 s system
    cpu_time.record_rank(tmp_path, "tests/distributed/test_b.py::test_y (call)", usage)
    cpu_time.record_rank(tmp_path, "tests/distributed/test_b.py::test_y (setup)", usage)
    warm = cpu_time.warm_by_test(tmp_path)
    assert warm == {"tests/distributed/test_b.py::test_y": 4.0}
    tests = {
        "tests/unit/test_a.py::test_x": {"own": 3.0, "fresh": 0.0},
        "tests/unit/test_a.py::test_z[1]": {"own": 1.0, "fresh": 6.0},
        "tests/distributed/test_b.py::test_y": {"own": 0.5, "fresh": 0.0},
    }
    files = cpu_time.by_file(tests, warm)
    assert files == {
        "tests/unit/test_a.py": {"own": 4.0, "fresh": 6.0, "warm": 0.0},
        "tests/distributed/test_b.py": {"own": 0.5, "fresh": 0.0, "warm": 4.0},
    }
    assert cpu_time.by_test(tests, warm | {"tests/distributed/test_c.py::test_w": 1.0}) == {
        "tests/unit/test_a.py::test_x": {"own": 3.0, "fresh": 0.0, "warm": 0.0},
        "tests/unit/test_a.py::test_z[1]": {"own": 1.0, "fresh": 6.0, "warm": 0.0},
        "tests/distributed/test_b.py::test_y": {"own": 0.5, "fresh": 0.0, "warm": 4.0},
        "tests/distributed/test_c.py::test_w": {"own": 0.0, "fresh": 0.0, "warm": 1.0},  # warm ranks only
    }
    line = cpu_time.summary_line(files)
    assert line.startswith("CPU seconds: 14 counted (tests' own processes 4, their fresh subprocesses 6, warm ")
    assert line.endswith("most: test_a 10, test_b 4")  # 4.5 rounds to even


def test_no_warm_servers_no_warm_record(tmp_path):
    assert cpu_time.warm_by_test(tmp_path) == {}


def test_another_servers_record_joins_the_sessions(tmp_path):
    session, other = tmp_path / "session", tmp_path / "other"
    session.mkdir(), other.mkdir()
    usage = resource.struct_rusage((1.0, 0.0) + (0,) * 14)
    cpu_time.record_rank(session, "tests/distributed/test_a.py::test_x (call)", usage)
    cpu_time.join_ranks(other, session)  # nothing recorded there: nothing joins
    cpu_time.record_rank(other, "tests/distributed/test_b.py::test_y (call)", usage)
    cpu_time.record_rank(other, "tests/distributed/test_b.py::test_y (call)", usage)
    cpu_time.join_ranks(other, session)
    assert cpu_time.warm_by_test(session) == {
        "tests/distributed/test_a.py::test_x": 1.0,
        "tests/distributed/test_b.py::test_y": 2.0,
    }
