"""The preflight run's arguments against the launch's DeepSpeed JSON: its numbers where it fixes them, else the micro
batch its recorded plan was sized for (a generated JSON writes "auto" and records the plan), else the preflight's
own. One process, no launch."""

from __future__ import annotations

import pytest

from hf_dist_recipes.parallel.plan_record import PLAN_KEY, micro_batch_problem
from hf_dist_recipes.preflight.training.run import MICRO_BATCH, argument_values


def _values(ds, tmp_path):
    return argument_values(ds, tmp_path, steps=8, seed=None, logging_dir=None)


def _generated(micro_batch, model="deepseek-v3"):
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        PLAN_KEY: {"generated_for": {"micro_batch": micro_batch, "grad_accum": 5, "model": model}},
    }


@pytest.mark.parametrize("planned", [1, 3])
def test_an_auto_micro_batch_trains_at_the_plans_and_raises_no_batch_warning(tmp_path, planned):
    ds = _generated(planned)
    values = _values(ds, tmp_path)
    assert values["per_device_train_batch_size"] == planned
    assert "gradient_accumulation_steps" not in values  # more accumulation than planned costs time, not memory
    record = ds[PLAN_KEY]["generated_for"]
    assert micro_batch_problem(record, values["per_device_train_batch_size"], 1) is None
    # the control: the preflight's own micro batch would have exceeded the plan and drawn the recipe's warning
    assert MICRO_BATCH > planned and micro_batch_problem(record, MICRO_BATCH, 1) is not None


def test_a_number_in_the_json_wins_and_a_config_without_a_plan_keeps_the_preflights(tmp_path):
    assert _values({**_generated(1), "train_micro_batch_size_per_gpu": 2}, tmp_path)["per_device_train_batch_size"] == 2
    assert _values({"train_micro_batch_size_per_gpu": "auto"}, tmp_path)["per_device_train_batch_size"] == MICRO_BATCH
    assert _values({}, tmp_path)["per_device_train_batch_size"] == MICRO_BATCH
