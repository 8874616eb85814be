import json

import pytest
import torch

from hf_dist_recipes.core.model_templates import TEMPLATES, template_config
from hf_dist_recipes.planning.models import COMPONENTS, cached_hub_config, component_of, introspect, load_model_config

# Public parameter counts of the checkpoints the templates copy (as transformers builds them; DeepSeek-V3's
# multi-token-prediction layer is not part of the transformers model).
PUBLIC = {
    "deepseek-v3": 671_026_404_352,
    "deepseek-v2": 235_741_434_880,
    "deepseek-v2-lite": 15_706_484_224,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_templates_have_the_public_sizes(name):
    assert introspect(name).total_params == PUBLIC[name]


def test_deepseek_v3_components_and_shape():
    s = introspect("deepseek-v3")
    assert (s.num_layers, s.num_heads, s.routed_experts, s.shared_experts, s.experts_per_token) == (61, 128, 256, 1, 8)
    assert (s.q_lora_rank, s.kv_lora_rank) == (1536, 512) and s.is_deepseek and s.is_moe
    c = s.params_by_component
    assert set(c) == set(COMPONENTS) and sum(c.values()) == s.total_params
    assert c["routed_experts"] / s.total_params > 0.97  # where a DeepSeek model keeps its parameters
    assert c["embeddings"] == c["lm_head"] == 129280 * 7168


def test_widths_for_the_activation_estimate():
    """The public config.json values: DeepSeek-V3 (MLA nope/rope/v 128/64/128, dense MLP 18432 in its first 3 of 61
    layers, experts 2048 wide, one shared expert), Mixtral-8x7B (experts 14336 wide in all 32 layers, no dense MLP),
    Llama-3.1-8B (32 heads of 128, MLP 14336)."""
    v3 = introspect("deepseek-v3")
    assert (v3.qk_nope_head_dim, v3.qk_rope_head_dim, v3.v_head_dim, v3.is_mla) == (128, 64, 128, True)
    assert (v3.intermediate_size, v3.moe_intermediate_size, v3.shared_intermediate_size) == (18432, 2048, 2048)
    assert v3.num_moe_layers == 61 - 3
    lite = introspect("deepseek-v2-lite")  # two shared experts of 1408 and no q LoRA
    assert (lite.shared_intermediate_size, lite.q_lora_rank, lite.num_moe_layers) == (2 * 1408, None, 27 - 1)
    mixtral = introspect("mixtral-8x7b")
    assert (mixtral.moe_intermediate_size, mixtral.intermediate_size, mixtral.num_moe_layers) == (14336, 0, 32)
    assert not mixtral.is_mla and mixtral.head_dim == 4096 // 32
    llama = introspect("llama-3.1-8b")
    assert (llama.head_dim, llama.intermediate_size, llama.num_moe_layers, llama.is_mla) == (128, 14336, 0, False)


def test_counts_equal_a_real_model_exactly():
    config = template_config("tiny-deepseek-v3")
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_config(config)
    s = introspect(config)
    # 191,568 is also counted by hand, layer by layer, in test_memory.py (TINY_PARAMS).
    assert s.total_params == sum(p.numel() for p in real.parameters()) == 191_568
    assert s.largest_layer_params == max(sum(p.numel() for p in m.parameters(recurse=False)) for m in real.modules())


def test_local_config_json(tmp_path):
    values = template_config("tiny-llama").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(values))
    assert introspect(tmp_path).total_params == introspect("tiny-llama").total_params
    assert introspect(tmp_path / "config.json").model_type == "llama"


def test_bad_model_inputs(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'gpt-5'.*deepseek-v3"):
        introspect("gpt-5")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        introspect(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ValueError, match="no model_type"):
        introspect(tmp_path)


def test_every_template_parameter_has_a_component():
    for name in TEMPLATES:
        assert sum(introspect(name).params_by_component.values()) > 0


def test_unknown_parameter_names_are_refused():
    with pytest.raises(ValueError, match="fits no component"):
        component_of("model.layers.0.mystery.weight")


def test_template_overrides_keep_derived_fields():
    config = template_config("demo-deepseek-v3", qk_nope_head_dim=8, qk_rope_head_dim=8)
    assert config.qk_head_dim == 16
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_config(config)


def test_config_json_that_is_not_an_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object, not list"):
        introspect(tmp_path)


def _hub_cache(root, repo_id: str, values: dict) -> None:
    """A model's config.json where `hf download` leaves it: the Hub cache's documented layout
    (models--OWNER--NAME/refs/main naming a snapshot folder)."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "snapshots" / revision).mkdir(parents=True)
    (repo / "snapshots" / revision / "config.json").write_text(json.dumps(values))


def test_a_hub_id_whose_config_is_in_the_local_cache(tmp_path):
    _hub_cache(tmp_path, "acme/tiny-llama-clone", template_config("tiny-llama").to_dict())
    name, config = load_model_config("acme/tiny-llama-clone", cache_dir=tmp_path)
    assert name == "acme/tiny-llama-clone" and config.model_type == "llama"
    assert introspect(config).total_params == introspect("tiny-llama").total_params
    with pytest.raises(ValueError, match=r"acme/other: no config.json .* `hf download acme/other config.json`"):
        load_model_config("acme/other", cache_dir=tmp_path)
    assert cached_hub_config("not a hub id", cache_dir=tmp_path) is None


def test_config_estimate_takes_a_cached_hub_id_offline(tmp_path):
    import os
    import subprocess
    import sys

    _hub_cache(tmp_path, "acme/tiny-llama-clone", template_config("tiny-llama").to_dict())
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path), HF_HUB_OFFLINE="1")
    argv = ["config", "estimate", "--model", "acme/tiny-llama-clone", "--gpus-per-node", "2", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "hf_dist_recipes.cli.main", *argv], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "acme/tiny-llama-clone" in proc.stdout
