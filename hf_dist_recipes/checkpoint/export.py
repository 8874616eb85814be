"""`save_hf_checkpoint`: a `from_pretrained`-loadable checkpoint from a model trained in any DeepSpeed layout.

Streams: one group of modules (a decoder layer, the embeddings, ...) is gathered, reverted to the on-disk layout
and handed to a shard writer before the next is gathered, so no rank ever holds the whole model.

Shared writing (the default on more than one rank): every rank first computes the same shard plan from metadata
alone (`iter_module_groups(meta=True)`, no collective; `checkpoint.shard_plan`), owns a contiguous block of them,
receives (CPU copy, expert gathers) only the groups that hold a tensor of its shards and writes those files; after
a barrier rank 0 writes the index, the config and `shard_writers.json` (which rank wrote which file). The gathers
are collective as before -- every rank takes part in each -- what is shared is the conversion and the writing: each
rank writes about 1/world_size of the bytes instead of rank 0 writing all while the others wait. The files are the
single writer's byte for byte. Peak host memory per rank: one gathered group plus one shard buffer, as rank 0 alone
had before; a group is copied to the CPU only on the ranks whose shards it feeds (1, or 2 where two ranks' blocks
meet).
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch import nn

from hf_dist_recipes._compat.transformers import to_disk_layout
from hf_dist_recipes.checkpoint.gather import group_key, iter_module_groups
from hf_dist_recipes.checkpoint.shard_plan import PlannedShardWriter, plan_shards, write_index
from hf_dist_recipes.checkpoint.writer import (
    DEFAULT_MAX_SHARD_BYTES,
    ExportResult,
    ShardedSafetensorsWriter,
    remove_previous_weights,
    save_config_files,
)
from hf_dist_recipes.core.gather import gather_objects


def to_disk_names(model: nn.Module, group: dict) -> dict:
    """transformers' own reverse of its load-time conversions (e.g. fused experts -> one tensor per expert); works
    on meta tensors too (the shard plan)."""
    return to_disk_layout(model, group) if group else group


def write_groups(groups, model: nn.Module, output_dir: str, max_shard_bytes: int) -> ExportResult:
    """Write in-memory-named tensor groups as a HuggingFace checkpoint (weights, index, config): one writer."""
    writer = ShardedSafetensorsWriter(output_dir, max_shard_bytes)
    for group in groups:
        writer.add(to_disk_names(model, group))
        del group
    result = writer.close()
    save_config_files(model.config, output_dir, getattr(model, "generation_config", None))
    return result


def save_hf_checkpoint(
    model: nn.Module,
    output_dir: str,
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    shared: bool = True,
) -> ExportResult | None:
    """Save the (unwrapped) `model` as a HuggingFace checkpoint in `output_dir`, from any mix of ZeRO-3, AutoTP and
    AutoEP. Call it on every rank. `shared` (default): every rank writes its share of the shard files (see the
    module docstring); False: global rank 0 gathers and writes every file (the behaviour before shared writing).
    Global rank 0 gets the `ExportResult` (with shared writing, `shard_writers.json` names each file's rank), the
    others get None."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not distributed or not shared:
        if not distributed or dist.get_rank() == 0:
            return write_groups(iter_module_groups(model), model, output_dir, max_shard_bytes)
        for _ in iter_module_groups(model):  # the other ranks only take part in the gathers
            pass
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    disk_groups = {}  # in-memory group key -> its on-disk tensor names
    meta_groups = []
    for group in iter_module_groups(model, meta=True):
        disk = to_disk_names(model, group)
        disk_groups[group_key(next(iter(group)))] = list(disk)
        meta_groups.append(disk)
    plan = plan_shards(meta_groups, max_shard_bytes)
    del meta_groups
    receivers = {key: plan.owners_of(names, world) for key, names in disk_groups.items()}
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        remove_previous_weights(output_dir)
    dist.barrier()  # no rank writes before the previous save's files are gone
    writer = PlannedShardWriter(output_dir, plan, rank, world)
    for group in iter_module_groups(model, receivers=lambda key: receivers.get(key, ())):
        writer.add(to_disk_names(model, group))
        del group
    written = writer.close()
    everyone = gather_objects(written)  # also the barrier before the index: every shard is on disk
    if rank != 0:
        return None
    result = write_index(output_dir, plan, dict(enumerate(everyone)))
    save_config_files(model.config, output_dir, getattr(model, "generation_config", None))
    return result
