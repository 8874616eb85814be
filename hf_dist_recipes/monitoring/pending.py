"""Callbacks that prepare keys for the next Trainer log.

`RecipeTrainer.log` adds every such callback's keys before the stock `log`, so `log_history`, TensorBoard and every
`report_to` integration see them. Under a plain Trainer the keys are added in `on_log` instead, where only the
callbacks after this one see them (transformers hands the integrations, added first, the log before).
"""

from __future__ import annotations


class PendingLogs:
    """Mixin for a TrainerCallback: fill `self._pending` (key -> number or text); each key is logged once."""

    _pending: dict | None = None

    def pop_pending(self) -> dict:
        """The keys prepared for the next log, once ({} when none)."""
        pending, self._pending = self._pending or {}, {}
        return pending

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None:
            logs.update(self.pop_pending())
