"""Practice 6: linear warm-up, then cosine annealing with hard restarts.

The learning-rate multiplier at optimizer step `t` (total `T`, warm-up `W`, `k` cycles, floor `m`):

    t < W:  t / W
    t >= W: m + (1 - m) * 0.5 * (1 + cos(pi * ((k * p) mod 1))),  p = (t - W) / (T - W)
    t >= T: m

With `m = 0` this is exactly transformers' `cosine_with_restarts` schedule (checked by a test); `m` keeps the
learning rate from touching zero at the end of each cycle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

DEFAULT_NUM_CYCLES = 3


def validate_min_lr_ratio(value: float) -> float:
    """Return `value`, or raise ValueError unless it is in [0, 1)."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1), got {value}; e.g. min_lr_ratio=0.1")
    return value


@dataclass(frozen=True)
class WarmupCosineRestarts:
    """Schedule shape. `warmup_steps` and `total_steps` in optimizer steps; `min_lr_ratio` in [0, 1) is the floor
    as a fraction of the peak learning rate (default 0)."""

    warmup_steps: int
    total_steps: int
    num_cycles: int = DEFAULT_NUM_CYCLES
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be at least 1, got {self.total_steps}; set max_steps or epochs")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} must be between 0 and total_steps={self.total_steps}; "
                "lower warmup_steps (or give a ratio such as warmup_steps=0.05)"
            )
        if isinstance(self.num_cycles, bool) or not isinstance(self.num_cycles, int) or self.num_cycles < 1:
            raise ValueError(f"num_cycles must be a positive integer, got {self.num_cycles!r}; e.g. num_cycles=3")
        validate_min_lr_ratio(self.min_lr_ratio)

    def multiplier(self, step: int) -> float:
        """The learning-rate multiplier (0..1) at optimizer step `step`."""
        if step < self.warmup_steps:
            return step / max(1, self.warmup_steps)
        if step >= self.total_steps:
            return self.min_lr_ratio
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * ((self.num_cycles * progress) % 1.0)))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine

    def restart_steps(self) -> list[int]:
        """Optimizer steps at which a new cycle starts (the learning rate jumps back to its peak)."""
        span = self.total_steps - self.warmup_steps
        return [self.warmup_steps + math.ceil(span * i / self.num_cycles) for i in range(1, self.num_cycles)]


def _multiplier(schedule: WarmupCosineRestarts, step: int) -> float:
    return schedule.multiplier(step)


def warmup_cosine_restarts_scheduler(optimizer: Optimizer, schedule: WarmupCosineRestarts, last_epoch: int = -1) -> LambdaLR:
    """A `LambdaLR` following `schedule`. The lambda is a `partial` of a module-level function so the scheduler
    pickles (checkpoints) like the stock ones."""
    return LambdaLR(optimizer, partial(_multiplier, schedule), last_epoch)
