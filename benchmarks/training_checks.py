"""Cost of the training checks (issue 8) at their defaults against the same run with them off, at two model sizes,
interleaved in one launch:
- seeds (`seed_check="error"`): the weight checksum when the trainer is built, the seed / data-order gather at train
  begin, and every `rank_check_steps` (100) one all-gather of the step, learning rate and TP-group values;
- gradient health (`nonfinite_policy="skip"`): a loss flag per micro-step and, under DeepSpeed ZeRO-3, one fused
  norm call per gradient bucket before the reduce-scatter and one all-reduce of the spike checks' losses per
  logging step (elsewhere a gradient-sum hook per parameter tensor and one all-reduce per step).
Off: `seed_check="off"`, `rank_check_steps=0`, `nonfinite_policy="off"`.

    python benchmarks/training_checks.py                        # one process
    accelerate launch --config_file accelerate_configs/cpu_zero3_2proc.yaml benchmarks/training_checks.py
                                                                # 2 ranks, DeepSpeed ZeRO-3

Sizes (`--sizes`): "demo" is the demo model (1,012,224 parameters, hidden 128, micro batch 8); "small" the same
60 parameter tensors at hidden 64 (534,976 parameters) with micro batch 4, a shorter step on which a cost fixed per
tensor and per step weighs most. An untimed warm-up run comes first (the first run in a process is slower: imports,
caches, the first engine). Each round then runs every size off and with the checks, back to back, the order
flipped every other round (use an even --rounds), so that machine noise and drift hit both alike.

Two measures per size:
- end to end: the wall time of each loop iteration (on_step_begin to the next, so every callback and the logging
  are in it), the first --skip steps of each run excluded; the median of each setting over all rounds, their
  ratio (checks / off; 1.00 = no cost) and difference, the ratio of each round's medians (the spread), the mean
  ratio (includes the periodic rank check) and the whole-run ratio (includes the start-up checks);
- direct: the wall time spent inside the checks' per-step code (`GuardClock`: every per-step entry point of the
  gradient-health and rank-agreement callbacks, the per-tensor hooks and ZeRO-3 bucket watch included), per
  step, on rank 0, and that over the off median step. This is the fixed cost in ms, free of the run-to-run noise
  that dominates the end-to-end numbers on a shared machine; a wait it caused elsewhere (a collective that
  makes a rank wait for the other) is not in it, but the waits happen inside the timed calls.
Also prints the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
import warnings

from _timing import IterationTimer  # benchmarks/ is on sys.path when a benchmark runs as a script

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.reproducibility.rank_agreement import RankAgreementCallback
from hf_dist_recipes.stability.gradient_health import GradientHealthCallback

OFF = {"seed_check": "off", "rank_check_steps": 0, "nonfinite_policy": "off"}
SIZES = {  # name -> (model overrides, micro batch)
    "demo": ({}, 8),
    "small": ({"hidden_size": 64}, 4),
}


class GuardClock:
    """Wall seconds spent inside the checks' per-step code, summed (installed once, class-wide)."""

    PER_STEP = {
        GradientHealthCallback: (
            "on_micro_batch_loss",
            "on_grad_norm",
            "_observe_bucket",
            "on_pre_optimizer_step",
            "on_step_end",
            "_log_counters",
        ),
        RankAgreementCallback: ("on_micro_step", "on_step_end"),
    }

    def __init__(self):
        self.seconds = 0.0
        for cls, names in self.PER_STEP.items():
            for name in names:
                if hasattr(cls, name):  # an older version may lack one (e.g. the ZeRO-3 bucket watch)
                    setattr(cls, name, self._timed(getattr(cls, name)))
        hook_factory = GradientHealthCallback._grad_hook
        GradientHealthCallback._grad_hook = lambda cb, index: self._timed(hook_factory(cb, index))

    def _timed(self, method):
        @functools.wraps(method)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def run_one(size: str, setting: str, steps: int, out: str, clock: GuardClock) -> dict:
    """Iteration seconds, whole-run seconds, guard seconds per step, and this rank."""
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
    timer = IterationTimer()
    data = stdlib_dataset(seq_len=128, max_bytes=1_000_000)
    start = time.perf_counter()
    trainer = RecipeTrainer(
        model_init=lambda: build_tiny_deepseek(**overrides), args=args, callbacks=[timer], train_dataset=data
    )
    guard_before = clock.seconds
    trainer.train()
    return {
        "times": timer.times,
        "run_s": time.perf_counter() - start,
        "guard_s_per_step": (clock.seconds - guard_before) / steps,
        "rank": args.process_index,
    }


