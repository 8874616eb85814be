"""Cost of the per-rank system metrics (`hf_dist_recipes.monitoring.system_metrics.SystemMetricsCallback`): the same
single-process run with the callback against without it (removed), one run, settings alternating.

    python benchmarks/system_metrics.py [--steps 40] [--rounds 3]

Worst case on purpose: `logging_steps=1`, so a sample is taken at every step (with the default logging_steps the
cost per step is divided by it). Timed: each loop iteration (one `on_step_begin` to the next, callbacks included),
and each `sample()` call directly (wall clock). Goal: a sample costs at most 1% of a step. On a CPU-only host the
NVML keys are absent (no driver) and the CUDA ones too, so this measures psutil's RSS and CPU; on a GPU host the
NVML queries are included. Prints medians and the ratios (on / off: 1.00 = no cost; sample / step).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

from _timing import IterationTimer  # benchmarks/ is on sys.path when a benchmark runs as a script
from transformers import PrinterCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.monitoring.system_metrics import SystemMetricsCallback


def run_one(metrics_on: bool, steps: int, out: str) -> tuple[list[float], list[float], list[str]]:
    args = RecipeTrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_drop_last=True,
        disable_tqdm=True,
        seed=42,
        per_rank_tensorboard=False,
        seed_check="off",
    )
    timer = IterationTimer()
    data = stdlib_dataset(seq_len=128, max_bytes=1_000_000)
    trainer = RecipeTrainer(model_init=lambda: build_tiny_deepseek(), args=args, callbacks=[timer], train_dataset=data)
    trainer.remove_callback(PrinterCallback)  # disable_tqdm's per-log print: noise in the timing and the output
    samples: list[float] = []
    keys: list[str] = []
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, SystemMetricsCallback))
    if metrics_on:
        sample = callback.sample

        def timed():
            start = time.perf_counter()
            out = sample()
            samples.append(time.perf_counter() - start)
            keys[:] = sorted(out)
            return out

        callback.sample = timed
    else:
        trainer.remove_callback(SystemMetricsCallback)
    trainer.train()
    return timer.times, samples, keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run (%(default)s)")
    parser.add_argument("--skip", type=int, default=5, help="warm-up iterations excluded from timing (%(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (%(default)s)")
    opts = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    times = {True: [], False: []}
    samples: list[float] = []
    keys: list[str] = []
    for _ in range(opts.rounds):
        for on in (False, True):
            with tempfile.TemporaryDirectory() as out:
                iteration, sampled, names = run_one(on, opts.steps, out)
            times[on] += iteration[opts.skip :]
            samples += sampled
            keys = names or keys
    off, on = statistics.median(times[False]), statistics.median(times[True])
    per_sample = statistics.median(samples)
    print(f"keys sampled: {', '.join(keys)}")
    print(
        f"step (iteration) median: off {off * 1e3:.2f} ms, on {on * 1e3:.2f} ms, on/off {on / off:.3f} "
        f"({len(times[False])} + {len(times[True])} iterations, logging_steps=1)"
    )
    print(
        f"sample() median {per_sample * 1e6:.1f} us, mean {statistics.mean(samples) * 1e6:.1f} us, "
        f"max {max(samples) * 1e6:.1f} us over {len(samples)} samples"
    )
    print(f"sample / step (off median): {per_sample / off * 100:.3f}% (goal <= 1%)")


if __name__ == "__main__":
    main()
