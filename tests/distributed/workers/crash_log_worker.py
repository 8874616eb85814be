"""A rank that dies mid-run: RecipeTrainer on a tiny model logs every 2 steps; at step `die_at` (not a logging step)
a callback writes one unflushed probe scalar straight to the rank's writer, then the process ends by `mode`:
`term` (SIGTERM to itself, with `preemption_signals="none"`: it dies of it), `kill` (SIGKILL to itself) or `raise`
(an exception out of train()). Mode `save`: SIGTERM with the default preemption signals: the run saves the next
step and exits 75 (`checkpoint.preemption`). Mode `none`: no probe, no death; trains `die_at` steps and ends
normally.

Usage: crash_log_worker.py OUTPUT_DIR MODE DIE_AT [then OUTPUT_DIR MODE DIE_AT ...]  (tests/distributed/workers/runs.py)
"""

from __future__ import annotations

import os
import signal
import sys

from transformers import TrainerCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.monitoring import PerRankTensorBoardCallback
from tests.distributed.workers.runs import split_runs
from tests.support.models import SMALL


class Die(TrainerCallback):
    def __init__(self, trainer, mode: str, at: int):
        self.trainer, self.mode, self.at = trainer, mode, at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.at or self.mode == "none":
            return
        tb = next(c for c in self.trainer.callback_handler.callbacks if isinstance(c, PerRankTensorBoardCallback))
        tb.writer.add_scalar("probe/unflushed", 1.0, state.global_step)
        if self.mode == "raise":
            raise RuntimeError(f"worker dies at step {state.global_step}")
        os.kill(os.getpid(), signal.SIGKILL if self.mode == "kill" else signal.SIGTERM)


def main(output_dir: str, mode: str, die_at: int) -> None:
    steps = die_at if mode == "none" else die_at + 10
    args = RecipeTrainingArguments(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed_check="off",
        # `term`: the stock death by SIGTERM, whose TensorBoard flush is under test (the save on it: mode `save`)
        **({"preemption_signals": "none"} if mode == "term" else {}),
    )
    trainer = RecipeTrainer(
        model_init=lambda: build_tiny_deepseek(**SMALL),
        args=args,
        train_dataset=stdlib_dataset(seq_len=16, max_bytes=8_000),
    )
    trainer.add_callback(Die(trainer, mode, die_at))
    trainer.train()


if __name__ == "__main__":
    for output_dir, mode, die_at in split_runs(sys.argv[1:]):
        main(output_dir, mode, int(die_at))
