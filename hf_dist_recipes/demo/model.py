"""The demo's model: a small DeepSeek-V3-style causal LM (MLA attention + mixture of experts), built from a config.

Its shape is the `demo-deepseek-v3` template of `hf_dist_recipes.core.model_templates` (1,012,224 parameters over a
256-symbol byte vocabulary: hidden 128, 4 layers, MLA ranks q 64 / kv 32, 8 routed experts of 64 + 1 shared, first
layer dense). Nothing is downloaded: the weights are a random init from the seed active when the model is built.
"""

from __future__ import annotations

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from hf_dist_recipes.core.model_templates import template_config

DEMO_TEMPLATE = "demo-deepseek-v3"


def tiny_deepseek_config(**overrides) -> DeepseekV3Config:
    """The demo model's config; keyword arguments override template values (e.g. hidden_size=32 for tests)."""
    return template_config(DEMO_TEMPLATE, **overrides)


def build_tiny_deepseek(**overrides) -> DeepseekV3ForCausalLM:
    """Build the demo model with random weights (seed first: see `hf_dist_recipes.reproducibility.seeding`)."""
    return DeepseekV3ForCausalLM(tiny_deepseek_config(**overrides))
