"""Each trap of verified-on-cpu.md, and upstream's own refusals, found in files before a launch."""

import json

import pytest

from hf_dist_recipes.parallel.lint import ERROR, WARNING, lint_deepspeed, lint_file

Z3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}


def _messages(findings, level):
    return " | ".join(f.message for f in findings if f.level == level)


def test_clean_config_has_no_findings():
    assert lint_deepspeed(dict(Z3), "ds.json") == []


def test_a_deepspeed_scheduler_section_that_would_replace_the_recipe_schedule():
    # transformers' deepspeed_optim_sched builds DeepSpeed's scheduler when the JSON has one, ignoring
    # lr_scheduler_type; without the section the Trainer's (the recipe's) schedule is used.
    sched = {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}
    assert "replaces the recipe's" in _messages(lint_deepspeed({**Z3, "scheduler": sched}, "x"), WARNING)
    assert _messages(lint_deepspeed(dict(Z3), "x"), WARNING) == ""


def test_trap1_train_batch_size_under_tp():
    found = lint_deepspeed(
        {**Z3, "train_batch_size": "auto", "tensor_parallel": {"autotp_size": 2, "preset_model": "llama"}}, "x"
    )
    assert "remove train_batch_size" in _messages(found, ERROR)


def test_trap2_autotp_without_partition_config():
    found = lint_deepspeed({**Z3, "tensor_parallel": {"autotp_size": 2}}, "x")
    assert "DeepSeek MLA/MoE" in _messages(found, WARNING)


def test_deepseek_preset_without_ep_keeps_experts_whole():
    found = lint_deepspeed({**Z3, "tensor_parallel": {"autotp_size": 2, "preset_model": "deepseek_v2"}}, "x")
    assert "fused expert weights whole" in _messages(found, WARNING)


def test_trap3_presets_must_agree():
    cfg = {
        **Z3,
        "tensor_parallel": {"autotp_size": 2, "preset_model": "deepseek_v2"},
        "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "deepseek_v3"},
    }
    assert "must match" in _messages(lint_deepspeed(cfg, "x"), ERROR)


def test_tp_ep_offload():
    cfg = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "tensor_parallel": {"autotp_size": 2, "partition_config": {"use_default_specs": True}},
        "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "deepseek_v3"},
    }
    assert "offload" in _messages(lint_deepspeed(cfg, "x"), ERROR)


def test_consolidated_save_under_zero3_and_autoep():
    """DeepSpeed 0.19.8 raises NotImplementedError at the first save for this combination (verified-on-cpu.md)."""
    ep = {"enabled": True, "autoep_size": 2, "preset_model": "deepseek_v3"}
    gather = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}
    found = lint_deepspeed({"zero_optimization": gather, "expert_parallel": ep}, "x")
    assert "refuses the consolidated save" in _messages(found, ERROR)
    off = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}
    assert lint_deepspeed({"zero_optimization": off, "expert_parallel": ep}, "x") == []
    assert lint_deepspeed({"zero_optimization": gather}, "x") == []  # without EP DeepSpeed consolidates fine


def test_deepspeeds_own_config_class_refuses_bad_values():
    found = lint_deepspeed({"zero_optimization": {"stage": 7}}, "x")
    assert "DeepSpeed refuses the config" in _messages(found, ERROR)


def test_deepspeeds_own_autoep_rule_with_a_world_size():
    cfg = {**Z3, "expert_parallel": {"enabled": True, "autoep_size": 3, "preset_model": "deepseek_v3"}}
    assert lint_deepspeed(cfg, "x") == []  # without a world size the rule cannot apply
    assert "must divide the stage size" in _messages(lint_deepspeed(cfg, "x", world_size=4), ERROR)


def _yaml(tmp_path, body: str, ds: dict | None = None):
    if ds is not None:
        (tmp_path / "ds.json").write_text(json.dumps(ds))
    path = tmp_path / "acc.yaml"
    path.write_text(body.replace("DS", str(tmp_path / "ds.json")))
    return path


def test_mixed_precision_beside_a_deepspeed_file(tmp_path):
    path = _yaml(
        tmp_path,
        "distributed_type: DEEPSPEED\nnum_processes: 2\nmixed_precision: bf16\n"
        "deepspeed_config:\n  deepspeed_config_file: DS\n",
        Z3,
    )
    assert "mixed_precision set next to deepspeed_config_file" in _messages(lint_file(path), ERROR)


def test_yaml_lints_its_json_against_its_process_count(tmp_path):
    ds = {**Z3, "expert_parallel": {"enabled": True, "autoep_size": 4, "preset_model": "deepseek_v3"}}
    path = _yaml(
        tmp_path, "distributed_type: DEEPSPEED\nnum_processes: 6\ndeepspeed_config:\n  deepspeed_config_file: DS\n", ds
    )
    assert "AutoEP refuses it for 6 processes" in _messages(lint_file(path), ERROR)


def test_unknown_accelerate_keys(tmp_path):
    path = _yaml(tmp_path, "distributed_type: MULTI_GPU\nnum_processes: 2\nnum_procesess: 4\n")
    assert "accelerate refuses the config" in _messages(lint_file(path), ERROR)


def test_fsdp2_sizes_and_cpu(tmp_path):
    path = _yaml(
        tmp_path,
        "distributed_type: FSDP\nnum_processes: 8\nuse_cpu: true\nfsdp_config:\n  fsdp_version: 2\n"
        "parallelism_config:\n  parallelism_config_tp_size: 2\n  parallelism_config_dp_shard_size: 2\n",
    )
    errors = _messages(lint_file(path), ERROR)
    assert "multiply to 4" in errors and "GPUs only" in errors


def test_unreadable_inputs_raise(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        lint_file(tmp_path / "none.json")
    (tmp_path / "x.txt").write_text("")
    with pytest.raises(ValueError, match="expected a DeepSpeed .json or an accelerate .yaml"):
        lint_file(tmp_path / "x.txt")
