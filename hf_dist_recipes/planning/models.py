"""Model shapes for planning: any transformers config introspected, named by template, config.json or cached Hub id.

Parameters are counted exactly by building the model on PyTorch's meta device (no memory, about a second for
DeepSeek-V3's 671B), so every count here is what `model.parameters()` would hold, per parameter name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and transformers load in seconds: only the functions that build configs import them, so
    from transformers import PretrainedConfig  # `hf-dist-recipes doctor/pin/--help` start fast

from hf_dist_recipes.core.jsonfile import read_json_object
from hf_dist_recipes.core.model_templates import TEMPLATES, template_config

COMPONENTS = ("embeddings", "attention", "dense_mlp", "routed_experts", "shared_experts", "router", "norms", "lm_head")
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")

# A Hub model id as the Hub spells them: an owner and a name, no path beyond.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cached_hub_config(repo_id: str, cache_dir: str | Path | None = None) -> Path | None:
    """The config.json of Hub model `repo_id` where the local Hugging Face cache holds it (`cache_dir`, default the
    cache `huggingface_hub` uses: HF_HUB_CACHE, else HF_HOME/hub); None when it does not. Never downloads: a plan is
    made offline, as `accelerate estimate-memory` users expect of a model they already fetched."""
    if not HUB_ID.match(repo_id):
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir)
    return Path(found) if isinstance(found, str) else None


def load_model_config(
    model: str | Path | PretrainedConfig, cache_dir: str | Path | None = None
) -> tuple[str, PretrainedConfig]:
    """(name, config) for a template name, a local directory or config.json path, a Hub id whose config.json is in
    the local Hugging Face cache (`cached_hub_config`), or a config object."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return model.model_type, model
    text = str(model)
    if text in TEMPLATES:
        return text, template_config(text)
    path = Path(text)
    if not path.exists() and HUB_ID.match(text):
        cached = cached_hub_config(text, cache_dir)
        if cached is None:
            raise ValueError(
                f"{text}: no config.json of this Hub model in the local Hugging Face cache (nothing is downloaded "
                f"here); fetch it once with `hf download {text} config.json`, or give a config.json path or a "
                f"family template ({', '.join(TEMPLATES)})"
            )
        values = read_json_object(cached, "model config", "give a config.json path")
        return text, AutoConfig.for_model(**values)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model directory {path} holds no config.json; give a directory or path of a "
                "transformers config.json, or a family template"
            )
        path = path / "config.json"
    elif path.suffix == ".json" or os.sep in text:  # meant as a file, not a template name
        if not path.is_file():
            raise ValueError(
                f"model config {path} does not exist; give an existing config.json, or a family "
                "template such as deepseek-v3"
            )
    if path.is_file():
        values = read_json_object(path, "model config", "give a config.json path")
        if "model_type" not in values:
            raise ValueError(f"{path} has no model_type; is it a transformers config.json?")
        return path.parent.name or str(path), AutoConfig.for_model(**values)
    raise ValueError(
        f"unknown model {text!r}: give a family template ({', '.join(TEMPLATES)}), a directory "
        "holding config.json, or a config.json path"
    )


def component_of(name: str) -> str:
    """Which component a parameter belongs to, from its name (transformers 5 naming)."""
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".self_attn." in name:
        return "attention"
    if ".experts." in name:
        return "routed_experts"
    if ".shared_expert" in name:
        return "shared_experts"
    if ".mlp.gate." in name or ".mlp.router." in name or name.endswith(".mlp.gate.weight"):
        return "router"
    if ".mlp." in name:
        return "dense_mlp"
    if "norm" in name:
        return "norms"
    raise ValueError(f"parameter {name!r} fits no component; extend hf_dist_recipes.planning.models.component_of")


