import math
from dataclasses import replace

import pytest

from hf_dist_recipes.parallel.memory import (
    GIB, activation_bytes, estimate, rank_elements, render_table,
)
from hf_dist_recipes.parallel.models import introspect, template_config
from hf_dist_recipes.parallel.plan import ParallelPlan

TINY = introspect("tiny-deepseek-v3")
V3 = introspect("deepseek-v3")


def test_zero3_without_tp_reconciles_with_deepspeeds_own_estimate():
    """DeepSpeed's estimate_zero3_model_states_mem_needs (no offload): 4 B x largest layer + 18 B x params / GPUs.
    Ours: 2 B x largest layer gathered + 16 B per partitioned element (2 param + 2 grad + 12 Adam). The gap must be
    exactly DeepSpeed's extra 2 B x largest layer + 2 B per parameter, up to our ceil padding."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(template_config("demo-deepseek-v3"))
    total, largest = model_to_params(model)
    shape = introspect(template_config("demo-deepseek-v3"))
    assert (shape.total_params, shape.largest_layer_params) == (total, largest)
    for gpus in (2, 8):
        _, ds_gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=gpus, cpu_offload=False,
                                                             cpu_offload_params=False)
        ours = estimate(ParallelPlan(procs_per_node=gpus), shape)
        states = ours.params + ours.grads + ours.optimizer + ours.gathered
        padding = 16 * len(shape.parameters)
        assert 0 <= (ds_gpu - states) - (2 * largest + 2 * total // gpus) <= padding


def test_zero3_partitions_every_tensor_with_ceil():
    plan = ParallelPlan(procs_per_node=3, device="cpu", precision="fp32")
    el = rank_elements(plan, TINY)
    assert el.params == sum(math.ceil(math.prod(s) / 3) for _, s in TINY.parameters)
    assert el.sharded == TINY.total_params


def test_lower_zero_stages_keep_whole_copies():
    plan = ParallelPlan(procs_per_node=4, zero_stage=1)
    el = rank_elements(plan, TINY)
    assert el.params == el.grads == TINY.total_params and el.optimizer < TINY.total_params / 3
    assert rank_elements(replace(plan, zero_stage=2), TINY).grads == el.optimizer


def test_bytes_per_element_and_offload_placement():
    plan = ParallelPlan(procs_per_node=8)
    base = estimate(plan, V3, device_gib=80)
    assert base.optimizer == 6 * base.params  # 12 B vs 2 B per element
    off = estimate(replace(plan, offload_optimizer=True), V3, device_gib=80)
    assert off.device_total == base.device_total - base.optimizer - base.grads
    assert off.host_total_per_node == (base.optimizer + base.grads) * 8
    both = estimate(replace(plan, offload_optimizer=True, offload_params=True), V3)
    assert both.device_total == base.gathered + base.activations and both.fits is None
    fp32 = estimate(replace(plan, precision="fp32"), V3)
    assert fp32.params == 2 * base.params and fp32.optimizer == base.optimizer * 8 // 12


def test_activation_formula_and_checkpointing():
    plan = ParallelPlan(seq_len=4096, micro_batch=1, tp=2)
    s, b, h, L, V = 4096, 1, 7168, 61, 129280
    assert activation_bytes(plan, V3) == int(L * s * b * h * (10 + 24 / 2) + s * b * V * 6)
    ckpt = activation_bytes(replace(plan, activation_checkpointing=True), V3)
    assert ckpt == int(L * 2 * s * b * h + s * b * h * (10 + 24 / 2) + s * b * V * 6)


def test_ep_divides_the_experts_and_tp_the_split_weights():
    z3 = rank_elements(ParallelPlan(procs_per_node=8), V3)
    ep8 = rank_elements(ParallelPlan(procs_per_node=8, ep=8), V3)
    assert ep8.gathered_layer == z3.gathered_layer // 8  # one layer's experts gathered: 32 of 256
    tp8 = rank_elements(ParallelPlan(procs_per_node=8, tp=8, ep=8), V3)
    assert tp8.sharded < ep8.sharded
