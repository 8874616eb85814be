"""Which weights DeepSpeed AutoTP splits, per model family: explicit `tensor_parallel.partition_config` specs.

Stock AutoTP refuses DeepSeek's MLA/MoE tp_plan (trap 2 of verified-on-cpu.md) and its `deepseek_v2` preset leaves
the fused experts whole on every TP rank. The specs below are written out for every family so that the generated
JSON says exactly what is split, and the memory estimate reads the same specs through DeepSpeed's own
`AutoTPConfig` (one source for both).

DeepSeek MLA: the low-rank down-projections `q_a_proj` / `kv_a_proj_with_mqa` feed an RMSNorm over their whole
output, so they are split by output and gathered back (`gather_output`), like the LM head: weights sharded,
activations whole. Measured on 4 CPU ranks (tiny DeepSeek-V3, TP 2 + EP 2): 50,344 model-state elements per rank
versus 55,080 with those layers replicated (ideal 47,892), with the loss sequence equal to a ZeRO-3-only run within
2e-5. Routed experts are left to expert parallelism (AutoEP), not TP.
"""

from __future__ import annotations

COLUMN, ROW = "column", "row"


def _spec(patterns: list[str], partition_type: str, gather_output: bool = False) -> dict:
    spec = {"patterns": patterns, "partition_type": partition_type}
    if gather_output:
        spec["gather_output"] = True
    return spec


_LM_HEAD = _spec([r"^lm_head\.weight$"], COLUMN, gather_output=True)
_DENSE_MLP = [
    _spec([r".*\.mlp\.(shared_experts?\.)?down_proj\.weight$"], ROW),
    _spec([r".*\.mlp\.(shared_experts?\.)?(up|gate)_proj\.weight$"], COLUMN),
]

DEEPSEEK_SPECS = [
    _spec([r".*\.self_attn\.o_proj\.weight$"], ROW),
    _spec([r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$"], COLUMN, gather_output=True),
    _spec([r".*\.self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight$"], COLUMN),
    *_DENSE_MLP,
    _LM_HEAD,
]

# Llama, Qwen2, Mixtral, Qwen3-MoE attention (q/k/v biases follow their weights), dense MLPs.
GQA_SPECS = [
    _spec([r".*\.self_attn\.o_proj\.weight$"], ROW),
    _spec([r".*\.self_attn\.[qkv]_proj\.(weight|bias)$"], COLUMN),
    *_DENSE_MLP,
    _LM_HEAD,
]

FAMILY_SPECS = {
    "deepseek_v2": DEEPSEEK_SPECS,
    "deepseek_v3": DEEPSEEK_SPECS,
    "llama": GQA_SPECS,
    "qwen2": GQA_SPECS,
    "qwen3_moe": GQA_SPECS,
    "mixtral": GQA_SPECS,
}


def partition_config(model_type: str) -> dict:
    """The `tensor_parallel.partition_config` for a transformers `model_type`."""
    if model_type not in FAMILY_SPECS:
        raise ValueError(
            f"no tensor-parallel layer specs for model_type {model_type!r}; known: "
            f"{', '.join(sorted(FAMILY_SPECS))}. Use --tp 1, or add specs to planning/tp_specs.py"
        )
    return {"use_default_specs": False, "layer_specs": [dict(s) for s in FAMILY_SPECS[model_type]]}


def tp_split_dim(param_name: str, shape: tuple[int, ...], autotp_config) -> int | None:
    """The dimension AutoTP splits `param_name` along (None: kept whole), read from DeepSpeed's `AutoTPConfig`.
    Column splits a weight's output dimension (0), row its input dimension (1); a 1-D bias follows column only."""
    spec = autotp_config.find_matching_spec(param_name)
    if spec is None:
        return None
    kind = spec.partition_type.value
    if kind == COLUMN:
        return 0
    if kind == ROW and len(shape) >= 2:
        return 1
    return None
