"""Fold every rank's TensorBoard scalars into cross-rank statistics and findings, in bounded memory.

`summarize_logs(logdir)` reads the ranks in parallel (`events.read_rank`, one task per rank) and folds each rank
into the running state as soon as it is read, then drops it. What is kept, for R ranks, S logged steps, T tags:
- per tag and step: count, mean, M2 (Welford), min, max: 40 B x S x T (100k steps x 5 tags: 20 MB);
- per rank, for the step time, the per-rank loss and the learning rate: means over at most BLOCKS blocks of steps
  (16 B x R x BLOCKS x 3: 256 ranks, 11 MB), for the straggler list, the heat map and the per-rank curves;
- for each value that must agree, one reference curve per group (8 B x S per group).
Plus the ranks being read or waiting to be folded in (at most 2 x `workers`), 16 B per value each, 24 B while
being read (100k steps x 5 tags: 8-12 MB a rank). So 256 ranks x 100k steps x 5 tags stays under ~100 MB
(a per-rank copy of everything would be 256 x 100k x 5 x 4 B = 512 MB at float32).

Stragglers: a rank whose block-mean busy time (`train/straggler/busy_s`, logged by the live straggler check;
else `rank/step_time_s`, which differs between ranks only when they do not wait for each other) exceeds the median of
all ranks' by more than `straggler_threshold` (default 0.2, i.e. 20 %) in at least STRAGGLER_BLOCKS consecutive
blocks (all blocks if the run has fewer); its start step is the first step of that run of blocks, exact when the run
has <= BLOCKS steps.
Divergence: `train/learning_rate` must be equal on every rank; with `tp` given, `rank/loss` must be equal inside
each tensor-parallel group (ranks tp*g .. tp*g+tp-1). A value is equal when within rtol 1e-5.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import FIRST_COMPLETED, Executor, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hf_dist_recipes.core.event_writer import write_scalar_run
from hf_dist_recipes.core.layout import RankLayout
from hf_dist_recipes.logs.events import RankEvents, find_rank_files, read_rank

BLOCKS = 256
STRAGGLER_BLOCKS = 2
STEP_TIME_TAG = "rank/step_time_s"
# RecipeTrainer's live straggler check logs each rank's busy time (step time minus its wait for the others) at each
# check; in synchronous training raw step times are the same on every rank, so the busy time is preferred.
BUSY_TAG = "train/straggler/busy_s"
LR_TAG = "train/learning_rate"
RANK_LOSS_TAGS = ("rank/loss", "train/loss")  # the first present is the per-rank loss curve
RTOL = 1e-5


@dataclass
class StepStats:
    """Cross-rank statistics of one tag at each step. `std` is the population standard deviation across ranks."""

    steps: np.ndarray
    count: np.ndarray
    mean: np.ndarray
    m2: np.ndarray
    min: np.ndarray
    max: np.ndarray

    @classmethod
    def empty(cls) -> StepStats:
        z = np.zeros(0)
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int32), z, z.copy(), z.copy(), z.copy())

    @property
    def spread(self) -> np.ndarray:
        return self.max - self.min

    @property
    def std(self) -> np.ndarray:
        return np.sqrt(self.m2 / np.maximum(self.count, 1))

    def add(self, steps: np.ndarray, values: np.ndarray) -> None:
        """Fold one rank's curve in (steps sorted and unique)."""
        if not np.isin(steps, self.steps, assume_unique=True).all():
            grid = np.union1d(self.steps, steps)
            where = np.searchsorted(grid, self.steps)
            n = len(grid)
            grown = (np.zeros(n, np.int32), np.zeros(n), np.zeros(n), np.full(n, np.inf), np.full(n, -np.inf))
            for new, old in zip(grown, (self.count, self.mean, self.m2, self.min, self.max), strict=True):
                new[where] = old
            self.steps, (self.count, self.mean, self.m2, self.min, self.max) = grid, grown
        i = np.searchsorted(self.steps, steps)
        self.count[i] += 1
        delta = values - self.mean[i]
        self.mean[i] += delta / self.count[i]
        self.m2[i] += delta * (values - self.mean[i])
        self.min[i] = np.minimum(self.min[i], values)
        self.max[i] = np.maximum(self.max[i], values)


