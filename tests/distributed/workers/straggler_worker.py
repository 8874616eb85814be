"""Run on every rank by tests/distributed/test_straggler_ranks.py (and benchmarks/stragglers.py) under `accelerate
launch` (CPU ranks, DeepSpeed ZeRO-3).

    straggler_worker.py OUTPUT_DIR STEPS [--slow-rank R --delay-s S [--slow-until G]] [--check-steps K]
                        [--threshold T] [--windows M] [--mlflow] [then OUTPUT_DIR STEPS ...]

RecipeTrainingArguments -> tiny DeepSeek-V3 (template shrunk, built with from_config: under ZeRO-3 inside zero.Init)
-> RecipeTrainer. With --slow-rank, that rank alone sleeps S seconds at the beginning of every optimizer step (a
callback registered before the trainer's own, so the sleep lies where a slow data loader would: after the batch is
fetched, before the step's first collective), while the Trainer's global_step is <= G (default: always).
Writes OUTPUT_DIR/stragglers/rank<N>.json: the rank, its host name, the Trainer's log_history, the callback's
events and host list, and the train runtime. With --mlflow the run also reports to MLflow (`report_to=["mlflow"]`,
the MLflow run named after OUTPUT_DIR's last part; the store and the experiment come from the launch's
MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME), and rank 0 writes OUTPUT_DIR/trainer_state.json (`save_state`).
Runs joined by `then` run one after the other in the same processes (tests/distributed/workers/runs.py), rank 0
marking the end of each on stdout and stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.demo.data import TokenBlocks
from tests.distributed.workers.runs import mark_run_end, split_runs

SEQ, SAMPLES = 16, 256


class Slow(TrainerCallback):
    def __init__(self, rank: int | None, delay_s: float, until: int | None):
        self.rank, self.delay_s, self.until = rank, delay_s, until

    def on_step_begin(self, args, state, control, **kwargs):
        if args.process_index == self.rank and (self.until is None or state.global_step <= self.until):
            time.sleep(self.delay_s)


class RankLogs(TrainerCallback):
    """Each log as the per-rank TensorBoard run gets it (monitoring/tensorboard.py): the log the callbacks see
    (with the job channel's spread: slowest rank, largest RSS) and this rank's own values and event texts from the
    runtime's rank channel (`straggler_event`, `system/rss_gib`), which no `logs` dict carries. Both stay out of
    log_history (wall-clock values a resumed run would not repeat)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        # This rank's own window (the numbers its TensorBoard run gets: the same step, the same numbers).
        own = {f"own/{k}": v for k, v in self.runtime.rank_metrics.flush_window(state.global_step).items()}
        self.logs.append({**(logs or {}), **self.runtime.logs.last.rank, **own, "step": state.global_step})


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("steps", type=int)
    p.add_argument("--slow-rank", type=int, default=None)
    p.add_argument("--delay-s", type=float, default=0.0)
    p.add_argument("--slow-until", type=int, default=None)
    p.add_argument("--check-steps", type=int, default=5)
    p.add_argument("--threshold", type=float, default=0.2)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--mlflow", action="store_true")
    opts = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    args = RecipeTrainingArguments(
        output_dir=opts.output_dir,
        seed=0,
        max_steps=opts.steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=["mlflow"] if opts.mlflow else "none",
        run_name=Path(opts.output_dir).name,
        disable_tqdm=True,
        per_rank_tensorboard=False,
        straggler_check_steps=opts.check_steps,
        straggler_threshold=opts.threshold,
        straggler_windows=opts.windows,
    )
    config = template_config("tiny-deepseek-v3", hidden_size=32, num_hidden_layers=2)
    model = AutoModelForCausalLM.from_config(config)
    data = TokenBlocks(torch.randint(0, config.vocab_size, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(0)))
    slow = Slow(opts.slow_rank, opts.delay_s, opts.slow_until)
    trainer = RecipeTrainer(model=model, args=args, train_dataset=data, callbacks=[slow])
    rank_logs = RankLogs(trainer.runtime)
    trainer.add_callback(rank_logs)  # after RecipeTrainer's callbacks
    result = trainer.train()
    if opts.mlflow:
        trainer.save_state()  # trainer_state.json: the log_history a user finds on disk, next to MLflow's record
    straggler = trainer.recipe_callbacks.stragglers
    out = {
        "rank": args.process_index,
        "host": socket.gethostname(),
        "log_history": trainer.state.log_history,
        "rank_logs": rank_logs.logs,
        "events": straggler.events,
        "hosts": straggler.hosts,
        "train_runtime": result.metrics["train_runtime"],
    }
    target = Path(opts.output_dir) / "stragglers"
    target.mkdir(parents=True, exist_ok=True)
    (target / f"rank{args.process_index}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    runs = split_runs(sys.argv[1:])
    for index, run in enumerate(runs):
        main(run)
        if index < len(runs) - 1:
            mark_run_end(index, int(os.environ.get("RANK", "0")))
