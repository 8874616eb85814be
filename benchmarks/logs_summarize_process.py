"""`hf-dist-recipes logs summarize --json --no-report` against tbparse, each as a WHOLE PROCESS (start-up, imports,
reading, and for ours the aggregation, the findings and the aggregate TensorBoard run), on the same files, alternated.

    python benchmarks/logs_summarize_process.py                               # 8 ranks x 5,000 steps x 5 tags
    python benchmarks/logs_summarize_process.py --ranks 64 --steps 20000 --reps 2
    python benchmarks/logs_summarize_process.py --data /tmp/r64 ...           # reuse (or keep) the generated files

Files: written by torch's SummaryWriter, one event per add_scalar, RANKS x STEPS x 5 tags (`logs_summarize.py`'s
generator), page cache warm for both sides (read once before timing). Each repetition runs both commands one after
the other, the first alternating, so a change of machine load hits both. tbparse:
`SummaryReader(dir, extra_columns={"dir_name"}).scalars` (dir_name keeps the ranks apart), which only reads into a
DataFrame. Per run: wall seconds; peak memory as (a) the largest single process's max RSS (os.wait4's rusage, which
covers the waited-for workers too) and (b) the peak of the summed RSS of the process tree, sampled every 20 ms
(psutil). The load average is printed before every run: other work on a shared machine slows both sides.
Goal (issue 21): ours <= 1/5 of tbparse's time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from logs_summarize import TAGS, _write_rank  # noqa: E402  (the same generator as the in-process benchmark)

TBPARSE = """
import sys
from tbparse import SummaryReader
df = SummaryReader(sys.argv[1], extra_columns={"dir_name"}).scalars
assert len(df) == int(sys.argv[2]), f"tbparse read {len(df)} of {sys.argv[2]}"
"""


def _generate(root: Path, ranks: int, steps: int) -> None:
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(_write_rank, [(str(root), r, steps) for r in range(ranks)]))


def _tree_rss(pid: int, stop: threading.Event, peak: list[int]) -> None:
    import psutil

    try:
        proc = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    while not stop.is_set():
        total = 0
        try:
            for p in [proc, *proc.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
        except psutil.NoSuchProcess:
            break
        peak[0] = max(peak[0], total)
        stop.wait(0.02)


def run_timed(argv: list[str]) -> dict:
    """Run `argv` to completion: wall seconds, max RSS of the largest process (MiB), peak tree RSS (MiB), stdout."""
    load = os.getloadavg()[0]
    out = tempfile.TemporaryFile()
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.PIPE)
    stop, peak = threading.Event(), [0]
    sampler = threading.Thread(target=_tree_rss, args=(proc.pid, stop, peak), daemon=True)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode()
    if proc.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed ({proc.returncode}):\n{err[-3000:]}")
    out.seek(0)
    return {
        "seconds": seconds,
        "max_rss_mib": usage.ru_maxrss / 1024,  # KiB on Linux
        "tree_rss_mib": peak[0] / 1024**2,
        "load": load,
        "stdout": out.read().decode(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of the pair (default: %(default)s)")
    parser.add_argument("--data", help="folder of the files: used when it holds them, else written and kept")
    args = parser.parse_args()

    records = args.ranks * args.steps * len(TAGS)
    keep = args.data is not None
    root = Path(args.data) if keep else Path(tempfile.mkdtemp(prefix="logs_bench_"))
    try:
        if not any(root.glob("rank*/*tfevents*")):
            t = time.perf_counter()
            _generate(root, args.ranks, args.steps)
            print(f"generated in {time.perf_counter() - t:.0f} s")
        files = sorted(root.glob("rank*/*tfevents*"))
        size = sum(p.stat().st_size for p in files)
        for p in files:  # page cache warm for both sides
            p.read_bytes()
        print(
            f"{args.ranks} ranks x {args.steps:,} steps x {len(TAGS)} tags = {records:,} scalars, {len(files)} files, "
            f"{size / 1024**2:.1f} MiB; {os.cpu_count()} CPU(s); python {sys.version.split()[0]}"
        )
        out_dir = Path(tempfile.mkdtemp(prefix="logs_bench_out_"))
        cli = str(Path(sys.executable).with_name("hf-dist-recipes"))
        commands = {
            "ours": [cli, "logs", "summarize", str(root), "--json", "--no-report", "--out", str(out_dir)],
            "tbparse": [sys.executable, "-c", TBPARSE, str(root), str(records)],
        }
        runs: dict[str, list[dict]] = {name: [] for name in commands}
        for rep in range(args.reps):
            order = list(commands) if rep % 2 == 0 else list(reversed(commands))
            for name in order:
                r = run_timed(commands[name])
                if name == "ours":
                    data = json.loads(r["stdout"])
                    scalars = sum(t["steps"] for t in data["tags"].values())
                    assert data["ranks"] == args.ranks and scalars == args.steps * len(TAGS), data["tags"]
                    assert data["records"] == records + args.ranks, "not every record was read"  # + file_version
                runs[name].append(r)
                print(
                    f"rep {rep + 1} {name:8s} {r['seconds']:8.2f} s  max RSS {r['max_rss_mib']:7.1f} MiB  "
                    f"tree RSS {r['tree_rss_mib']:7.1f} MiB  (load before: {r['load']:.2f})",
                    flush=True,
                )
        shutil.rmtree(out_dir, ignore_errors=True)
        med = {name: statistics.median(r["seconds"] for r in rs) for name, rs in runs.items()}
        pairs = [t["seconds"] / o["seconds"] for o, t in zip(runs["ours"], runs["tbparse"], strict=True)]
        print("\n| side | median s | min s | max s | max RSS (largest process) | peak tree RSS |")
        print("|---|---|---|---|---|---|")
        for name, rs in runs.items():
            secs = [r["seconds"] for r in rs]
            print(
                f"| {name} | {med[name]:.2f} | {min(secs):.2f} | {max(secs):.2f} | "
                f"{max(r['max_rss_mib'] for r in rs):.0f} MiB | {max(r['tree_rss_mib'] for r in rs):.0f} MiB |"
            )
        print(
            f"\ntbparse / ours, medians: {med['tbparse'] / med['ours']:.1f}x; per repetition: "
            f"{', '.join(f'{p:.1f}x' for p in pairs)} (goal >= 5x); load average now {os.getloadavg()}"
        )
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
