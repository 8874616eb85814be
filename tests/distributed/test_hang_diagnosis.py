"""Hangs and desyncs diagnosed from what the ranks leave on disk: five jobs of 2 real CPU ranks (Gloo, torchrun) that
part on purpose (tests/distributed/workers/hang_worker.py), RecipeTrainer under plain DDP and, for the short
dataset, DeepSpeed ZeRO-3. For each, the ranks' dumps in `<output_dir>/flight_recorder/` (comm/flight_recorder.py)
must show the collective where they part, the ranks at it, the rank that never arrived and the user's line, which
the test finds independently: the worker's `# HANG <case> rank <r>` comments.

1. skip: rank 1 skips an all_reduce rank 0 makes in a callback; 2. op: all_reduce against all_gather; 3. shape:
all_reduce of 4 against 6 elements (Gloo aborts the rank that receives more than it expects: its stacks come from
faulthandler); 4. stop: rank 1 frozen by SIGSTOP (rank 0 dumps on SIGUSR1 while it waits, then when the heartbeat
names rank 1); 5. short: rank 1's dataset one batch shorter, under ZeRO-3.

The five jobs run at the same time: 90 s for the module on 2 cores at load 10-12 (5 launches). Without the
feature there are no dumps and every test fails. The time from the hang to each dump is printed (bounded by the
timeouts below plus the dump itself; not asserted: the machine is shared).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hf_dist_recipes.comm.flight_recorder import FLIGHT_RECORDER_DIR
from hf_dist_recipes.comm.hang_report import HangDiagnosis, diagnose
from tests.support.launch import _launch_env, cpu_only_env, free_port
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = REPO / "tests" / "distributed" / "workers" / "hang_worker.py"
ZERO3_JSON = REPO / "accelerate_configs" / "deepspeed" / "cpu_zero3_2proc.json"
PEER_TIMEOUT, STEP_TIMEOUT = 10.0, 15.0
STOP_PEER_TIMEOUT = 30.0  # the stop case: room for the SIGUSR1 dump before the heartbeat's, under load
CASES = ("skip", "op", "shape", "stop", "short")
JOB_TIMEOUT_S = 480


def marker_line(case: str, rank: int) -> int:
    """The worker's line that makes `rank` part in `case`, found by its comment (not by the code under test)."""
    lines = WORKER.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if re.search(rf"# HANG .*\b{case} rank {rank}\b", text))


@dataclass
class Job:
    case: str
    out: Path
    proc: subprocess.Popen
    lines: list[tuple[float, str]] = field(default_factory=list)  # (unix time read, line)
    signal_dump: dict | None = None  # the stop case: rank 0's stack file as SIGUSR1 left it

    @property
    def text(self) -> str:
        return "".join(line for _, line in self.lines)

    def pids(self) -> dict[int, int]:
        # the ranks share one pipe: a line may run into another's, so no anchors
        return {int(r): int(p) for r, p in re.findall(r"rank (\d) pid (\d+)", self.text)}

    def started(self) -> float:
        """Unix seconds at which the ranks parted: the first HANG-START (short: rank 0 finishing the last step
        both ranks had, after which rank 1 has no batch left)."""
        if self.case == "short":
            ends = [t for t, line in self.lines if re.search(r"rank 0 finished step \d+", line)]
            assert ends, f"short: no step finished:\n{self.text[-4000:]}"
            return ends[-1]
        times = [float(t) for t in re.findall(rf"HANG-START {self.case} \d (\d+\.\d{{3}})", self.text)]
        assert times, f"{self.case}: the job never reached its hang:\n{self.text[-4000:]}"
        return min(times)

    def stack(self, rank: int) -> dict | None:
        path = self.out / FLIGHT_RECORDER_DIR / f"stack_rank_{rank}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def trace(self, rank: int) -> dict:
        return pickle.loads((self.out / FLIGHT_RECORDER_DIR / f"rank_{rank}").read_bytes())

    def diagnosis(self) -> HangDiagnosis:
        """What `hf-dist-recipes logs hang <output_dir>` says (comm/hang_report.py), from the job's output dir."""
        return diagnose(self.out, world_size=2)

    def fatal(self, rank: int) -> str:
        path = self.out / FLIGHT_RECORDER_DIR / f"fatal_rank_{rank}.txt"
        return path.read_text() if path.exists() else ""


