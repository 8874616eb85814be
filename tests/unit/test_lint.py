"""Each trap of verified-on-cpu.md, and upstream's own refusals, found in files before a launch."""

import json

import pytest

from hf_dist_recipes.planning.initialize_rules import initialize_refusals
from hf_dist_recipes.planning.lint import ERROR, WARNING, lint_deepspeed, lint_file
from hf_dist_recipes.planning.plan import ParallelPlan

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


# The initialize-time refusals that one CPU process cannot reach (the others: tests/distributed/
# test_initialize_refusals.py, beside DeepSpeed's own failure). Each line was read in DeepSpeed 0.19.8's source.
EP8 = {"enabled": True, "autoep_size": 8, "preset_model": "deepseek_v3"}


@pytest.mark.parametrize(
    "config, world, where",
    [
        # expert TP: a JSON alone (with a world size DeepSpeed's own validate_autoep_config says it)
        ({**Z3, "expert_parallel": {**EP8, "expert_tensor_parallel_size": 2}}, None, "auto_ep_folding.py:215"),
        # hpZ groups are consecutive blocks of zero_hpz_partition_size ranks: 8 does not divide 12
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, 12, "groups.py:71"),
        ({**Z3, "tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}, "preset_model": "llama"}}, 2, "1021"),
        (
            {
                **Z3,
                "tensor_parallel": {"autotp_size": 2, "vocab_parallel_ce_backend": "liger", "preset_model": "llama"},
            },
            2,
            "engine.py:1076",
        ),
    ],
)
def test_initialize_refusals_beyond_one_process(config, world, where):
    assert where in _messages(lint_deepspeed(config, "ds.json", world_size=world), ERROR)


def test_initialize_rules_leave_the_fixed_configs_alone():
    fixed = [
        ({**Z3, "expert_parallel": EP8}, 16),
        ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}}, 16),
        ({**Z3, "tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 2}, "preset_model": "llama"}}, 2),
        (
            {
                **Z3,
                "tensor_parallel": {
                    "autotp_size": 2,
                    "vocab_parallel_ce_backend": "liger",
                    "vocab_parallel_lm_head": True,
                    "preset_model": "llama",
                },
            },
            2,
        ),
    ]
    # 16-bit master weights with optimizer offload (DeepSpeed then needs DeepSpeedCPUAdam, which accelerate maps the
    # Trainer's AdamW to; the CPU test does not build that op)
    master = {"enabled": True, "bf16_master_weights_and_grads": True}
    fixed.append(({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "bf16": master}, 2))
    for config, world in fixed:
        assert _messages(lint_deepspeed(config, "ds.json", world_size=world), ERROR) == ""


def test_auto_values_turn_initialize_refusals_into_warnings():
    # The Trainer fills "auto": bf16 from --bf16, gradient_clipping from max_grad_norm (1.0 by default).
    zero0 = {"zero_optimization": {"stage": 0}, "bf16": {"enabled": "auto"}, "data_types": {"grad_accum_dtype": "fp32"}}
    findings = lint_deepspeed(zero0, "ds.json")
    assert "engine.py:2323" in _messages(findings, WARNING) and _messages(findings, ERROR) == ""
    no_norm = {"zero_optimization": {"stage": 2, "compute_grad_norm": False}, "gradient_clipping": "auto"}
    findings = lint_deepspeed(no_norm, "ds.json")
    assert "max_grad_norm" in _messages(findings, WARNING) and _messages(findings, ERROR) == ""
    # nvme under ZeRO-2 runs, but on CPU memory: a warning, not an error
    nvme2 = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}
    assert "CPU memory, not on NVMe" in _messages(lint_deepspeed(nvme2, "ds.json"), WARNING)


@pytest.mark.parametrize("cpu_fp16, level", [(False, ERROR), (True, WARNING)])
def test_fp16_on_a_cpu_launch(tmp_path, monkeypatch, cpu_fp16, level):
    # Fake: the CPU's fp16 kernels, which the rule asks of the host running the lint (a CPU with AVX512-FP16 gets a
    # warning, one without an error; tests/distributed/test_initialize_refusals.py checks the real answer against
    # DeepSpeed's). What is tested here: the YAML's use_cpu reaches the rule, and a GPU launch never meets it.
    monkeypatch.setattr("hf_dist_recipes.planning.initialize_rules.cpu_fp16_supported", lambda: cpu_fp16)
    ds = {**Z3, "fp16": {"enabled": True}}
    path = _yaml(
        tmp_path,
        "distributed_type: DEEPSPEED\nnum_processes: 2\nuse_cpu: true\n"
        "deepspeed_config:\n  deepspeed_config_file: DS\n",
        ds,
    )
    findings = lint_file(path)
    assert "engine.py:2004" in _messages(findings, level)
    assert "engine.py:2004" not in _messages(findings, WARNING if level == ERROR else ERROR)
    gpu = _yaml(
        tmp_path, "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n  deepspeed_config_file: DS\n", ds
    )
    assert "engine.py:2004" not in _messages(lint_file(gpu), ERROR) + _messages(lint_file(gpu), WARNING)


def test_a_stage_left_to_auto_applies_no_stage_rule():
    auto = {
        "zero_optimization": {"stage": "auto"},
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
    }
    assert "engine.py:2323" not in _messages(lint_deepspeed(auto, "ds.json"), ERROR)
    absent = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}  # DeepSpeed's default: ZeRO-0
    assert "engine.py:2323" in _messages(lint_deepspeed(absent, "ds.json"), ERROR)


