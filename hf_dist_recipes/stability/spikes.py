"""Practice 5: loss and gradient-norm spikes, by a robust z-score against a window of recent values.

Spikes: a step's loss (mean over ranks) or gradient norm (the pre-clip global norm the Trainer's clip call
returns; under DeepSpeed the engine's) more than `spike_threshold` robust z-scores above the median of the last
`spike_window` finite values of applied steps is a spike: robust z = (x - median) / (1.4826 * MAD), MAD floored
at 1e-3 x |median| so that a flat window does not call noise a spike. Checked once the window is full. Only
values above the window count (a falling loss is not a spike).

The rank a spike is about: the one whose own value at that step (its loss; its local gradient norm, before the
reduction) is the highest, shown against the median over ranks (`highest_rank`), so one rank's bad batch stands out
and a spike every rank shares shows as such.

The callback that feeds it once per optimizer step: `stability.gradient_health`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_SPIKE_WINDOW = 50
DEFAULT_SPIKE_THRESHOLD = 6.0
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation
MAD_FLOOR_RATIO = 1e-3


def validate_spike_settings(window: object, threshold: object) -> tuple[int, float]:
    if isinstance(window, bool) or not isinstance(window, int) or window < 3:
        raise ValueError(f"spike_window must be an integer >= 3 (steps), got {window!r}; use 50 (the default)")
    if (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not threshold > 0
        or not math.isfinite(threshold)
    ):
        raise ValueError(f"spike_threshold must be a positive finite robust z-score, got {threshold!r}; use 6.0")
    return window, float(threshold)


def robust_z(value: float, window: Sequence[float]) -> float:
    """(value - median) / (1.4826 * MAD) of `window`, the MAD floored at 1e-3 x |median| (and at 1e-12)."""
    median = statistics.median(window)
    mad = statistics.median(abs(v - median) for v in window)
    scale = max(MAD_TO_SIGMA * mad, MAD_FLOOR_RATIO * abs(median), 1e-12)
    return (value - median) / scale


@dataclass
class SpikeDetector:
    """A value more than `threshold` robust z-scores above the last `window` values. `values` is its state."""

    window: int = DEFAULT_SPIKE_WINDOW
    threshold: float = DEFAULT_SPIKE_THRESHOLD
    values: list[float] = field(default_factory=list)

    def check(self, value: float) -> float | None:
        """The robust z-score of `value` when it is a spike, else None; a finite value then joins the window."""
        if not math.isfinite(value):
            return None
        z = robust_z(value, self.values) if len(self.values) >= self.window else None
        self.values.append(float(value))
        del self.values[: -self.window]
        return z if z is not None and z > self.threshold else None


def highest_rank(values: Sequence[float], what: str) -> str:
    """Names the rank with the highest finite value of `values` (one per rank, in rank order), e.g. "highest loss
    on rank 1: 600.2 (median of 2 ranks 303.1)"; with one rank "on rank 0"."""
    finite = [(v, r) for r, v in enumerate(values) if math.isfinite(v)]
    if not finite:
        return f"{what} of no rank known"
    value, rank = max(finite, key=lambda vr: (vr[0], -vr[1]))  # the lowest rank among equals
    if len(values) == 1:
        return f"on rank {rank}"
    median = statistics.median(v for v, _ in finite)
    return f"highest {what} on rank {rank}: {value:.6g} (median of {len(values)} ranks {median:.6g})"
