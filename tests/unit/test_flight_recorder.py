"""The hang dump (comm/flight_recorder.py): torch's own recorder pickle and every thread's stack, written atomically
in the layout `logs hang` reads, from a real one-rank Gloo group; the dump on SIGUSR1 while the main thread is
blocked in C code."""

from __future__ import annotations

import json
import os
import pickle
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_dist_recipes.comm.flight_recorder import (
    FLIGHT_RECORDER_DIR,
    AutomaticDump,
    SignalDump,
    dump_rank_state,
    stacks_text,
    thread_stacks,
)
from tests.support.launch import free_port


@pytest.fixture
def gloo_group(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _collective_here():
    dist.all_reduce(torch.ones(3, 2))  # the call site the recorder keeps


def test_dump_writes_torchs_pickle_and_the_stacks_innermost_last(tmp_path, gloo_group):
    _collective_here()
    path = dump_rank_state(tmp_path, "timeout", "why")
    directory = tmp_path / FLIGHT_RECORDER_DIR
    assert path == directory / "stack_rank_0.json"
    assert sorted(p.name for p in directory.iterdir()) == ["rank_0", "stack_rank_0.json", "stack_rank_0.txt"]
    trace = pickle.loads((directory / "rank_0").read_bytes())
    last = trace["entries"][-1]
    assert last["profiling_name"] == "gloo:all_reduce" and last["input_sizes"] == [[3, 2]]
    assert any(f["name"] == "_collective_here" and f["filename"] == __file__ for f in last["frames"])
    record = json.loads(path.read_text())
    assert record["rank"] == 0 and record["reason"] == "timeout" and record["message"] == "why"
    assert record["flight_recorder"] == "rank_0" and abs(record["time"] - time.time()) < 60
    main = [t for t in record["threads"] if t["is_main"]]
    assert len(main) == 1 and record["threads"][0] is not None
    innermost = main[0]["frames"][-1]
    assert innermost["function"] == "dump_rank_state" or innermost["file"].endswith("flight_recorder.py")
    mine = [
        f for f in main[0]["frames"] if f["function"] == "test_dump_writes_torchs_pickle_and_the_stacks_innermost_last"
    ]
    assert mine and mine[0]["code"].startswith("path = dump_rank_state(")
    text = (directory / "stack_rank_0.txt").read_text()
    assert text.startswith("# timeout: why") and "(most recent call first)" in text
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_an_errors_traceback_is_the_main_threads_stack(tmp_path):
    def failing_collective():
        raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")  # MARK

    try:
        failing_collective()
    except RuntimeError as err:
        path = dump_rank_state(tmp_path, "timeout", "t", error=err, rank=3)
    record = json.loads(path.read_text())
    assert path.name == "stack_rank_3.json" and record["rank"] == 3
    frames = next(t for t in record["threads"] if t["is_main"])["frames"]
    assert frames[-1]["function"] == "failing_collective" and frames[-1]["code"].endswith("# MARK")
    assert frames[-2]["function"] == "test_an_errors_traceback_is_the_main_threads_stack"


def test_reason_must_be_one_the_reader_knows(tmp_path):
    with pytest.raises(ValueError, match="lost_peer, timeout, signal"):
        dump_rank_state(tmp_path, "hang", "x", rank=0)


def test_automatic_dump_keeps_the_first_failures_state(tmp_path):
    dump = AutomaticDump(tmp_path)
    first = dump("timeout", "first", None)
    assert dump("lost_peer", "second") == first
    assert json.loads(first.read_text())["message"] == "first"


def test_other_threads_are_in_the_dump_with_their_names():
    release = threading.Event()
    worker = threading.Thread(target=release.wait, name="data-loader-like", daemon=True)
    worker.start()
    try:
        stacks = thread_stacks()
    finally:
        release.set()
    named = {s.name: s for s in stacks}
    assert stacks[0].is_main and "data-loader-like" in named
    assert named["data-loader-like"].frames[-1].function == "wait"
    assert 'Thread "data-loader-like"' in stacks_text(stacks)


def test_sigusr1_dumps_while_the_main_thread_is_blocked_in_c(tmp_path):
    """time.sleep holds the main thread in C as a waiting collective does: Python would run a signal handler only
    after it returns; the dump must come from the reading thread before that."""
    dump = SignalDump(tmp_path, describe=lambda: " (test)")
    try:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        start = time.monotonic()
        deadline = start + 60
        while not dump.dumps and time.monotonic() < deadline:
            time.sleep(3)  # blocked in C; checked between sleeps
            if dump.dumps:
                break
        assert dump.dumps, "no dump within 60 s"
        record = json.loads(dump.dumps[0].read_text())
        assert record["reason"] == "signal" and "SIGUSR1" in record["message"] and "(test)" in record["message"]
        main = next(t for t in record["threads"] if t["is_main"])
        assert main["frames"][-1]["code"].startswith("time.sleep(3)")  # caught inside the sleep, not after it
    finally:
        dump.close()
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)
    assert signal.set_wakeup_fd(-1) == -1  # ours was removed


