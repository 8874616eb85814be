"""The recipe's schedule selected by name under DeepSpeed ZeRO-3 on 2 real CPU ranks, with the optimizer built by
the Trainer and with an `optimizer` section (DeepSpeed builds the optimizer and steps the scheduler through
transformers' callable), both runs in one launch. The learning rates are those the engine's optimizer held at each
step, and the shape (floor 0.3, re-warm-up after the restart) is one transformers' stock `cosine_with_restarts`
cannot produce."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.distributed.workers.runs import THEN
from tests.support.launch import accelerate_launch, check_launch, write_cpu_deepspeed_yaml
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "schedule_worker.py")
STEPS = 12
PEAK = 1e-2


def _expected() -> list[float]:
    """By hand: W=2, T=12, 2 cycles over the 10 steps after warm-up (5 each, the restart at step 7), floor
    m=0.3, re-warm-up R=2. Cosine part: m + (1 - m) * 0.5 * (1 + cos(pi * phase))."""
    cos = lambda phase: 0.3 + 0.35 * (1 + math.cos(math.pi * phase))  # noqa: E731
    multipliers = [
        0 / 2,
        1 / 2,  # warm-up t / W
        cos(0 / 5),
        cos(1 / 5),
        cos(2 / 5),
        cos(3 / 5),
        cos(4 / 5),  # cycle 0: 5 cosine steps
        0.3,
        0.3 + 0.7 * 1 / 2,  # restart at step 7: from the floor, + (1 - m) / R a step
        cos(0 / 3),
        cos(1 / 3),
        cos(2 / 3),  # then cosine over the cycle's 5 - 2 = 3 steps left
    ]
    return [PEAK * m for m in multipliers]


def _deepspeed_json(tmp_path, name: str, deepspeed_optimizer: bool) -> Path:
    ds = json.loads((REPO / "accelerate_configs" / "deepspeed" / "cpu_zero3_2proc.json").read_text())
    if deepspeed_optimizer:
        # torch_adam: DeepSpeed's torch.optim.AdamW; its FusedAdam would be JIT-built for the CPU first.
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "torch_adam": True},
        }
    ds_json = tmp_path / f"{name}.json"
    ds_json.write_text(json.dumps(ds))
    return ds_json


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[bool, list[dict]]:
    """One launch, both runs in the same ranks (tests/distributed/workers/runs.py), each with its own DeepSpeed JSON:
    the Trainer's optimizer, then DeepSpeed's. {deepspeed_optimizer: the ranks' records}."""
    tmp_path = tmp_path_factory.mktemp("schedule")
    names = {False: "hf_opt", True: "ds_opt"}
    argv: list[str] = []
    for deepspeed_optimizer, name in names.items():
        ds_json = _deepspeed_json(tmp_path, name, deepspeed_optimizer)
        argv += [*([THEN] if argv else []), str(ds_json), str(tmp_path / name), str(STEPS)]
    yaml = write_cpu_deepspeed_yaml(tmp_path / "launch.yaml", tmp_path / f"{names[False]}.json")
    check_launch(accelerate_launch(yaml, [WORKER, *argv]))
    return {
        ds_opt: [json.loads((tmp_path / name / "schedule" / f"rank{r}.json").read_text()) for r in (0, 1)]
        for ds_opt, name in names.items()
    }


@pytest.mark.parametrize("deepspeed_optimizer", [False, True], ids=["trainer-optimizer", "deepspeed-optimizer"])
def test_engine_applies_the_recipe_schedule(runs, deepspeed_optimizer):
    ranks = runs[deepspeed_optimizer]
    expected = _expected()
    # Stock cosine_with_restarts (2 cycles, no floor, hard restart) at steps 6 and 7: near 0, then back at the peak.
    stock_6_7 = [PEAK * 0.5 * (1 + math.cos(math.pi * 4 / 5)), PEAK]
    for rank in ranks:
        print(f"\n{rank['basic_optimizer']} / {rank['engine_scheduler']}: {rank['param_group_lrs']}")
        assert rank["param_group_lrs"] == pytest.approx(expected, rel=1e-6, abs=1e-12)
        assert rank["engine_lrs"] == pytest.approx(expected, rel=1e-6, abs=1e-12)
        assert rank["param_group_lrs"][6:8] != pytest.approx(stock_6_7, rel=0.1)
        assert all(math.isfinite(x) for x in rank["losses"]) and len(rank["losses"]) == STEPS
    if deepspeed_optimizer:
        # Really DeepSpeed's optimizer (torch_adam), and the engine holds and steps the scheduler.
        assert ranks[0]["basic_optimizer"] == "AdamW" and ranks[0]["engine_scheduler"] == "LambdaLR"
