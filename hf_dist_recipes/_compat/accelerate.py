"""accelerate's details that are not public API (proven: `PROVEN["accelerate"]`): the variables its launcher hands
the ranks, the optimizer's skipped-step flag, and where the accelerator keeps the DeepSpeed engine. Each says when it
can go."""

from __future__ import annotations

import os

from hf_dist_recipes.core.jsonfile import load_deepspeed_json

# accelerate 1.16 `utils/launch.py` exports the YAML's deepspeed_config_file to the ranks under these names, and
# `DeepSpeedPlugin.__post_init__` reads the file back from the second one. transformers 5.24
# `TrainingArguments.__post_init__` builds its DeepSpeed plugin from them when `deepspeed=` is not given. Not
# documented; goes when accelerate documents them (or hands the ranks the config another way).
ACCELERATE_USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"
ACCELERATE_DEEPSPEED_CONFIG_FILE = "ACCELERATE_DEEPSPEED_CONFIG_FILE"


def launcher_deepspeed_config() -> dict | None:
    """The DeepSpeed JSON that `accelerate launch` handed to this rank, or None when it handed none."""
    if os.environ.get(ACCELERATE_USE_DEEPSPEED, "false").lower() not in ("1", "true", "yes"):
        return None
    path = os.environ.get(ACCELERATE_DEEPSPEED_CONFIG_FILE)
    if not path or path == "none":
        return None
    return load_deepspeed_json(path)


# Gradient health (stability/gradient_health.py). accelerate 1.16 `AcceleratedOptimizer`: `step_was_skipped`
# returns `self._is_overflow`, which only the GradScaler path of `step()` writes; `Accelerator.
# optimizer_step_was_skipped` (read by transformers 5.24 `Trainer._run_epoch` to leave the scheduler alone) and
# `AcceleratedScheduler.step` both read it. `scaler` is the GradScaler or None. Can go when accelerate lets a caller
# mark a step skipped.
def mark_optimizer_step_skipped(optimizer, skipped: bool) -> None:
    """Make accelerate (and so the Trainer's scheduler step) see this optimizer step as skipped, or not."""
    if optimizer is not None and hasattr(optimizer, "_is_overflow"):
        optimizer._is_overflow = skipped


def has_grad_scaler(optimizer) -> bool:
    return getattr(optimizer, "scaler", None) is not None


# accelerate 1.16 keeps the DeepSpeed engine it built for training as `accelerator.deepspeed_engine_wrapped.engine`
# (not documented; checkpoint/resume_loading.py reads it, see `deepspeed.py`'s resume loads). Can go when accelerate
# exposes the engine.
def training_engine(trainer):
    """The DeepSpeed engine `trainer`'s accelerator built for training, or None (not built yet, or no DeepSpeed)."""
    wrapped = getattr(trainer.accelerator, "deepspeed_engine_wrapped", None)
    return None if wrapped is None else wrapped.engine
