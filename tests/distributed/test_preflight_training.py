"""Preflight checks 5 (training) and 6 (failure paths) on real CPU ranks under `accelerate launch`
(hf_dist_recipes.preflight.training through tests/distributed/workers/preflight_training_worker.py):
ZeRO-3 on 2 ranks passes every row with the numbers checked against independent references (about 12 s a launch);
a user JSON clipping at 0.5 with a DeepSpeed `scheduler` section is seen as such; two machines given different seeds
get a finding naming the odd rank. Each launch writes every rank's results; the ranks must return the same list.
The shipped ZeRO-3 + TP 2 + EP 2 config's rows on 4 ranks are checked against the one 4-rank launch the CLI test
makes (tests/cli/test_preflight_cli.py, `shipped_tp2_ep2`): its training checks are these, run by the preflight."""

from __future__ import annotations

import json
import math

import pytest

from hf_dist_recipes.monitoring.tensorboard import rank_log_dir
from tests.support.launch import (
    LAUNCH_TIMEOUT_S,
    accelerate_launch,
    check_launch,
    launch_machine,
    two_machine_config,
    write_cpu_deepspeed_yaml,
)
from tests.support.paths import REPO
from tests.support.preflight import recipe_learning_rates, rows_by_name

pytestmark = [pytest.mark.distributed]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "preflight_training_worker.py")
ZERO3 = REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml"
STEPS, SAVE_AT, NAN_STEP = 20, 10, 12  # the resumed run: step 11 compared, NaN at 12


def _ranks(out, world: int) -> list[dict]:
    return [json.loads((out / "preflight" / f"rank{r}.json").read_text()) for r in range(world)]


def _rows(rank: dict) -> dict[str, dict]:
    return rows_by_name(rank["results"])


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    out = tmp_path_factory.mktemp("preflight_zero3")
    check_launch(accelerate_launch(ZERO3, [WORKER, str(out), "--steps", str(STEPS)]))
    return out, _ranks(out, 2)


def test_every_rank_returns_the_same_results(zero3):
    _, ranks = zero3
    assert ranks[0]["results"] == ranks[1]["results"]
    assert [r["name"] for r in ranks[0]["results"]] == ["training"] * 4 + ["failure_paths"] * 2
    assert all(r["status"] == "ok" and r["fix"] == "" for r in ranks[0]["results"]), ranks[0]["results"]
    assert [line.split(" ", 1)[1].split(":")[0] for line in ranks[0]["progress"]] == ["training", "failure paths"]


def test_loss_falls_from_the_untrained_level(zero3):
    loss = _rows(zero3[1][0])["training/loss"]["data"]
    assert len(loss["losses"]) == STEPS and all(math.isfinite(x) for x in loss["losses"])
    # An untrained model predicts about uniformly over its 128 tokens: ln 128 = 4.85 nats at the start (measured
    # first quarter 4.58: the first steps already learn). Python source has far fewer likely bytes; the measured
    # last quarter is 3.37, a drop of 1.2 nats: 0.5 is asked.
    assert abs(loss["losses"][0] - math.log(128)) < 0.3
    assert loss["first_quarter"] - loss["last_quarter"] > 0.5
    assert loss["first_quarter"] == pytest.approx(sum(loss["losses"][:5]) / 5)
    assert loss["last_quarter"] == pytest.approx(sum(loss["losses"][-5:]) / 5)


def test_clipping_is_the_engines_at_one(zero3):
    clip = _rows(zero3[1][0])["training/clipping"]["data"]
    assert clip["source"] == "engine", "not a DeepSpeed run: the launch did not give the ranks DeepSpeed"
    assert clip["expected"] == 1.0 and clip["applied"] == {"0": [1.0], "1": [1.0]}  # engine and ZeRO-3 optimizer
    assert len(clip["pre_clip_norms"]) == STEPS and clip["steps_above_clip"] == sum(
        n > 1.0 for n in clip["pre_clip_norms"]
    )


def test_learning_rates_are_transformers_cosine_with_restarts(zero3):
    schedule = _rows(zero3[1][0])["training/schedule"]["data"]
    assert schedule["learning_rates"] == pytest.approx(recipe_learning_rates(STEPS), rel=1e-9, abs=1e-15)
    assert schedule["mismatched_steps"] == []


def test_ranks_agree_and_weights_were_compared(zero3):
    agreement = _rows(zero3[1][0])["training/agreement"]["data"]
    # Built whole on each rank (not under zero.Init), so the built weights were really compared: 1.0, not -1.0.
    assert agreement["rank_check"] == {
        "rank_check/seed_ok": 1.0,
        "rank_check/data_ok": 1.0,
        "rank_check/weights_ok": 1.0,
    }
    assert agreement["mismatches"] == []


