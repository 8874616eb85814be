"""The exit handler RecipeTrainer registers for Gloo (`hf_dist_recipes.comm.backend.destroy_gloo_group`), on 2 plain
Gloo ranks (tests/distributed/workers/gloo_exit_worker.py, env rendezvous, no launcher): a rank exiting cleanly waits
at the barrier for a peer that ends later; a rank ending in an exception does not wait; a peer that never comes
holds a clean rank only for the barrier's timeout. How often the ranks abort without it: benchmarks/gloo_exit.py
(an abort is a rare race, so no test here can assert its absence)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.support.launch import free_port, launched_ranks_env, python_for
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "gloo_exit_worker.py")
COLLECTIVES = 10


def _ranks(*per_rank: list[str]) -> list[subprocess.Popen]:
    port = str(free_port())
    procs = []
    for rank, args in enumerate(per_rank):
        # launched_ranks_env: the rank servers' import-time environment, so the rank forks warm in a session that
        # launches (tests.support.warm_ranks; its exit code and signals are the rank's own).
        env = dict(launched_ranks_env(os.environ), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank))
        env["WORLD_SIZE"] = str(len(per_rank))
        procs.append(
            subprocess.Popen(
                [*python_for(env), WORKER, "recipe", str(COLLECTIVES), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def _handler_done_at(output: str) -> float:
    found = re.search(r"exit handler done at (\d+\.\d+)", output)
    assert found, output[-2000:]
    return float(found.group(1))


def test_a_rank_exiting_cleanly_waits_for_the_peer_that_ends_later():
    # Rank 1 sleeps 6 s after the last collective; rank 0 exits at once. Left alone, rank 0's handler would be done
    # about 6 s before rank 1's; met at the barrier, both are done within a moment of each other.
    procs = _ranks([], ["--sleep-s", "6"])
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    done = [_handler_done_at(o) for o in outputs]
    assert done[1] - done[0] < 2.5, done


def test_a_rank_ending_in_an_exception_does_not_wait():
    # Rank 0 raises; rank 1 is alive for 60 s more. Rank 0 must be gone long before rank 1 reaches its exit.
    procs = _ranks(["--raise"], ["--sleep-s", "60"])
    try:
        output = procs[0].communicate(timeout=45)[0]
        assert procs[0].returncode == 1 and "RuntimeError: this rank fails" in output, output[-2000:]
        assert procs[1].poll() is None  # the peer had not come to the barrier: rank 0 did not wait for it
        assert "exit handler done at" in output  # the handler ran, without the barrier
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_peer_that_never_comes_holds_a_clean_rank_only_for_the_timeout():
    # Rank 1 stays alive (600 s) and never reaches its exit; rank 0 exits cleanly with a 3 s barrier timeout.
    procs = _ranks(["--barrier-timeout-s", "3"], ["--sleep-s", "600"])
    try:
        output = procs[0].communicate(timeout=90)[0]
        assert procs[0].returncode == 0, output[-2000:]
        assert "exit handler done at" in output
        assert procs[1].poll() is None
    finally:
        for p in procs:
            p.kill()
            p.wait()
