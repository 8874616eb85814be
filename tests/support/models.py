"""The tiny model of the one-process trainer tests and of the workers: the demo's DeepSeek-V3 model
(`hf_dist_recipes.demo.model.build_tiny_deepseek`, template `demo-deepseek-v3`) shrunk by these overrides so that a
few steps on one CPU core take seconds. Importing this module imports nothing else (workers use it too)."""

from __future__ import annotations

# From the template's hidden 128, MLP 256, experts 64 wide, 4 layers, MLA ranks q 64 / kv 32 and heads 16/16/32 down to
# the values below; its 8 routed experts + 1 shared, top-2 routing, first layer dense and byte vocabulary stay.
SMALL: dict[str, int] = dict(
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
)
