"""The plan recorded in a generated DeepSpeed JSON reaches the arguments: activation checkpointing is switched on
when the plan's memory estimate assumed it."""

import json

import pytest
import torch
from deepspeed.runtime.config import DeepSpeedConfig

from hf_dist_recipes import RecipeTrainingArguments
from hf_dist_recipes._compat import accelerate as compat_accelerate
from hf_dist_recipes.parallel.plan_record import (
    PLAN_KEY,
    PlanConformanceCallback,
    activation_checkpointing_problem,
    can_recompute,
    micro_batch_problem,
    recorded_plan,
    recorded_sp,
)
from hf_dist_recipes.planning.deepspeed_config import deepspeed_config
from hf_dist_recipes.planning.plan import ParallelPlan

# What the Trainer writes over the generated JSON's "auto" (HfTrainerDeepSpeedConfig.trainer_config_process).
TRAINER_FILLS = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}


def _launch_with(tmp_path, monkeypatch, plan: ParallelPlan):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(deepspeed_config(plan, auto=True)))
    monkeypatch.setenv(compat_accelerate.ACCELERATE_USE_DEEPSPEED, "true")
    monkeypatch.setenv(compat_accelerate.ACCELERATE_DEEPSPEED_CONFIG_FILE, str(ds))
    return ds


def test_the_record_holds_what_the_estimate_assumed_and_deepspeed_accepts_it():
    plan = ParallelPlan(procs_per_node=2, device="cpu", precision="fp32", seq_len=512, activation_checkpointing=True)
    config = deepspeed_config(plan)
    record = recorded_plan(config)
    assert record["seq_len"] == 512 and record["activation_checkpointing"] is True and record["procs_per_node"] == 2
    # An unknown top-level key is ignored by DeepSpeed 0.19.8 (it would raise otherwise); the Trainer's fills first.
    DeepSpeedConfig({**config, **TRAINER_FILLS})
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
    assert explicit.activation_checkpointing is False  # the user's choice stands (RecipeTrainer stops on it)
    assert args.activation_checkpointing_from_plan is True and explicit.activation_checkpointing_from_plan is False


def test_a_plan_without_it_leaves_it_off(tmp_path, monkeypatch):
    _launch_with(tmp_path, monkeypatch, ParallelPlan(procs_per_node=2, device="cpu", precision="fp32"))
    assert RecipeTrainingArguments(output_dir=str(tmp_path / "out")).activation_checkpointing is False


def _tiny_llama():
    from transformers import AutoModelForCausalLM

    from hf_dist_recipes.core.model_templates import template_config

    return AutoModelForCausalLM.from_config(template_config("tiny-llama"))


def _without_recompute_support():
    """tiny-llama under a class that, like many remote-code models, declares no activation-checkpointing support."""
    from transformers import LlamaForCausalLM

    from hf_dist_recipes.core.model_templates import template_config

    class NoRecomputeLlama(LlamaForCausalLM):
        supports_gradient_checkpointing = False

    return NoRecomputeLlama(template_config("tiny-llama"))


PLANNED = {"activation_checkpointing": True, "seq_len": 4096, "micro_batch": 1}


def test_each_way_a_model_does_not_recompute_names_its_fix():
    model = _tiny_llama()
    refused = activation_checkpointing_problem(PLANNED, model, activation_checkpointing=False)
    assert "activation_checkpointing=False" in refused and "leave activation_checkpointing unset" in refused
    assert "allow_no_recompute=True" in refused
    assert activation_checkpointing_problem(PLANNED, model, activation_checkpointing=True) is None  # it will
    assert "not on in LlamaForCausalLM" in activation_checkpointing_problem(PLANNED, model)  # judged as it is
    model.activation_checkpointing_enable()
    assert activation_checkpointing_problem(PLANNED, model) is None
    cannot = activation_checkpointing_problem(PLANNED, _without_recompute_support(), activation_checkpointing=True)
    assert "NoRecomputeLlama cannot recompute" in cannot and "supports_gradient_checkpointing" in cannot
    assert can_recompute(model) and not can_recompute(_without_recompute_support())
    assert not can_recompute(torch.nn.Linear(2, 2))  # no enable method the Trainer could call
    assert activation_checkpointing_problem({"activation_checkpointing": False}, torch.nn.Linear(2, 2)) is None


