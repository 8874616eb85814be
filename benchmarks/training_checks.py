"""Cost of the training checks of issue 8 at their defaults against the same run with them off, one run:
- seeds (`seed_check="error"`): the weight checksum when the trainer is built, the seed / data-order gather at train
  begin, and every `rank_check_steps` (100) one all-gather of the step, learning rate and TP-group values;
- gradient health (`nonfinite_policy="skip"`): a loss flag and a gradient-sum hook per parameter every micro-step,
  one all-reduce of world_size + 1 float64 and the spike windows every step.
Off: `seed_check="off"`, `rank_check_steps=0`, `nonfinite_policy="off"`.

    python benchmarks/training_checks.py                        # one process
    accelerate launch --config_file accelerate_configs/cpu_zero3_2proc.yaml benchmarks/training_checks.py
                                                                # 2 ranks, DeepSpeed ZeRO-3

The two settings alternate for --rounds rounds so that machine noise hits both alike. Step time: on_step_begin ->
on_step_end, wall clock, the first --skip steps of each run excluded. Prints the median and mean step time of each
(the mean includes the periodic rank check: run more than rank_check_steps steps), the mean time from building the
trainer to the end of training per run (the start-up checks), and the ratios checks / off (1.00 = no cost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings

from _timing import StepTimer  # benchmarks/ is on sys.path when a benchmark runs as a script

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek

OFF = {"seed_check": "off", "rank_check_steps": 0, "nonfinite_policy": "off"}


def run_one(setting: str, steps: int, out: str) -> tuple[list[float], float, int]:
    checks = OFF if setting == "off" else {}
    args = RecipeTrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        dataloader_drop_last=True,
        disable_tqdm=True,
        seed=42,
        per_rank_tensorboard=False,
        **checks,
    )
    timer = StepTimer()
    data = stdlib_dataset(seq_len=128, max_bytes=1_000_000)
    start = time.perf_counter()
    trainer = RecipeTrainer(model_init=lambda: build_tiny_deepseek(), args=args, callbacks=[timer], train_dataset=data)
    trainer.train()
    return timer.times, time.perf_counter() - start, args.process_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run (%(default)s)")
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps excluded from timing (%(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (%(default)s)")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    times = {"off": [], "defaults": []}
    totals = {"off": [], "defaults": []}
    rank = 0
    for _ in range(opts.rounds):
        for setting in ("off", "defaults"):
            with tempfile.TemporaryDirectory() as out:
                measured, total, rank = run_one(setting, opts.steps, out)
            times[setting] += measured[opts.skip :]
            totals[setting].append(total)
    if rank != 0:
        return
    med = {k: statistics.median(v) for k, v in times.items()}
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    total = {k: statistics.fmean(v) for k, v in totals.items()}
    print(
        json.dumps(
            {
                "steps_timed_each": len(times["off"]),
                "median_step_s": med,
                "mean_step_s": mean,
                "run_s": total,
                "ratio_median": round(med["defaults"] / med["off"], 4),
                "ratio_mean": round(mean["defaults"] / mean["off"], 4),
                "ratio_run": round(total["defaults"] / total["off"], 4),
            }
        )
    )
    print(
        f"median step: off {med['off'] * 1e3:.1f} ms, defaults {med['defaults'] * 1e3:.1f} ms, "
        f"ratio {med['defaults'] / med['off']:.4f}; mean ratio {mean['defaults'] / mean['off']:.4f}; "
        f"whole run ratio {total['defaults'] / total['off']:.4f}"
    )


if __name__ == "__main__":
    main()
