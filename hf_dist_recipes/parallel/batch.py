"""The global batch under tensor parallelism (DeepSpeed issue 7298; trap 1 in verified-on-cpu.md).

With DeepSpeed AutoTP the ranks of one TP group work on the same samples, so the global batch is
micro x grad-accum x data-parallel size, where data-parallel size = world size / TP degree. The Trainer fills
`"train_batch_size": "auto"` with the whole world size instead, and DeepSpeed's batch assertion then fails. An
explicit data-parallel value is refused by the Trainer's own fill check. What trains: leave `train_batch_size` out
of the JSON and let DeepSpeed derive it from the micro batch, accumulation and its data-parallel group.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from hf_dist_recipes.core.layout import RankLayout
from hf_dist_recipes.core.user_values import positive_int
from hf_dist_recipes.parallel.deepspeed_view import DeepSpeedView


def validate_micro_batch(value: object, name: str = "micro_batch") -> int:
    """Return `value`, or raise ValueError unless it is a whole number of samples >= 1 per rank per micro step.
    `name`: the setting as the user wrote it (`per_device_train_batch_size`, the demo's `--micro-batch`)."""
    return positive_int(value, name, 8, unit="samples")


def data_parallel_size(world_size: int, tp_size: int = 1) -> int:
    """Ranks that see different data: world size / TP degree. Raises when TP does not divide the world."""
    return RankLayout(world_size, tp_size).dp


@dataclass(frozen=True)
class BatchFix:
    """Outcome of `fix_tp_batch_size`: the config to use, its AutoTP degree and what changed (None when nothing did)."""

    config: dict
    tp: int
    global_batch: int
    change: str | None


def fix_tp_batch_size(ds_config: dict, *, world_size: int, micro_batch: int, grad_accum: int) -> BatchFix:
    """Return a copy of `ds_config` that trains under TP with global batch micro x grad-accum x DP.

    Without TP (autotp_size <= 1) the config is returned unchanged. With TP, `train_batch_size` is removed when it
    is "auto" or already equals the data-parallel value; any other number raises ValueError naming the right one.
    `micro_batch` and `grad_accum` are the Trainer's values (`"auto"` entries in the JSON take them).
    """
    view = DeepSpeedView.read(ds_config)
    tp = view.tp
    dp = data_parallel_size(world_size, tp)
    micro, accum = view.micro_batch or micro_batch, view.grad_accum or grad_accum
    global_batch = micro * accum * dp
    if tp == 1 or "train_batch_size" not in ds_config:
        return BatchFix(config=ds_config, tp=tp, global_batch=global_batch, change=None)
    value = ds_config["train_batch_size"]
    if value != "auto" and value != global_batch:
        raise ValueError(
            f"DeepSpeed train_batch_size={value} does not match micro batch {micro} x gradient accumulation "
            f"{accum} x data-parallel size {dp} (world {world_size} / TP {tp}) = {global_batch}. Remove "
            f'"train_batch_size" from the DeepSpeed JSON (recommended) or set it to {global_batch}.'
        )
    fixed = copy.deepcopy(ds_config)
    del fixed["train_batch_size"]
    change = (
        f"removed train_batch_size={value!r} from the DeepSpeed config: under TP {tp} DeepSpeed derives the global "
        f"batch {micro} x {accum} x DP {dp} = {global_batch} itself (DeepSpeed issue 7298)"
    )
    return BatchFix(config=fixed, tp=tp, global_batch=global_batch, change=change)
