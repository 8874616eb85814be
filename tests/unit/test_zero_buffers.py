import inspect
import math

import pytest
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from hf_dist_recipes.core.sizes import GIB
from hf_dist_recipes.planning.deepspeed_config import deepspeed_config
from hf_dist_recipes.planning.memory import estimate
from hf_dist_recipes.planning.models import introspect
from hf_dist_recipes.planning.plan import ParallelPlan
from hf_dist_recipes.planning.zero_buffers import (
    hpz_partition_size,
    recommended_env,
    use_vocab_parallel_lm_head,
    zero_buffer_notes,
    zero_buffers,
)

V3 = introspect("deepseek-v3")
LLAMA = introspect("llama-3.1-8b")
TINY = introspect("tiny-deepseek-v3")

# DeepSeek-V3 at EP 8: each rank gathers 256 / 8 = 32 experts of gate_up_proj (2 x 2048 x 7168) and down_proj
# (7168 x 2048) in one module; the largest tensor it gathers is the embedding (129280 x 7168, whole at TP 1).
V3_EP8_EXPERTS = 32 * (2 * 2048 * 7168 + 7168 * 2048)  # 1,409,286,144
V3_EMBEDDING = 129280 * 7168  # 926,679,040


def _parsed(config: dict):
    """DeepSpeed's own config class over the generated dict (outside a process group: world of 1), with the values
    the Trainer fills over its "auto" micro batch, accumulation and clipping."""
    from deepspeed.runtime.config import DeepSpeedConfig

    fills = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
    return DeepSpeedConfig({**config, **fills})


def test_deepseek_v3_ep8_prefetch_and_live_limits_by_hand():
    plan = ParallelPlan(ep=8)
    b = zero_buffers(plan, V3)
    assert (b.gathered_module, b.gathered_elements) == ("model.layers.3.mlp.experts", V3_EP8_EXPERTS)
    assert b.prefetch_bucket_size == V3_EP8_EXPERTS and b.max_live_parameters == 2 * V3_EP8_EXPERTS
    assert b.largest_tensor == V3_EMBEDDING
    zero = deepspeed_config(plan, V3)["zero_optimization"]
    by_hand = (V3_EP8_EXPERTS, 2 * V3_EP8_EXPERTS)  # 1,409,286,144 and 2,818,572,288
    assert (zero["stage3_prefetch_bucket_size"], zero["stage3_max_live_parameters"]) == by_hand
    # DeepSpeed's own defaults (runtime/zero/config.py in 0.19.8: reduce_bucket_size 5e8, sub_group_size 1e9), kept.
    ds = DeepSpeedZeroConfig()
    assert (zero["reduce_bucket_size"], zero["sub_group_size"]) == (ds.reduce_bucket_size, ds.sub_group_size)
    parsed = _parsed(deepspeed_config(plan, V3)).zero_config
    assert (parsed.prefetch_bucket_size, parsed.max_live_parameters) == by_hand
    # The estimate counts the same budget: 2 x experts + the embedding live at most, less the experts computing.
    e = estimate(plan, V3)
    assert e.buffers["prefetched_params"] == (V3_EP8_EXPERTS + V3_EMBEDDING) * 2


def test_tiny_model_keeps_deepspeeds_defaults():
    # tiny-deepseek-v3's largest module (8 experts: 8 x 64 x 64 + 8 x 64 x 32 = 49,152) is far below both defaults.
    b = zero_buffers(ParallelPlan(procs_per_node=2, device="cpu", precision="fp32"), TINY)
    assert b.gathered_elements == 49_152
    # DeepSpeed's own defaults (runtime/zero/config.py in 0.19.8: 5e7 and 1e9).
    ds = DeepSpeedZeroConfig()
    assert (b.prefetch_bucket_size, b.max_live_parameters) == (ds.prefetch_bucket_size, ds.max_live_parameters)


def test_no_sizes_below_zero3_or_without_a_model():
    assert not zero_buffers(ParallelPlan(zero_stage=2), V3).written
    zero = deepspeed_config(ParallelPlan())["zero_optimization"]
    assert "stage3_prefetch_bucket_size" not in zero and "zero_hpz_partition_size" not in zero


