"""Every DeepSpeed 0.19.8 refusal that `config validate` lints from `initialize_rules` and that one CPU process can
reach: a real `deepspeed.initialize` (one plain process, a 1-rank Gloo group, tiny models; all cases in one
process, a few seconds) fails at the DeepSpeed line written here by hand, and the lint reports an error naming the
same line, while the control configs initialize and lint clean.

Not reachable on one process (linted, not run here): expert_tensor_parallel_size under ZeRO-3 + AutoEP
(engine.py:2231; on one rank AutoEP's folding check refuses it first), tensor_parallel.tp.tp_size and
vocab_parallel_ce_backend (engine.py:1021 / 1076; need AutoTP over 2 ranks), hpZ not dividing the world
(utils/groups.py:71, called at :945; needs 3 ranks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, cpu_only_env, free_port

from hf_dist_recipes.parallel.lint import ERROR, lint_deepspeed

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
    "fp16_on_cpu": ("tiny-llama", {"fp16": {"enabled": True}}, "runtime/engine.py:2004"),
}
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
    "torch_optimizer_by_name": ("tiny-llama", {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}),
}


@pytest.fixture(scope="module")
def deepspeed_outcomes(tmp_path_factory):
    """One process, every case: {name: {"ok", "type", "message", "where"}}."""
    out = tmp_path_factory.mktemp("initialize_refusals")
    cases = [[n, model, cfg] for n, (model, cfg, _) in REFUSED.items()]
    cases += [[n, model, cfg] for n, (model, cfg) in CONTROLS.items()]
    (out / "cases.json").write_text(json.dumps(cases))
    env = cpu_only_env(dict(os.environ, PYTHONPATH=str(REPO), MASTER_PORT=str(free_port()), HF_HUB_OFFLINE="1"))
    proc = subprocess.run(
        [sys.executable, WORKER, str(out / "cases.json"), str(out / "results.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


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