def test_a_rank_gloo_aborts_leaves_its_stacks_and_a_healthy_one_no_file(tmp_path):
    """Gloo ends a rank with SIGABRT on a collective size mismatch: no Python runs then, faulthandler writes."""
    import subprocess
    import sys

    script = (
        "import os, sys\n"
        "from hf_dist_recipes.comm.flight_recorder import FatalStacks\n"
        "def collective_here():\n"
        "    os.abort()\n"
        "fatal = FatalStacks(sys.argv[1], 5)\n"
        "if sys.argv[2] == 'abort':\n"
        "    collective_here()\n"
        "fatal.close()\n"
    )
    aborted = subprocess.run([sys.executable, "-c", script, str(tmp_path / "a"), "abort"], capture_output=True)
    assert aborted.returncode == -signal.SIGABRT
    text = (tmp_path / "a" / FLIGHT_RECORDER_DIR / "fatal_rank_5.txt").read_text()
    assert "Fatal Python error: Aborted" in text and "line 4 in collective_here" in text
    healthy = subprocess.run([sys.executable, "-c", script, str(tmp_path / "h"), "no"], capture_output=True)
    assert healthy.returncode == 0, healthy.stderr
    assert list((tmp_path / "h" / FLIGHT_RECORDER_DIR).iterdir()) == []


def test_sigterm_writes_the_state_first_then_ends_the_process(tmp_path):
    """torchrun ends the other ranks with SIGTERM when one fails: a rank still waiting (in C: a sleep here) writes
    where it waits, then dies of SIGTERM as before."""
    import subprocess
    import sys

    script = (
        "import sys, time\n"
        "from hf_dist_recipes.comm.flight_recorder import AutomaticDump, SignalDump\n"
        "dump = SignalDump(sys.argv[1], on_terminate=AutomaticDump(sys.argv[1]))\n"
        "print('ready', flush=True)\n"
        "time.sleep(120)  # waiting\n"
    )
    (tmp_path / "waiting.py").write_text(script)  # a file, so that the stack shows its source lines
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "waiting.py"), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, RANK="1"),
    )
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM  # from the reading thread, which cannot re-raise it
    record = json.loads((tmp_path / FLIGHT_RECORDER_DIR / "stack_rank_1.json").read_text())
    assert record["reason"] == "signal" and "SIGTERM" in record["message"]
    assert next(t for t in record["threads"] if t["is_main"])["frames"][-1]["code"].endswith("# waiting")


def test_a_dump_while_the_main_thread_handles_a_collective_error_shows_where_it_waited(tmp_path):
    """A signal or the heartbeat can come between Gloo's raise and the recipe's own dump: the stack is still the
    failed call's."""

    def waiting_collective():
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")  # WAITED HERE

    try:
        waiting_collective()
    except RuntimeError:
        path = dump_rank_state(tmp_path, "signal", "SIGTERM", rank=0)  # as the reading thread would, unaware
    frames = next(t for t in json.loads(path.read_text())["threads"] if t["is_main"])["frames"]
    assert frames[-1]["function"] == "waiting_collective" and frames[-1]["code"].endswith("# WAITED HERE")
    try:
        raise ValueError("not a collective")
    except ValueError:
        path = dump_rank_state(tmp_path, "signal", "x", rank=0)
    frames = next(t for t in json.loads(path.read_text())["threads"] if t["is_main"])["frames"]
    assert frames[-1]["file"].endswith("flight_recorder.py")  # any other error: the stack as it is


def test_an_earlier_attempts_dumps_go_aside_and_a_killed_ranks_empty_file_goes(tmp_path):
    from hf_dist_recipes.comm.flight_recorder import FLIGHT_RECORDER_DIR, set_aside_dumps

    assert set_aside_dumps(tmp_path) is None  # no folder
    folder = tmp_path / FLIGHT_RECORDER_DIR
    folder.mkdir()
    (folder / "fatal_rank_1.txt").write_text("")  # FatalStacks' file of a SIGKILLed rank
    assert set_aside_dumps(tmp_path) is None and list(folder.iterdir()) == []  # nothing worth keeping
    kept = []
    for _ in range(2):  # two attempts that ended in the same second keep two folders
        (folder / "rank_0").write_bytes(b"pickle")
        (folder / "stack_rank_0.json").write_text("{}")
        os.utime(folder / "rank_0", (1_700_000_000, 1_700_000_000))
        os.utime(folder / "stack_rank_0.json", (1_700_000_000, 1_700_000_000))
        kept.append(set_aside_dumps(tmp_path))
        folder.mkdir()
    assert kept == [str(tmp_path / f"{FLIGHT_RECORDER_DIR}.attempt-1700000000{s}") for s in ("", "+")]
    assert sorted(p.name for p in Path(kept[1]).iterdir()) == ["rank_0", "stack_rank_0.json"]
