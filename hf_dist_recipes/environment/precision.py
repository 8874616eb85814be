"""Training precision: bf16 wherever the GPUs support it, fp32 only when chosen; no training from FP8 weights.

The stock `TrainingArguments.bf16` defaults to False, and a DeepSpeed JSON with `"bf16": {"enabled": "auto"}` is
then filled with false: the job trains in fp32, with twice the parameter and activation memory the plan assumed
and matmuls several times slower (H100: 989 dense bf16 TFLOP/s against 67 fp32 without TF32). Here `bf16=None`
(the recipe default) means: on when every visible GPU supports bf16 (compute capability >= 8.0: A100, H100, H200,
...), off on CPU-only hosts (CPU bf16 matmuls are slower than fp32 on most CPUs) and on older GPUs (V100, T4).
An explicit `bf16=False` (or `fp16=True`) is the user's choice and is kept.

Gradients still accumulate in fp32: the generated DeepSpeed JSON sets `"data_types": {"grad_accum_dtype": "fp32"}`
(DeepSpeed 0.19.8 `engine.get_data_types`; ZeRO-3 then keeps its gradient partitions in fp32), so summing many
micro-batches and data-parallel ranks in bf16 (8 bits of mantissa) does not drift.
"""

from __future__ import annotations

import torch


def cuda_bf16_supported() -> bool:
    """True when CUDA is visible and every visible GPU supports bf16 (torch's own check covers the current one;
    a mixed node is judged by its weakest GPU)."""
    if not torch.cuda.is_available():
        return False
    return all(torch.cuda.get_device_capability(i) >= (8, 0) for i in range(torch.cuda.device_count()))


def resolve_bf16(requested: bool | None, *, fp16: bool, cuda_devices: int, bf16_supported: bool) -> bool:
    """The `bf16` flag to train with. `requested`: the user's value, None for the recipe default (on where the
    GPUs support it); `fp16`: the user asked for fp16 (then bf16 stays off); `cuda_devices`: visible GPUs;
    `bf16_supported`: whether they all support bf16. An explicit True on hardware without bf16 is left to the
    stock check, which names the problem."""
    if requested is not None:
        return bool(requested)
    return bool(cuda_devices) and bf16_supported and not fp16


def _is_fp8(quant) -> bool:
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(getattr(method, "value", method)) == "fp8"


def _source_config(name_or_path: str) -> dict | None:
    """The config.json of the checkpoint a model was loaded from: a local folder, or a hub id's copy in the local
    cache (never downloaded); None where neither is found or readable."""
    import json
    from pathlib import Path

    path: str | Path | None = Path(name_or_path) / "config.json"
    if not Path(path).is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(name_or_path, "config.json")
        except Exception:  # not a hub id (a path that is gone, a name with odd characters)
            path = None
    if not isinstance(path, (str, Path)):  # None, or the cache's "known not to exist"
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def check_not_fp8(model) -> None:
    """Stop a model loaded from an FP8 block-scaled checkpoint before training: a fine-tune starts from the bf16
    weights `checkpoint dequantize` writes. Judged from the model's config (transformers keeps the FP8
    `quantization_config` on a model it loads as FP8) and from the config.json of the checkpoint it was loaded from
    (`name_or_path`, a folder or the hub cache): transformers 5.25 drops `quantization_config` from a model it
    dequantized while loading (on a host without a GPU, or with `dequantize=True`), through its own reading of the
    scale grid, which partial blocks defeat."""
    config = getattr(model, "config", None)
    source = str(getattr(config, "name_or_path", "") or "")
    if _is_fp8(getattr(config, "quantization_config", None)):
        where = "config quantization_config quant_method 'fp8'"
    elif source and _is_fp8((_source_config(source) or {}).get("quantization_config")):
        where = f"{source}/config.json quantization_config quant_method 'fp8'; transformers dequantized it on load"
    else:
        return
    raise ValueError(
        f"the model comes from an FP8 block-scaled checkpoint ({where}): train from bf16 weights: "
        "hf-dist-recipes checkpoint dequantize SRC --output DST, then from_pretrained(DST)"
    )
