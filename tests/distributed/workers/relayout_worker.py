"""Train, checkpoint, resume -- in whatever layout the launch gives -- run on every rank under `accelerate launch` by
tests/distributed/test_resume_other_layout.py:

    relayout_worker.py OUTPUT_DIR PRETRAINED_DIR STEPS SAVE_STEPS [RESUME_CHECKPOINT|-] [fresh-optimizer]
                       [then OUTPUT_DIR ...]...

Trains STEPS steps (a checkpoint every SAVE_STEPS), from RESUME_CHECKPOINT when given. `fresh-optimizer`: the control
run, which resumes the weights only (the engine's `load_checkpoint(load_optimizer_states=False)`: master weights
converted, Adam moments and step fresh). Rank 0 writes OUTPUT_DIR/relayout.json: the loss per step and what the
resume converted (`trainer.relayout`, None when the checkpoint's layout was the running one).
"""

import dataclasses
import json
import sys
import warnings
from pathlib import Path

from transformers import AutoModelForCausalLM

from hf_dist_recipes import RecipeTrainer
from hf_dist_recipes._compat import accelerate as compat_accelerate
from tests.distributed.workers.checkpointed_run import checkpointed_run_args
from tests.distributed.workers.lifecycle_worker import datasets
from tests.distributed.workers.runs import mark_run_end, split_runs


class WeightsOnly(RecipeTrainer):
    """The control: the engine's resume is asked for the weights only (a fresh optimizer)."""

    def create_scheduler(self, num_training_steps, optimizer=None):
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        engine = compat_accelerate.training_engine(self)
        if engine is not None and not getattr(engine, "_weights_only", False):
            load = engine.load_checkpoint
            engine.load_checkpoint = lambda path, **kw: load(path, **{**kw, "load_optimizer_states": False})
            engine._weights_only = True
        return scheduler


def main(output_dir: str, pretrained: str, steps: int, save_steps: int, resume: str | None, fresh: bool) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    args = checkpointed_run_args(output_dir, steps, save_steps)
    model = AutoModelForCausalLM.from_pretrained(pretrained)
    train, _ = datasets(model.config.vocab_size)
    trainer = (WeightsOnly if fresh else RecipeTrainer)(model=model, args=args, train_dataset=train)
    trainer.train(resume_from_checkpoint=resume)
    if args.process_index == 0:
        history = trainer.state.log_history
        relayout = trainer.relayout
        Path(output_dir, "relayout.json").write_text(
            json.dumps(
                {
                    "loss": {e["step"]: e["loss"] for e in history if "loss" in e},
                    "lr": {e["step"]: e["learning_rate"] for e in history if "learning_rate" in e},
                    "relayout": None if relayout is None else dataclasses.asdict(relayout),
                }
            )
        )


if __name__ == "__main__":
    runs = split_runs(sys.argv[1:])
    for index, (output_dir, pretrained, steps, save_steps, *rest) in enumerate(runs):
        main(
            output_dir,
            pretrained,
            int(steps),
            int(save_steps),
            resume=rest[0] if rest and rest[0] != "-" else None,
            fresh="fresh-optimizer" in rest,
        )
        if index < len(runs) - 1:
            import torch.distributed as dist

            mark_run_end(index, dist.get_rank())
