"""The demo's model: a small DeepSeek-V3-style causal LM (MLA attention + mixture of experts), built from a config.

Nothing is downloaded: the weights are a random init from the seed that is active when the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM


@dataclass(frozen=True)
class TinyDeepSeekShape:
    """Shape of the demo model. Defaults give 1,012,224 parameters over a 256-symbol byte vocabulary."""

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 256  # the dense MLP of the first layer(s)
    moe_intermediate_size: int = 64  # each routed / shared expert
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    first_k_dense_replace: int = 1
    q_lora_rank: int = 64
    kv_lora_rank: int = 32
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 16
    v_head_dim: int = 32
    max_position_embeddings: int = 512


def tiny_deepseek_config(shape: TinyDeepSeekShape | None = None) -> DeepseekV3Config:
    """A `DeepseekV3Config` for `shape` (the defaults above when None)."""
    s = shape or TinyDeepSeekShape()
    return DeepseekV3Config(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        moe_intermediate_size=s.moe_intermediate_size,
        num_hidden_layers=s.num_hidden_layers,
        num_attention_heads=s.num_attention_heads,
        num_key_value_heads=s.num_attention_heads,
        n_shared_experts=s.n_shared_experts,
        n_routed_experts=s.n_routed_experts,
        num_experts_per_tok=s.num_experts_per_tok,
        # Group-limited routing needs n_routed_experts divisible by n_group; 2 groups, pick the best 1.
        n_group=2,
        topk_group=1,
        first_k_dense_replace=s.first_k_dense_replace,
        q_lora_rank=s.q_lora_rank,
        kv_lora_rank=s.kv_lora_rank,
        qk_rope_head_dim=s.qk_rope_head_dim,
        qk_nope_head_dim=s.qk_nope_head_dim,
        v_head_dim=s.v_head_dim,
        max_position_embeddings=s.max_position_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        use_cache=False,
    )


def build_tiny_deepseek(shape: TinyDeepSeekShape | None = None) -> DeepseekV3ForCausalLM:
    """Build the demo model with random weights (seed first: see `hf_dist_recipes.seeding`)."""
    return DeepseekV3ForCausalLM(tiny_deepseek_config(shape))
