"""Practice 5: clip gradients (max norm 1.0 by default) and never let a NaN pass silently."""

from __future__ import annotations

import math


def validate_max_grad_norm(max_grad_norm: float | None, *, allow_unclipped: bool = False) -> float:
    """Return the clipping norm, or raise ValueError when clipping would be off without an explicit opt-out.

    The Trainer treats 0 (or None) as "no clipping"; an unclipped MoE model is one bad batch away from a
    diverged run, so that needs `allow_unclipped_gradients=True`.
    """
    if max_grad_norm is None or max_grad_norm == 0:
        if allow_unclipped:
            return 0.0
        raise ValueError(
            f"max_grad_norm={max_grad_norm} turns gradient clipping off; use max_grad_norm=1.0 (the default), "
            "or pass allow_unclipped_gradients=True if you really want no clipping."
        )
    if not math.isfinite(max_grad_norm) or max_grad_norm < 0:
        raise ValueError(f"max_grad_norm must be a positive finite number, got {max_grad_norm}; use 1.0")
    return float(max_grad_norm)
