"""Live straggler detection on 2 real CPU ranks under DeepSpeed ZeRO-3 (accelerate_configs/cpu_zero3_2proc.yaml):
rank 1 made slow on purpose (it sleeps 0.5 s at the start of each step up to step 10, where a slow data loader
would) is flagged by both ranks with its host at the check that completes 2 slow windows of 5 steps, and reported
recovered at the first check after the sleeps stop; a run without the delay flags nobody. Both runs in one launch,
the calm one second in the same ranks.

Both runs also report to MLflow (`report_to=["mlflow"]`, its local file store): the per-rank spread of the
runtime's `job` channel (`straggler/slowest_rank`, `straggler/flagged_ranks`, `system/rss_gib_max` and its rank) is
read back from what MLflow recorded, and is absent from the run's trainer_state.json, where `loss` is (issue 30)."""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest

from tests.distributed.workers.runs import THEN, output_of_run
from tests.support.launch import accelerate_launch, check_launch
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "straggler_worker.py")
ZERO3 = REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml"
K, M, THRESHOLD, DELAY_S = 5, 2, 0.2, 0.5
EXPERIMENT = "stragglers"
# The job channel (hf_dist_recipes/runtime.py LogSink.job): measured, the same on every rank; report_to, not history.
JOB_KEYS = (
    "straggler/slowest_over_median",
    "straggler/slowest_rank",
    "straggler/flagged_ranks",
    "system/rss_gib_max",
    "system/rss_gib_max_rank",
)
# MLflow 3.18 keeps the file store in maintenance mode: it opens only with this opt-in (its sqlite store would need
# SQLAlchemy and Alembic, which mlflow-skinny leaves out). No usage telemetry: nothing leaves the machine.
MLFLOW_QUIET = {"MLFLOW_ALLOW_FILE_STORE": "true", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}


def _args(out, steps: int, *extra: str) -> list[str]:
    opts = ["--check-steps", str(K), "--windows", str(M), "--threshold", str(THRESHOLD)]
    return [str(out), str(steps), *opts, *extra]


def _ranks(out) -> list[dict]:
    return [json.loads((out / "stragglers" / f"rank{r}.json").read_text()) for r in (0, 1)]


def _mlflow_metrics(uri: str) -> dict[str, dict[str, dict[int, float]]]:
    """What MLflow recorded, read back through its client: {run name: {metric: {step: value}}}. `loss` or a job key
    logged twice at one step fails (it would hide a value); the standing counters (`loss_spikes`...) are logged
    twice at the last step by design (its training log and the end-of-training log)."""
    with mock.patch.dict(os.environ, MLFLOW_QUIET):  # the telemetry switch is read when mlflow is imported
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(EXPERIMENT)
        runs = {}
        for run in client.search_runs([experiment.experiment_id]):
            metrics = {}
            for key in run.data.metrics:
                history = client.get_metric_history(run.info.run_id, key)
                metrics[key] = {m.step: m.value for m in history}
                if key in ("loss", *JOB_KEYS):
                    assert len(metrics[key]) == len(history), f"{key} logged twice at one step: {history}"
            runs[run.info.run_name] = metrics
    return runs


