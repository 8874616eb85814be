"""Callbacks that prepare keys for the next Trainer log, of two kinds.

- `_pending` / `pop_pending`: numbers a run resumed from a checkpoint logs again exactly as the uninterrupted run
  did (tokens per expert, the gradient-health counters, the periodic rank check). `RecipeTrainer.log` adds them
  before the stock `log`, so `log_history` (`trainer_state.json`), every `report_to` integration, the console
  (`monitoring/console.py` shows a few) and the per-rank TensorBoard get them.
- `_rank_pending` / `pop_rank_pending`: what one rank measured about its machine or its timing (memory, CPU,
  straggler times), what only the first log of a `train()` call holds (the rank checks at train begin), and text
  (events, notes). These would make a resumed run's `log_history` differ from the uninterrupted run's, and text
  there reaches integrations that expect numbers. They are added in `on_log`: after the Trainer appended the log
  to `log_history` and after the integrations and the console, all registered before this callback, saw it. So
  the callbacks after this one get them: the per-rank TensorBoard run (`train/<key>`) and the rank summary (texts).

Under a plain Trainer both kinds are added in `on_log`, where only the callbacks after this one see them.
"""

from __future__ import annotations


class PendingLogs:
    """Mixin for a TrainerCallback: fill `self._pending` (numbers a resumed run reproduces) and
    `self._rank_pending` (this rank's measurements, first-log values, text); each key is logged once."""

    _pending: dict | None = None
    _rank_pending: dict | None = None

    def pop_pending(self) -> dict:
        """The numbers prepared for the next log (`log_history`), once ({} when none)."""
        pending, self._pending = self._pending or {}, {}
        return pending

    def pop_rank_pending(self) -> dict:
        """The per-rank values and texts prepared for the next log (TensorBoard, not `log_history`), once."""
        pending, self._rank_pending = self._rank_pending or {}, {}
        return pending

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            logs.update(self.pop_pending())
            logs.update(self.pop_rank_pending())
