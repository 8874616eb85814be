"""RecipeTrainer(model_init=...) under ZeRO++ hpZ on 2 real CPU ranks: `train()` builds the model a second time
(DeepSpeed 0.19.8 asserts on a second hpZ group unless RecipeTrainer forgets the first), trains, and its losses
equal the same run without hpZ (hpZ only changes where the backward gathers read from)."""

from __future__ import annotations

import json
import math

import pytest

from tests.support.launch import accelerate_launch, check_launch, write_cpu_deepspeed_yaml
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "hpz_worker.py")
STEPS = 4
# fp32 on CPU; hpZ gathers the same values from a different copy, so only summation order could differ.
LOSS_TOLERANCE = 1e-5


def _run(tmp_path, name: str, hpz: int) -> list[dict]:
    ds = json.loads((REPO / "accelerate_configs" / "deepspeed" / "cpu_zero3_2proc.json").read_text())
    # tiny-llama's tensors (at most 256 x 64 elements) are below the default persistence threshold (1e5) and would
    # stay whole on every rank, bypassing both partitions: partition every tensor.
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if hpz > 1:
        ds["zero_optimization"]["zero_hpz_partition_size"] = hpz
    ds_json = tmp_path / f"{name}.json"
    ds_json.write_text(json.dumps(ds))
    yaml = write_cpu_deepspeed_yaml(tmp_path / f"{name}.yaml", ds_json)
    out = tmp_path / name
    check_launch(accelerate_launch(yaml, [WORKER, str(out), str(STEPS)]))
    return [json.loads((out / "hpz" / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_model_init_trains_under_hpz_with_the_losses_of_plain_zero3(tmp_path):
    hpz = _run(tmp_path, "hpz", hpz=2)
    plain = _run(tmp_path, "plain", hpz=1)
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
