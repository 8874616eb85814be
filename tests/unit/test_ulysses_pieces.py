"""The recipe's pieces around Ulysses SP that need no process group (hf_dist_recipes.parallel.sequence_parallel); the
trained runs are tests/distributed/test_sequence_parallel.py."""

from types import SimpleNamespace

import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig
from torch.nn import functional as F
from transformers import DeepseekV3Config, LlamaConfig, default_data_collator

from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.parallel.sequence_parallel import (
    UlyssesRegistration,
    eval_length_problem,
    eval_unsharded,
    is_mla,
    sequence_parallel_size,
    with_position_ids,
)


def _sdpa(module, query, key, value, attention_mask, *args, scaling=None, **kwargs):
    """transformers' attention-function shape: (batch, heads, seq, dim) in, (batch, seq, heads, dim) out."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2), None


def test_is_mla_knows_deepseek_and_not_llama():
    assert is_mla(template_config("tiny-deepseek-v3"))  # Q/K 24 wide, V 16, head_dim 8 (the RoPE width)
    # MLA with V as wide as Q/K and head_dim at that width: Ulysses' one head size fits already
    assert not is_mla(DeepseekV3Config(qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, head_dim=16))
    assert not is_mla(LlamaConfig(hidden_size=64, num_attention_heads=4))


def test_the_shim_pads_v_exactly_and_gives_the_registration_the_qk_width():
    config = template_config("tiny-deepseek-v3")
    model = SimpleNamespace(config=config)
    functions = {"sdpa": _sdpa}
    seen = {}

    def register(attention):  # what Ulysses does in Accelerator.prepare: read head_dim, wrap the function
        seen["head_dim"] = config.head_dim

        def ulysses(module, query, key, value, *args, **kwargs):
            assert key.shape == value.shape, "Ulysses' own check (ulysses_sp.py:303)"
            out, weights = attention(module, query, key, value, *args, **kwargs)
            return out.flatten(-2), weights  # Ulysses hands back (batch, seq, heads x dim)

        functions["sdpa"] = ulysses

    shim = UlyssesRegistration(model, "sdpa", attention_functions=functions)
    for _ in range(2):  # a second train() registers from the implementation's own function again
        shim.before_prepare()
        assert functions["sdpa"] is _sdpa and config.head_dim == 24
        register(functions["sdpa"])
        shim.after_prepare()
        assert seen["head_dim"] == 24 and config.head_dim == 8  # the model's own again: what a save writes
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 6, 24, requires_grad=True), torch.randn(2, 4, 6, 24)
    v = torch.randn(2, 4, 6, 16, requires_grad=True)
    out, _ = functions["sdpa"](None, q, k, v, None, scaling=24**-0.5)
    # Independently: attention with the narrow V, no padding anywhere
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=24**-0.5).transpose(1, 2)
    assert out.shape == (2, 6, 4 * 16)
    torch.testing.assert_close(out, expected.flatten(-2), rtol=0, atol=1e-6)
    out.sum().backward()
    assert v.grad.shape == v.shape
    # A train() that stopped before train begin puts the config back too
    shim.before_prepare()
    shim.restore()
    shim.restore()
    assert config.head_dim == 8
    # model_init's new model in train(): the earlier model's config back as it was, the new one's changed
    shim.before_prepare()
    other = template_config("tiny-deepseek-v3")
    shim.use_model(SimpleNamespace(config=other))
    shim.before_prepare()
    assert (config.head_dim, other.head_dim) == (8, 24)
    shim.after_prepare()
    assert other.head_dim == 8


def test_each_prepare_registers_from_the_models_own_attention():
    # An evaluate() before train() registered Ulysses already: the training prepare must wrap the model's own sdpa,
    # not that wrapper (Ulysses inside Ulysses). A model without MLA keeps its head_dim and gets no padding.
    config = LlamaConfig(hidden_size=64, num_attention_heads=4)
    functions = {"sdpa": _sdpa}
    registration = UlyssesRegistration(SimpleNamespace(config=config), "sdpa", attention_functions=functions)
    functions["sdpa"] = lambda *args, **kwargs: None  # the evaluation's registration
    registration.before_prepare()
    assert functions["sdpa"] is _sdpa and config.head_dim == 16
    registration.after_prepare()
    assert functions["sdpa"] is _sdpa and not registration.mla


def test_position_ids_are_added_where_a_batch_has_none():
    collate = with_position_ids(default_data_collator)
    batch = collate([{"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([5, 6, 7])}] * 2)
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]
    packed = {"input_ids": torch.tensor([5, 6, 7]), "position_ids": torch.tensor([0, 0, 1])}
    assert collate([packed])["position_ids"].tolist() == [[0, 0, 1]]  # a packing collator's own are kept


def test_sp_size_and_eval_come_from_accelerates_parallelism_config(monkeypatch):
    assert sequence_parallel_size(SimpleNamespace(parallelism_config=None)) == 1
    accelerator = SimpleNamespace(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed"))
    assert sequence_parallel_size(accelerator) == 2
    assert eval_unsharded(accelerator)  # accelerate's default: sp_disable_in_eval
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_DISABLE_IN_EVAL", "false")
    assert not eval_unsharded(SimpleNamespace(parallelism_config=ParallelismConfig(sp_size=2)))


def test_an_eval_batch_over_the_limit_is_named_with_the_fix():
    batch = {"input_ids": torch.zeros(1, 64, dtype=torch.long)}
    assert eval_length_problem(batch, None, 4) is None
    assert eval_length_problem(batch, 64, 4) is None
    problem = eval_length_problem(batch, 32, 4)
    assert "64 tokens, over sp_eval_max_length=32" in problem and "4 x the activation memory" in problem


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_sp_eval_max_length_is_a_positive_token_count(value, tmp_path):
    from hf_dist_recipes import RecipeTrainingArguments

    with pytest.raises(ValueError, match="sp_eval_max_length must be a whole number of tokens >= 1"):
        RecipeTrainingArguments(output_dir=str(tmp_path), sp_eval_max_length=value)