def _checks(rank: dict) -> dict[int, dict]:
    """Log entries that carry a check's keys, by the step of the log: this rank's logs as its TensorBoard run gets
    them. Wall-clock values and text: never in log_history."""
    assert not [k for e in rank["log_history"] for k in e if k.startswith("straggler")]
    return {e["step"]: e for e in rank["rank_logs"] if "straggler/slowest_over_median" in e}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch, two runs in the same ranks: the slow one, then the calm one (tests/distributed/workers/runs.py);
    each run's console output is cut from the launch's at rank 0's end-of-run line. Each run is an MLflow run of its
    own (named after its output folder) in one local file store, as a user's MLFLOW_* variables would set it up."""
    out = tmp_path_factory.mktemp("stragglers")
    # Sleeps while global_step <= 10, i.e. in the checks at steps 5 and 10 (each check runs in on_step_begin after
    # the sleep); the check at step 15 sees none. Each check's keys reach the log of the step it begins (logs
    # every step): steps 6, 11, 16.
    slow = _args(out / "slow", 16, "--slow-rank", "1", "--delay-s", str(DELAY_S), "--slow-until", "10", "--mlflow")
    uri = (out / "mlruns").as_uri()
    env = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": EXPERIMENT, "DISABLE_MLFLOW_INTEGRATION": None}
    proc = accelerate_launch(ZERO3, [WORKER, *slow, THEN, *_args(out / "calm", 11, "--mlflow")], env=env | MLFLOW_QUIET)
    check_launch(proc)
    mlflow = _mlflow_metrics(uri)
    return {
        name: {
            "ranks": _ranks(out / name),
            "output": output_of_run(proc.stdout, index) + output_of_run(proc.stderr, index),
            "mlflow": mlflow[name],
            "log_history": json.loads((out / name / "trainer_state.json").read_text())["log_history"],
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


def test_the_spread_reaches_mlflow_but_not_log_history(runs):
    slow, calm = runs["slow"], runs["calm"]
    recorded = slow["mlflow"]
    # MLflow logs rank 0's view (MLflowCallback writes on the main process only); its checks are the ones above.
    checks = _checks(slow["ranks"][0])
    assert sorted(recorded["straggler/slowest_rank"]) == [6, 11, 16]
    # The independent reason: rank 1 sleeps before every step up to step 10, so the checks at steps 5 and 10
    # (logged at 6 and 11) find it the slowest; from step 11 on nobody sleeps (step 16: either rank, not asserted).
    assert recorded["straggler/slowest_rank"][6] == recorded["straggler/slowest_rank"][11] == 1
    # Not flagged after one slow window (M = 2), flagged after the second, recovered at the next check.
    assert recorded["straggler/flagged_ranks"] == {6: 0, 11: 1, 16: 0}
    # The very numbers the callbacks saw in the same logs (a lost, renamed or rescaled value fails here).
    for step, check in checks.items():
        for key in ("straggler/slowest_over_median", "straggler/slowest_rank", "straggler/flagged_ranks"):
            assert recorded[key][step] == check[key]
    # The largest RSS and its rank at every logged step: the larger of the two ranks' own samples of that step
    # (each rank's `system/rss_gib`, its rank channel), read on the ranks and compared with what MLflow got.
    steps = list(range(1, 17))
    assert sorted(recorded["system/rss_gib_max"]) == sorted(recorded["system/rss_gib_max_rank"]) == steps
    own = [{e["step"]: e["system/rss_gib"] for e in r["rank_logs"] if "system/rss_gib" in e} for r in slow["ranks"]]
    for step in steps:
        largest = max(own[0][step], own[1][step])
        assert recorded["system/rss_gib_max"][step] == largest > 0
        assert recorded["system/rss_gib_max_rank"][step] in (0, 1)
        assert own[int(recorded["system/rss_gib_max_rank"][step])][step] == largest
    # loss: in MLflow and in trainer_state.json's log_history alike, step by step; the spread only in MLflow.
    for run in (slow, calm):
        history = run["log_history"]
        assert {e["step"]: e["loss"] for e in history if "loss" in e} == run["mlflow"]["loss"]
        assert len(run["mlflow"]["loss"]) == history[-1]["step"]  # every step logged its loss
        assert not [k for e in history for k in e if k in JOB_KEYS]
        assert set(JOB_KEYS) <= set(run["mlflow"])
    # The negative control: without a delay the checks still run and name a slowest rank (either), but no check
    # flags one; the same key the slow run had at 1 stays 0 here.
    assert sorted(calm["mlflow"]["straggler/slowest_rank"]) == [6, 11]
    assert set(calm["mlflow"]["straggler/slowest_rank"].values()) <= {0, 1}
    assert calm["mlflow"]["straggler/flagged_ranks"] == {6: 0, 11: 0}


def test_every_ranks_series_reaches_mlflow(runs):
    """Issue 42: `report_to` got the cross-rank summary only. Every rank's step time, tokens/s and loss of each logged
    window, and its local gradient norm, now reach MLflow as `per_rank/<metric>/rank<N>`: each equal to what that
    rank measured itself (its own window, read on the rank), the two ranks' losses different (each its own batch),
    their mean the loss the Trainer logged (its cross-rank mean, rounded to 4 digits), and the global gradient norm
    of the averaged gradient no larger than the mean of the ranks' local norms (the triangle inequality)."""
    for run in (runs["slow"], runs["calm"]):
        recorded, logged = run["mlflow"], run["mlflow"]["loss"]
        own = [{e["step"]: e for e in r["rank_logs"] if "own/loss" in e} for r in run["ranks"]]
        steps = sorted(logged)
        assert steps and all(sorted(o) == steps for o in own)
        for metric in ("step_time_s", "tokens_per_s", "loss"):
            for r in (0, 1):
                assert recorded[f"per_rank/{metric}/rank{r}"] == {s: own[r][s][f"own/{metric}"] for s in steps}
        losses = [recorded[f"per_rank/loss/rank{r}"] for r in (0, 1)]
        assert all(losses[0][s] != losses[1][s] for s in steps)
        for s in steps:
            assert (losses[0][s] + losses[1][s]) / 2 == pytest.approx(logged[s], abs=1e-4)
            local = [recorded[f"per_rank/grad_norm/rank{r}"][s] for r in (0, 1)]
            assert 0 < recorded["grad_norm"][s] <= (local[0] + local[1]) / 2 + 1e-6
        assert not [k for e in run["log_history"] for k in e if k.startswith("per_rank/")]
