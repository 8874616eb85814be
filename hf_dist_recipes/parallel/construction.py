"""Model construction under ZeRO-3: a model built whole on every rank is caught before it costs a cluster.

Whether ZeRO-3 partitions a model while it is built depends on the order of construction, not on any launch flag:
transformers' `from_pretrained` / `from_config` / `AutoModel*.from_config` enter `deepspeed.zero.Init` only when a
DeepSpeed ZeRO-3 config is already registered, which `TrainingArguments` does (`HfTrainerDeepSpeedConfig`). A model
built before the arguments exist, or by calling its class (`LlamaForCausalLM(config)`), is a full copy on every
rank: 8 x 141 GB of host RAM per node for Llama-3.1-70B in bf16. DeepSpeed partitions it later, but the peak has
already happened, on every rank at once. accelerate's `zero3_init_flag` does not change this for the Trainer (the
arguments register the config either way), so the generated files no longer carry it.

Partitioned parameters carry DeepSpeed's `ds_id` attribute (set by `zero.Init`); the check sums the bytes of those
that do not.
"""

from __future__ import annotations

import torch

from hf_dist_recipes._compat.deepspeed import is_zero_partitioned
from hf_dist_recipes.core.sizes import format_size

FIX = (
    "build the model after RecipeTrainingArguments(...) with from_pretrained / from_config (they partition it "
    "under ZeRO-3 while loading), or pass model_init=... to RecipeTrainer; raise max_unpartitioned_model_size "
    "(or set it to None) if a full copy per rank is really meant"
)


def unpartitioned_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters of `model` that ZeRO-3's `zero.Init` did not partition."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not is_zero_partitioned(p))


def check_partitioned(model: torch.nn.Module, *, limit_bytes: int | None, world_size: int) -> int:
    """Raise ValueError when more than `limit_bytes` of `model` were built unpartitioned under ZeRO-3 on a job of
    `world_size` processes (None: no check). Returns the unpartitioned bytes."""
    size = unpartitioned_bytes(model)
    if limit_bytes is not None and size > limit_bytes:
        raise ValueError(
            f"{type(model).__name__} was built without ZeRO-3 partitioning: {format_size(size)} of parameters "
            f"on every rank ({world_size} full copies, {format_size(world_size * size)} over the job) before "
            f"DeepSpeed starts. Fix: {FIX}."
        )
    return size
