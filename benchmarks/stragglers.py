"""Cost of live straggler detection (`hf_dist_recipes.monitoring.stragglers`): the same run with
`straggler_check_steps=K` against `straggler_check_steps=0` (off), one run, settings alternating.

    accelerate launch --config_file accelerate_configs/cpu_zero3_2proc.yaml benchmarks/stragglers.py [--check-steps 5]

What a check costs: two all-gathers of one float64 per rank every K steps (and one `all_gather_object` of the host
names at train begin). The check runs in `on_step_begin`, so the step timer here is the whole loop iteration (one
`on_step_begin` to the next), not `benchmarks/_timing.StepTimer`'s begin -> end, which would leave the check out.
Also timed directly: each check on rank 0 (wall clock of the straggler callback's `on_step_begin` on the steps it
checks, between two timing callbacks placed around it in the trainer's callback list), whose mean divided by K is the
cost per step. The first --skip iterations of each run are not timed. Prints medians, means and the ratios on / off
(1.00 = no cost), from rank 0. With one process the callback does nothing (nothing to compare).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings

import torch
from _timing import IterationTimer  # benchmarks/ is on sys.path when a benchmark runs as a script
from transformers import TrainerCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.monitoring.stragglers import StragglerCallback


class _Stamp(TrainerCallback):
    """Calls `at(state)` in `on_step_begin`; one goes right before the straggler callback, one right after."""

    def __init__(self, at):
        self.at = at

    def on_step_begin(self, args, state, control, **kwargs):
        self.at(state)


def timed_checks(trainer: RecipeTrainer) -> list[float]:
    """Times the trainer's straggler callback's checks through public hooks only: a callback on each side of it in
    `callback_handler.callbacks`; the time between them on a step the callback checks (every `check_steps`-th,
    after the first step) is the check's. Returns the list it fills."""
    seconds: list[float] = []
    callbacks = trainer.callback_handler.callbacks
    at = next(i for i, c in enumerate(callbacks) if isinstance(c, StragglerCallback))
    k = callbacks[at].check_steps
    started = [0.0]

    def start(state) -> None:
        started[0] = time.perf_counter()

    def stop(state) -> None:
        # The callback checks only with more than one process (torch.distributed initialised by then).
        checks = k and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        if checks and state.global_step and state.global_step % k == 0:
            seconds.append(time.perf_counter() - started[0])

    callbacks[at : at + 1] = [_Stamp(start), callbacks[at], _Stamp(stop)]
    return seconds


def run_one(check_steps: int, steps: int, out: str) -> tuple[list[float], list[float], float, int]:
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
        straggler_check_steps=check_steps,
    )
    timer = IterationTimer()
    data = stdlib_dataset(seq_len=128, max_bytes=1_000_000)
    trainer = RecipeTrainer(model_init=lambda: build_tiny_deepseek(), args=args, callbacks=[timer], train_dataset=data)
    checks = timed_checks(trainer)
    start = time.perf_counter()
    trainer.train()
    return timer.times, checks, time.perf_counter() - start, args.process_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check-steps", type=int, default=5, help="K of the 'on' runs (%(default)s; default 50)")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run (%(default)s)")
    parser.add_argument("--skip", type=int, default=10, help="warm-up iterations excluded from timing (%(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (%(default)s)")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    times: dict[str, list[float]] = {"off": [], "on": []}
    totals: dict[str, list[float]] = {"off": [], "on": []}
    check_s: list[float] = []
    rank = 0
    for _ in range(opts.rounds):
        for setting, k in (("off", 0), ("on", opts.check_steps)):
            with tempfile.TemporaryDirectory() as out:
                measured, checks, total, rank = run_one(k, opts.steps, out)
            times[setting] += measured[opts.skip :]
            totals[setting].append(total)
            check_s += checks
    if rank != 0:
        return
    med = {k: statistics.median(v) for k, v in times.items()}
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    total = {k: statistics.fmean(v) for k, v in totals.items()}
    per_check = statistics.fmean(check_s) if check_s else float("nan")
    print(
        json.dumps(
            {
                "check_steps": opts.check_steps,
                "iterations_timed_each": len(times["off"]),
                "median_iteration_s": med,
                "mean_iteration_s": mean,
                "train_s": total,
                "checks": len(check_s),
                "mean_check_s": per_check,
                "median_check_s": statistics.median(check_s) if check_s else None,
                "check_cost_per_step_over_off_median": per_check / opts.check_steps / med["off"],
                "ratio_median": round(med["on"] / med["off"], 4),
                "ratio_mean": round(mean["on"] / mean["off"], 4),
                "ratio_train": round(total["on"] / total["off"], 4),
            }
        )
    )
    print(
        f"K={opts.check_steps}: median iteration off {med['off'] * 1e3:.1f} ms, on {med['on'] * 1e3:.1f} ms, ratio "
        f"{med['on'] / med['off']:.4f}; mean ratio {mean['on'] / mean['off']:.4f}; train() ratio "
        f"{total['on'] / total['off']:.4f}; one check {per_check * 1e3:.2f} ms (mean of {len(check_s)}) = "
        f"{per_check / opts.check_steps / med['off']:.3%} of a step at K={opts.check_steps}"
    )


if __name__ == "__main__":
    main()
