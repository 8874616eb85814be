"""Run on every rank by tests/distributed/test_seed_agreement.py under `accelerate launch` (2 CPU ranks, ZeRO-3).

    seed_worker.py OUTPUT_DIR SEED STEPS [--build from_config|class] [--skew-rank R] [--policy P]
                   [--rank-check-steps K] [--perturb-lr-rank R --perturb-lr-from S] [--dropout D]
                   [then OUTPUT_DIR SEED STEPS [options]]...

The order of the HuggingFace examples, no set_seed: RecipeTrainingArguments, then the model (tiny-deepseek-v3
template shrunk, attention dropout D, default 0.1), then RecipeTrainer. `--build from_config` builds through
`AutoModelForCausalLM.from_config` (under ZeRO-3 inside zero.Init: rank 0 initialises, DeepSpeed broadcasts);
`class` calls the model class (built whole on every rank). `--skew-rank R`: rank R reseeds torch with SEED + 1
just before building the model (a rank built from a different RNG state). `--perturb-lr-rank R`: at the end of
optimizer step S, rank R's schedule is scaled by 1.5 (the learning rate differs from step S + 1 on). Writes
OUTPUT_DIR/seed/rank<N>.json: the logged losses, grad norms and rank_check/* values. Each `then ...` is one more
run, in order, in the same processes (tests/distributed/workers/runs.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, TrainerCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import TokenBlocks
from hf_dist_recipes.demo.model import tiny_deepseek_config
from tests.distributed.workers.runs import split_runs

SEQ, SAMPLES = 16, 64


def token_data(vocab: int) -> TokenBlocks:
    """Fixed random tokens from a private generator: the data do not depend on the global RNG."""
    return TokenBlocks(torch.randint(0, vocab, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(0)))


class PerturbLr(TrainerCallback):
    def __init__(self, rank: int, start: int):
        self.rank, self.start = rank, start

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        # The schedule's base rate, not the optimizer's current one, which the next scheduler step overwrites.
        if args.process_index == self.rank and state.global_step == self.start:
            lr_scheduler.base_lrs = [lr * 1.5 for lr in lr_scheduler.base_lrs]


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("output_dir")
    p.add_argument("seed", type=int)
    p.add_argument("steps", type=int)
    p.add_argument("--build", default="from_config")
    p.add_argument("--skew-rank", type=int, default=None)
    p.add_argument("--policy", default="error")
    p.add_argument("--rank-check-steps", type=int, default=100)
    p.add_argument("--perturb-lr-rank", type=int, default=None)
    p.add_argument("--perturb-lr-from", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.1)
    opts = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    args = RecipeTrainingArguments(
        output_dir=opts.output_dir,
        seed=opts.seed,
        max_steps=opts.steps,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed_check=opts.policy,
        rank_check_steps=opts.rank_check_steps,
    )
    config = tiny_deepseek_config(hidden_size=32, num_hidden_layers=2, attention_dropout=opts.dropout)
    if opts.skew_rank == args.process_index:
        torch.manual_seed(opts.seed + 1)
    if opts.build == "class":
        model = AutoModelForCausalLM._model_mapping[type(config)](config)  # the class itself: no zero.Init
    else:
        model = AutoModelForCausalLM.from_config(config)
    callbacks = [] if opts.perturb_lr_rank is None else [PerturbLr(opts.perturb_lr_rank, opts.perturb_lr_from)]
    trainer = RecipeTrainer(model=model, args=args, train_dataset=token_data(config.vocab_size), callbacks=callbacks)
    trainer.train()
    history = trainer.state.log_history
    out = {
        "losses": [e["loss"] for e in history if "loss" in e],
        "grad_norms": [e["grad_norm"] for e in history if "grad_norm" in e],
        # The periodic rank_check/ok is in log_history; the train-begin report only in the per-rank logs
        # (begin_report): a resumed run would log it where the uninterrupted one did not.
        "rank_check": {
            **trainer.rank_agreement.begin_report,
            **{k: v for e in history for k, v in e.items() if k.startswith("rank_check/")},
        },
        "begin_report_in_history": any("rank_check/seed_ok" in e for e in history),
    }
    target = Path(opts.output_dir) / "seed"
    target.mkdir(parents=True, exist_ok=True)
    (target / f"rank{args.process_index}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    for run in split_runs(sys.argv[1:]):
        main(run)
