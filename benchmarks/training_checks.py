"""Cost of the training checks (issue 8) at their defaults against the same run with them off, at two model sizes,
interleaved in one launch:
- seeds (`seed_check="error"`): the weight checksum when the trainer is built, the seed / data-order gather at train
  begin, and every `rank_check_steps` (100) one all-gather of the step, learning rate and TP-group values;
- gradient health (`nonfinite_policy="skip"`): a loss flag per micro-step and, under DeepSpeed ZeRO-3, one fused
  norm per gradient bucket before the reduce-scatter (elsewhere a gradient-sum hook per parameter tensor and one
  all-reduce per step); the spike checks (one all-reduce per logging step under ZeRO-3).
Off: `seed_check="off"`, `rank_check_steps=0`, `nonfinite_policy="off"`.

    python benchmarks/training_checks.py                        # one process
    accelerate launch --config_file accelerate_configs/cpu_zero3_2proc.yaml benchmarks/training_checks.py
                                                                # 2 ranks, DeepSpeed ZeRO-3

Sizes (`--sizes`): "demo" is the demo model (1,012,224 parameters, hidden 128, micro batch 8); "small" the same
60 parameter tensors at hidden 64 (534,976 parameters) with micro batch 4, a shorter step on which a cost fixed per
tensor and per step weighs most. Each round runs every size off and with the checks, back to back, the order
flipped every other round, so that machine noise hits both alike. Step time: on_step_begin -> on_step_end, wall
clock, the first --skip steps of each run excluded. Prints per size the median step of each setting over all
rounds, their ratio (checks / off; 1.00 = no cost) and difference (the fixed cost per step, ms), the ratio of each
round's medians (the spread), the mean ratio (includes the periodic rank check), and the machine's load average
before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings

from _timing import StepTimer  # benchmarks/ is on sys.path when a benchmark runs as a script

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek

OFF = {"seed_check": "off", "rank_check_steps": 0, "nonfinite_policy": "off"}
SIZES = {  # name -> (model overrides, micro batch)
    "demo": ({}, 8),
    "small": ({"hidden_size": 64}, 4),
}


def run_one(size: str, setting: str, steps: int, out: str) -> tuple[list[float], float, int]:
    overrides, micro = SIZES[size]
    checks = OFF if setting == "off" else {}
    args = RecipeTrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=micro,
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
    trainer = RecipeTrainer(
        model_init=lambda: build_tiny_deepseek(**overrides), args=args, callbacks=[timer], train_dataset=data
    )
    trainer.train()
    return timer.times, time.perf_counter() - start, args.process_index


def summarize(rounds: list[dict[str, list[float]]]) -> dict:
    """`rounds`: per round, setting -> timed step seconds. Medians over all rounds, per-round ratios, fixed cost."""
    pooled = {k: [t for r in rounds for t in r[k]] for k in ("off", "checks")}
    med = {k: statistics.median(v) for k, v in pooled.items()}
    mean = {k: statistics.fmean(v) for k, v in pooled.items()}
    per_round = [statistics.median(r["checks"]) / statistics.median(r["off"]) for r in rounds]
    return {
        "steps_timed_each": len(pooled["off"]),
        "median_step_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "ratio_median": round(med["checks"] / med["off"], 4),
        "fixed_cost_ms": round((med["checks"] - med["off"]) * 1e3, 2),
        "ratio_per_round": [round(r, 4) for r in per_round],
        "ratio_mean": round(mean["checks"] / mean["off"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run (%(default)s)")
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps excluded from timing (%(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (%(default)s)")
    parser.add_argument("--sizes", default="demo,small", help=f"comma-separated, of: {', '.join(SIZES)}")
    opts = parser.parse_args()
    sizes = [s for s in opts.sizes.split(",") if s]
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown:
        parser.error(f"unknown size(s) {unknown}; choose from {sorted(SIZES)}")
    warnings.filterwarnings("ignore", category=FutureWarning)
    load_before = os.getloadavg()
    results: dict[str, list[dict[str, list[float]]]] = {s: [] for s in sizes}
    totals: dict[str, dict[str, list[float]]] = {s: {"off": [], "checks": []} for s in sizes}
    rank = 0
    for i in range(opts.rounds):
        order = ("off", "checks") if i % 2 == 0 else ("checks", "off")
        for size in sizes:
            measured = {}
            for setting in order:
                with tempfile.TemporaryDirectory() as out:
                    times, total, rank = run_one(size, setting, opts.steps, out)
                measured[setting] = times[opts.skip :]
                totals[size][setting].append(total)
            results[size].append(measured)
    load_after = os.getloadavg()
    if rank != 0:
        return
    report = {
        "load_average_1_5_15_before": [round(x, 2) for x in load_before],
        "load_average_1_5_15_after": [round(x, 2) for x in load_after],
        "rounds": opts.rounds,
    }
    for size in sizes:
        report[size] = summarize(results[size])
        report[size]["ratio_run"] = round(
            statistics.fmean(totals[size]["checks"]) / statistics.fmean(totals[size]["off"]), 4
        )
    print(json.dumps(report))
    for size in sizes:
        r = report[size]
        print(
            f"{size}: median step off {r['median_step_ms']['off']:.1f} ms, checks {r['median_step_ms']['checks']:.1f}"
            f" ms, ratio {r['ratio_median']:.4f}, fixed cost {r['fixed_cost_ms']:+.2f} ms per step; per round "
            f"{min(r['ratio_per_round']):.4f}-{max(r['ratio_per_round']):.4f}; mean ratio {r['ratio_mean']:.4f}"
        )
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")


if __name__ == "__main__":
    main()
