"""A job that something ends, run on every rank under `accelerate launch` by tests/distributed/test_job_dies.py and
test_sbatch_requeue.py (under the generated sbatch script):

    survival_worker.py OUTPUT_DIR STEPS SAVE_STEPS [kill-at=K] [step-pause=S] [then OUTPUT_DIR STEPS SAVE_STEPS ...]

Trains a tiny Llama from its config (the same weights on every attempt: the recipe seeds before the model is built)
with `auto_resume=True`, STEPS steps, a checkpoint every SAVE_STEPS, then `save_model` to OUTPUT_DIR/final.
`kill-at=K`: rank 1 ends itself with SIGKILL at the end of step K, on the launcher's first attempt only
(TORCHELASTIC_RESTART_COUNT=0), as a dead node would. `step-pause=S`: each step end waits S seconds, so that a test
can signal the launcher between two steps. Each rank writes OUTPUT_DIR/progress/rank<N> (the last step ended) at
every step end, OUTPUT_DIR/survival/rank<N>-attempt<A>.json at the end of each attempt that returns from train()
(the first step it trained, the step it ended at, its losses), and OUTPUT_DIR/exits/rank<N> with the code of a
SystemExit that train() raised (the recipe's exit after a save on a signal).
"""

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

from transformers import AutoModelForCausalLM, TrainerCallback

from hf_dist_recipes import RecipeTrainer
from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.demo.data import TokenBlocks, stdlib_dataset, token_blocks
from tests.distributed.workers.checkpointed_run import checkpointed_run_args
from tests.distributed.workers.runs import mark_run_end, split_runs

SEQ_LEN = 32


class Progress(TrainerCallback):
    def __init__(self, output_dir: str, kill_at: int | None, pause_s: float):
        self.output_dir, self.kill_at, self.pause_s = Path(output_dir), kill_at, pause_s
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.first_step: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.first_step is None:
            self.first_step = state.global_step
        folder = self.output_dir / "progress"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{args.process_index}").write_text(str(state.global_step))
        if state.global_step == self.kill_at and args.process_index == 1 and self.attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.pause_s)


def main(output_dir: str, steps: int, save_steps: int, kill_at: int | None, pause_s: float) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    args = checkpointed_run_args(output_dir, steps, save_steps, auto_resume=True)
    model = AutoModelForCausalLM.from_config(template_config("tiny-llama"))
    train = TokenBlocks(token_blocks(stdlib_dataset(seq_len=SEQ_LEN, max_bytes=60_000), model.config.vocab_size).tokens)
    progress = Progress(output_dir, kill_at, pause_s)
    trainer = RecipeTrainer(model=model, args=args, train_dataset=train, callbacks=[progress])
    trainer.train()
    trainer.save_model(str(Path(output_dir) / "final"))
    out = Path(output_dir) / "survival"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{args.process_index}-attempt{progress.attempt}.json").write_text(
        json.dumps(
            {
                "first_step": progress.first_step,
                "global_step": trainer.state.global_step,
                "loss": {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e},
            }
        )
    )


if __name__ == "__main__":
    runs = split_runs(sys.argv[1:])
    for index, (output_dir, steps, save_steps, *rest) in enumerate(runs):
        options = dict(word.split("=", 1) for word in rest)
        kill_at = int(options["kill-at"]) if "kill-at" in options else None
        try:
            main(output_dir, int(steps), int(save_steps), kill_at, float(options.get("step-pause", "0")))
        except SystemExit as stop:  # the recipe's exit after a save on a signal: its code, for the test
            folder = Path(output_dir) / "exits"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank{os.environ.get('RANK', '0')}").write_text(str(stop.code))
            raise
        if index < len(runs) - 1:
            mark_run_end(index, int(os.environ.get("RANK", "0")))
