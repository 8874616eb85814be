"""Live straggler detection on 2 real CPU ranks under DeepSpeed ZeRO-3 (accelerate_configs/cpu_zero3_2proc.yaml):
rank 1 made slow on purpose (it sleeps 0.5 s at the start of each step up to step 10, where a slow data loader
would) is flagged by both ranks with its host at the check that completes 2 slow windows of 5 steps, and reported
recovered at the first check after the sleeps stop; a run without the delay flags nobody. Both runs in one launch,
the calm one second in the same ranks."""

from __future__ import annotations

import json

import pytest

from tests.distributed.workers.runs import THEN, output_of_run
from tests.support.launch import accelerate_launch, check_launch
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "straggler_worker.py")
ZERO3 = REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml"
K, M, THRESHOLD, DELAY_S = 5, 2, 0.2, 0.5


def _args(out, steps: int, *extra: str) -> list[str]:
    opts = ["--check-steps", str(K), "--windows", str(M), "--threshold", str(THRESHOLD)]
    return [str(out), str(steps), *opts, *extra]


def _ranks(out) -> list[dict]:
    return [json.loads((out / "stragglers" / f"rank{r}.json").read_text()) for r in (0, 1)]


def _checks(rank: dict) -> dict[int, dict]:
    """Log entries that carry a check's keys, by the step of the log: this rank's logs as its TensorBoard run gets
    them. Wall-clock values and text: never in log_history."""
    assert not [k for e in rank["log_history"] for k in e if k.startswith("straggler")]
    return {e["step"]: e for e in rank["rank_logs"] if "straggler/slowest_over_median" in e}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch, two runs in the same ranks: the slow one, then the calm one (tests/distributed/workers/runs.py);
    each run's console output is cut from the launch's at rank 0's end-of-run line."""
    out = tmp_path_factory.mktemp("stragglers")
    # Sleeps while global_step <= 10, i.e. in the checks at steps 5 and 10 (each check runs in on_step_begin after
    # the sleep); the check at step 15 sees none. Each check's keys reach the log of the step it begins (logs
    # every step): steps 6, 11, 16.
    slow = _args(out / "slow", 16, "--slow-rank", "1", "--delay-s", str(DELAY_S), "--slow-until", "10")
    proc = accelerate_launch(ZERO3, [WORKER, *slow, THEN, *_args(out / "calm", 11)])
    check_launch(proc)
    return {
        name: {
            "ranks": _ranks(out / name),
            "output": output_of_run(proc.stdout, index) + output_of_run(proc.stderr, index),
        }
        for index, name in enumerate(("slow", "calm"))
    }


def test_the_slow_rank_is_flagged_with_its_host_on_every_rank_then_recovers(runs):
    slow = runs["slow"]
    host1 = slow["ranks"][1]["host"]
    for rank in slow["ranks"]:
        assert rank["hosts"] == [r["host"] for r in slow["ranks"]]
        flagged, recovered = rank["events"]
        assert flagged.startswith(f"step 10: straggler rank 1 (host {host1}) ")
        assert f"slower than the median of ranks for {M} window(s) of {K} steps" in flagged
        assert recovered.startswith(f"step 15: rank 1 (host {host1}) recovered")
        checks = _checks(rank)
        assert sorted(checks) == [6, 11, 16]
        # Slow in both windows (the first alone does not flag: M = 2), flagged once, then recovered.
        assert checks[6]["straggler/slowest_over_median"] > 1 + THRESHOLD and "straggler_event" not in checks[6]
        assert checks[11]["straggler/slowest_over_median"] > 1 + THRESHOLD
        assert checks[11]["straggler_event"] == flagged and checks[11]["straggler/flagged_ranks"] == 1
        assert checks[16]["straggler_event"] == recovered and checks[16]["straggler/flagged_ranks"] == 0
        assert checks[16]["straggler/slowest_over_median"] <= 1 + THRESHOLD
    assert slow["output"].count(f"Straggler check: step 10: straggler rank 1 (host {host1})") == 1  # rank 0 only


def test_without_a_delay_nobody_is_flagged(runs):
    calm = runs["calm"]
    for rank in calm["ranks"]:
        checks = _checks(rank)
        assert sorted(checks) == [6, 11]  # the checks ran
        assert rank["events"] == [] and all("straggler_event" not in e for e in rank["rank_logs"])
        assert all(c["straggler/flagged_ranks"] == 0 for c in checks.values())
    assert "Straggler check" not in calm["output"]
