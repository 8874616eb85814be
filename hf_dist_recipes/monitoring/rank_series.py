"""Per-rank series for the `report_to` integrations (MLflow, W&B, Comet, ...): every rank's step time, loss and
local gradient norm at each step that logs, as `per_rank/<metric>/rank<N>`.

TensorBoard has them already, one run per rank (`monitoring.tensorboard`); an integration gets the log of rank 0
alone (transformers' integrations log from the main process), which held only the cross-rank summary (the slowest
rank, the flagged ranks, the largest memory: `stragglers`, `system_metrics`). A rank that drifts or slows is then
found in MLflow's or W&B's own charts, without the TensorBoard files.

| key | value |
|---|---|
| `per_rank/step_time_s/rank<N>` | rank N's mean wall time per optimizer step since the last log, s (`RankMetrics`) |
| `per_rank/tokens_per_s/rank<N>` | rank N's tokens per second over the same window |
| `per_rank/loss/rank<N>` | rank N's own loss, the mean over the window's optimizer steps (before the cross-rank mean) |
| `per_rank/grad_norm/rank<N>` | rank N's local gradient norm at the logged step (before the reduction) |

Cost: one all-gather of 3 float64 values per rank at each step that logs (`core.gather.gather_floats`, as the
memory spread of `system_metrics` at the same log); the local gradient norms come with the gradient-health check,
which has every rank's already (`stability.gradient_health`). Only with an integration other than TensorBoard in
`report_to` (`wanted`). The keys go into the runtime's `job` channel:
the integrations get them, `log_history` (which a resume rebuilds) and the console do not, and the per-rank
TensorBoard leaves them out (`PREFIX`: each rank's own run has these series).
"""

from __future__ import annotations

import math

from hf_dist_recipes.core.gather import gather_floats
from hf_dist_recipes.runtime import RecipeCallback

PREFIX = "per_rank/"
WINDOW_KEYS = ("step_time_s", "tokens_per_s", "loss")  # of RankMetrics.flush_window
NOT_INTEGRATIONS = frozenset({"none", "tensorboard"})  # the per-rank TensorBoard covers the second


def wanted(report_to) -> bool:
    """Whether `report_to` (the arguments' list, or one name) names an integration other than TensorBoard."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    return any(str(name).lower() not in NOT_INTEGRATIONS for name in names)


class RankSeriesCallback(RecipeCallback):
    """Puts every rank's step time, tokens/s, loss and local gradient norm into each log (module docstring).
    `gradient_health`: the run's `GradientHealthCallback`, whose check of each step holds every rank's local norm
    (None, or a check that is off: no `grad_norm` series)."""

    def __init__(self, gradient_health=None):
        super().__init__()
        self.gradient_health = gradient_health

    def on_step_end(self, args, state, control, **kwargs):
        if not control.should_log:
            return
        window = self.runtime.rank_metrics.flush_window(state.global_step)  # the same numbers TensorBoard gets
        rows = gather_floats([window.get(k, math.nan) for k in WINDOW_KEYS])  # in rank order
        series = {
            f"{PREFIX}{key}/rank{r}": value
            for r, row in enumerate(rows)
            for key, value in zip(WINDOW_KEYS, row, strict=True)
            if math.isfinite(value)
        }
        norms = self.gradient_health.rank_norms if self.gradient_health is not None else None
        if norms is not None and norms[0] == state.global_step:
            series.update({f"{PREFIX}grad_norm/rank{r}": v for r, v in enumerate(norms[1]) if math.isfinite(v)})
        self.runtime.logs.job(series)