def test_hpz_for_multi_node_zero3_only_where_deepspeed_allows_it():
    multi = ParallelPlan(nodes=2)
    assert hpz_partition_size(multi, LLAMA) == 8
    assert deepspeed_config(multi, LLAMA)["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert _parsed(deepspeed_config(multi, LLAMA)).zero_config.zero_hpz_partition_size == 8
    assert "zero_hpz_partition_size" not in deepspeed_config(ParallelPlan(nodes=1), LLAMA)["zero_optimization"]
    # AutoEP + ZeRO-3 + hpZ: DeepSpeed 0.19.8 raises. If this refusal disappears upstream, revisit the rule.
    from deepspeed.runtime.engine import DeepSpeedEngine

    assert "does not support hpZeRO" in inspect.getsource(DeepSpeedEngine._validate_zero3_moe_compatibility)
    v3_multi = ParallelPlan(nodes=8, ep=16, offload_optimizer=True)
    assert "zero_hpz_partition_size" not in deepspeed_config(v3_multi, V3)["zero_optimization"]
    assert "no zero_hpz_partition_size: DeepSpeed 0.19.8 refuses it with AutoEP" in "\n".join(
        zero_buffer_notes(v3_multi, V3)
    )
    assert hpz_partition_size(ParallelPlan(nodes=2, tp=2), LLAMA) == 1  # AutoTP: groups would mix TP shards
    assert hpz_partition_size(ParallelPlan(nodes=2, offload_optimizer=True, offload_params=True), LLAMA) == 1
    # Llama-3.1-70B's copy: 70,553,706,496 / 8 x 2 B = 17.6 GB per GPU, over the 8 GiB cap.
    assert hpz_partition_size(ParallelPlan(nodes=2), introspect("llama-3.1-70b")) == 1


def test_hpz_copy_is_in_the_estimate():
    e = estimate(ParallelPlan(nodes=2), LLAMA)
    assert e.buffers["hpz_secondary"] == sum(math.ceil(math.prod(s) / 8) for _, s in LLAMA.parameters) * 2
    assert e.buffers["hpz_secondary"] < 8 * GIB
    assert estimate(ParallelPlan(nodes=1), LLAMA).buffers["hpz_secondary"] == 0


def test_vocab_parallel_head_when_it_saves_a_gib():
    # DeepSeek-V3, TP 2, 4096 tokens: gathered head 4096 x 129280 x 12 B, vocabulary-parallel 4096 x 64640 x 14 B.
    plan = ParallelPlan(tp=2, ep=8, seq_len=4096)
    saving = 4096 * 129280 * 12 - 4096 * 64640 * 14  # 2.65e9 B
    assert saving > GIB and use_vocab_parallel_lm_head(plan, V3)
    config = deepspeed_config(plan, V3)
    assert config["tensor_parallel"]["vocab_parallel_lm_head"] is True
    assert _parsed(config).tensor_parallel_config.vocab_parallel_lm_head is True
    assert estimate(plan, V3).activation_parts["logits"] == 4096 * 64640 * 14
    # Llama-3.1-8B, TP 2, 512 tokens: 512 x 128256 x 12 - 512 x 64128 x 14 = 0.33 GB saved, under 1 GiB.
    short = ParallelPlan(nodes=2, tp=2, seq_len=512)
    assert 512 * 128256 * 12 - 512 * 64128 * 14 < GIB and not use_vocab_parallel_lm_head(short, LLAMA)
    assert "vocab_parallel_lm_head" not in deepspeed_config(short, LLAMA)["tensor_parallel"]
    assert estimate(short, LLAMA).activation_parts["logits"] == 512 * 128256 * 12
    assert not use_vocab_parallel_lm_head(ParallelPlan(seq_len=65536), V3)  # TP 1: nothing to shard over


def test_notes_name_each_choice_and_fit_a_header():
    notes = zero_buffer_notes(ParallelPlan(ep=8), V3)
    text = "\n".join(notes)
    assert "stage3_prefetch_bucket_size 1.41e9 = model.layers.3.mlp.experts" in text
    assert "stage3_max_live_parameters 2.82e9" in text and "(default 1e9)" in text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text
    assert "hpz" not in text  # one node: nothing to say about hierarchical partitioning
    hpz_notes = "\n".join(zero_buffer_notes(ParallelPlan(nodes=2), LLAMA))
    assert "zero_hpz_partition_size 8: a node-local copy" in hpz_notes
    # RecipeTrainer rebuilds under hpZ (tests/distributed/test_hpz_model_init.py): nothing to warn about.
    assert "zero.Init" not in hpz_notes
    for plan, model in ((ParallelPlan(ep=8), V3), (ParallelPlan(nodes=2, tp=2), LLAMA), (ParallelPlan(nodes=2), LLAMA)):
        assert all(len(line) <= 116 for line in zero_buffer_notes(plan, model))


@pytest.mark.parametrize(
    "plan, env",
    [
        (ParallelPlan(), {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
        (ParallelPlan(device="cpu", precision="fp32"), {}),
        (ParallelPlan(zero_stage=2), {}),  # a dense model's shapes repeat every step: the allocator reuses its blocks
    ],
)
def test_allocator_recommendation(plan, env):
    assert recommended_env(plan, LLAMA) == env