@dataclass(frozen=True)
class ModelShape:
    """What planning needs to know of a model. `parameters`: (name, shape) of every parameter, in model order;
    `largest_layer_params`: the most parameters any one module holds directly (ZeRO-3 gathers one at a time).

    Widths for the activation estimate (`hf_dist_recipes.planning.memory`), read from the parameter shapes so
    that every family is read the same way: `head_dim` (per attention head of a non-MLA model);
    `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim` (MLA; None elsewhere); `intermediate_size` (one dense
    MLP, 0 when every layer is MoE); `moe_intermediate_size` (one routed expert); `shared_intermediate_size` (all
    shared experts of a layer together); `num_moe_layers` (layers with routed experts)."""

    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    routed_experts: int
    shared_experts: int
    experts_per_token: int
    q_lora_rank: int | None
    kv_lora_rank: int | None
    parameters: tuple[tuple[str, tuple[int, ...]], ...] = field(repr=False)
    params_by_component: dict[str, int] = field(default_factory=dict)
    largest_layer_params: int = 0
    head_dim: int = 0
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    num_moe_layers: int = 0

    @property
    def total_params(self) -> int:
        return sum(self.params_by_component.values())

    @property
    def is_moe(self) -> bool:
        return self.routed_experts > 0

    @property
    def is_deepseek(self) -> bool:
        return self.model_type in DEEPSEEK_TYPES

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): K/V come from a compressed latent, not from k/v_proj."""
        return self.kv_lora_rank is not None and self.v_head_dim is not None


def _get(config: PretrainedConfig, *names: str, default=0):
    for n in names:
        value = getattr(config, n, None)
        if value is not None:
            return value
    return default


def introspect(model: str | Path | PretrainedConfig) -> ModelShape:
    """Shape and exact parameter counts of `model` (see `load_model_config` for what it accepts)."""
    import torch
    from transformers import AutoModelForCausalLM

    name, config = load_model_config(model)
    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(config)
    params, by_component = [], dict.fromkeys(COMPONENTS, 0)
    for pname, p in module.named_parameters():
        params.append((pname, tuple(p.shape)))
        by_component[component_of(pname)] += p.numel()
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())
    heads = config.num_attention_heads
    widths = _mlp_widths(params)
    return ModelShape(
        name=name,
        model_type=config.model_type,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=_get(config, "num_key_value_heads", default=heads),
        vocab_size=config.vocab_size,
        routed_experts=_get(config, "n_routed_experts", "num_experts", "num_local_experts"),
        shared_experts=_get(config, "n_shared_experts"),
        experts_per_token=_get(config, "num_experts_per_tok"),
        q_lora_rank=getattr(config, "q_lora_rank", None),
        kv_lora_rank=getattr(config, "kv_lora_rank", None),
        parameters=tuple(params),
        params_by_component=by_component,
        largest_layer_params=largest,
        head_dim=_get(config, "head_dim", default=config.hidden_size // heads),
        qk_nope_head_dim=getattr(config, "qk_nope_head_dim", None),
        qk_rope_head_dim=getattr(config, "qk_rope_head_dim", None),
        v_head_dim=getattr(config, "v_head_dim", None),
        **widths,
    )


def _mlp_widths(params: list[tuple[str, tuple[int, ...]]]) -> dict[str, int]:
    """MLP widths from the parameter shapes (transformers 5 layouts): a dense MLP's `down_proj.weight` is
    [hidden, intermediate]; fused routed experts' `experts.down_proj` is [experts, hidden, intermediate]."""
    dense = routed = shared = 0
    moe_layers = set()
    for name, shape in params:
        if not name.endswith("down_proj.weight") and not name.endswith("experts.down_proj"):
            continue
        component = component_of(name)
        if component == "routed_experts":
            routed = routed or shape[-1]
            moe_layers.add(name.split(".mlp.")[0])
        elif component == "shared_experts":
            shared = shared or shape[-1]
        elif component == "dense_mlp":
            dense = dense or shape[-1]
    return {
        "intermediate_size": dense,
        "moe_intermediate_size": routed,
        "shared_intermediate_size": shared,
        "num_moe_layers": len(moe_layers),
    }
