"""Throughput of `logs summarize`'s reader and aggregation against tbparse, on the same event files, in one run.

    python benchmarks/logs_summarize.py                     # 8 ranks x 5,000 steps x 5 tags
    python benchmarks/logs_summarize.py --ranks 64 --steps 20000

Files: written by torch's SummaryWriter (one event per add_scalar, as our callback writes them), RANKS x STEPS x 5
tags, into a temporary directory (generation spread over processes, not timed). Timed after the imports (both sides),
page cache warm for both (the files were just written):
- ours: `summarize_logs(dir, workers=W)`: reading, cross-rank per-step statistics, stragglers and divergence (not
  the writing of the aggregate run or the report), for W = 1 and W = all CPUs;
- tbparse: `SummaryReader(dir, extra_columns={"dir_name"}).scalars` (dir_name: without it the ranks are lost),
  which only reads into a DataFrame.
Throughput: scalar records per second. Goal: ours >= 10x tbparse's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

TAGS = ("train/loss", "train/learning_rate", "rank/loss", "rank/step_time_s", "rank/tokens_per_s")


def _write_rank(args: tuple[str, int, int]) -> None:
    import numpy as np
    from torch.utils.tensorboard import SummaryWriter

    root, rank, steps = args
    rng = np.random.default_rng(rank)
    noise = rng.standard_normal((steps, len(TAGS)))
    w = SummaryWriter(os.path.join(root, f"rank{rank}"), max_queue=1000)
    for s in range(steps):
        for k, tag in enumerate(TAGS):
            w.add_scalar(tag, float(1.0 + 0.01 * noise[s, k]), s)
    w.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--skip-tbparse", action="store_true", help="time ours only (tbparse is slow at 64 ranks)")
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    # Imports before any timing, for both sides (tbparse imports tensorboard's event loader when imported).
    import tensorboard.compat.proto.event_pb2  # noqa: F401
    from tbparse import SummaryReader

    from hf_dist_recipes.logs.aggregate import summarize_logs

    records = args.ranks * args.steps * len(TAGS)
    with tempfile.TemporaryDirectory() as root:
        t = time.perf_counter()
        with ProcessPoolExecutor(os.cpu_count()) as pool:
            list(pool.map(_write_rank, [(root, r, args.steps) for r in range(args.ranks)]))
        size = sum(p.stat().st_size for p in Path(root).rglob("*tfevents*"))
        print(
            f"{args.ranks} ranks x {args.steps:,} steps x {len(TAGS)} tags = {records:,} scalars, "
            f"{size / 1024**2:.1f} MiB, written in {time.perf_counter() - t:.1f} s; {os.cpu_count()} CPU(s)"
        )

        results = {}
        for workers in sorted({1, os.cpu_count() or 1}):
            t = time.perf_counter()
            summary = summarize_logs(root, workers=workers)
            results[f"ours, {workers} worker(s)"] = time.perf_counter() - t
            assert summary.stats["train/loss"].count.sum() == args.ranks * args.steps, "not every value was read"
        if not args.skip_tbparse:
            t = time.perf_counter()
            df = SummaryReader(root, extra_columns={"dir_name"}).scalars
            results["tbparse"] = time.perf_counter() - t
            assert len(df) == records, f"tbparse read {len(df)} of {records}"
        for name, seconds in results.items():
            print(f"{name:22s} {seconds:8.2f} s  {records / seconds:12,.0f} scalars/s")
        if "tbparse" in results:
            best = min(v for k, v in results.items() if k.startswith("ours"))
            print(f"throughput ratio, ours (best) / tbparse: {results['tbparse'] / best:.1f}x (goal >= 10x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
