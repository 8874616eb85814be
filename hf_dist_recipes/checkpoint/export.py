"""`save_hf_checkpoint`: a `from_pretrained`-loadable checkpoint from a model trained in any DeepSpeed layout.

Streams: one group of modules (a decoder layer, the embeddings, ...) is gathered, reverted to the on-disk layout
and handed to the shard writer before the next is gathered, so no rank ever holds the whole model. Peak host
memory: on every rank one gathered group; on the writing rank also the shard buffer (`max_shard_bytes`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from hf_dist_recipes.checkpoint.gather import iter_module_groups
from hf_dist_recipes.checkpoint.writer import (
    DEFAULT_MAX_SHARD_BYTES,
    ExportResult,
    ShardedSafetensorsWriter,
    save_config_files,
)


def to_disk_names(model: nn.Module, group: dict) -> dict:
    """transformers' own reverse of its load-time conversions (e.g. fused experts -> one tensor per expert)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, group) if group else group


def write_groups(groups, model: nn.Module, output_dir: str, max_shard_bytes: int) -> ExportResult:
    """Write in-memory-named tensor groups as a HuggingFace checkpoint (weights, index, config)."""
    writer = ShardedSafetensorsWriter(output_dir, max_shard_bytes)
    for group in groups:
        writer.add(to_disk_names(model, group))
        del group
    result = writer.close()
    save_config_files(model.config, output_dir, getattr(model, "generation_config", None))
    return result


def save_hf_checkpoint(
    model: nn.Module, output_dir: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> ExportResult | None:
    """Save the (unwrapped) `model` as a HuggingFace checkpoint in `output_dir`, from any mix of ZeRO-3, AutoTP and
    AutoEP. Call it on every rank; global rank 0 writes and gets the `ExportResult`, the others get None."""
    main = not dist.is_initialized() or dist.get_rank() == 0
    groups = iter_module_groups(model, main)
    if main:
        return write_groups(groups, model, output_dir, max_shard_bytes)
    for _ in groups:  # the other ranks only take part in the gathers
        pass
    return None