def _start(case: str, out: Path) -> Job:
    peer = STOP_PEER_TIMEOUT if case == "stop" else PEER_TIMEOUT
    step = 4 * STOP_PEER_TIMEOUT if case == "stop" else STEP_TIMEOUT  # stop: the heartbeat must come first
    extra = [f"peer_timeout={peer}", f"step_timeout={step}"]
    if case == "short":
        # Without the preemption check's all-reduce at each step end: rank 1's last collective is then ZeRO-3's own,
        # the silent desync this case is about. With it (the default), the check's 16 bytes meet rank 0's next
        # all-gather and Gloo aborts at once on the size mismatch ("Received data size doesn't match").
        extra += [f"deepspeed={ZERO3_JSON}", "preemption_signals=none"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd += [str(WORKER), str(out), case, *extra]
    env = cpu_only_env(_launch_env())
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    job = Job(case, out, proc)

    def read():
        for line in proc.stdout:
            job.lines.append((time.time(), line))  # unix seconds, as the dumps' "time"

    threading.Thread(target=read, daemon=True).start()
    return job


def _wait_for(predicate, timeout_s: float, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    return None


def _drive_stop(job: Job) -> None:
    """Once rank 1 froze: SIGUSR1 to rank 0 while it waits (keep that dump), then, after the heartbeat's dump,
    SIGKILL the frozen rank so the launcher can end (a stopped process would hold torchrun's teardown 30 s)."""
    if not _wait_for(lambda: "HANG-START stop 1" in job.text and 0 in job.pids(), JOB_TIMEOUT_S):
        return
    time.sleep(2)  # rank 0 is in its next collective by now
    os.kill(job.pids()[0], signal.SIGUSR1)
    job.signal_dump = _wait_for(lambda: (s := job.stack(0)) and s["reason"] == "signal" and s, STOP_PEER_TIMEOUT)
    _wait_for(lambda: (s := job.stack(0)) and s["reason"] == "lost_peer", JOB_TIMEOUT_S)
    time.sleep(1)
    pid1 = job.pids().get(1)
    if pid1:
        os.kill(pid1, signal.SIGKILL)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Job]:
    started = {case: _start(case, tmp_path_factory.mktemp(case)) for case in CASES}
    driver = threading.Thread(target=_drive_stop, args=(started["stop"],), daemon=True)
    driver.start()
    try:
        for job in started.values():
            try:
                job.proc.wait(timeout=JOB_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for job in started.values():
            for pid in [job.proc.pid, *job.pids().values()]:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            job.proc.wait()
    driver.join(timeout=5)
    for job in started.values():
        print(f"\n{job.case}: " + "; ".join(_report_times(job)))
        try:
            print(f"  logs hang: {job.diagnosis().summary}")
        except ValueError as err:
            print(f"  logs hang: {err}")
    return started


def _report_times(job: Job) -> list[str]:
    hang = job.started()
    times = []
    for rank in (0, 1):
        stack = job.stack(rank)
        if stack:
            times.append(f"rank {rank} {stack['reason']} dump {stack['time'] - hang:.1f} s after the hang")
        elif job.fatal(rank):
            times.append(f"rank {rank} aborted (fatal_rank_{rank}.txt)")
    return times


def _main_frames(stack: dict) -> list[dict]:
    return next(t for t in stack["threads"] if t["is_main"])["frames"]


def _user_lines(stack: dict) -> list[int]:
    """The worker lines on the main thread's stack, innermost last."""
    return [f["line"] for f in _main_frames(stack) if f["file"] == str(WORKER)]


def _last(trace: dict) -> dict:
    return max(trace["entries"], key=lambda e: e["collective_seq_id"])


def _calls_from(entry: dict, line: int) -> bool:
    return any(f["filename"] == str(WORKER) and f["line"] == line for f in entry["frames"])


def _names_line(diagnosis: HangDiagnosis, rank: int, line: int) -> None:
    """The report puts `rank` at the worker's `line` (the first divergence's call, or the rank's own user frame)."""
    first = diagnosis.first_divergence
    assert first is not None, diagnosis.summary
    calls = [c for c in first.calls if c.rank == rank]
    frames = [c.user_frame for c in calls] + [s.user_frame for s in diagnosis.ranks if s.rank == rank]
    assert any(f is not None and f.file == str(WORKER) and f.line == line for f in frames), diagnosis.summary
    assert f"{WORKER.name}:{line}" in diagnosis.summary, diagnosis.summary


def _parted_at_one_collective(job: Job) -> tuple[dict, dict]:
    """Both ranks' last recorded collective: the same sequence number (where they wait), each rank's own call."""
    a, b = _last(job.trace(0)), _last(job.trace(1))
    assert a["collective_seq_id"] == b["collective_seq_id"], (a, b)
    return a, b


def test_skipped_collective(jobs):
    job = jobs["skip"]
    s0, s1 = job.stack(0), job.stack(1)
    assert s0 and s1, job.text[-4000:]
    # rank 0 waited in the collective rank 1 skipped until one of them timed out (its own timeout, or rank 1's end
    # closing the connection first: both ranks wait out step_timeout at about the same moment)
    assert s0["reason"] in ("timeout", "lost_peer")
    line = marker_line("skip", 0)
    assert _user_lines(s0)[-1] == line  # rank 0's stack top in the user's code: the callback's all_reduce
    a, b = _parted_at_one_collective(job)
    assert a["profiling_name"] == "gloo:all_reduce" and a["input_sizes"] == [[1]] and _calls_from(a, line)
    assert not _calls_from(b, line)  # rank 1 is at its next collective, not the skipped one
    assert (b["profiling_name"], b["input_sizes"]) != (a["profiling_name"], a["input_sizes"])
    report = job.diagnosis()
    assert report.first_divergence.seq == a["collective_seq_id"] and report.exit_code() == 1
    _names_line(report, 0, line)
    assert {c.rank: c.op for c in report.first_divergence.calls}[0] == "all_reduce"


def test_op_mismatch(jobs):
    job = jobs["op"]
    s0, s1 = job.stack(0), job.stack(1)
    assert s0 and s1, job.text[-4000:]
    assert _user_lines(s0)[-1] == marker_line("op", 0) and _user_lines(s1)[-1] == marker_line("op", 1)
    a, b = _parted_at_one_collective(job)
    assert a["profiling_name"] == "gloo:all_reduce" and _calls_from(a, marker_line("op", 0))
    assert b["profiling_name"] == "gloo:all_gather" and _calls_from(b, marker_line("op", 1))
    report = job.diagnosis()
    assert report.first_divergence.kind == "op_mismatch", report.summary
    _names_line(report, 0, marker_line("op", 0))
    _names_line(report, 1, marker_line("op", 1))


def test_shape_mismatch(jobs):
    """Gloo aborts the rank that receives more bytes than it expects; the other fails its collective and dumps."""
    job = jobs["shape"]
    line = marker_line("shape", 0)
    aborted = [r for r in (0, 1) if f"line {line} in on_step_end" in job.fatal(r) and job.stack(r) is None]
    assert len(aborted) == 1, job.text[-4000:]
    survivor = 1 - aborted[0]
    stack = job.stack(survivor)
    assert stack and _user_lines(stack)[-1] == line
    entry = _last(job.trace(survivor))
    assert entry["profiling_name"] == "gloo:all_reduce" and entry["input_sizes"] == [[4 if survivor == 0 else 6]]
    assert _calls_from(entry, line)
    report = job.diagnosis()
    assert aborted[0] in report.first_divergence.not_arrived, report.summary
    _names_line(report, survivor, line)
    dead = next(s for s in report.ranks if s.rank == aborted[0])
    assert dead.user_frame is not None and dead.user_frame.line == line, report.summary  # from faulthandler's text


def test_frozen_rank(jobs):
    job = jobs["stop"]
    s0 = job.stack(0)
    assert s0 and job.stack(1) is None, job.text[-4000:]  # the frozen rank writes nothing: the survivor names it
    assert s0["reason"] == "lost_peer" and re.search(r"lost rank 1 \(host [^)]+\): no heartbeat", s0["message"])
    assert "hf-dist-recipes logs hang" in s0["message"]
    assert _user_lines(s0)[-1] == marker_line("stop", 0)  # inside trainer.train(), in its next collective
    assert _main_frames(s0)[-1]["file"].endswith("distributed_c10d.py")  # blocked in the collective, not after
    # On demand: SIGUSR1 while rank 0 waited wrote the same picture, blocked in the collective
    dump = job.signal_dump
    assert dump and "SIGUSR1" in dump["message"], job.text[-4000:]
    assert _main_frames(dump)[-1]["file"].endswith("distributed_c10d.py") and _main_frames(dump)[-1]["code"] == (
        "work.wait()"
    )
    assert job.trace(0)["entries"], "rank 0's flight recorder is empty"
    report = job.diagnosis()
    assert report.ranks_without_files == [1] and report.exit_code() == 1, report.summary
    assert "rank 1" in report.summary and "lost, killed or frozen" in report.summary, report.summary
    assert next(s for s in report.ranks if s.rank == 0).user_frame.line == marker_line("stop", 0)


def test_dataset_one_batch_shorter_under_zero3(jobs):
    job = jobs["short"]
    s0, s1 = job.stack(0), job.stack(1)
    assert s0 and s1, job.text[-4000:]
    for stack in (s0, s1):
        assert _user_lines(stack)[-1] == marker_line("short", 0)  # both inside trainer.train()
    a, b = _parted_at_one_collective(job)
    assert (a["profiling_name"], a["input_sizes"]) != (b["profiling_name"], b["input_sizes"])
    # rank 1 ran out of batches: its last collective comes from the end of its last step (a callback), rank 0's
    # from its next step
    assert "on_step_end" in {f["name"] for f in b["frames"]}, b["frames"]
    assert "on_step_end" not in {f["name"] for f in a["frames"]}, a["frames"]
    report = job.diagnosis()
    assert report.first_divergence.seq == a["collective_seq_id"], report.summary
    assert {c.rank for c in report.first_divergence.calls} == {0, 1}, report.summary
    for rank in (0, 1):
        assert next(s for s in report.ranks if s.rank == rank).user_frame.line == marker_line("short", 0)
