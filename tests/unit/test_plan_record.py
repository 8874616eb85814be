"""The plan recorded in a generated DeepSpeed JSON reaches the arguments: activation checkpointing is switched on
when the plan's memory estimate assumed it."""

import json

import torch
from deepspeed.runtime.config import DeepSpeedConfig

from hf_dist_recipes import RecipeTrainingArguments, _compat
from hf_dist_recipes.parallel.deepspeed_config import deepspeed_config
from hf_dist_recipes.parallel.plan import ParallelPlan
from hf_dist_recipes.parallel.plan_record import PLAN_KEY, activation_checkpointing_warning, recorded_plan


def _launch_with(tmp_path, monkeypatch, plan: ParallelPlan):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(deepspeed_config(plan, auto=True)))
    monkeypatch.setenv(_compat.ACCELERATE_USE_DEEPSPEED, "true")
    monkeypatch.setenv(_compat.ACCELERATE_DEEPSPEED_CONFIG_FILE, str(ds))
    return ds


def test_the_record_holds_what_the_estimate_assumed_and_deepspeed_accepts_it():
    plan = ParallelPlan(procs_per_node=2, device="cpu", precision="fp32", seq_len=512, activation_checkpointing=True)
    config = deepspeed_config(plan)
    record = recorded_plan(config)
    assert record["seq_len"] == 512 and record["activation_checkpointing"] is True and record["procs_per_node"] == 2
    DeepSpeedConfig(config)  # an unknown top-level key is ignored by DeepSpeed 0.19.8 (it would raise otherwise)
    assert recorded_plan({"zero_optimization": {"stage": 3}}) == {}  # a file written by anything else
    assert recorded_plan({PLAN_KEY: "garbage"}) == {}


def test_a_plan_with_activation_checkpointing_turns_it_on(tmp_path, monkeypatch):
    _launch_with(
        tmp_path,
        monkeypatch,
        ParallelPlan(procs_per_node=2, device="cpu", precision="fp32", activation_checkpointing=True),
    )
    args = RecipeTrainingArguments(output_dir=str(tmp_path / "out"))
    assert args.activation_checkpointing is True and args.gradient_checkpointing is True
    explicit = RecipeTrainingArguments(output_dir=str(tmp_path / "out"), activation_checkpointing=False)
    assert explicit.activation_checkpointing is False  # the user's choice stands (and is warned about at train)


def test_a_plan_without_it_leaves_it_off(tmp_path, monkeypatch):
    _launch_with(tmp_path, monkeypatch, ParallelPlan(procs_per_node=2, device="cpu", precision="fp32"))
    assert RecipeTrainingArguments(output_dir=str(tmp_path / "out")).activation_checkpointing is False


def test_warning_when_the_model_does_not_recompute():
    from transformers import AutoModelForCausalLM

    from hf_dist_recipes.parallel.models import template_config

    model = AutoModelForCausalLM.from_config(template_config("tiny-llama"))
    record = {"activation_checkpointing": True, "seq_len": 4096, "micro_batch": 1}
    assert "stores every activation" in activation_checkpointing_warning(record, model)
    model.activation_checkpointing_enable()
    assert activation_checkpointing_warning(record, model) is None
    assert activation_checkpointing_warning({"activation_checkpointing": False}, torch.nn.Linear(2, 2)) is None
