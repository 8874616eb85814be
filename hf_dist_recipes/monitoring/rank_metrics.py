"""What one rank measured about itself, shared by RecipeTrainer (which feeds it) and the per-rank callbacks.

The Trainer logs one loss averaged over all ranks; a rank that diverges or crawls is invisible in it. The run's
runtime (`hf_dist_recipes.runtime`) owns one and adds each micro step's own loss and token count here;
`RankSummaryCallback` (always registered) times the optimizer steps and closes the window at each log, so the
summary has its numbers with or without the TensorBoard callback.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import torch


@dataclass
class RankMetrics:
    """Running per-rank counters. Losses stay tensors until a log step reads them, so feeding them costs no
    device synchronisation."""

    RESUMED_FIELDS = ("tokens", "optimizer_steps", "train_seconds", "first_loss", "last_loss")
    CHECKPOINT_DIRNAME = "rank_metrics"

    tokens: int = 0
    optimizer_steps: int = 0
    train_seconds: float = 0.0
    first_loss: float | None = None
    last_loss: float | None = None
    _window_loss: torch.Tensor | None = None
    _window_steps: int = 0
    _window_tokens: int = 0
    _window_seconds: float = 0.0
    _step_started: float | None = field(default=None, repr=False)
    _flushed_step: int | None = field(default=None, repr=False)
    _flushed: dict[str, float] = field(default_factory=dict, repr=False)

    def add_micro_step(self, loss: torch.Tensor, tokens: int) -> None:
        """Record one micro step: its (accumulation-scaled) loss as returned by `Trainer.training_step`."""
        loss = loss.detach().float()
        self._window_loss = loss if self._window_loss is None else self._window_loss + loss
        self.tokens += tokens
        self._window_tokens += tokens

    def step_begin(self) -> None:
        self._step_started = time.perf_counter()

    def step_end(self) -> None:
        if self._step_started is None:
            return
        elapsed = time.perf_counter() - self._step_started
        self._step_started = None
        self.optimizer_steps += 1
        self.train_seconds += elapsed
        self._window_steps += 1
        self._window_seconds += elapsed

    def flush_window(self, step: int | None = None) -> dict[str, float]:
        """Means since the last flush: `loss` (this rank's, per optimizer step), `step_time_s`, `tokens_per_s`.
        Empty when no optimizer step finished since then.

        With `step` (the optimizer step of a log), every caller at that step gets the same numbers: the first call
        closes the window. Several callbacks read one log (summary, TensorBoard) and none may depend on another's
        order or presence."""
        if step is not None and step == self._flushed_step:
            return dict(self._flushed)
        if self._window_steps == 0:
            return {}
        out = {"step_time_s": self._window_seconds / self._window_steps}
        if self._window_seconds > 0:
            out["tokens_per_s"] = self._window_tokens / self._window_seconds
        if self._window_loss is not None:
            out["loss"] = self._window_loss.item() / self._window_steps
            if self.first_loss is None:
                self.first_loss = out["loss"]
            self.last_loss = out["loss"]
        self._window_loss, self._window_steps, self._window_tokens, self._window_seconds = None, 0, 0, 0.0
        if step is not None:
            self._flushed_step, self._flushed = step, dict(out)
        return out

    def save(self, checkpoint_dir: str | os.PathLike, rank: int) -> None:
        """Write the job-long counters into `<checkpoint_dir>/rank_metrics/rank<rank>.json` (every rank its own:
        the Trainer's state file comes from rank 0 only)."""
        folder = os.path.join(os.fspath(checkpoint_dir), self.CHECKPOINT_DIRNAME)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{rank}.json"), "w", encoding="utf-8") as f:
            json.dump({k: getattr(self, k) for k in self.RESUMED_FIELDS}, f)

    def load(self, checkpoint_dir: str | os.PathLike, rank: int) -> bool:
        """Continue the counters of a checkpoint written by `save`; False when it holds none for this rank (a
        checkpoint of another trainer, or of a job with another world size)."""
        path = os.path.join(os.fspath(checkpoint_dir), self.CHECKPOINT_DIRNAME, f"rank{rank}.json")
        if not os.path.isfile(path):
            return False
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        for key in self.RESUMED_FIELDS:
            setattr(self, key, saved[key])
        return True