@pytest.mark.parametrize("cpu_fp16, level", [(False, ERROR), (True, WARNING)])
def test_fp16_on_cpu_follows_the_cpus_fp16_kernels(cpu_fp16, level):
    """DeepSpeed's CPU accelerator takes fp16 only on CPUs with fp16 kernels: the rule says which, for a given CPU."""
    refusals = initialize_refusals({"fp16": {"enabled": True}}, use_cpu=True, cpu_fp16=cpu_fp16)
    assert [(r.level, r.where) for r in refusals] == [(level, "runtime/engine.py:2004")]
    assert initialize_refusals({"fp16": {"enabled": True}}, use_cpu=False, cpu_fp16=False) == []


def test_a_launch_beyond_its_recorded_plan_is_reported(tmp_path):
    """Issue 40: validate passed a YAML checked without --gpu-memory, a process count the plan record contradicts,
    and parallelism the plan does not model. The shipped DeepSeek-V2-Lite config records 1 machine x 8 GPUs."""
    from tests.support.paths import REPO

    name = "deepseek_v2_lite_zero3_ep2_1node_8gpu"
    shipped = (REPO / "accelerate_configs" / f"{name}.yaml").read_text()
    as_shipped = tmp_path / "as_shipped.yaml"
    as_shipped.write_text(shipped.replace("accelerate_configs/deepspeed/", f"{REPO}/accelerate_configs/deepspeed/"))
    assert "memory not checked: deepseek-v2-lite was planned for GPUs; pass --gpu-memory" in _messages(
        lint_file(as_shipped), WARNING
    )
    assert lint_file(as_shipped, gpu_memory_gib=80) == []
    two_nodes = tmp_path / "two_nodes.yaml"
    two_nodes.write_text(as_shipped.read_text().replace("machines: 1", "machines: 2").replace(": 8\n", ": 16\n"))
    errors = _messages(lint_file(two_nodes, gpu_memory_gib=80), ERROR)
    assert "generated for 1 machine(s) x 8 processes; this launch has 2 machine(s) and 16 processes" in errors
    assert "--nodes 2 --gpus-per-node 8" in errors
    cp = tmp_path / "cp.yaml"
    cp.write_text(as_shipped.read_text() + "parallelism_config:\n  parallelism_config_cp_size: 2\n")
    assert "parallelism_config_cp_size=2: parallelism the plan does not model" in _messages(
        lint_file(cp, gpu_memory_gib=80), WARNING
    )
    # Ulysses SP is modelled now, and refused beside the file's AutoEP 2 (DeepSpeed 0.19.8, engine.py:836).
    sp = tmp_path / "sp.yaml"
    sp.write_text(as_shipped.read_text() + "parallelism_config:\n  parallelism_config_sp_size: 2\n")
    errors = _messages(lint_file(sp, gpu_memory_gib=80), ERROR)
    assert "expert_parallel.autoep_size 2 beside SP 2" in errors and "engine.py:836" in errors


def _sp_launch(tmp_path, yaml_edit=None, json_edit=None):
    """A generated 4-process CPU launch with SP 2 x data-parallel 2, edited, and its lint findings."""
    import yaml

    from hf_dist_recipes.planning.generate import write_configs

    plan = ParallelPlan(nodes=1, procs_per_node=4, device="cpu", precision="fp32", sp=2)
    result = write_configs(plan, tmp_path, name="sp")
    data = yaml.safe_load(result.yaml_file.read_text())
    if yaml_edit:
        data["parallelism_config"].update(yaml_edit)
    result.yaml_file.write_text(yaml.safe_dump(data))
    ds = json.loads(result.deepspeed_file.read_text())
    if json_edit:
        json_edit(ds)
    result.deepspeed_file.write_text(json.dumps(ds))
    return lint_file(result.yaml_file)


def test_a_generated_sp_launch_is_clean(tmp_path):
    assert _sp_launch(tmp_path) == []


@pytest.mark.parametrize(
    "yaml_edit, message",
    [
        # 4 processes, SP 3: no whole SP groups (DeepSpeed lays them over consecutive ranks).
        ({"parallelism_config_sp_size": 3}, "parallelism_config_sp_size 3 does not divide num_processes 4"),
        # world / sp = 2 data-parallel ranks: a shard size of 4 makes accelerate's train_batch_size twice DeepSpeed's.
        ({"parallelism_config_dp_shard_size": 4}, "set parallelism_config_dp_shard_size: 2"),
        ({"parallelism_config_cp_size": 2}, "parallelism_config_cp_size 2 beside sp_size 2"),
        ({"parallelism_config_sp_backend": "torch"}, "set parallelism_config_sp_backend: deepspeed"),
        ({"parallelism_config_sp_attn_implementation": "eager"}, "accelerate refuses eager and flex_attention"),
        (
            {"parallelism_config_sp_attn_implementation": "flex_attention"},
            "set parallelism_config_sp_attn_implementation",
        ),
    ],
)
def test_sp_block_rules(tmp_path, yaml_edit, message):
    assert message in _messages(_sp_launch(tmp_path, yaml_edit=yaml_edit), ERROR)


def test_sp_beside_autotp_autoep_or_split_reduction_is_an_error(tmp_path):
    def autotp(ds):
        ds["tensor_parallel"] = {"autotp_size": 2}

    def autoep(ds):
        ds["expert_parallel"] = {"enabled": True, "autoep_size": 2, "preset_model": "deepseek_v3"}

    def no_reduce_scatter(ds):
        ds["zero_optimization"]["reduce_scatter"] = False

    assert "AutoTP replaces the SP groups (engine.py:957)" in _messages(_sp_launch(tmp_path, json_edit=autotp), ERROR)
    assert "engine.py:836" in _messages(_sp_launch(tmp_path, json_edit=autoep), ERROR)
    assert "set reduce_scatter: true" in _messages(_sp_launch(tmp_path, json_edit=no_reduce_scatter), ERROR)
