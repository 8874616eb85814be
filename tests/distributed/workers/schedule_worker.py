"""Run on every rank by tests/distributed/test_schedule_deepspeed.py under `accelerate launch` with a ZeRO-3
DeepSpeed JSON, with or without an `optimizer` section (DeepSpeed then owns the optimizer and steps the scheduler).

    schedule_worker.py DEEPSPEED_JSON OUTPUT_DIR STEPS [then DEEPSPEED_JSON OUTPUT_DIR STEPS]...

Each `then` is one more run in the same processes with its own DeepSpeed JSON (tests/distributed/workers/runs.py
`use_deepspeed_json`).

Trains tiny-llama with the recipe's schedule given by name (cosine_with_restarts, 2 cycles, floor 0.3, re-warm-up
of 2 steps, warm-up 2 steps, peak 1e-2). Writes OUTPUT_DIR/schedule/rank<N>.json: the learning rate the engine's
optimizer holds at the start of each optimizer step (`model_wrapped.optimizer.param_groups`, what that step
applies) and `engine.get_lr()` at the same moment, read from the engine, not from our scheduler object.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.core.model_templates import template_config
from tests.distributed.workers.runs import split_runs, use_deepspeed_json


class EngineLearningRates(TrainerCallback):
    def __init__(self):
        self.trainer = None
        self.param_group_lrs: list[float] = []
        self.engine_lrs: list[float] = []

    def on_step_begin(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped  # the DeepSpeedEngine once train() has built it
        self.param_group_lrs.append(engine.optimizer.param_groups[0]["lr"])
        self.engine_lrs.append(engine.get_lr()[0])


def main(output_dir: str, steps: int) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    config = template_config("tiny-llama")
    # Fixed random tokens: only the schedule is under test, and this keeps the worker off the demo's data code.
    tokens = torch.randint(0, config.vocab_size, (64, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in tokens]
    args = RecipeTrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        max_steps=steps,
        warmup_steps=2,
        lr_scheduler_type="cosine_with_restarts",
        lr_scheduler_kwargs={"num_cycles": 2, "min_lr_ratio": 0.3, "restart_warmup_steps": 2},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=7,
    )
    probe = EngineLearningRates()
    trainer = RecipeTrainer(
        model=AutoModelForCausalLM.from_config(config), args=args, train_dataset=data, callbacks=[probe]
    )
    probe.trainer = trainer
    trainer.train()
    engine = trainer.model_wrapped
    out = {
        "param_group_lrs": probe.param_group_lrs,
        "engine_lrs": probe.engine_lrs,
        "engine_optimizer": type(engine.optimizer).__name__,
        "basic_optimizer": type(engine.basic_optimizer).__name__,
        "engine_scheduler": type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else None,
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }
    target = Path(output_dir) / "schedule"
    target.mkdir(parents=True, exist_ok=True)
    (target / f"rank{args.process_index}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    for ds_json, output_dir, steps in split_runs(sys.argv[1:]):
        use_deepspeed_json(ds_json)
        main(output_dir, int(steps))
