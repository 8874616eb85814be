"""The recipe's trainer as the preflight runs it: `RecipeTrainer` unchanged but for a digest of each step's batch,
a callback recording each step from the live objects, and a hook making one rank's loss NaN on one step."""

from __future__ import annotations

import contextlib
import hashlib
import math

from transformers import TrainerCallback

from hf_dist_recipes._compat.deepspeed import is_zero_partitioned
from hf_dist_recipes.preflight.training.facts import StepFacts
from hf_dist_recipes.trainer import RecipeTrainer


class PreflightTrainer(RecipeTrainer):
    """`RecipeTrainer` keeping `batches`: optimizer step (1-based) -> SHA-256 (16 hex digits) of the input ids of
    its last micro-batch, which the resume check compares with the uninterrupted run's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: dict[int, str] = {}

    def training_step(self, model, inputs, num_items_in_batch=None):
        ids = inputs["input_ids"].detach().cpu().numpy().tobytes()
        self.batches[self.state.global_step + 1] = hashlib.sha256(ids).hexdigest()[:16]
        return super().training_step(model, inputs, num_items_in_batch)


def weights_digest(model) -> str:
    """SHA-256 (16 hex digits) of this rank's full weights (ZeRO-3 partitions gathered; under TP/EP this rank's
    shard)."""
    params = list(model.parameters())
    gathered = contextlib.nullcontext()
    if any(is_zero_partitioned(p) for p in params):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    digest = hashlib.sha256()
    with gathered:
        for p in params:
            digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class StepRecorder(TrainerCallback):
    """Per optimizer step, from the live objects, a `StepFacts` in `steps`: the learning rate the step applies,
    whether the engine applied it, the clip values, and (with `digests`) the weights' digest. Also asks for a save
    at step `save_at` and stops after step `stop_after` (None: neither). Set `trainer` once the trainer exists."""

    def __init__(self, digests: bool, save_at: int | None, stop_after: int | None):
        self.trainer = None
        self.digests, self.save_at, self.stop_after = digests, save_at, stop_after
        self.steps: dict[int, StepFacts] = {}

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.steps[state.global_step + 1] = StepFacts(lr=float(optimizer.param_groups[0]["lr"]))

    def on_step_end(self, args, state, control, optimizer=None, model=None, **kwargs):
        step = self.steps.setdefault(state.global_step, StepFacts())
        engine = getattr(self.trainer, "model_wrapped", None)  # the live DeepSpeed engine, when there is one
        if hasattr(engine, "gradient_clipping") and hasattr(engine, "was_step_applied"):
            step.applied = bool(engine.was_step_applied())
            step.clip = float(engine.gradient_clipping())
            clip = getattr(getattr(engine, "optimizer", None), "clip_grad", None)
            step.zero_clip = None if clip is None else float(clip)
        else:
            step.applied = not bool(getattr(optimizer, "step_was_skipped", False))
            step.clip = float(args.max_grad_norm)
        if self.digests:
            step.weights = weights_digest(model)
        if state.global_step == self.save_at:
            control.should_save = True
        if state.global_step == self.stop_after:
            control.should_training_stop = True


class NanLoss:
    """A forward hook making the model's own loss NaN on `rank` at optimizer step `step` (1-based), training only,
    as a real overflow would. Set `trainer` once the trainer exists."""

    def __init__(self, model, rank: int, step: int):
        self.rank, self.step, self.trainer = rank, step, None
        model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        trainer = self.trainer
        if (
            trainer is not None
            and module.training
            and trainer.args.process_index == self.rank
            and trainer.state.global_step + 1 == self.step
            and getattr(output, "loss", None) is not None
        ):
            output.loss = output.loss * math.nan
        return output
