"""The per-rank callback's writing cost: torch's SummaryWriter (before) against `core.event_writer.RunWriter` (now),
side by side in one process.

    python benchmarks/event_writer.py                  # 2,000 logging steps, 5 repetitions
    python benchmarks/event_writer.py --calls 5000 --reps 3

One logging step is what `PerRankTensorBoardCallback.on_log` asks of its writer: 15 `add_scalar` (the Trainer's
loss, learning rate, grad norm and epoch, the job-wide spread, the rank's own values), one `add_text` (an event of
the step) and a `flush()`. The rest of on_log is the same for both writers and not timed. Timed per logging step,
median of --reps (the writers interleaved in each repetition, order reversed every other one): wall time (what the
training thread waits) and process CPU time (all threads: SummaryWriter serializes and writes on a thread of its own).
RunWriter is timed twice: with google-crc32c (the `report` extra) and with the numpy / Python fallback a training
image without that extra uses. The files' scalars and texts are read back and checked equal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TAGS = [
    "train/loss",
    "train/learning_rate",
    "train/grad_norm",
    "train/epoch",
    "train/straggler_slowest_rank",
    "train/straggler_ratio",
    "train/max_rss_gb",
    "train/max_reserved_gb",
    "train/grad_norm_pre_clip",
    "train/tokens_per_s_job",
    "train/rank_rss_gb",
    "train/rank_gpu_util",
    "rank/loss",
    "rank/step_time_s",
    "rank/tokens_per_s",
]


@contextmanager
def patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def log_steps(writer, calls: int) -> tuple[float, float]:
    """`calls` logging steps as on_log writes them; (wall seconds, process CPU seconds)."""
    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(1, calls + 1):
        for k, tag in enumerate(TAGS):
            writer.add_scalar(tag, 1.0 / (step + k), step)
        writer.add_text("train/spike_event", f"loss spike at step {step}: 3.2x the running median", step)
        writer.flush()
    return time.perf_counter() - wall, time.process_time() - cpu


def import_seconds(statement: str) -> float:
    """Seconds `statement` takes in a fresh interpreter that has already imported torch (as a rank has)."""
    code = f"import time, torch; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="logging steps per repetition")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)

    from torch.utils.tensorboard import SummaryWriter

    from hf_dist_recipes.core import crc32c
    from hf_dist_recipes.core.event_writer import RunWriter
    from hf_dist_recipes.logs.events import read_scalars, read_texts

    variants = {
        "torch SummaryWriter (before)": lambda d: (SummaryWriter(d), None),
        f"RunWriter, {crc32c.BACKEND} CRC (now)": lambda d: (RunWriter(d), None),
        "RunWriter, numpy/Python fallback CRC": lambda d: (RunWriter(d), patched(crc32c, "_C_EXTEND", None)),
    }
    times = {name: [] for name in variants}
    root = tempfile.mkdtemp(prefix="event_writer_bench_")
    try:
        for rep in range(args.reps):
            order = list(variants) if rep % 2 == 0 else list(reversed(variants))
            for name in order:
                run = os.path.join(root, f"{rep}-{list(variants).index(name)}")
                writer, patch = variants[name](run)
                if patch is not None:
                    with patch:
                        times[name].append(log_steps(writer, args.calls))
                        writer.close()
                else:
                    times[name].append(log_steps(writer, args.calls))
                    writer.close()
        runs = [os.path.join(root, f"0-{k}") for k in range(len(variants))]
        first = (read_scalars(runs[0]), read_texts(runs[0]))
        if any((read_scalars(r), read_texts(r)) != first for r in runs[1:]):
            raise SystemExit("the writers' files do not read back the same")
        sizes = [sum(p.stat().st_size for p in Path(r).iterdir()) for r in runs]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    load = os.getloadavg()
    print(
        f"{args.calls} logging steps x ({len(TAGS)} scalars + 1 text + flush), median of {args.reps}; "
        f"{os.cpu_count()} CPU(s); load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        f"file bytes: {', '.join(map(str, sizes))}"
    )
    base = statistics.median(w for w, _ in times["torch SummaryWriter (before)"])
    print("| writer | wall per step | CPU per step | SummaryWriter wall / it |\n|---|---|---|---|")
    for name, runs_times in times.items():
        wall = statistics.median(w for w, _ in runs_times)
        cpu = statistics.median(c for _, c in runs_times)
        print(f"| {name} | {wall / args.calls * 1e6:.1f} us | {cpu / args.calls * 1e6:.1f} us | {base / wall:.2f}x |")
    print(
        f"first use in a process that has torch: `from torch.utils.tensorboard import SummaryWriter` "
        f"{import_seconds('from torch.utils.tensorboard import SummaryWriter'):.3f} s, "
        f"`from hf_dist_recipes.core.event_writer import RunWriter` "
        f"{import_seconds('from hf_dist_recipes.core.event_writer import RunWriter'):.3f} s"
    )


if __name__ == "__main__":
    main()
