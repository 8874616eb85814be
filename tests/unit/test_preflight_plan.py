"""Preflight check 4 (plan) and the local halves of checks 1-3 and 7, on hand-made configs and findings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_dist_recipes.planning.memory import estimate
from hf_dist_recipes.planning.models import introspect
from hf_dist_recipes.preflight import plan_checks
from hf_dist_recipes.preflight.comm_checks import interpret
from hf_dist_recipes.preflight.env_checks import deepspeed_dropped, merge_by_rank
from hf_dist_recipes.preflight.log_checks import logs_check
from hf_dist_recipes.preflight.result import ERROR, OK, WARNING
from tests.support.paths import REPO


def write_config(tmp_path: Path, *, processes: int, tp: int = 1, ep: int = 1, model: str | None = None) -> Path:
    """An accelerate YAML + DeepSpeed JSON pair like the generated ones, ZeRO-3 on CPU."""
    ds = {
        "zero_optimization": {"stage": 3},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
    }
    if tp > 1:
        ds["tensor_parallel"] = {"autotp_size": tp}
    if ep > 1:
        ds["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": "deepseek_v3"}
    if model:
        ds["hf_dist_recipes"] = {"generated_for": {"model": model}}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    yaml = tmp_path / "launch.yaml"
    yaml.write_text(
        f"compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n"
        f"  deepspeed_config_file: {tmp_path / 'ds.json'}\nmachine_rank: 0\nnum_machines: 1\n"
        f"num_processes: {processes}\nuse_cpu: true\n"
    )
    return yaml


def test_shipped_cpu_config_plans_the_demo_model():
    cfg, plan, recorded = plan_checks.launch_plan(REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml", root=REPO)
    assert (plan.world_size, plan.tp, plan.ep, plan.zero_stage, recorded) == (2, 1, 1, 3, None)
    models = plan_checks.resolve_models(plan, None, recorded)
    assert (models.name, models.source, models.train_name) == ("demo-deepseek-v3", "default", "demo-deepseek-v3")


def test_a_launch_config_read_once_is_handed_on(tmp_path):
    """The plan check and the lint take the LaunchConfig already read: the files are not read again (here they
    are gone once read; only accelerate's own loader, inside the lint, reads the YAML itself)."""
    from hf_dist_recipes.planning.launch_config import load_launch_config

    path = write_config(tmp_path, processes=4, tp=2, ep=2)
    cfg = load_launch_config(path)
    (tmp_path / "ds.json").unlink()
    same, plan, _ = plan_checks.launch_plan(cfg)
    assert same is cfg and (plan.world_size, plan.tp, plan.ep, plan.zero_stage) == (4, 2, 2, 3)
    with pytest.raises(ValueError, match="does not exist"):  # a path is read: the JSON is gone
        plan_checks.launch_plan(path)


@pytest.mark.parametrize("seed", [-1, 2**32, True, "42"])
def test_the_seed_follows_the_arguments_rule(seed, tmp_path):
    """A seed the ranks' RecipeTrainingArguments would refuse stops the plan, with the arguments' own message."""
    from hf_dist_recipes.preflight.launch import plan_preflight
    from hf_dist_recipes.reproducibility.seeding import validate_seed

    with pytest.raises(ValueError) as expected:
        validate_seed(seed, "--seed")
    with pytest.raises(ValueError) as refused:
        plan_preflight(write_config(tmp_path, processes=2), seed=seed, output_dir=tmp_path / "out")
    assert str(refused.value) == str(expected.value) and "e.g. --seed 42" in str(refused.value)


def test_tp_not_dividing_the_processes_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel degree 2"):
        plan_checks.launch_plan(write_config(tmp_path, processes=3, tp=2))


def test_ep_not_dividing_the_experts_is_refused(tmp_path):
    # tiny-deepseek-v3 has 8 routed experts; EP 3 on 6 processes divides the processes but not 8.
    _, plan, recorded = plan_checks.launch_plan(write_config(tmp_path, processes=6, ep=3, model="tiny-deepseek-v3"))
    models = plan_checks.resolve_models(plan, None, recorded)
    with pytest.raises(ValueError, match="EP 3 does not divide .*'s 8 routed experts"):
        plan_checks.validate_against_model(plan, models)
    [result] = plan_checks.check_plan(plan, models, device_bytes=2**40, device_what="test")
    assert result.status == ERROR and "EP 3 does not divide" in result.detail


def test_default_stand_in_is_sized_for_the_plan(tmp_path):
    # No model recorded, EP 3: the demo model's 8 experts round up to 9 (a multiple of 3), an odd count that its two
    # routing groups cannot split, so group-limited routing goes to one group; TP 1 keeps the 4 heads.
    _, plan, recorded = plan_checks.launch_plan(write_config(tmp_path, processes=6, ep=3))
    models = plan_checks.resolve_models(plan, None, recorded)
    cfg = models.config
    assert (cfg.n_routed_experts, cfg.n_group, cfg.num_attention_heads) == (9, 1, 4)
    assert plan_checks.validate_against_model(plan, models) == []


def test_large_named_model_trains_a_stand_in_of_its_family(tmp_path):
    _, plan, _ = plan_checks.launch_plan(write_config(tmp_path, processes=4, tp=2, ep=2))
    models = plan_checks.resolve_models(plan, "deepseek-v3", None)
    assert models.name == "deepseek-v3" and models.train_name == "demo-deepseek-v3"
    llama = plan_checks.resolve_models(plan, "llama-3.1-8b", None)
    assert llama.train_config.model_type == "llama" and introspect(llama.train_config).total_params < 10**6


def test_memory_verdict_against_the_device(tmp_path):
    _, plan, _ = plan_checks.launch_plan(write_config(tmp_path, processes=2))
    models = plan_checks.resolve_models(plan, "tiny-deepseek-v3", None)
    need = estimate(plan, introspect(models.config)).device_total  # the estimate itself, from planning.memory
    statuses = {}
    for label, device in (("short", need - 1), ("tight", int(need / 0.95)), ("ample", 2 * need)):
        [r] = plan_checks.check_plan(plan, models, device_bytes=device, device_what="test")
        statuses[label] = r.status
        assert r.data["estimate_bytes"] == need
    assert statuses == {"short": ERROR, "tight": WARNING, "ample": OK}
    assert "micro batch 1, fp32, no recomputation" in r.detail  # the verdict names what it assumed
    [unknown] = plan_checks.check_plan(plan, models, device_bytes=None, device_what="no CUDA device visible")
    assert unknown.status == WARNING and "could not be read" in unknown.detail


def test_dense_model_with_ep_is_a_plan_error(tmp_path):
    _, plan, _ = plan_checks.launch_plan(write_config(tmp_path, processes=2, ep=2))
    models = plan_checks.resolve_models(plan, "tiny-llama", None)
    [r] = plan_checks.check_plan(plan, models, device_bytes=2**40, device_what="test")
    assert r.status == ERROR and "no routed experts" in r.detail


def test_deepspeed_dropped_by_the_cpu_flag():
    assert deepspeed_dropped({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_CPU": "True"})
    assert deepspeed_dropped({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_USE_CPU": "False"}) is None
    assert deepspeed_dropped({"ACCELERATE_USE_CPU": "true"}) is None  # no DeepSpeed asked: nothing dropped


def test_a_finding_on_one_rank_names_it_and_its_host():
    finding = {"status": WARNING, "what": "doctor: /dev/shm", "detail": "64 MiB", "fix": "enlarge /dev/shm"}
    [one] = merge_by_rank("environment", [[], [finding]], ["a", "b"])
    assert one.ranks == (1,) and "rank 1 (b)" in one.detail
    [every] = merge_by_rank("environment", [[finding], [finding]], ["a", "b"])
    assert every.ranks == () and "every rank" in every.detail


def test_commbench_flags_become_warnings_naming_the_link():
    rows = [{"op": "all_reduce", "size_bytes": 4096, "time_us": 10.0, "algbw_GBps": 0.4, "busbw_GBps": 0.4}]
    links = [
        {"src": 0, "dst": 1, "src_host": "a", "dst_host": "b", "GBps": 0.1, "flagged": True},
        {"src": 1, "dst": 0, "src_host": "b", "dst_host": "a", "GBps": 1.0, "flagged": False},
    ]
    result = {
        "backend": "gloo",
        "device": "cpu",
        "world_size": 2,
        "fraction": 0.5,
        "results": rows,
        "links": links,
        "ranks": [],
        "flagged": {"links": [[0, 1]], "ranks": []},
    }
    [r] = interpret(result)
    assert r.status == WARNING and r.ranks == (0, 1) and "rank 0 (a) -> rank 1 (b)" in r.detail
    assert r.detail.startswith("link rank 0 (a) -> rank 1 (b): 0.100 GB/s, below 50% of the median link")
    links[0]["flagged"] = False
    assert [x.status for x in interpret(result)] == [OK]
    result["ranks"] = [{"rank": 1, "host": "b", "algbw_GBps": 0.05, "flagged": True}]
    [r] = interpret(result)
    assert r.status == WARNING and r.ranks == (1,)
    assert r.detail.startswith("rank 1 (b): all-reduce at 0.050 GB/s, below 50% of the median rank")


def test_logs_check_names_a_rank_without_a_run(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "rank0")) as w:
        for step in range(3):
            w.add_scalar("train/loss", 1.0 / (step + 1), step)
    results = logs_check(tmp_path, world_size=2)
    errors = [r for r in results if r.status == ERROR]
    assert errors and errors[0].ranks == (1,)
    with SummaryWriter(str(tmp_path / "rank1")) as w:
        for step in range(3):
            w.add_scalar("train/loss", 1.0 / (step + 1), step)
    assert [r.status for r in logs_check(tmp_path, world_size=2)] == [OK]


def test_rank_0_reports_the_training_rows_only_when_every_rank_decided_alike():
    from hf_dist_recipes.preflight.result import CheckResult
    from hf_dist_recipes.preflight.worker import ranks_decided_alike

    nan = float("nan")  # a NaN in the data must equal itself across ranks (compared as JSON text)
    mine = [CheckResult("training", OK, "loss: fine", data={"losses": [4.2, nan]})]
    other = [CheckResult("training", OK, "loss: fine", data={"losses": [4.2, 3.9]})]
    assert ranks_decided_alike(mine, "training", gather=lambda text: [text, text, text]) == []
    assert ranks_decided_alike(mine, "training", gather=lambda text: [text]) == []  # one process
    other_text = json.dumps([r.to_dict() for r in other], sort_keys=True, default=str)
    [row] = ranks_decided_alike(mine, "training", gather=lambda text: [text, other_text, text, other_text])
    assert row.status == ERROR and row.ranks == (1, 3) and row.detail.startswith("rank(s) 1, 3 decided")


def test_host_memory_verdict_of_a_gpu_plan():
    # A GPU plan's host figures (offloaded states; the optimizer files a stock resume loads) against the node's memory.
    from hf_dist_recipes.planning.plan import ParallelPlan

    plan = ParallelPlan(nodes=8, procs_per_node=8, ep=16, offload_optimizer=True, activation_checkpointing=True)
    models = plan_checks.resolve_models(plan, "deepseek-v3", None)
    shape = introspect(models.config)
    est = estimate(plan, shape)
    steady = est.host_steady_per_node
    stock = estimate(plan, shape, memory_mapped_resume=False).host_resume_peak_per_node
    assert stock > steady == est.host_resume_peak_per_node  # RecipeTrainer's mapped resume: the steady state
    assert est.stock_resume_peak_per_node == stock  # derived from the mapped estimate, as the stock one computes it
    verdicts = {}
    for label, host in (("short", steady - 1), ("stock", stock - 1), ("ample", stock)):
        r = plan_checks.host_result(plan, est, host, "test", models.name)
        verdicts[label] = (r.status, r.detail.rsplit(": ", 1)[-1])
    assert verdicts["short"] == (ERROR, "training does not fit")
    assert verdicts["stock"] == (WARNING, "a stock Trainer's resume does not fit")
    assert verdicts["ample"][0] == OK
    # Through check_plan, beside the device verdict; CPU plans and unread hosts have no host verdict.
    results = plan_checks.check_plan(
        plan, models, device_bytes=80 * 2**30, device_what="test", host_bytes=steady - 1, host_what="test"
    )
    assert [r.status for r in results if "host memory per node" in r.detail] == [ERROR]
    assert plan_checks.host_result(plan, est, None, "", models.name) is None
    cpu = ParallelPlan(device="cpu", nodes=1, procs_per_node=2)
    assert plan_checks.host_result(cpu, estimate(cpu, shape), 1, "t", models.name) is None
