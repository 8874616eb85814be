"""PerRankTensorBoardCallback: every rank writes its own TensorBoard run, `<logging_dir>/rank<N>`.

The stock TensorBoardCallback writes from rank 0 only. Point TensorBoard at `<logging_dir>` and each rank shows up
as a run of its own, so the slow or diverging one stands out.

Keys, at each logging step (x axis: optimizer step):
- `train/<key>`: every number in the Trainer's logs (loss averaged over ranks, learning_rate, grad_norm, epoch);
- `rank/loss`: this rank's own mean loss since the previous log;
- `rank/step_time_s`, `rank/tokens_per_s`: this rank's mean optimizer-step time and token throughput.
The step timing is done by `RankSummaryCallback` (registered with or without this one); this callback only writes.
Once, at the start: text `seed` with the rank's seed and RNG fingerprint. A run resumed at step k purges what an
earlier attempt logged after step k (TensorBoard's `purge_step`), so a step never shows twice.
"""

from __future__ import annotations

import os
from numbers import Number

from transformers import TrainerCallback

from hf_dist_recipes.monitoring.rank_metrics import RankMetrics
from hf_dist_recipes.seeding import SeedReport


def rank_log_dir(logging_dir: str | os.PathLike, rank: int) -> str:
    """The TensorBoard directory of global rank `rank`."""
    return os.path.join(os.fspath(logging_dir), f"rank{rank}")


class PerRankTensorBoardCallback(TrainerCallback):
    def __init__(self, logging_dir: str, metrics: RankMetrics, seed_report: SeedReport | None = None):
        self.logging_dir = logging_dir
        self.metrics = metrics
        self.seed_report = seed_report
        self.writer = None
        self._rank_scalars_step: int | None = None  # an evaluation log at the same step must not repeat them

    def on_train_begin(self, args, state, control, **kwargs):
        from torch.utils.tensorboard import SummaryWriter

        if self.writer is None:
            # Resumed at step k: hide what a previous attempt logged after k (purge_step hides steps >= its value),
            # so each step shows once.
            purge = state.global_step + 1 if state.global_step > 0 else None
            self.writer = SummaryWriter(log_dir=rank_log_dir(self.logging_dir, args.process_index), purge_step=purge)
        if self.seed_report is not None:
            r = self.seed_report
            self.writer.add_text("seed", f"rank {args.process_index}: seed {r.seed}, rng fingerprint {r.fingerprint}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.writer is None:
            return
        for key, value in (logs or {}).items():
            if isinstance(value, Number) and not isinstance(value, bool):
                self.writer.add_scalar(f"train/{key}", value, state.global_step)
            elif isinstance(value, str):  # events (a skipped non-finite step, a spike) as text at their step
                self.writer.add_text(f"train/{key}", value, state.global_step)
        if self._rank_scalars_step != state.global_step:
            self._rank_scalars_step = state.global_step
            for key, value in self.metrics.flush_window(state.global_step).items():
                self.writer.add_scalar(f"rank/{key}", value, state.global_step)
        self.writer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def read_texts(run_dir: str | os.PathLike) -> dict[str, list[tuple[int, str]]]:
    """All text entries of one TensorBoard run directory: tag -> [(step, text), ...] in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.fspath(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["tensors"]:
        out[tag] = [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
    return out


def read_scalars(run_dir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """All scalars of one TensorBoard run directory: tag -> [(step, value), ...] in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.fspath(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
