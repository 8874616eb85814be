"""Cost of the gradient-health checks: optimizer-step time of RecipeTrainer at the defaults (nonfinite_policy="skip":
a loss flag and a gradient-sum hook per parameter every micro-step, one all-reduce of world_size + 1 float64 and
the spike windows every step) against nonfinite_policy="off", same model, data and settings, one run.

    python benchmarks/gradient_health.py                        # one process
    accelerate launch --config_file accelerate_configs/cpu_zero3_2proc.yaml benchmarks/gradient_health.py
                                                                # 2 ranks, DeepSpeed ZeRO-3

The two settings alternate for --rounds rounds so that machine noise hits both alike. Step time: on_step_begin ->
on_step_end, wall clock, the first --skip steps of each run excluded. Prints the median step time of each and the
ratio checks / off (1.00 = no cost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings

from transformers import TrainerCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self._t = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t)


def run_one(policy: str, steps: int, out: str) -> tuple[list[float], int]:
    args = RecipeTrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3,
                                   logging_steps=10, save_strategy="no", report_to="none", dataloader_drop_last=True,
                                   disable_tqdm=True, seed=42, nonfinite_policy=policy, per_rank_tensorboard=False)
    timer = StepTimer()
    trainer = RecipeTrainer(model_init=lambda: build_tiny_deepseek(), args=args, callbacks=[timer],
                            train_dataset=stdlib_dataset(seq_len=128, max_bytes=1_000_000))
    trainer.train()
    return timer.times, args.process_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (%(default)s)")
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps excluded from timing (%(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (%(default)s)")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    times = {"off": [], "skip": []}
    rank = 0
    for _ in range(opts.rounds):
        for policy in ("off", "skip"):
            with tempfile.TemporaryDirectory() as out:
                measured, rank = run_one(policy, opts.steps, out)
            times[policy] += measured[opts.skip:]
    if rank != 0:
        return
    off, on = statistics.median(times["off"]), statistics.median(times["skip"])
    print(json.dumps({"steps_timed_each": len(times["off"]), "off_median_step_s": round(off, 5),
                      "checks_median_step_s": round(on, 5), "ratio_checks_over_off": round(on / off, 4)}))
    print(f"median step: checks off {off * 1e3:.1f} ms, at defaults {on * 1e3:.1f} ms, ratio {on / off:.4f}")


if __name__ == "__main__":
    main()
