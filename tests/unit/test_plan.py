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


LITE = introspect("deepseek-v2-lite")  # 16 heads, 16 KV heads, MLA (query/key 192 wide, value 128)
ONE_NODE = ParallelPlan(nodes=1, procs_per_node=8, seq_len=131072)


def test_sp_divides_the_data_parallel_ranks_and_the_tokens_each_rank_holds():
    plan = replace(ONE_NODE, sp=4, micro_batch=1, grad_accum=2)
    # 8 ranks in groups of 4 consecutive ranks: 2 groups, each seeing one batch; a rank holds a quarter of a sequence.
    assert (plan.world_size, plan.dp_size, plan.tokens_per_rank) == (8, 2, 32768)
    assert plan.global_batch == 1 * 2 * 2
    # ZeRO partitions over every rank (DeepSpeed's sequence-data-parallel group), not over the 2 data-parallel ones.
    assert plan.zero_dp_size == 8
    assert plan.as_dict()["tokens_per_rank"] == 32768 and plan.as_dict()["sp"] == 4
    assert ParallelPlan().tokens_per_rank == 4096  # without SP: the whole sequence


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(tp=2), "--sp 2 with --tp 2: DeepSpeed 0.19.8's AutoTP replaces the sequence-parallel groups"),
        (dict(ep=2), r'--sp 2 with --ep 2: DeepSpeed 0.19.8 refuses it \("AutoEP does not currently support tensor'),
        (dict(engine="fsdp2"), "--sp 2 with --engine fsdp2: accelerate's sequence parallelism runs on DeepSpeed only"),
        (dict(procs_per_node=6, sp=4), r"SP 4 does not divide the world size 6 .*pick --sp from \[2, 3, 6\]"),
        (dict(seq_len=4097), "--seq-len 4097 is not divisible by SP 2 .*use --seq-len 4098"),
        (dict(sp=0), "sp must be an integer >= 1"),
    ],
)
def test_sp_rules(changes, message):
    with pytest.raises(ValueError, match=message) as err:
        replace(ONE_NODE, **{"sp": 2, **changes}).validate()
    assert "\n" not in str(err.value) and "; " in str(err.value)  # one line, the fix after the reason


def test_sp_needs_the_deepspeed_accelerate_requires():
    with pytest.raises(ValueError, match=r"needs DeepSpeed >= 0.18.2 \(accelerate refuses it below"):
        replace(ONE_NODE, sp=2).validate(deepspeed_version="0.18.1")
    assert replace(ONE_NODE, sp=2).validate(deepspeed_version="0.18.2") == []
    with pytest.raises(
        ValueError, match=r"needs accelerate >= 1.12.0 .* this is 1.11.0; upgrade accelerate, or --sp 1"
    ):
        replace(ONE_NODE, sp=2).validate(accelerate_version="1.11.0")
    assert replace(ONE_NODE, sp=2).validate(accelerate_version="1.12.0") == []


def test_sp_must_split_the_heads_as_ulysses_does():
    # 16 heads: SP 32 cannot give each rank whole heads (ulysses_sp.py:147).
    with pytest.raises(
        ValueError, match=r"SP 32 does not divide deepseek-v2-lite's 16 attention heads.*\[1, 2, 4, 8, 16\]"
    ):
        ParallelPlan(nodes=4, procs_per_node=8, sp=32).validate(LITE)
    # Llama-3.1-8B: 8 KV heads. SP 16 replicates them (16 % 8 == 0); a KV count neither dividing nor divided is refused.
    assert ParallelPlan(nodes=2, procs_per_node=8, sp=16).validate(LLAMA)[0].startswith("SP 16 spans nodes")
    odd_kv = replace(LLAMA, num_heads=24, num_kv_heads=6)
    with pytest.raises(ValueError, match=r"SP 4 and .* 6 KV heads: Ulysses needs one to divide the other"):
        ParallelPlan(nodes=1, procs_per_node=8, sp=4).validate(odd_kv)


def test_sp_on_mla_warns_that_the_stock_trainer_stops():
    warnings = replace(ONE_NODE, sp=8).validate(LITE)
    assert len(warnings) == 1 and "query/key heads are 192 wide, its value heads 128" in warnings[0]
    assert "RecipeTrainer" in warnings[0]
    assert replace(ONE_NODE, sp=8).validate(LLAMA) == []  # one head size: nothing to pad


def test_sp_across_nodes_warns():
    warnings = ParallelPlan(nodes=2, procs_per_node=8, sp=16).validate()
    assert len(warnings) == 1 and "SP 16 spans nodes (8 processes per node)" in warnings[0]
    assert ParallelPlan(nodes=2, procs_per_node=8, sp=8).validate() == []