def test_the_message_quotes_the_estimates_config_generate_recorded():
    """A rank imports no estimator: `config generate` records the plan's estimate with and without recomputation,
    which the message quotes; a record without them (an older file, a plan made without --model) gives none."""
    from hf_dist_recipes.core.sizes import GIB
    from hf_dist_recipes.planning.memory import estimate
    from hf_dist_recipes.planning.models import introspect

    model = _tiny_llama()
    shape = introspect(model.config)
    plan = ParallelPlan(procs_per_node=2, seq_len=512, activation_checkpointing=True)
    record = recorded_plan(deepspeed_config(plan, shape))
    message = activation_checkpointing_problem(record, model, activation_checkpointing=False)
    without = estimate(ParallelPlan(procs_per_node=2, seq_len=512), shape).device_total / GIB
    assert f"about {without:,.0f} GiB per GPU instead of {estimate(plan, shape).device_total / GIB:,.0f}" in message
    older = recorded_plan(deepspeed_config(plan))
    assert "device_gib" not in older and "recomputation anyway" in (
        quiet := activation_checkpointing_problem(older, model, activation_checkpointing=False)
    )
    assert "GiB" not in quiet


def test_the_callback_stops_unless_allowed_and_then_trains_without_recomputation():
    from types import SimpleNamespace

    model = _without_recompute_support()
    from_plan = SimpleNamespace(activation_checkpointing=True, gradient_checkpointing=True)
    from_plan.activation_checkpointing_from_plan = True
    with pytest.raises(ValueError, match="cannot recompute"):
        PlanConformanceCallback(PLANNED).check_before_training(model, from_plan)
    allowed = PlanConformanceCallback(PLANNED, allow=True)
    allowed.check_before_training(model, from_plan)
    assert len(allowed.warnings) == 1 and "cannot recompute" in allowed.warnings[0]
    # The plan's True is turned off, so transformers does not stop in activation_checkpointing_enable...
    assert from_plan.activation_checkpointing is False and from_plan.gradient_checkpointing is False
    allowed.on_train_begin(from_plan, None, None, model=model)
    assert len(allowed.warnings) == 1  # ...and the start of training does not say it twice
    users = SimpleNamespace(activation_checkpointing=True, gradient_checkpointing=True)
    users.activation_checkpointing_from_plan = False
    PlanConformanceCallback(PLANNED, allow=True).check_before_training(model, users)
    assert users.activation_checkpointing is True  # the user's own request is never changed
    with pytest.raises(ValueError, match="not on in LlamaForCausalLM"):  # a model that was never switched on
        PlanConformanceCallback(PLANNED).on_train_begin(users, None, None, model=_tiny_llama())