def test_nan_on_the_last_rank_is_skipped_on_both(zero3):
    nan = _rows(zero3[1][0])["failure_paths/nan"]["data"]
    assert nan["step"] == NAN_STEP and nan["rank"] == 1
    for rank in ("0", "1"):
        got = nan["ranks"][rank]
        assert got["not_applied"] == [NAN_STEP] and got["skipped_steps"] == 1 and got["flagged_ranks"] == [1]
        assert got["event"].startswith(
            "step 12: non-finite value first on rank 1 (rank(s) 1); loss non-finite on rank(s) 1"
        )


def test_resume_reproduces_the_next_step(zero3):
    resume = _rows(zero3[1][0])["failure_paths/resume"]["data"]
    assert resume["saved_at"] == SAVE_AT and resume["step"] == SAVE_AT + 1
    for rank in resume["ranks"].values():
        # fp32 on CPU, the same forward on the same restored state: equal (measured difference 0).
        assert rank["loss"] == pytest.approx(rank["uninterrupted_loss"], abs=1e-6) and rank["same_batch"]
    assert (zero3[0] / "training" / f"checkpoint-{SAVE_AT}").is_dir()


def test_tensorboard_runs_are_left_for_the_logs_check(zero3):
    out = zero3[0]
    for rank in (0, 1):
        assert list((out / "tensorboard" / f"rank{rank}").glob("events.out.tfevents.*"))
        assert rank_log_dir(out / "tensorboard", rank) == str(out / "tensorboard" / f"rank{rank}")


def test_a_deepspeed_scheduler_section_and_another_clip_value_are_seen(tmp_path):
    """The user's JSON clips at 0.5 and has a `scheduler` section (DeepSpeed's WarmupLR), which replaces the recipe's
    schedule: clipping is reported at 0.5, read from the engine; the schedule row is an error naming the section."""
    ds = json.loads((REPO / "accelerate_configs" / "deepspeed" / "cpu_zero3_2proc.json").read_text())
    ds["gradient_clipping"] = 0.5
    ds["scheduler"] = {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    }
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    config = write_cpu_deepspeed_yaml(tmp_path / "user.yaml", tmp_path / "ds.json")
    check_launch(accelerate_launch(config, [WORKER, str(tmp_path / "out"), "--steps", "8"]))
    rows = _rows(_ranks(tmp_path / "out", 2)[0])
    clip = rows["training/clipping"]
    assert clip["status"] == "ok" and clip["data"]["applied"] == {"0": [0.5], "1": [0.5]}
    schedule = rows["training/schedule"]
    assert schedule["status"] == "error" and "scheduler` section" in schedule["fix"]
    assert schedule["data"]["learning_rates"] != pytest.approx(recipe_learning_rates(8, warmup=1))
    assert rows["training/loss"]["status"] == rows["failure_paths/resume"]["status"] == "ok"


def test_machines_given_different_seeds_are_named(tmp_path):
    """Two `accelerate launch` processes as machine 0 and 1 of a generated 2-machine CPU config (one rank each), the
    preflight's --seed differing: rank 1 is named, with the seed, and the run still reports every row."""
    config, _ = two_machine_config(tmp_path)
    out = tmp_path / "run"
    procs = [
        launch_machine(config, rank, [WORKER, str(out), "--steps", "8", "--seed", str(seed)], cwd=tmp_path)
        for rank, seed in ((0, 0), (1, 1))
    ]
    try:
        outputs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    ranks = _ranks(out, 2)
    assert ranks[0]["results"] == ranks[1]["results"]
    rows = _rows(ranks[0])
    agreement = rows["training/agreement"]
    assert agreement["status"] == "error" and agreement["ranks"] == [1]
    assert agreement["detail"].startswith(
        "agreement: rank(s) 1 disagree with ranks [0, 1] on the seed at train begin (rank 0: 0, rank 1: 1)"
    )
    assert "pass the same seed= on every rank" in agreement["fix"]
    found = {m["what"] for m in agreement["data"]["mismatches"]}
    assert {"the seed", "the weights they built"} <= found  # built from different RNG states
    assert agreement["data"]["rank_check"]["rank_check/seed_ok"] == 0.0
    assert {name: r["status"] for name, r in rows.items() if name != "training/agreement"} == {
        "training/loss": "ok",
        "training/clipping": "ok",
        "training/schedule": "ok",
        "failure_paths/nan": "ok",
        "failure_paths/resume": "ok",
    }
