"""The package's event-file reader against a plain loop over tensorboard's own loader, on the same files, in one
process; then what each hand-written part of the reader buys, each switched off in turn.

    python benchmarks/event_reader.py                    # 8 ranks x 5,000 steps x 5 tags
    python benchmarks/event_reader.py --ranks 16 --steps 20000 --reps 3

Files: torch's SummaryWriter, one event per add_scalar (benchmarks/logs_summarize.py's generator), written into a
temporary directory first (not timed); page cache warm for all. Every reader reads every rank's run directory in one
thread and ends with tag -> (steps, values) per rank; the results are checked equal. Timed (median of --reps, the
readers interleaved in each repetition):
- `EventFileLoader` loop: `for event in EventFileLoader(path).Load(): for v in event.summary.value: ...` (what
  TensorBoard's own data loading does: protobuf per record, data_compat's migration of simple_value to a tensor,
  both CRCs in pure Python), the value read from `v.tensor.float_val[0]`;
- `LegacyEventFileLoader` loop: the same without the migration (what EventAccumulator reads with);
- `EventAccumulator`: the former `read_scalars` (Reload, then Scalars(tag) per tag);
- ours, `read_run` (the new `read_scalars`: TensorBoard's semantics, both CRCs checked);
- ours, `read_rank` (`logs summarize`'s per-rank reader: the length CRC only, the last write of a step kept).
Parts of `read_run`, each replaced by the plain way (the difference is what the part buys):
- the CRC-32C library: google-crc32c for every CRC instead of numpy for short rows (`C_ROWS_FROM` = 0), and the
  numpy fallback alone (no C library, as without the `report` extra);
- the at-once framing (`_frame_at_once`) replaced by the record-by-record walk;
- the numpy scalar scan (`scan_scalars`) replaced by protobuf for every record (what the framing hands on);
- the data CRC check skipped (what `read_rank` does).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from logs_summarize import TAGS, _write_rank  # noqa: E402


def loader_loop(run_dirs, loader_cls, *, migrated):
    out = []
    for run in run_dirs:
        curves: dict[str, tuple[list, list]] = {}
        for name in sorted(os.listdir(run)):
            if "tfevents" not in name:
                continue
            for event in loader_cls(os.path.join(run, name)).Load():
                for v in event.summary.value:
                    if migrated:
                        if v.metadata.plugin_data.plugin_name != "scalars":
                            continue
                        x = v.tensor.float_val[0]
                    else:
                        if v.WhichOneof("value") != "simple_value":
                            continue
                        x = v.simple_value
                    steps, values = curves.setdefault(v.tag, ([], []))
                    steps.append(event.step)
                    values.append(x)
        out.append(curves)
    return out


def accumulator(run_dirs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for run in run_dirs:
        acc = EventAccumulator(run, size_guidance={"scalars": 0})
        acc.Reload()
        out.append(
            {t: ([e.step for e in acc.Scalars(t)], [e.value for e in acc.Scalars(t)]) for t in acc.Tags()["scalars"]}
        )
    return out


def ours_run(run_dirs):
    from hf_dist_recipes.logs.events import read_run

    return [{t: (s.tolist(), v.tolist()) for t, (s, v) in read_run(run).scalars.items()} for run in run_dirs]


def ours_rank(run_dirs):
    from hf_dist_recipes.logs.events import read_rank, run_files

    return [
        {t: (s.tolist(), v.tolist()) for t, (s, v) in read_rank(0, run_files(run)).scalars.items()} for run in run_dirs
    ]


@contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def variants():
    """name -> context manager that switches one part of read_run to the plain way."""
    import numpy as np
    from tensorboard.compat.proto.event_pb2 import Event

    from hf_dist_recipes.core import crc32c
    from hf_dist_recipes.logs import events, record_scan

    def protobuf_scan(buf, starts, lengths):
        e = np.zeros(0, np.int64)
        return record_scan.ScalarScan([], e, e, e, np.zeros(0), np.arange(len(starts)))

    assert Event  # imported before timing
    return {
        "C library for every CRC (C_ROWS_FROM = 0)": lambda: patched(crc32c, "C_ROWS_FROM", 0),
        "numpy fallback only (no C library)": lambda: patched(crc32c, "_C_EXTEND", None),
        "record-by-record framing (no _frame_at_once)": lambda: patched(record_scan, "_frame_at_once", lambda b: None),
        "protobuf for every record (no scan_scalars)": lambda: patched(events, "scan_scalars", protobuf_scan),
        "no data CRC check": lambda: patched(events, "first_bad_data", lambda *a: None),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-slow", action="store_true", help="leave out EventAccumulator and the legacy loop")
    args = parser.parse_args()

    # Imports before any timing, for every reader.
    import tensorboard.backend.event_processing.event_accumulator  # noqa: F401
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader, LegacyEventFileLoader

    from hf_dist_recipes.core import crc32c
    from hf_dist_recipes.logs import events  # noqa: F401

    records = args.ranks * args.steps * len(TAGS)
    with tempfile.TemporaryDirectory() as root:
        with ProcessPoolExecutor(os.cpu_count()) as pool:
            list(pool.map(_write_rank, [(root, r, args.steps) for r in range(args.ranks)]))
        runs = [os.path.join(root, f"rank{r}") for r in range(args.ranks)]
        size = sum(p.stat().st_size for p in Path(root).rglob("*tfevents*"))
        print(
            f"{args.ranks} ranks x {args.steps:,} steps x {len(TAGS)} tags = {records:,} scalars, {size / 1024**2:.1f} "
            f"MiB; {os.cpu_count()} CPU(s); CRC-32C backend: {crc32c.BACKEND}; load {os.getloadavg()[0]:.1f}"
        )
        readers = {
            "EventFileLoader loop": lambda: loader_loop(runs, EventFileLoader, migrated=True),
            "ours, read_run (read_scalars)": lambda: ours_run(runs),
            "ours, read_rank (logs summarize)": lambda: ours_rank(runs),
        }
        if not args.skip_slow:
            readers["LegacyEventFileLoader loop"] = lambda: loader_loop(runs, LegacyEventFileLoader, migrated=False)
            readers["EventAccumulator (old read_scalars)"] = lambda: accumulator(runs)
        for name, make in variants().items():
            readers[f"read_run, {name}"] = lambda make=make: _under(make, lambda: ours_run(runs))
        times: dict[str, list[float]] = {name: [] for name in readers}
        reference = None
        for rep in range(args.reps):
            names = list(readers) if rep % 2 == 0 else list(reversed(readers))
            for name in names:
                t = time.perf_counter()
                result = readers[name]()
                times[name].append(time.perf_counter() - t)
                if reference is None:
                    reference = result
                assert result == reference, f"{name} read something else"
        base = statistics.median(times["EventFileLoader loop"])
        ours = statistics.median(times["ours, read_run (read_scalars)"])
        print(f"{'reader':62s} {'median s':>9s} {'scalars/s':>12s} {'loop / it':>9s} {'it / read_run':>13s}")
        for name, ts in times.items():
            m = statistics.median(ts)
            print(f"{name:62s} {m:9.3f} {records / m:12,.0f} {base / m:8.1f}x {m / ours:12.2f}x")
    crc_rows_timings()
    return 0


def crc_rows_timings() -> None:
    """crc32c_rows over (N, L) rows: numpy against a C call per row (what C_ROWS_FROM decides between)."""
    import numpy as np

    from hf_dist_recipes.core import crc32c

    if crc32c.BACKEND != "google-crc32c":
        print("CRC rows: google-crc32c not installed; numpy only")
        return
    rng = np.random.default_rng(0)
    for n, length in ((100_000, 8), (100_000, 40), (20_000, 128), (20_000, 200), (100, 100_000)):
        rows = rng.integers(0, 256, (n, length), dtype=np.uint8)
        t = time.perf_counter()
        a = crc32c.crc32c_rows_numpy(rows)
        t_numpy = time.perf_counter() - t
        with patched(crc32c, "C_ROWS_FROM", 0):
            t = time.perf_counter()
            b = crc32c.crc32c_rows(rows)
            t_c = time.perf_counter() - t
        assert (a == b).all()
        print(f"CRC rows {n:>7,} x {length:>7,} B: numpy {t_numpy * 1e3:7.1f} ms, C per row {t_c * 1e3:7.1f} ms")


def _under(make, fn):
    with make():
        return fn()


if __name__ == "__main__":
    sys.exit(main())