def summarize(rounds: list[dict[str, dict]], skip: int) -> dict:
    """`rounds`: per round, setting -> run_one's result."""
    pooled = {k: [t for r in rounds for t in r[k]["times"][skip:]] for k in ("off", "checks")}
    med = {k: statistics.median(v) for k, v in pooled.items()}
    mean = {k: statistics.fmean(v) for k, v in pooled.items()}
    per_round = [
        statistics.median(r["checks"]["times"][skip:]) / statistics.median(r["off"]["times"][skip:]) for r in rounds
    ]
    run = {k: statistics.fmean(r[k]["run_s"] for r in rounds) for k in ("off", "checks")}
    guard = {k: statistics.fmean(r[k]["guard_s_per_step"] for r in rounds) for k in ("off", "checks")}
    return {
        "steps_timed_each": len(pooled["off"]),
        "median_step_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "ratio_median": round(med["checks"] / med["off"], 4),
        "difference_ms": round((med["checks"] - med["off"]) * 1e3, 2),
        "ratio_per_round": [round(r, 4) for r in per_round],
        "ratio_mean": round(mean["checks"] / mean["off"], 4),
        "ratio_run": round(run["checks"] / run["off"], 4),
        "guard_ms_per_step": {k: round(v * 1e3, 3) for k, v in guard.items()},
        "guard_over_off_step": round((guard["checks"] - guard["off"]) / med["off"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run (%(default)s)")
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps excluded from timing (%(default)s)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds, even (%(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=20, help="untimed first run (%(default)s; 0: none)")
    parser.add_argument("--sizes", default="demo,small", help=f"comma-separated, of: {', '.join(SIZES)}")
    opts = parser.parse_args()
    sizes = [s for s in opts.sizes.split(",") if s]
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown or opts.rounds < 1:
        parser.error(f"sizes from {sorted(SIZES)} (got unknown {unknown}) and --rounds >= 1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    clock = GuardClock()
    if opts.warmup_steps:
        with tempfile.TemporaryDirectory() as out:
            run_one(sizes[0], "checks", opts.warmup_steps, out, clock)
    load_before = os.getloadavg()
    results: dict[str, list[dict[str, dict]]] = {s: [] for s in sizes}
    rank = 0
    for i in range(opts.rounds):
        order = ("off", "checks") if i % 2 == 0 else ("checks", "off")
        for size in sizes:
            measured = {}
            for setting in order:
                with tempfile.TemporaryDirectory() as out:
                    measured[setting] = run_one(size, setting, opts.steps, out, clock)
                rank = measured[setting]["rank"]
            results[size].append(measured)
    load_after = os.getloadavg()
    if rank != 0:
        return
    report = {
        "load_average_1_5_15_before": [round(x, 2) for x in load_before],
        "load_average_1_5_15_after": [round(x, 2) for x in load_after],
        "rounds": opts.rounds,
    }
    report.update({size: summarize(results[size], opts.skip) for size in sizes})
    print(json.dumps(report))
    for size in sizes:
        r = report[size]
        print(
            f"{size}: median step off {r['median_step_ms']['off']:.1f} ms, checks {r['median_step_ms']['checks']:.1f}"
            f" ms, ratio {r['ratio_median']:.4f} (per round {min(r['ratio_per_round']):.4f}-"
            f"{max(r['ratio_per_round']):.4f}, mean {r['ratio_mean']:.4f}, whole run {r['ratio_run']:.4f}); "
            f"inside the checks {r['guard_ms_per_step']['checks']:.3f} ms per step = "
            f"{100 * r['guard_over_off_step']:.2f}% of the off step"
        )
    print(f"load average (1, 5, 15 min): before {load_before}, after {load_after}")


if __name__ == "__main__":
    main()
