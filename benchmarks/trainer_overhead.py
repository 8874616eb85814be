"""RecipeTrainer vs the stock Trainer: optimizer-step time, same model, same data, same settings, one run.

    python benchmarks/trainer_overhead.py                       # one process
    accelerate launch --config_file accelerate_configs/cpu_zero3_2proc.yaml benchmarks/trainer_overhead.py
                                                                # 2 ranks, DeepSpeed ZeRO-3 (as the demo)

The two trainers alternate for --rounds rounds so that machine noise hits both alike. Step time is measured by
one callback on both (on_step_begin -> on_step_end, wall clock), the first --skip steps of each run excluded.
Prints the median step time of each and the ratio RecipeTrainer / Trainer (1.00 = no overhead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import warnings

from _timing import StepTimer  # benchmarks/ is on sys.path when a benchmark runs as a script
from transformers import Trainer, TrainingArguments

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek


def run_one(kind: str, steps: int, out: str) -> list[float]:
    common = dict(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        warmup_steps=10,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        dataloader_drop_last=True,
        disable_tqdm=True,
        lr_scheduler_type="cosine_with_restarts",
        lr_scheduler_kwargs={"num_cycles": 3},
        max_grad_norm=1.0,
        seed=42,
    )
    if kind == "recipe":
        cls, args = RecipeTrainer, RecipeTrainingArguments(**common)
    else:
        cls, args = Trainer, TrainingArguments(use_cpu=True, **common)
    timer = StepTimer()
    trainer = cls(
        model_init=lambda: build_tiny_deepseek(),
        args=args,
        callbacks=[timer],
        train_dataset=stdlib_dataset(seq_len=128, max_bytes=1_000_000),
    )
    trainer.train()
    return timer.times, args.process_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (%(default)s)")
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps excluded from timing (%(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (%(default)s)")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    times = {"trainer": [], "recipe": []}
    rank = 0
    for _ in range(opts.rounds):
        for kind in ("trainer", "recipe"):
            with tempfile.TemporaryDirectory() as out:
                measured, rank = run_one(kind, opts.steps, out)
            times[kind] += measured[opts.skip :]
    if rank != 0:
        return
    base, ours = statistics.median(times["trainer"]), statistics.median(times["recipe"])
    print(
        json.dumps(
            {
                "steps_timed_each": len(times["trainer"]),
                "trainer_median_step_s": round(base, 5),
                "recipe_median_step_s": round(ours, 5),
                "ratio_recipe_over_trainer": round(ours / base, 3),
            }
        )
    )
    print(f"median step: Trainer {base * 1e3:.1f} ms, RecipeTrainer {ours * 1e3:.1f} ms, ratio {ours / base:.3f}")


if __name__ == "__main__":
    main()
