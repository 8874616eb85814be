"""Preflight checks 5 (training) and 6 (failure paths) on real CPU ranks under `accelerate launch`
(hf_dist_recipes.preflight.training through tests/distributed/workers/preflight_training_worker.py), in the cases
that must not pass: a user JSON clipping at 0.5 with a DeepSpeed `scheduler` section is seen as such; two machines
given different seeds get a finding naming the odd rank. Each launch writes every rank's results; the ranks must
return the same list. The shipped configs' passing rows (ZeRO-3 on 2 ranks, ZeRO-3 + TP 2 + EP 2 on 4), with their
numbers checked against independent references, are asserted on the one launch of each that the CLI test makes
(tests/cli/test_preflight_cli.py, `shipped_zero3` and `shipped_tp2_ep2`): its training checks are these, run by
the preflight."""

from __future__ import annotations

import json

import pytest

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


def _ranks(out, world: int) -> list[dict]:
    return [json.loads((out / "preflight" / f"rank{r}.json").read_text()) for r in range(world)]


def _rows(rank: dict) -> dict[str, dict]:
    return rows_by_name(rank["results"])


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
    ranks = _ranks(tmp_path / "out", 2)
    assert ranks[0]["results"] == ranks[1]["results"]
    rows = _rows(ranks[0])
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
