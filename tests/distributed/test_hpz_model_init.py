"""RecipeTrainer(model_init=...) under ZeRO++ hpZ on 2 real CPU ranks: `train()` builds the model a second time
(DeepSpeed 0.19.8 asserts on a second hpZ group unless RecipeTrainer forgets the first), trains, and its losses
equal the same run without hpZ (hpZ only changes where the backward gathers read from). Both runs share one launch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.distributed.workers.runs import THEN
from tests.support.launch import accelerate_launch, check_launch, write_cpu_deepspeed_yaml
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "hpz_worker.py")
STEPS = 4
# fp32 on CPU; hpZ gathers the same values from a different copy, so only summation order could differ.
LOSS_TOLERANCE = 1e-5


def _deepspeed_json(tmp_path, name: str, hpz: int) -> Path:
    ds = json.loads((REPO / "accelerate_configs" / "deepspeed" / "cpu_zero3_2proc.json").read_text())
    # tiny-llama's tensors (at most 256 x 64 elements) are below the default persistence threshold (1e5) and would
    # stay whole on every rank, bypassing both partitions: partition every tensor.
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if hpz > 1:
        ds["zero_optimization"]["zero_hpz_partition_size"] = hpz
    ds_json = tmp_path / f"{name}.json"
    ds_json.write_text(json.dumps(ds))
    return ds_json


def _ranks(out: Path) -> list[dict]:
    return [json.loads((out / "hpz" / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_model_init_trains_under_hpz_with_the_losses_of_plain_zero3(tmp_path):
    # One launch, two runs in the same ranks (tests/distributed/workers/runs.py), each with its own DeepSpeed JSON:
    # plain ZeRO-3, then hpZ (the process's first hpZ group is the hpZ run's first build).
    plain_json, hpz_json = _deepspeed_json(tmp_path, "plain", hpz=1), _deepspeed_json(tmp_path, "hpz", hpz=2)
    yaml = write_cpu_deepspeed_yaml(tmp_path / "plain.yaml", plain_json)
    plain_run = [str(plain_json), str(tmp_path / "plain"), str(STEPS)]
    hpz_run = [str(hpz_json), str(tmp_path / "hpz"), str(STEPS)]
    check_launch(accelerate_launch(yaml, [WORKER, *plain_run, THEN, *hpz_run]))
    plain, hpz = _ranks(tmp_path / "plain"), _ranks(tmp_path / "hpz")
    for rank in hpz:
        assert rank["model_init_calls"] == 2  # the constructor's build and train()'s
        assert rank["params_with_hpz_group"] == rank["params"]  # the second zero.Init made its own hpZ group
        assert rank["secondary_partitions"] > 0  # hpZ's node-local copy was in use
        assert len(rank["losses"]) == STEPS and all(math.isfinite(x) for x in rank["losses"])
    for rank in plain:
        assert rank["secondary_partitions"] == rank["params_with_hpz_group"] == 0  # really without hpZ
    print(f"\nhpZ losses {hpz[0]['losses']}\nplain losses {plain[0]['losses']}")
    assert hpz[0]["losses"] == pytest.approx(plain[0]["losses"], abs=LOSS_TOLERANCE)
    assert hpz[0]["losses"] != pytest.approx([hpz[0]["losses"][0]] * STEPS, abs=1e-3)  # it learns, not a constant
