"""No silent hangs across machines: two `accelerate launch` processes act as machines 0 and 1 on 127.0.0.1 (a
generated 2-machine CPU config, one rank each, DeepSpeed ZeRO-3 over Gloo) and train RecipeTrainer on a tiny model.
At step 5 machine 1's training process is lost: SIGKILL (a crash: Gloo then fails the next collective on machine 0
within a second, without saying which rank) or SIGSTOP (a frozen host whose sockets stay open: before the watchdog,
machine 0 was measured still waiting 120 s later, and would wait for ddp_timeout, 2 hours). Machine 0 must end
within the bound set here (peer_timeout), non-zero, naming rank 1 and step 5. About 32 s per case."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, cpu_only_env, free_port
from hf_dist_recipes.cli.main import main
from hf_dist_recipes.watchdog import LOST_PEER_EXIT_CODE, heartbeat_interval

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "dead_rank_worker.py")
DIE_AT = 5
PEER_TIMEOUT = 10.0
# The bound: silence for PEER_TIMEOUT, noticed at the next check (one interval later at most), plus the launcher
# tearing the job down (torchrun's agent, a few seconds on 2 loaded cores).
BOUND_S = PEER_TIMEOUT + heartbeat_interval(PEER_TIMEOUT) + 10


class Output(threading.Thread):
    """Reads a process's output line by line, remembering when each line arrived."""

    def __init__(self, proc: subprocess.Popen):
        super().__init__(daemon=True)
        self.proc, self.lines = proc, []

    def run(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def first(self, pattern: str) -> float | None:
        return next((t for t, line in self.lines if re.search(pattern, line)), None)

    def text(self) -> str:
        return "".join(line for _, line in self.lines)


@pytest.mark.parametrize("mode", ["kill", "stop"])
def test_machine_0_ends_within_the_bound_naming_the_lost_rank_and_its_step(tmp_path, mode):
    port = free_port()
    assert main(["config", "generate", "--cpu", "--nodes", "2", "--gpus-per-node", "1", "--auto", "--name", "two",
                 "--main-process-ip", "127.0.0.1", "--main-process-port", str(port), "--output", str(tmp_path)]) == 0
    # The generated --cpu config, as a CPU run on any host (conftest.cpu_only_env).
    env = cpu_only_env(dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    procs = [subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                               str(tmp_path / "two.yaml"), "--machine_rank", str(rank), WORKER, str(tmp_path / "out"),
                               mode, str(DIE_AT), f"peer_timeout={PEER_TIMEOUT}"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)  # a process group each, so a stopped rank can be cleaned up
             for rank in (0, 1)]
    outputs = [Output(p) for p in procs]
    for o in outputs:
        o.start()
    try:
        procs[0].wait(timeout=240)
        ended = time.monotonic()
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        for o in outputs:
            o.join(timeout=10)
    text0, text1 = outputs[0].text(), outputs[1].text()
    lost_at = outputs[1].first(rf"rank 1 finished step {DIE_AT}\b")
    assert lost_at is not None, f"machine 1 never reached step {DIE_AT}:\n{text1[-3000:]}\n{text0[-3000:]}"
    assert procs[0].returncode != 0
    assert f"exitcode  : {LOST_PEER_EXIT_CODE}" in text0, text0[-3000:]  # the watchdog ended it, not something else
    assert re.search(rf"lost rank 1 \(host [^)]+\): no heartbeat for \d+ s .*its last step was {DIE_AT}", text0), \
        text0[-3000:]
    elapsed = ended - lost_at
    assert elapsed <= BOUND_S, f"machine 0 ended {elapsed:.1f} s after rank 1 was lost; bound {BOUND_S} s"
    print(f"{mode}: machine 0 ended {elapsed:.1f} s after rank 1 was lost (bound {BOUND_S} s)")
