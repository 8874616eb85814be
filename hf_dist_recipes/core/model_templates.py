"""Model templates by name: the shapes of public checkpoints (their config.json values) that `--model` accepts, the
demo's model (`demo-deepseek-v3`), and the tiny models the tests and the preflight train. Shared: the demo's ranks
build one, the planner (`planning.models`) reads any of them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers loads in seconds: only template_config imports it
    from transformers import PretrainedConfig

# What the two small DeepSeek-V3-style templates below share.
_DEEPSEEK_V3_COMMON = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    qk_nope_head_dim=16,
    use_cache=False,
    bos_token_id=None,
    eos_token_id=None,
)

# DeepSeek-V2 (236B) and Qwen3-30B-A3B; the other template of each family below changes their sizes only.
_DEEPSEEK_V2 = dict(
    vocab_size=102400,
    hidden_size=5120,
    intermediate_size=12288,
    moe_intermediate_size=1536,
    num_hidden_layers=60,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_routed_experts=160,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    n_group=8,
    topk_group=3,
    topk_method="group_limited_greedy",
    routed_scaling_factor=16.0,
)
_QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
)

# model_type and config values of public checkpoints (their config.json). Names are what --model accepts.
TEMPLATES: dict[str, tuple[str, dict]] = {
    "deepseek-v3": ("deepseek_v3", {}),  # DeepseekV3Config's defaults are DeepSeek-V3 (671B)
    "deepseek-v2": ("deepseek_v2", _DEEPSEEK_V2),
    "deepseek-v2-lite": (
        "deepseek_v2",
        dict(
            _DEEPSEEK_V2,
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            num_hidden_layers=27,
            num_attention_heads=16,
            num_key_value_heads=16,
            n_routed_experts=64,
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            topk_method="greedy",  # V2-Lite's config.json keeps DeepseekV2Config's defaults for these two
            routed_scaling_factor=1.0,
        ),
    ),
    "llama-3.1-8b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
        ),
    ),
    "llama-3.1-70b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
        ),
    ),
    "qwen2.5-7b": (
        "qwen2",
        dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
        ),
    ),
    "qwen3-30b-a3b": ("qwen3_moe", _QWEN3_30B_A3B),
    "qwen3-235b-a22b": (
        "qwen3_moe",
        dict(
            _QWEN3_30B_A3B,
            hidden_size=4096,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_hidden_layers=94,
            num_attention_heads=64,
        ),
    ),
    "mixtral-8x7b": ("mixtral", {}),  # MixtralConfig's defaults are Mixtral-8x7B
    # Small models that train on a CPU, for tests and demos. A tiny Llama (dense, plain multi-head attention):
    "tiny-llama": (
        "llama",
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
        ),
    ),
    # Small DeepSeek-V3-style models: the 191,568-parameter one of verified-on-cpu.md, and
    # the demo's (hf_dist_recipes.demo.model, 1,012,224).
    "tiny-deepseek-v3": (
        "deepseek_v3",
        dict(
            **_DEEPSEEK_V3_COMMON,
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            v_head_dim=16,
            max_position_embeddings=64,
        ),
    ),
    "demo-deepseek-v3": (
        "deepseek_v3",
        dict(
            **_DEEPSEEK_V3_COMMON,
            vocab_size=256,
            hidden_size=128,
            intermediate_size=256,
            moe_intermediate_size=64,
            num_hidden_layers=4,
            kv_lora_rank=32,
            q_lora_rank=64,
            qk_rope_head_dim=16,
            v_head_dim=32,
            max_position_embeddings=512,
        ),
    ),
}


def template_config(name: str, **overrides) -> PretrainedConfig:
    """The config of template `name`, with keyword arguments overriding its values (derived fields follow)."""
    if name not in TEMPLATES:
        raise ValueError(f"unknown template {name!r}; known: {', '.join(TEMPLATES)}")
    model_type, values = TEMPLATES[name]
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **{**values, **overrides})
