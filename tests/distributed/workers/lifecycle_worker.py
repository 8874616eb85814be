"""A real job's shape, run on every rank under `accelerate launch` by tests/distributed/test_checkpoint_lifecycle.py:

    lifecycle_worker.py OUTPUT_DIR PRETRAINED_DIR STEPS SAVE_STEPS [RESUME_CHECKPOINT|-] [no-eval-first]
                        [hf-in-checkpoints] [then OUTPUT_DIR PRETRAINED_DIR ...]...

In the order of the HuggingFace examples -- arguments, then `from_pretrained`, then the trainer -- with no other
set-up: evaluate on a fixed set before training (skipped when resuming, or with `no-eval-first`), train STEPS
steps writing a checkpoint every SAVE_STEPS (`save_strategy="steps"`; with `hf-in-checkpoints` each holds the HF
weights too), evaluate again, and `save_model` to OUTPUT_DIR/final (every rank writes its share of SHARD-sized
files), then the same weights with the single writer (rank 0 writes every file, as before shared writing) to
OUTPUT_DIR/final_single, for the tests to compare byte for byte. Each rank writes
OUTPUT_DIR/lifecycle/rank<N>.json: evaluation losses, and per optimizer step the loss, learning rate and the hashes
of the batches this rank trained on, and per checkpoint the default group's collective timeout right after
save_model wrote into it and after the checkpoint was complete (on_save), and the process state at train begin
with the recipe's warnings (`tests.support.process_state`: the recipe route of issue 30 section 1), and what the engine
read on resume (`trainer.resume_loads`: each file, memory-mapped or not).

Each `then ...` is one more job, in order, in the same processes (new arguments and trainer;
tests/distributed/workers/runs.py): the test's run C without a launch of its own.
"""

import dataclasses
import hashlib
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, TrainerCallback

from hf_dist_recipes import RecipeTrainer
from hf_dist_recipes.checkpoint.export import save_hf_checkpoint
from hf_dist_recipes.demo.data import TokenBlocks, stdlib_dataset, token_blocks
from tests.distributed.workers.checkpointed_run import MICRO_BATCH, checkpointed_run_args
from tests.distributed.workers.runs import split_runs
from tests.support.process_state import ProcessStateAtTrainBegin, recipe_warnings

EVAL_SAMPLES = 16
SEQ_LEN = 32
SHARD = "64KB"  # tiny models: about a dozen files, so that every rank has some to write


def datasets(vocab_size: int):
    """Training blocks and a fixed evaluation set (the last EVAL_SAMPLES blocks, never trained on)."""
    tokens = token_blocks(stdlib_dataset(seq_len=SEQ_LEN, max_bytes=100_000), vocab_size).tokens
    return TokenBlocks(tokens[:-EVAL_SAMPLES]), TokenBlocks(tokens[-EVAL_SAMPLES:])


def main(
    output_dir: str,
    pretrained: str,
    steps: int,
    save_steps: int,
    resume: str | None = None,
    eval_first: bool = True,
    hf_in_checkpoints: bool = False,
) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    with recipe_warnings() as warned:
        args = checkpointed_run_args(
            output_dir,
            steps,
            save_steps,
            per_device_eval_batch_size=MICRO_BATCH,
            save_shard_size=SHARD,
            hf_weights_in_checkpoints=hf_in_checkpoints,
        )
    model = AutoModelForCausalLM.from_pretrained(pretrained)
    train, evaluation = datasets(model.config.vocab_size)
    batches: dict[int, list[str]] = {}
    timeouts: dict[int, list[float]] = {}

    def world_timeout() -> float:  # read back from the Gloo backend, as tests/unit/test_watchdog.py does
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    class AfterSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            timeouts.setdefault(state.global_step, []).append(world_timeout())

    class Recorder(RecipeTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            digest = hashlib.sha256(inputs["input_ids"].cpu().numpy().tobytes()).hexdigest()[:12]
            batches.setdefault(self.state.global_step + 1, []).append(digest)
            return super().training_step(model, inputs, num_items_in_batch)

        def save_model(self, output_dir=None, _internal_call=False):
            super().save_model(output_dir, _internal_call)
            if _internal_call:
                timeouts.setdefault(self.state.global_step, []).append(world_timeout())

    process_state = ProcessStateAtTrainBegin()
    with recipe_warnings() as warned_by_trainer:
        trainer = Recorder(model=model, args=args, train_dataset=train, eval_dataset=evaluation)
    trainer.add_callback(process_state)  # after the recipe's callbacks: sees the state they leave at train begin
    trainer.add_callback(AfterSave())  # after the recipe's watchdog callback: sees what its on_save left
    eval_before = trainer.evaluate()["eval_loss"] if eval_first and not resume else None
    trainer.train(resume_from_checkpoint=resume)
    eval_after = trainer.evaluate()["eval_loss"]
    trainer.save_model(str(Path(output_dir) / "final"))
    save_hf_checkpoint(
        trainer.accelerator.unwrap_model(trainer.model_wrapped),
        str(Path(output_dir) / "final_single"),
        max_shard_bytes=args.save_shard_bytes,
        shared=False,
    )
    history = trainer.state.log_history
    out = Path(output_dir) / "lifecycle"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{args.process_index}.json").write_text(
        json.dumps(
            {
                "rank": args.process_index,
                "eval_before": eval_before,
                "eval_after": eval_after,
                "loss": {e["step"]: e["loss"] for e in history if "loss" in e},
                "lr": {e["step"]: e["learning_rate"] for e in history if "learning_rate" in e},
                "history": history,
                "batches": batches,
                "save_timeouts": timeouts,
                "process_state": process_state.state,
                "resume_loads": dataclasses.asdict(trainer.resume_loads),
                "recipe_warnings": warned + warned_by_trainer,
            }
        )
    )


if __name__ == "__main__":
    for output_dir, pretrained, steps, save_steps, *rest in split_runs(sys.argv[1:]):
        main(
            output_dir,
            pretrained,
            int(steps),
            int(save_steps),
            resume=rest[0] if rest and rest[0] != "-" else None,
            eval_first="no-eval-first" not in rest,
            hf_in_checkpoints="hf-in-checkpoints" in rest,
        )