@dataclass
class BlockSeries:
    """One rank's curve as means over blocks of `width` steps (block j: steps j*width .. (j+1)*width - 1)."""

    width: int
    sums: np.ndarray
    counts: np.ndarray

    @classmethod
    def of(cls, steps: np.ndarray, values: np.ndarray) -> BlockSeries:
        width = 1
        while int(steps.max(initial=0)) // width >= BLOCKS:
            width *= 2
        j = steps // width
        return cls(width, np.bincount(j, values, BLOCKS), np.bincount(j, None, BLOCKS))

    def at_width(self, width: int) -> np.ndarray:
        """Block means at a coarser power-of-two width (NaN where the rank logged nothing)."""
        f = width // self.width
        sums = self.sums.reshape(-1, f).sum(1) if f > 1 else self.sums
        counts = self.counts.reshape(-1, f).sum(1) if f > 1 else self.counts
        pad = BLOCKS - len(sums)
        sums, counts = np.pad(sums, (0, pad)), np.pad(counts, (0, pad))
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(counts > 0, sums / np.where(counts > 0, counts, 1), np.nan)


@dataclass
class Straggler:
    rank: int
    host: str | None
    slower_by: float  # median over its slow blocks of (its step time / median step time) - 1
    from_step: int
    blocks: int  # how many blocks it was slow in


@dataclass
class Divergence:
    tag: str
    group: list[int]  # the ranks that must agree
    ranks: list[int]  # the ones that part from the rest (both, when two ranks disagree and nothing breaks the tie)
    first_step: int
    values: dict[int, float]  # rank -> value at first_step


@dataclass
class _AgreeGroup:
    ranks: list[int]
    ref_rank: int
    ref_steps: np.ndarray
    ref_values: np.ndarray
    parted: dict[int, tuple[int, float, float]] = field(default_factory=dict)  # rank -> (step, value, ref value)
    seen: int = 1  # ranks that logged the tag, the reference included (a rank that did not cannot agree)


def _first_disagreement(ref_steps, ref_values, steps, values) -> tuple[int, float, float] | None:
    common, ia, ib = np.intersect1d(ref_steps, steps, assume_unique=True, return_indices=True)
    a, b = ref_values[ia], values[ib]
    bad = ~np.isclose(b, a, rtol=RTOL, atol=0.0, equal_nan=True)
    if not bad.any():
        return None
    k = int(np.argmax(bad))
    return int(common[k]), float(b[k]), float(a[k])


@dataclass
class LogSummary:
    logdir: str
    ranks: list[int]
    hosts: dict[int, str]
    stats: dict[str, StepStats]
    block_width: int
    block_means: dict[str, dict[int, np.ndarray]]  # tag -> rank -> BLOCKS block means
    stragglers: list[Straggler]
    divergences: list[Divergence]
    warnings: list[str]
    files: int
    records: int
    seconds: float
    loss_tag: str | None

    def to_dict(self) -> dict:
        """JSON-ready: the findings and per-tag extents, not the curves."""
        return {
            "logdir": self.logdir,
            "ranks": len(self.ranks),
            "hosts": {str(r): h for r, h in self.hosts.items()},
            "files": self.files,
            "records": self.records,
            "seconds": round(self.seconds, 3),
            "tags": {
                tag: {
                    "steps": int(len(s.steps)),
                    "first_step": int(s.steps[0]),
                    "last_step": int(s.steps[-1]),
                    "last_mean": float(s.mean[-1]),
                    "last_min": float(s.min[-1]),
                    "last_max": float(s.max[-1]),
                }
                for tag, s in sorted(self.stats.items())
                if len(s.steps)
            },
            "block_width_steps": self.block_width,
            "stragglers": [vars(s) for s in self.stragglers],
            "divergences": [{**vars(d), "values": {str(k): v for k, v in d.values.items()}} for d in self.divergences],
            "warnings": list(self.warnings),
        }


