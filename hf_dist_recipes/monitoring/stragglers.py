"""Live straggler detection: every K optimizer steps the ranks compare how long their own work took, and a rank
slower than the median of ranks for M windows in a row is named (rank and host) while the job runs.

Why not simply compare step times: in synchronous data parallelism (DDP, ZeRO) a slow rank makes every rank slow.
The others wait for it inside the step's collectives (ZeRO-3's parameter all-gathers, the gradient reduce-scatter,
the Trainer's loss gather at a log step), so the wall time per step comes out the same on every rank and a
comparison of raw step times finds nobody. What differs is who waits. So at each check every rank measures

- `step_s`: its mean wall time per optimizer step since the previous check (step begin to step begin), and
- `wait_s`: how long it blocks in the check's own all-gather, i.e. how much earlier than the last rank it arrived,

and its busy time per step is `step_s - wait_s`. A rank's slowness is its busy time over the median busy time of
all ranks (`busy_ratios`); above `1 + threshold` for `windows` checks in a row it is flagged (`StragglerDetector`),
and a flagged rank back under it is reported as recovered. The check runs in `on_step_begin`, after the Trainer
fetched the step's batch and before its first collective, so what one check sees is the rank-local work since the
previous step's last collective: data loading, host-side callbacks, logging, checkpoint I/O, a busy or throttled
host. A rank that is slower inside the forward/backward compute is absorbed by the very next collective and shows
only in what is left after the step's last one (a known limit of measuring from the host).

Measured on 2 CPU ranks under ZeRO-3 (2026-12-03): rank 1 sleeping 0.1 s before each step gave step times of
0.1997 / 0.1995 s (raw step times: nobody) but waits of 0.105 / 0.004 s, busy ratios 0.66 / 1.35: flagged. Rank 1
sleeping 50 ms inside each of its 2 decoder layers' forward gave step times 0.2009 / 0.2008 s and waits 0.002 /
0.002 s: not found. Such compute stragglers show in the per-rank device metrics (clock, power, utilisation), not
here.

Cost: two all-gathers of one float64 per rank every `check_steps` steps (the first is the one whose wait is timed,
the second shares the waits), plus one `all_gather_object` of the host names at train begin. Nothing per step but
two `time.perf_counter()` reads. Off (`check_steps=0`) or with one process: nothing at all.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from collections.abc import Sequence

import torch

from hf_dist_recipes.core.gather import gather_objects
from hf_dist_recipes.core.user_values import positive_int
from hf_dist_recipes.runtime import RecipeCallback

logger = logging.getLogger(__name__)

DEFAULT_STRAGGLER_CHECK_STEPS = 50
DEFAULT_STRAGGLER_THRESHOLD = 0.2
DEFAULT_STRAGGLER_WINDOWS = 2


def validate_straggler_settings(check_steps: object, threshold: object, windows: object) -> tuple[int, float, int]:
    """The three settings, checked; ValueError naming the fix otherwise."""
    note = "optimizer steps, 0: off; use the default"
    positive_int(check_steps, "straggler_check_steps", DEFAULT_STRAGGLER_CHECK_STEPS, minimum=0, note=note)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
        raise ValueError(
            f"straggler_threshold must be a number > 0 (0.2: 20% slower than the median), got "
            f"{threshold!r}; use {DEFAULT_STRAGGLER_THRESHOLD} (the default)"
        )
    positive_int(windows, "straggler_windows", DEFAULT_STRAGGLER_WINDOWS, note="checks in a row; use the default")
    return check_steps, float(threshold), windows


def busy_ratios(step_s: Sequence[float], wait_s: Sequence[float]) -> list[float]:
    """Per rank: its busy time per step (`step_s - wait_s`, seconds) over the median of all ranks' busy times.
    1.0: as fast as the median rank; 1.3: 30% slower. All 1.0 when the median busy time is not positive."""
    if len(step_s) != len(wait_s):
        raise ValueError(f"one step time and one wait per rank: got {len(step_s)} and {len(wait_s)}")
    busy = [max(s - w, 0.0) for s, w in zip(step_s, wait_s, strict=True)]
    median = statistics.median(busy)
    if median <= 0:
        return [1.0] * len(busy)
    return [b / median for b in busy]


class StragglerDetector:
    """Pure bookkeeping of the flags, fed one list of `busy_ratios` per check.

    A rank whose ratio exceeds `1 + threshold` in `windows` checks in a row becomes flagged (reported once, in the
    check that completes the run); a flagged rank whose ratio is back at or under `1 + threshold` is recovered
    (reported once) and its count starts again from zero."""

    def __init__(self, threshold: float = DEFAULT_STRAGGLER_THRESHOLD, windows: int = DEFAULT_STRAGGLER_WINDOWS):
        validate_straggler_settings(0, threshold, windows)
        self.threshold = float(threshold)
        self.windows = windows
        self.streak: list[int] = []
        self.flagged: set[int] = set()

    def update(self, ratios: Sequence[float]) -> tuple[list[int], list[int]]:
        """(ranks flagged by this check, ranks recovered in this check), each in rank order."""
        if len(self.streak) != len(ratios):
            self.streak = [0] * len(ratios)
            self.flagged.clear()
        newly, recovered = [], []
        for rank, ratio in enumerate(ratios):
            if ratio > 1.0 + self.threshold:
                self.streak[rank] += 1
                if self.streak[rank] >= self.windows and rank not in self.flagged:
                    self.flagged.add(rank)
                    newly.append(rank)
            else:
                self.streak[rank] = 0
                if rank in self.flagged:
                    self.flagged.discard(rank)
                    recovered.append(rank)
        return newly, recovered


class StragglerCallback(RecipeCallback):
    """Finds ranks slower than the others while training runs (module docstring: what is measured, why, cost).
    RecipeTrainer registers it with `straggler_check_steps`, `straggler_threshold`, `straggler_windows`.

    Keys added to the next Trainer log after each check (the runtime's `LogSink`). They come from wall-clock times,
    so none reaches `log_history` (a resumed run would not log them alike). The job-wide ones, the same on every
    rank, reach every `report_to` integration and TensorBoard (`job` channel); this rank's own, its TensorBoard run
    and summary only (`rank` channel):

    | key | channel | meaning |
    |---|---|---|
    | `straggler/slowest_over_median` | job | the slowest rank's busy time per step over the median rank's (1.0: even) |
    | `straggler/slowest_rank` | job | the rank with the longest busy time per step in this window |
    | `straggler/flagged_ranks` | job | how many ranks are flagged now |
    | `straggler/busy_s` | rank | this rank's busy time per step in this window, s |
    | `straggler_event` | rank | text, only in the log after a rank was flagged or recovered |

    An event reads "step 10: straggler rank 1 (host h) 35% slower than the median of ranks for 2 window(s) of 5
    steps (busy time per step ...)" or "step 20: rank 1 (host h) recovered (+3% from the median of ranks)";
    several events of one log are joined by "; ".

    Each event is also a warning from rank 0 (one line per job, not one per rank). With one process or
    `check_steps=0` the callback does nothing."""

    def __init__(
        self,
        check_steps: int = DEFAULT_STRAGGLER_CHECK_STEPS,
        threshold: float = DEFAULT_STRAGGLER_THRESHOLD,
        windows: int = DEFAULT_STRAGGLER_WINDOWS,
    ):
        self.check_steps, self.threshold, self.windows = validate_straggler_settings(check_steps, threshold, windows)
        self.detector = StragglerDetector(self.threshold, self.windows)
        self.hosts: list[str] = []
        self.events: list[str] = []
        self._active = False
        self._window_start: float | None = None
        self._window_start_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        dist = torch.distributed
        self._active = (
            self.check_steps > 0 and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        )
        self.detector = StragglerDetector(self.threshold, self.windows)
        self._window_start = None
        if self._active:
            self.hosts = [str(h) for h in gather_objects(socket.gethostname())]

    def on_step_begin(self, args, state, control, **kwargs):
        if not self._active:
            return
        now = time.perf_counter()
        step = state.global_step
        if self._window_start is None:  # first step of this run (or of a resumed one)
            self._window_start, self._window_start_step = now, step
            return
        steps = step - self._window_start_step
        if steps <= 0 or step % self.check_steps:
            return
        self._check(args, step, (now - self._window_start) / steps)

    def _check(self, args, step: int, step_s: float) -> None:
        dist = torch.distributed
        world = self.runtime.facts.layout.world
        mine = torch.tensor([step_s], dtype=torch.float64, device=args.device)
        step_times = [torch.zeros_like(mine) for _ in range(world)]
        started = time.perf_counter()
        dist.all_gather(step_times, mine)  # every rank leaves it together: the time spent in it is this rank's wait
        wait = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=args.device)
        waits = [torch.zeros_like(wait) for _ in range(world)]
        dist.all_gather(waits, wait)
        step_list = [t.item() for t in step_times]
        wait_list = [t.item() for t in waits]
        ratios = busy_ratios(step_list, wait_list)
        newly, recovered = self.detector.update(ratios)
        median_busy = statistics.median(max(s - w, 0.0) for s, w in zip(step_list, wait_list, strict=True))
        events = [
            f"step {step}: straggler rank {r} (host {self._host(r)}) {ratios[r] - 1:.0%} slower than the "
            f"median of ranks for {self.windows} window(s) of {self.check_steps} steps (busy time per step "
            f"{step_list[r] - wait_list[r]:.4f} s vs median {median_busy:.4f} s)"
            for r in newly
        ]
        events += [
            f"step {step}: rank {r} (host {self._host(r)}) recovered ({ratios[r] - 1:+.0%} from the median of ranks)"
            for r in recovered
        ]
        # This rank's own busy time: the one per-rank time that differs between ranks in synchronous training,
        # so `logs summarize` finds stragglers offline from it (raw step times are everyone's).
        me = self.runtime.facts.rank
        self.runtime.logs.rank({"straggler/busy_s": max(step_list[me] - wait_list[me], 0.0)})
        self.runtime.logs.job(
            {
                "straggler/slowest_over_median": max(ratios),
                "straggler/slowest_rank": float(ratios.index(max(ratios))),
                "straggler/flagged_ranks": len(self.detector.flagged),
            }
        )
        if events:
            self.events.extend(events)
            self.runtime.logs.rank({"straggler_event": "; ".join(events)})
            if me == 0:
                for event in events:
                    logger.warning("Straggler check: %s", event)
        # The next window starts after the collectives, so their own time is not counted as anyone's step.
        self._window_start, self._window_start_step = time.perf_counter(), step

    def _host(self, rank: int) -> str:
        return self.hosts[rank] if rank < len(self.hosts) else "?"
