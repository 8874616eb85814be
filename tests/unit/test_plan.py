"""Every ParallelPlan rule: triggered, with the message that names the fix."""

from dataclasses import replace

import pytest

from hf_dist_recipes.planning.models import introspect
from hf_dist_recipes.planning.plan import ParallelPlan

V3 = introspect("deepseek-v3")
LLAMA = introspect("llama-3.1-8b")
TINY = introspect("tiny-deepseek-v3")
BASE = ParallelPlan(nodes=2, procs_per_node=8)


def test_derived_sizes_and_global_batch_from_data_parallel_ranks_only():
    plan = replace(BASE, tp=2, ep=8, micro_batch=2, grad_accum=4)
    assert (plan.world_size, plan.dp_size, plan.edp_size) == (16, 8, 2)
    assert plan.global_batch == 2 * 4 * 8  # not x 16: the TP pair shares its samples
    assert plan.validate(V3) == []


@pytest.mark.parametrize(
    "field, value", [("micro_batch", 0), ("tp", 0), ("nodes", -1), ("grad_accum", 1.5), ("seq_len", 0), ("ep", True)]
)
def test_sizes_must_be_positive_integers(field, value):
    with pytest.raises(ValueError, match=f"{field} must be an integer >= 1"):
        replace(BASE, **{field: value}).validate()


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(device="tpu"), "device must be one of"),
        (dict(precision="fp8"), "precision must be one of"),
        (dict(device="cpu", precision="fp16"), "fp16 on CPU runs only where the CPUs have oneDNN fp16 kernels"),
        (dict(zero_stage=4), "ZeRO stage must be 0, 1, 2 or 3"),
        (dict(zero_stage=0, offload_optimizer=True), "optimizer offload needs ZeRO stage 1"),
        (dict(zero_stage=2, offload_params=True), "parameter offload needs ZeRO stage 3"),
        (dict(tp=3), "not divisible by TP 3; pick a TP that divides 16"),
        (dict(ep=3), r"EP 3 must divide the world size 16 .* pick EP from \[1, 2, 4, 8, 16\]"),
        (dict(engine="megatron"), "engine must be one of"),
    ],
)
def test_plan_rules(changes, message):
    with pytest.raises(ValueError, match=message):
        replace(BASE, **changes).validate()


def test_tp_must_divide_heads():
    with pytest.raises(ValueError, match=r"TP 16 does not divide .*'s 4 attention heads; pick TP from \[1, 2, 4\]"):
        ParallelPlan(nodes=1, procs_per_node=16, tp=16).validate(TINY)


def test_tp_beyond_kv_heads_warns_of_idle_ranks():
    warnings = ParallelPlan(procs_per_node=16, tp=16).validate(LLAMA)
    assert any("exceeds llama-3.1-8b's 8 KV heads" in w for w in warnings)


def test_tp_across_nodes_warns():
    warnings = replace(BASE, tp=16).validate()
    assert any("spans nodes" in w for w in warnings)


def test_experts_must_divide_by_ep():
    plan = ParallelPlan(nodes=1, procs_per_node=6, ep=3)
    with pytest.raises(
        ValueError, match=r"EP 3 does not divide tiny-deepseek-v3's 8 routed experts; pick EP from \[1, 2\]"
    ):
        plan.validate(TINY)


def test_ep_needs_experts():
    with pytest.raises(ValueError, match="has no routed experts; use --ep 1"):
        replace(BASE, ep=2).validate(LLAMA)


def test_ep_need_not_divide_the_data_parallel_size():
    # DeepSpeed's real rule (module_inject/auto_ep_folding.py): EP x expert-TP must tile the world, not the DP size.
    plan = ParallelPlan(nodes=1, procs_per_node=8, tp=4, ep=8)
    assert plan.dp_size == 2 and plan.validate(V3) == []


def test_tp_without_ep_on_moe_is_refused():
    with pytest.raises(ValueError, match=r"keeps every routed expert .* whole on each TP rank.*--ep 2"):
        replace(BASE, tp=2).validate(V3)


def test_deepspeed_version_floor_for_zero3_autotp():
    with pytest.raises(ValueError, match=r"needs DeepSpeed >= 0.19.4 .* this is 0.18.0"):
        replace(BASE, tp=2).validate(LLAMA, deepspeed_version="0.18.0")
    assert replace(BASE, tp=2).validate(LLAMA, deepspeed_version="0.19.4") == []
    assert replace(BASE, tp=2, zero_stage=2).validate(LLAMA, deepspeed_version="0.18.0") == []


def test_tp_ep_offload_refused_like_deepspeed_does():
    with pytest.raises(ValueError, match="refuses ZeRO offload together with AutoEP \\+ AutoTP"):
        replace(BASE, tp=2, ep=2, offload_optimizer=True).validate(V3)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(device="cpu", precision="fp32"), "refuses ParallelismConfig .* on CPU"),
        (dict(ep=2), "has no expert parallelism"),
        (dict(offload_optimizer=True), "use --offload-params"),
    ],
)
def test_fsdp2_route_rules(changes, message):
    with pytest.raises(ValueError, match=message):
        replace(BASE, engine="fsdp2", **changes).validate()
