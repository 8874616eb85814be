"""Practice 6: linear warm-up, then cosine annealing with restarts (hard, or with a short re-warm-up).

The learning-rate multiplier at optimizer step `t` (total `T`, warm-up `W`, `k` cycles, floor `m`, re-warm-up `R`
steps at each restart). Cycle `i` (0-based) starts at the real-valued step `W + i * C`, with `C = (T - W) / k`, and
`u` is the position inside it in steps:

    t < W:                 t / W
    t >= W, cycle 0:       m + (1 - m) * 0.5 * (1 + cos(pi * u / C))
    t >= W, cycle i >= 1:  m + (1 - m) * u / R                                 while u < R (re-warm-up)
                           m + (1 - m) * 0.5 * (1 + cos(pi * (u - R) / (C - R)))  after it
    t >= T:                m

With `R = 0` a restart jumps straight back to the peak and the curve is
`m + (1 - m) * 0.5 * (1 + cos(pi * ((k * p) mod 1)))`, `p = (t - W) / (T - W)`; with `m = 0` too this is exactly
transformers' `cosine_with_restarts` schedule (checked by a test). `m` keeps the learning rate from touching zero
at the end of each cycle; `R > 0` climbs back from the floor to the peak instead of jumping, so the optimizer's
moments meet the peak learning rate gradually after every restart, as they did after the first warm-up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from hf_dist_recipes.core.user_values import positive_int, setting

DEFAULT_NUM_CYCLES = 3

# The keys our schedule reads from `lr_scheduler_kwargs`; transformers' own function takes only `num_cycles`.
SCHEDULE_KWARGS = ("num_cycles", "min_lr_ratio", "restart_warmup_steps")


def validate_total_steps(value: object, name: str = "total_steps") -> int:
    """Return `value`, or raise ValueError unless it is a whole number of optimizer steps >= 1. `name`: the setting
    as the user wrote it (`total_steps`, `max_steps`, the demo's `--max-steps`)."""
    return positive_int(value, name, 200, unit="optimizer steps")


def validate_warmup_steps(
    warmup_steps: object, total_steps: int, names: tuple[str, str] = ("warmup_steps", "total_steps")
) -> int:
    """Return `warmup_steps` (optimizer steps), or raise ValueError unless it is a whole number between 0 and
    `total_steps`: a warm-up longer than the run never reaches the peak learning rate. `names`: how the user wrote
    the two settings (e.g. `("--warmup-steps", "--max-steps")`)."""
    warm, total = names
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or not 0 <= warmup_steps <= total_steps:
        raise ValueError(
            f"{setting(warm, repr(warmup_steps))} must be a whole number of steps between 0 and "
            f"{setting(total, total_steps)}; "
            f"e.g. {setting(warm, total_steps // 10)}"
        )
    return warmup_steps


def validate_learning_rate(value: object, name: str = "learning_rate") -> float:
    """Return `value` as a float, or raise ValueError unless it is a finite number > 0 (the peak the schedule
    multiplies; 0 or less trains nothing or climbs the loss)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ValueError(f"{name} must be a number > 0, got {value!r}; e.g. {setting(name, 3e-3)}")
    return float(value)


def validate_min_lr_ratio(value: float) -> float:
    """Return `value`, or raise ValueError unless it is in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1), got {value!r}; e.g. min_lr_ratio=0.1")
    return float(value)


def validate_restart_warmup_steps(value: int) -> int:
    """Return `value`, or raise ValueError unless it is a whole number of optimizer steps >= 0."""
    return positive_int(value, "restart_warmup_steps", 20, minimum=0, unit="optimizer steps", note="0: hard restarts")


def validate_num_cycles(value: int) -> int:
    """Return `value`, or raise ValueError unless it is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"num_cycles must be a positive integer, got {value!r}; e.g. num_cycles=3")
    return value


@dataclass(frozen=True)
class WarmupCosineRestarts:
    """Schedule shape. `warmup_steps`, `total_steps` and `restart_warmup_steps` (default 0: hard restarts) in
    optimizer steps; `min_lr_ratio` in [0, 1) is the floor as a fraction of the peak learning rate (default 0);
    `num_cycles` cosine cycles share the steps after the warm-up (default 3)."""

    warmup_steps: int
    total_steps: int
    num_cycles: int = DEFAULT_NUM_CYCLES
    min_lr_ratio: float = 0.0
    restart_warmup_steps: int = 0

    def __post_init__(self):
        validate_total_steps(self.total_steps)
        validate_warmup_steps(self.warmup_steps, self.total_steps)
        validate_num_cycles(self.num_cycles)
        validate_min_lr_ratio(self.min_lr_ratio)
        validate_restart_warmup_steps(self.restart_warmup_steps)
        if self.num_cycles > 1 and self.restart_warmup_steps >= self.cycle_steps:
            # Only restarts re-warm up; with one cycle the value is never used.
            raise ValueError(
                f"restart_warmup_steps={self.restart_warmup_steps} must be shorter than a cycle "
                f"({self.cycle_steps:g} steps: {self.total_steps - self.warmup_steps} steps after warm-up / "
                f"{self.num_cycles} cycles); lower restart_warmup_steps or num_cycles"
            )

    @property
    def cycle_steps(self) -> float:
        """Length of one cosine cycle in optimizer steps (not necessarily whole)."""
        return max(1, self.total_steps - self.warmup_steps) / self.num_cycles

    def multiplier(self, step: int) -> float:
        """The learning-rate multiplier (0..1) at optimizer step `step`."""
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        if step >= self.total_steps:
            return self.min_lr_ratio
        # Integer arithmetic: the cycle index agrees with restart_steps() exactly, with no rounding at a boundary.
        span = max(1, self.total_steps - self.warmup_steps)
        cycle, into = divmod(self.num_cycles * (step - self.warmup_steps), span)  # `into / k`: steps into the cycle
        rewarm = self.num_cycles * self.restart_warmup_steps  # R, in the same units as `into`
        if cycle >= 1 and rewarm > 0:
            if into < rewarm:
                return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * into / rewarm
            phase = (into - rewarm) / (span - rewarm)
        else:
            phase = into / span
        cosine = 0.5 * (1.0 + math.cos(math.pi * phase))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine

    def restart_steps(self) -> list[int]:
        """Optimizer steps at which a new cycle starts (the learning rate jumps back to its peak, or to the floor
        from where it re-warms up): the first step at or after each cycle's real-valued start, once each, only
        steps before `total_steps` (cycles shorter than a step can share one, or start after the last)."""
        span = self.total_steps - self.warmup_steps
        starts = {self.warmup_steps - (-span * i // self.num_cycles) for i in range(1, self.num_cycles)}  # ceil
        return sorted(t for t in starts if t < self.total_steps)


def _multiplier(schedule: WarmupCosineRestarts, step: int) -> float:
    return schedule.multiplier(step)


def warmup_cosine_restarts_scheduler(
    optimizer: Optimizer, schedule: WarmupCosineRestarts, last_epoch: int = -1
) -> LambdaLR:
    """A `LambdaLR` following `schedule`. The lambda is a `partial` of a module-level function so the scheduler
    pickles (checkpoints) like the stock ones."""
    return LambdaLR(optimizer, partial(_multiplier, schedule), last_epoch)
