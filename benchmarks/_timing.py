"""Shared by the benchmarks: wall-clock timers driven by Trainer callbacks."""

from __future__ import annotations

import time

from transformers import TrainerCallback


class StepTimer(TrainerCallback):
    """Optimizer-step wall time, on_step_begin -> on_step_end."""

    def __init__(self):
        self.times, self._t = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t)


class IterationTimer(TrainerCallback):
    """Wall time from one `on_step_begin` to the next: everything a loop iteration does, callbacks included."""

    def __init__(self):
        self.times, self._t = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if self._t is not None:
            self.times.append(now - self._t)
        self._t = now