class _Folder:
    """The running state: fed one rank at a time, in any order."""

    def __init__(self, ranks: list[int], tp: int | None):
        self.ranks = ranks
        # A log folder may lack some ranks: the layout is the smallest world of whole TP groups holding those found.
        self.layout = RankLayout(tp * (max(ranks, default=0) // tp + 1), tp) if tp and tp > 1 else None
        self.stats: dict[str, StepStats] = {}
        self.blocks: dict[str, dict[int, BlockSeries]] = {}
        self.hosts: dict[int, str] = {}
        self.warnings: list[str] = []
        self.records = 0
        self.groups: dict[tuple[str, int], _AgreeGroup] = {}

    def _group_of(self, tag: str, rank: int) -> tuple[tuple[str, int], list[int]] | None:
        if tag == LR_TAG:
            return (tag, 0), self.ranks
        if self.layout is not None and tag == "rank/loss":
            peers = self.layout.tp_group(rank)
            return (tag, self.layout.dp_rank(rank)), [r for r in self.ranks if r in peers]
        return None

    def feed(self, ev: RankEvents) -> None:
        self.records += ev.records
        self.warnings.extend(ev.warnings)
        if ev.host:
            self.hosts[ev.rank] = ev.host
        for tag, (steps, values) in ev.scalars.items():
            self.stats.setdefault(tag, StepStats.empty()).add(steps, values)
            if tag in (STEP_TIME_TAG, BUSY_TAG, LR_TAG) or tag in RANK_LOSS_TAGS:
                self.blocks.setdefault(tag, {})[ev.rank] = BlockSeries.of(steps, values)
            found = self._group_of(tag, ev.rank)
            if found is None:
                continue
            key, members = found
            group = self.groups.get(key)
            if group is None:
                self.groups[key] = _AgreeGroup(members, ev.rank, steps, values)
                continue
            group.seen += 1
            parted = _first_disagreement(group.ref_steps, group.ref_values, steps, values)
            if parted is not None:
                group.parted[ev.rank] = parted

    def divergences(self) -> list[Divergence]:
        out = []
        for (tag, _), g in sorted(self.groups.items()):
            if not g.parted:
                continue
            agree = g.seen - len(g.parted)  # including the reference
            if agree > len(g.parted):
                odd = sorted(g.parted)
            elif agree < len(g.parted):
                odd = [g.ref_rank]  # the reference is the odd one: everyone else parts from it at the same step
            else:
                odd = sorted([g.ref_rank, *g.parted])
            # every case reports the first step any rank parts at: the parted ranks' values there, and the reference's
            step = min(step for step, _, _ in g.parted.values())
            values = {r: v[1] for r, v in g.parted.items() if v[0] == step}
            values[g.ref_rank] = next(v[2] for v in g.parted.values() if v[0] == step)
            out.append(Divergence(tag, sorted(g.ranks), odd, step, dict(sorted(values.items()))))
        return out


def block_matrix(block_means: dict[int, np.ndarray], ranks: list[int]) -> np.ndarray:
    """Ranks x BLOCKS (NaN where a rank logged nothing)."""
    return np.stack([block_means.get(r, np.full(BLOCKS, np.nan)) for r in ranks])


def find_stragglers(
    block_means: dict[int, np.ndarray], ranks: list[int], width: int, hosts: dict[int, str], threshold: float
) -> list[Straggler]:
    if not block_means:
        return []
    m = block_matrix(block_means, ranks)
    used = ~np.all(np.isnan(m), axis=0)
    m = m[:, used]
    block_index = np.flatnonzero(used)
    if m.shape[1] == 0:
        return []
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = m / np.nanmedian(m, axis=0)
    need = min(STRAGGLER_BLOCKS, m.shape[1])
    found = []
    for i, rank in enumerate(ranks):
        slow = ratio[i] > 1 + threshold
        run = 0
        for j, s in enumerate(slow):
            run = run + 1 if s else 0
            if run == need:
                start = j - need + 1
                blocks = int(slow[start:].sum())
                found.append(
                    Straggler(
                        rank,
                        hosts.get(rank),
                        float(np.median(ratio[i][start:][slow[start:]]) - 1),
                        int(block_index[start]) * width,
                        blocks,
                    )
                )
                break
    return sorted(found, key=lambda s: -s.slower_by)


def _read_all(rank_files: dict[int, list[str]], workers: int, feed) -> None:
    if workers <= 1 or len(rank_files) == 1:
        for rank, files in rank_files.items():
            feed(read_rank(rank, files))
        return
    pending = iter(rank_files.items())
    with ProcessPoolExecutor(max_workers=workers) as pool:
        # At most 2 x workers ranks in flight: finished ranks are folded in and dropped, so memory stays bounded.
        running = set()
        _submit(pool, pending, running, 2 * workers)
        while running:
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                feed(fut.result())
            _submit(pool, pending, running, 2 * workers - len(running))


def _submit(pool: Executor, pending, running: set, n: int) -> None:
    for _ in range(n):
        item = next(pending, None)
        if item is None:
            return
        running.add(pool.submit(read_rank, *item))


def summarize_logs(
    logdir: str | os.PathLike, tp: int | None = None, workers: int | None = None, straggler_threshold: float = 0.2
) -> LogSummary:
    """Read and fold every rank's event files under `logdir` (see the module docstring).

    `workers`: processes reading ranks in parallel (default: one per CPU, at most one per rank; 1 reads inline).
    `tp`: tensor-parallel size, to check that the per-rank loss agrees inside each TP group (default: not checked).
    """
    if tp is not None and tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if straggler_threshold <= 0:
        raise ValueError(
            f"the straggler threshold must be > 0 (a fraction, 0.2 = 20 % slower), got {straggler_threshold}"
        )
    start = time.perf_counter()
    rank_files = find_rank_files(logdir)
    ranks = list(rank_files)
    folder = _Folder(ranks, tp)
    workers = min(len(ranks), os.cpu_count() or 1) if workers is None else workers
    _read_all(rank_files, workers, folder.feed)
    width = max((b.width for per_rank in folder.blocks.values() for b in per_rank.values()), default=1)
    block_means = {tag: {r: b.at_width(width) for r, b in per_rank.items()} for tag, per_rank in folder.blocks.items()}
    loss_tag = next((t for t in RANK_LOSS_TAGS if t in folder.stats), None)
    return LogSummary(
        logdir=os.fspath(logdir),
        ranks=ranks,
        hosts=dict(sorted(folder.hosts.items())),
        stats=folder.stats,
        block_width=width,
        block_means=block_means,
        stragglers=find_stragglers(
            block_means.get(BUSY_TAG) or block_means.get(STEP_TIME_TAG, {}),
            ranks,
            width,
            folder.hosts,
            straggler_threshold,
        ),
        divergences=folder.divergences(),
        warnings=folder.warnings,
        files=sum(len(f) for f in rank_files.values()),
        records=folder.records,
        seconds=time.perf_counter() - start,
        loss_tag=loss_tag,
    )


def write_aggregate_run(summary: LogSummary, run_dir: str | os.PathLike) -> str:
    """Write `<tag>/mean`, `/min`, `/max`, `/spread` (max - min across ranks) for every tag and step as one
    TensorBoard run in `run_dir`; one event per step carries all of them (`event_writer.write_scalar_run`).
    The run's earlier aggregate files are removed once the new one is written: a re-run over more steps would
    otherwise leave TensorBoard two copies of every point. Returns the run's directory."""
    earlier = list(Path(run_dir).glob("events.out.tfevents.*.aggregate")) if Path(run_dir).is_dir() else []
    columns = [
        (f"{tag}/{name}", s.steps, values)
        for tag, s in sorted(summary.stats.items())
        for name, values in (("mean", s.mean), ("min", s.min), ("max", s.max), ("spread", s.spread))
    ]
    written = Path(write_scalar_run(run_dir, columns, filename_suffix=".aggregate"))
    for path in earlier:
        if path != written:
            path.unlink(missing_ok=True)
    return os.fspath(run_dir)
