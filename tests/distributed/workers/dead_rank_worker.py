"""A job whose rank 1 is lost mid-run: RecipeTrainer on a tiny model for many steps; at optimizer step `die_at` the
process of global rank 1 sends itself SIGKILL (MODE kill: no Python cleanup, no goodbye, as a crashed or OOM-killed
machine) or SIGSTOP (MODE stop: frozen with its sockets open, as a hung host), or sleeps (MODE hang: alive, its
heartbeat thread running, but never reaching the next collective). Rank 0 prints its collective timeout at that
step. Extra `name=value` arguments go to RecipeTrainingArguments (ints and floats parsed).

Usage: dead_rank_worker.py OUTPUT_DIR MODE DIE_AT [name=value ...]
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from transformers import TrainerCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from tests.support.models import SMALL


class DieAt(TrainerCallback):
    def __init__(self, mode: str, at: int):
        self.mode, self.at = mode, at

    def on_train_begin(self, args, state, control, **kwargs):
        # torchrun starts each rank in a session of its own: the test ends a stopped rank by this pid
        print(f"rank {args.process_index} pid {os.getpid()}", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        print(f"rank {args.process_index} finished step {state.global_step}", flush=True)
        if state.global_step != self.at:
            return
        if args.process_index == 0:  # what RecipeTrainer made of step_timeout (torch 2.13 private, read-only here)
            backend = torch.distributed.group.WORLD._get_backend(torch.device("cpu"))
            print(f"rank 0 collective timeout {backend.options._timeout.total_seconds():g} s", flush=True)
        elif self.mode == "hang":
            time.sleep(3600)  # alive (its heartbeat goes on) but stuck
        else:
            os.kill(os.getpid(), signal.SIGKILL if self.mode == "kill" else signal.SIGSTOP)


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main(output_dir: str, mode: str, die_at: int, extra: list[str]) -> None:
    overrides = {name: _value(value) for name, value in (item.split("=", 1) for item in extra)}
    args = RecipeTrainingArguments(
        output_dir=output_dir,
        max_steps=10_000,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1000,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed_check="off",
        **overrides,
    )
    trainer = RecipeTrainer(
        model_init=lambda: build_tiny_deepseek(**SMALL),
        args=args,
        train_dataset=stdlib_dataset(seq_len=16, max_bytes=8_000),
    )
    trainer.add_callback(DieAt(mode, die_at))
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
