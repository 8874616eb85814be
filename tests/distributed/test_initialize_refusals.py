"""Every DeepSpeed 0.19.8 refusal that `config validate` lints from `initialize_rules` and that a CPU run of one or
two processes can reach: a real `deepspeed.initialize` (plain processes in a Gloo group, tiny models, all cases of a
world size in one run) fails at the DeepSpeed line written here by hand, and the lint reports an error naming the
same line, while the control configs initialize and lint clean.

Not run here (linted): hpZ not dividing the world (utils/groups.py:71, called at :945) needs 3 ranks, about 45 s on
two shared cores; seen failing there by hand with zero_hpz_partition_size 2 on 3 ranks.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from hf_dist_recipes.planning.lint import ERROR, lint_deepspeed
from tests.support.hosts import cpu_fp16_kernels
from tests.support.launch import free_port, launched_ranks_env, python_for
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "initialize_refusals_worker.py")
EP = {"enabled": True, "autoep_size": 1, "preset_model": "deepseek_v3"}
NVME = {"device": "nvme"}

# name: (model, config, DeepSpeed 0.19.8's raising line, read in its source)
REFUSED = {
    "hpz_with_autoep": (
        "tiny-deepseek-v3",
        {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}, "expert_parallel": EP},
        "runtime/engine.py:2226",
    ),
    "quantized_gradients_with_autoep": (
        "tiny-deepseek-v3",
        {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}, "expert_parallel": EP},
        "runtime/engine.py:2223",
    ),
    "nvme_optimizer_without_path": (
        "tiny-llama",
        {"zero_optimization": {"stage": 3, "offload_optimizer": NVME}},
        "runtime/zero/stage3.py:840",
    ),
    "nvme_params_without_path": (
        "tiny-llama",
        {"zero_optimization": {"stage": 3, "offload_param": NVME}},
        "runtime/zero/partition_parameters.py:1229",
    ),
    "zero0_bf16_with_fp32_accumulation": (
        "tiny-llama",
        {"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
        "runtime/engine.py:2323",
    ),
    "predivide_zero2": (
        "tiny-llama",
        {"zero_optimization": {"stage": 2}, "gradient_predivide_factor": 2.0},
        "runtime/zero/stage_1_and_2.py:350",
    ),
    "predivide_zero3": (
        "tiny-llama",
        {"zero_optimization": {"stage": 3}, "gradient_predivide_factor": 2.0},
        "runtime/zero/stage3.py:395",
    ),
    "prescale_zero2": (
        "tiny-llama",
        {"zero_optimization": {"stage": 2}, "prescale_gradients": True},
        "runtime/zero/stage_1_and_2.py:351",
    ),
    "prescale_zero3": (
        "tiny-llama",
        {"zero_optimization": {"stage": 3}, "prescale_gradients": True},
        "runtime/zero/stage3.py:396",
    ),
    "no_grad_norm_with_clipping": (
        "tiny-llama",
        {"zero_optimization": {"stage": 2, "compute_grad_norm": False}, "gradient_clipping": 1.0},
        "runtime/zero/stage_1_and_2.py:213",
    ),
    "no_grad_norm_with_offload": (
        "tiny-llama",
        {
            "zero_optimization": {"stage": 2, "compute_grad_norm": False, "offload_optimizer": {"device": "cpu"}},
            "gradient_clipping": 0.0,
        },
        "runtime/zero/stage_1_and_2.py:218",
    ),
    "no_grad_norm_zero1_bf16": (
        "tiny-llama",
        {
            "zero_optimization": {"stage": 1, "compute_grad_norm": False},
            "bf16": {"enabled": True},
            "data_types": {"grad_accum_dtype": "fp32"},
            "gradient_clipping": 0.0,
        },
        "runtime/engine.py:2308",
    ),
    "bf16_master_weights_without_offload_zero2": (
        "tiny-llama",
        {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
        "runtime/zero/stage_1_and_2.py:332",
    ),
    "bf16_master_weights_without_offload_zero3": (
        "tiny-llama",
        {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
        "runtime/zero/stage3.py:300",
    ),
    "odd_allgather_bucket": (
        "tiny-llama",
        {"zero_optimization": {"stage": 1, "allgather_bucket_size": 500_000_001}},
        "runtime/zero/stage_1_and_2.py:390",
    ),
    "unmanaged_accumulation_overlap_zero1": (
        "tiny-llama",
        {"zero_optimization": {"stage": 1, "overlap_comm": True}, "managed_gradient_accumulation": False},
        "runtime/engine.py:2031",
    ),
    "unknown_optimizer": (
        "tiny-llama",
        {"optimizer": {"type": "AdamX", "params": {"lr": 1e-3}}},
        "runtime/engine.py:2018",
    ),
    "lamb_with_static_loss_scale": (
        "tiny-llama",
        {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}, "fp16": {"enabled": False, "loss_scale": 128}},
        "runtime/engine.py:2022",
    ),
    "param_dtype_mismatch": ("tiny-llama", {"data_types": {"param_dtype": "bf16"}}, "runtime/engine.py:1827"),
}
# A host fact: DeepSpeed's CPU accelerator refuses fp16 only on CPUs without oneDNN fp16 kernels (AVX512-FP16, AMX-FP16
# or AVX-NE-CONVERT). Run in the same launch; what is expected is read from /proc/cpuinfo (tests.support.hosts),
# independently of the code under test.
FP16_ON_CPU = ("tiny-llama", {"fp16": {"enabled": True}}, "runtime/engine.py:2004")
# The same sections with the offending value fixed: they initialize, and the lint finds no error.
CONTROLS = {
    "zero3_autoep": ("tiny-deepseek-v3", {"zero_optimization": {"stage": 3}, "expert_parallel": EP}),
    "nvme_optimizer_with_path": (
        "tiny-llama",
        {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}},
    ),
    "zero1_bf16_with_fp32_accumulation": (
        "tiny-llama",
        {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
    ),
    "no_grad_norm_without_clipping": (
        "tiny-llama",
        {"zero_optimization": {"stage": 2, "compute_grad_norm": False}, "gradient_clipping": 0.0},
    ),
    # torch_adam: DeepSpeed's torch.optim.AdamW, as in test_schedule_deepspeed; its FusedAdam would be JIT-built for
    # the CPU first (about 80 s of CPU on a fresh machine, the only build of that op in the suite).
    "torch_optimizer_by_name": (
        "tiny-llama",
        {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}},
    ),
}


# Two ranks: AutoTP 2, and AutoEP with expert TP 2 (on one rank AutoEP's own size check refuses it first).
TWO_RANKS = {
    "tp_size_differs_from_autotp_size": (
        "tiny-llama",
        {"tensor_parallel": {"autotp_size": 2, "tp": {"tp_size": 4}}},
        "runtime/engine.py:1021",
    ),
    "liger_without_vocab_parallel_head": (
        "tiny-llama",
        {"tensor_parallel": {"autotp_size": 2, "vocab_parallel_ce_backend": "liger"}},
        "runtime/engine.py:1076",
    ),
    "expert_tensor_parallel": (
        "tiny-deepseek-v3",
        {"zero_optimization": {"stage": 3}, "expert_parallel": {**EP, "expert_tensor_parallel_size": 2}},
        "module_inject/auto_ep_folding.py:215",
    ),
}
TWO_RANK_CONTROLS = {"autotp_2": ("tiny-llama", {"tensor_parallel": {"autotp_size": 2}})}


def _initialize_all(out, refused: dict, controls: dict, world: int) -> dict:
    """Run the worker on `world` ranks over every case; rank 0's {name: {"ok", "type", "message", "where"}},
    after checking that every rank saw the same outcomes."""
    cases = [[n, model, cfg] for n, (model, cfg, _) in refused.items()]
    if world == 1:
        cases.append(["fp16_on_cpu", *FP16_ON_CPU[:2]])
    cases += [[n, model, cfg] for n, (model, cfg) in controls.items()]
    (out / "cases.json").write_text(json.dumps(cases))
    env = launched_ranks_env(dict(os.environ, MASTER_PORT=str(free_port())))  # ranks forked warm (python_for)
    procs = [
        subprocess.Popen(
            [*python_for(env), WORKER, str(out / "cases.json"), str(out / f"results{rank}.json")],
            env=dict(env, RANK=str(rank), WORLD_SIZE=str(world)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    for proc in procs:
        output = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, output[-3000:]
    results = [json.loads((out / f"results{rank}.json").read_text()) for rank in range(world)]
    assert all(r == results[0] for r in results), results
    return results[0]


@pytest.fixture(scope="module")
def deepspeed_outcomes(tmp_path_factory):
    return _initialize_all(tmp_path_factory.mktemp("one_rank"), REFUSED, CONTROLS, 1)


@pytest.fixture(scope="module")
def two_rank_outcomes(tmp_path_factory):
    return _initialize_all(tmp_path_factory.mktemp("two_ranks"), TWO_RANKS, TWO_RANK_CONTROLS, 2)


@pytest.mark.parametrize("name", sorted(TWO_RANKS))
def test_two_rank_refusals_in_initialize_and_validate_says_so(two_rank_outcomes, name):
    _, config, where = TWO_RANKS[name]
    outcome = two_rank_outcomes[name]
    assert not outcome["ok"] and outcome["where"] == where, outcome
    errors = [f for f in lint_deepspeed(config, name) if f.level == ERROR]
    assert any(where in f.message for f in errors), [f.message for f in errors]


def test_two_rank_control_initializes_and_lints_clean(two_rank_outcomes):
    _, config = TWO_RANK_CONTROLS["autotp_2"]
    assert two_rank_outcomes["autotp_2"] == {"ok": True}
    # a warning (no partition_config: AutoTP follows the model's own tp_plan, fine for Llama), no error
    assert [f.message for f in lint_deepspeed(config, "autotp_2") if f.level == ERROR] == []


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_deepspeed_refuses_it_in_initialize_and_validate_says_so(deepspeed_outcomes, name):
    _, config, where = REFUSED[name]
    outcome = deepspeed_outcomes[name]
    assert not outcome["ok"], f"{name}: DeepSpeed initialized it"
    assert outcome["where"] == where, outcome
    errors = [f for f in lint_deepspeed(config, name, use_cpu=True) if f.level == ERROR]
    assert any(where in f.message for f in errors), [f.message for f in errors]


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_the_fixed_config_initializes_and_lints_clean(deepspeed_outcomes, name):
    _, config = CONTROLS[name]
    assert deepspeed_outcomes[name] == {"ok": True}
    assert [f.message for f in lint_deepspeed(config, name, use_cpu=True) if f.level == ERROR] == []


def test_fp16_on_cpu_is_refused_exactly_on_hosts_without_fp16_kernels(deepspeed_outcomes):
    """Both kinds of machine prove something: a CPU with fp16 kernels initializes fp16 and the lint only warns; one
    without is refused at the line, and the lint says so as an error. Which kind this host is comes from its CPU
    flags (tests.support.hosts.cpu_fp16_kernels); where they cannot tell (a CPU without AVX-512 but with AVX-VNNI,
    or a capped oneDNN), DeepSpeed's real outcome decides, and the lint must still agree with it."""
    _, config, where = FP16_ON_CPU
    outcome = deepspeed_outcomes["fp16_on_cpu"]
    host_has_fp16, unknown = cpu_fp16_kernels()
    expected_from = f"DeepSpeed's outcome ({unknown})" if unknown else "this host's /proc/cpuinfo"
    if host_has_fp16 is None:
        host_has_fp16 = outcome["ok"]
    findings = lint_deepspeed(config, "fp16_on_cpu", use_cpu=True)
    errors = [f.message for f in findings if f.level == ERROR]
    if host_has_fp16:
        assert outcome == {"ok": True}, (expected_from, outcome)
        assert not any(where in m for m in errors), (expected_from, errors)
        assert any(where in f.message and "AVX512-FP16" in f.message for f in findings), findings
    else:
        assert not outcome["ok"] and outcome["where"] == where, (expected_from, outcome)
        assert any(where in m for m in errors), (expected_from, errors)
