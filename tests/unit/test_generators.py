import json
from dataclasses import replace

import pytest
import yaml

from hf_dist_recipes.planning.accelerate_config import accelerate_config, render_yaml
from hf_dist_recipes.planning.deepspeed_config import deepspeed_config
from hf_dist_recipes.planning.lint import ERROR, lint_file
from hf_dist_recipes.planning.models import introspect
from hf_dist_recipes.planning.plan import ParallelPlan

V3 = introspect("deepseek-v3")
LLAMA = introspect("llama-3.1-8b")
PLANS = [
    (ParallelPlan(), None),
    (ParallelPlan(nodes=2, tp=2), LLAMA),  # with the vocabulary-parallel LM head
    (ParallelPlan(nodes=2), LLAMA),  # with ZeRO++ hpZ
    (ParallelPlan(tp=2, ep=8), V3),
    (ParallelPlan(nodes=4, ep=32, offload_optimizer=True), V3),
    (ParallelPlan(procs_per_node=4, device="cpu", precision="fp32", tp=2, ep=2), introspect("tiny-deepseek-v3")),
]


@pytest.mark.parametrize("plan, model", PLANS)
def test_never_writes_the_batch_trap(plan, model):
    for auto in (False, True):
        assert "train_batch_size" not in deepspeed_config(plan, model, auto=auto)


def test_deepseek_tp_ep_sections():
    cfg = deepspeed_config(ParallelPlan(tp=2, ep=8), V3)
    tp = cfg["tensor_parallel"]
    assert tp["autotp_size"] == 2 and "preset_model" not in tp  # no TP preset: it cannot disagree with EP's
    specs = {s["patterns"][0]: s for s in tp["partition_config"]["layer_specs"]}
    assert specs[r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"]["gather_output"] is True
    assert specs[r".*\.self_attn\.o_proj\.weight$"]["partition_type"] == "row"
    assert cfg["expert_parallel"] == {"enabled": True, "autoep_size": 8, "preset_model": "deepseek_v3"}
    assert cfg["bf16"] == {"enabled": True} and cfg["gradient_clipping"] == "auto"


# What transformers' HfTrainerDeepSpeedConfig.trainer_config_process fills from TrainingArguments and, given an
# explicit value that differs, refuses: the generated JSON leaves each to the arguments.
TRAINER_FILLED = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")


def test_the_trainers_values_are_auto_and_the_plans_are_recorded(tmp_path):
    from hf_dist_recipes.parallel.plan_record import recorded_plan
    from hf_dist_recipes.planning.generate import write_configs
    from hf_dist_recipes.planning.launch_config import load_launch_config
    from hf_dist_recipes.planning.launch_plan import plan_of_launch

    plan = ParallelPlan(procs_per_node=2, device="cpu", precision="fp32", micro_batch=2, grad_accum=8)
    for auto in (False, True):
        generated = write_configs(plan, tmp_path / str(auto), model_ref="tiny-llama", auto=auto)
        cfg = json.loads(generated.deepspeed_file.read_text())
        assert {k: cfg[k] for k in TRAINER_FILLED} == dict.fromkeys(TRAINER_FILLED, "auto")
        # No optimizer or scheduler section: learning rate, betas, epsilon, weight decay are the arguments'.
        assert "optimizer" not in cfg and "scheduler" not in cfg and "train_batch_size" not in cfg
        record = recorded_plan(cfg)
        assert (record["micro_batch"], record["grad_accum"]) == (2, 8)  # what the memory fit assumed
        assert cfg["bf16"] == {"enabled": "auto" if auto else False}  # --auto: the precision too
        header = generated.yaml_file.read_text()
        assert "Sized for micro batch 2 x accumulation 8 = global batch 32" in header
        assert [f.message for f in lint_file(generated.yaml_file) if f.level == ERROR] == []
        # config validate's estimate reads the recorded micro batch and accumulation where the JSON says "auto"
        read, model = plan_of_launch(load_launch_config(generated.yaml_file), 2)
        assert (read.micro_batch, read.grad_accum, model) == (2, 8, "tiny-llama")


def test_offload_sections():
    zero = deepspeed_config(ParallelPlan(offload_optimizer=True, offload_params=True))["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"


def test_tp_needs_a_model():
    with pytest.raises(ValueError, match="--model"):
        deepspeed_config(ParallelPlan(tp=2))


def test_yaml_single_and_multi_node():
    single = accelerate_config(ParallelPlan(), deepspeed_file="ds.json")
    assert "main_process_ip" not in single and single["num_processes"] == 8 and single["use_cpu"] is False
    assert "mixed_precision" not in single  # accelerate refuses it beside a deepspeed_config_file
    multi = accelerate_config(
        ParallelPlan(nodes=2), deepspeed_file="ds.json", main_process_ip="10.1.2.3", main_process_port=29555
    )
    assert (multi["num_machines"], multi["num_processes"], multi["main_process_ip"], multi["main_process_port"]) == (
        2,
        16,
        "10.1.2.3",
        29555,
    )
    assert multi["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"


def test_fsdp2_route_yaml():
    cfg = accelerate_config(replace(ParallelPlan(nodes=2), engine="fsdp2", tp=4))
    assert cfg["distributed_type"] == "FSDP" and cfg["fsdp_config"]["fsdp_version"] == 2
    pc = cfg["parallelism_config"]
    assert (pc["parallelism_config_tp_size"], pc["parallelism_config_dp_shard_size"]) == (4, 4)
    assert cfg["mixed_precision"] == "bf16"


@pytest.mark.parametrize("plan, model", PLANS + [(replace(ParallelPlan(nodes=2), engine="fsdp2", tp=4), None)])
def test_generated_files_pass_lint_accelerate_and_deepspeed(tmp_path, plan, model):
    ds_file = None
    if plan.engine == "deepspeed":
        ds_file = tmp_path / "ds.json"
        ds_file.write_text(json.dumps(deepspeed_config(plan, model)))
    y = tmp_path / "acc.yaml"
    y.write_text(render_yaml(accelerate_config(plan, deepspeed_file=str(ds_file) if ds_file else None), "header"))
    assert yaml.safe_load(y.read_text())["num_processes"] == plan.world_size
    assert [f for f in lint_file(y) if f.level == ERROR] == []