def test_the_record_carries_the_startup_timeout_the_weights_load_needs():
    from hf_dist_recipes.planning.models import introspect

    v3 = introspect("deepseek-v3")
    plan = ParallelPlan(nodes=8, procs_per_node=8, ep=16, offload_optimizer=True, activation_checkpointing=True)
    record = recorded_plan(deepspeed_config(plan, v3))
    # Rank 0 reads every bf16 weight (2 bytes x 671.03B) at 500 MB/s, after the 1,800 s of the rest of start-up.
    assert record["startup_timeout_s"] == -(-(1800 * 500e6 + 2 * v3.total_params) // 500e6)
    assert 4400 < record["startup_timeout_s"] < 4600  # about 45 minutes of reading: the recipe's 7,200 s hold


def test_a_recorded_startup_timeout_raises_a_default_ddp_timeout_only(tmp_path, monkeypatch, caplog):
    ds = _launch_with(tmp_path, monkeypatch, ParallelPlan(procs_per_node=2, device="cpu", precision="fp32"))
    config = json.loads(ds.read_text())
    config[PLAN_KEY]["generated_for"]["startup_timeout_s"] = 9000  # a checkpoint read slower than 7,200 s allow
    ds.write_text(json.dumps(config))
    assert RecipeTrainingArguments(output_dir=str(tmp_path / "out")).ddp_timeout == 9000
    with caplog.at_level("WARNING"):
        chosen = RecipeTrainingArguments(output_dir=str(tmp_path / "out"), ddp_timeout=3600)
    assert chosen.ddp_timeout == 3600 and "less than the 9000 s" in caplog.text  # the script's choice, warned
    config[PLAN_KEY]["generated_for"]["startup_timeout_s"] = 1900  # below the default: nothing lowered
    ds.write_text(json.dumps(config))
    assert RecipeTrainingArguments(output_dir=str(tmp_path / "out")).ddp_timeout == 7200


def _batch_args(micro: int, accum: int = 1, rank: int = 0):
    from types import SimpleNamespace

    return SimpleNamespace(
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum,
        process_index=rank,
        activation_checkpointing=False,
    )


def test_a_micro_batch_above_the_plans_warns_on_rank_0_once_naming_both_and_the_fix(caplog):
    plan = ParallelPlan(procs_per_node=2, micro_batch=2, grad_accum=4)
    record = recorded_plan(deepspeed_config(plan, model_ref="tiny-llama"))
    assert micro_batch_problem(recorded_plan(deepspeed_config(plan)), 8, 1) is None  # sized for no model
    assert micro_batch_problem(record, 2, 4) is None and micro_batch_problem(record, 1, 16) is None
    assert micro_batch_problem(record, 2, 64) is None  # more accumulation: a longer step, the same memory
    assert micro_batch_problem({}, 8, 1) is None  # a file config generate did not write
    message = micro_batch_problem(record, 6, 3)
    assert "per_device_train_batch_size 6 exceeds the micro batch 2 the launch config's plan assumed" in message
    assert "config generate --micro-batch 6 --grad-accum 3" in message and "\n" not in message
    model = _tiny_llama()
    with caplog.at_level("WARNING"):
        callback = PlanConformanceCallback(record)
        callback.check_before_training(model, _batch_args(6, 3))
        callback.check_before_training(model, _batch_args(6, 3))
    assert caplog.text.count("exceeds the micro batch 2") == 1  # once
    assert callback.warnings == []  # not the recomputation warnings (allow_no_recompute's)
    other_rank = PlanConformanceCallback(record)
    other_rank.check_before_training(model, _batch_args(6, 3, rank=1))
    assert other_rank.batch_warning is None  # rank 0 alone says it
    within = PlanConformanceCallback(record)
    within.check_before_training(model, _batch_args(1, 32))
    assert within.batch_warning is None


def test_the_sp_degree_is_recorded_above_one_and_deepspeed_reduces_in_the_plans_dtype():
    plan = ParallelPlan(nodes=1, procs_per_node=4, device="cpu", precision="fp32", sp=2)
    config = deepspeed_config(plan)
    record = recorded_plan(config)
    assert record["sp"] == 2 and recorded_sp(record) == 2
    # With an SP group DeepSpeed reduces in seq_parallel_communication_data_type (fp32 when absent, engine.py:2182).
    bf16 = deepspeed_config(ParallelPlan(sp=2, grad_reduce_dtype="bf16"))
    assert bf16["seq_parallel_communication_data_type"] == "bf16" == bf16["communication_data_type"]
    assert config["zero_optimization"]["reduce_scatter"] is True  # transformers refuses false next to SP + ZeRO-3
    DeepSpeedConfig({**config, **TRAINER_FILLS})  # DeepSpeed's own class takes the file
    # Without SP nothing changes: no key, and a record without one reads 1 (older configs too).
    plain = deepspeed_config(ParallelPlan(nodes=1, procs_per_node=4, device="cpu", precision="fp32"))
    assert "sp" not in recorded_plan(plain) and recorded_sp(recorded_plan(plain)) == 1
    assert "seq_parallel_communication_data_type" not in plain and "reduce_scatter" not in plain["zero_optimization"]
    assert recorded_sp({"sp": "2"}) == recorded_sp({"sp": True}) == recorded_sp({}) == 1


def test_a_job_running_another_sp_degree_than_its_plan_is_stopped_or_named():
    record = recorded_plan(deepspeed_config(ParallelPlan(procs_per_node=8, seq_len=32768, sp=4)))
    conformance = PlanConformanceCallback(record)
    conformance.check_sequence_parallel(4)  # as planned: nothing
    assert conformance.warnings == []
    # The JSON launched without the YAML's parallelism_config block: every rank would hold the whole sequence.
    stopped = r"for sequence parallelism 4 \(8192 tokens per rank\), but this job runs SP 1: launch with the accelerate"
    with pytest.raises(ValueError, match=stopped + r" YAML.*or regenerate the files with --sp 1"):
        conformance.check_sequence_parallel(1)
    conformance.check_sequence_parallel(8)  # more SP ranks than planned: fewer tokens each, a smaller global batch
    assert len(conformance.warnings) == 1 and "runs SP 8" in conformance.warnings[0]
    PlanConformanceCallback({}).check_sequence_parallel(2)  # a config of anything else records no plan


def test_tiled_mlps_are_recorded_and_reach_the_arguments(tmp_path, monkeypatch):
    plan = ParallelPlan(procs_per_node=2, device="cpu", precision="fp32", tiled_mlp_shards=4)
    assert recorded_plan(deepspeed_config(plan))["tiled_mlp_shards"] == 4
    assert "tiled_mlp_shards" not in recorded_plan(deepspeed_config(ParallelPlan()))  # absent when not planned
    _launch_with(tmp_path, monkeypatch, plan)
    assert RecipeTrainingArguments(output_dir=str(tmp_path / "out")).tiled_mlp_shards == 4
    assert RecipeTrainingArguments(output_dir=str(tmp_path / "out"), tiled_mlp_shards=0).tiled_mlp_shards == 0
