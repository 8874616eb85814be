"""PerRankTensorBoardCallback: every rank writes its own TensorBoard run, `<logging_dir>/rank<N>`.

The stock TensorBoardCallback writes from rank 0 only. Point TensorBoard at `<logging_dir>` and each rank shows up
as a run of its own, so the slow or diverging one stands out.

Keys, at each logging step (x axis: optimizer step):
- `train/<key>`: every number in the Trainer's logs (loss averaged over ranks, learning_rate, grad_norm, epoch), the
  recipe's job-wide values (the per-rank spread) and this rank's own values and event texts (the runtime's
  `LogSink`: `rank` channel);
- `rank/loss`: this rank's own mean loss since the previous log;
- `rank/step_time_s`, `rank/tokens_per_s`: this rank's mean optimizer-step time and token throughput.
The step timing is done by `RankSummaryCallback` (registered with or without this one); this callback only writes.
Once, at the start: text `seed` with the rank's seed and RNG fingerprint, and text `run` with host, rank, local
rank and the launch's run id (`system_metrics.launch_identity`, also in `rank<N>/run.json`). A run resumed at step k
purges what an earlier attempt logged after step k (TensorBoard's `purge_step`), so a step never shows twice.
A new (not resumed) launch into a `rank<N>` that holds event files of another launch is refused (ValueError): its
curves would mix with the old ones. (Several `train()` calls in one process are one launch and share the run.)
Under `auto_resume` it is the run starting again with nothing to resume (an attempt that died before its first save):
each rank moves the earlier attempt's `rank<N>` to `<logging_dir>.attempt-<its run id>/rank<N>`, out of what
TensorBoard and `logs summarize` read, and rank 0 names it in one line.

The writer is `core.event_writer.RunWriter`: the records torch's SummaryWriter would write (TensorBoard reads them
the same; texts under `<tag>/text_summary`, as torch names them), built as bytes and held in memory until a flush,
on the training thread (no writer thread, no protobuf objects).

Crash safety: the writer is flushed at every logging step (the only steps it writes at, so a killed rank loses at
most what it did since its last log), closed when train() fails (the runtime's `flush` event), and flushed on
SIGTERM (the handler flushes, then hands the signal to the handler that was there before, by default ending the
process; a flush it interrupts writes nothing twice). Python runs signal handlers between bytecodes of the main
thread, so a rank blocked inside one C call (a hung collective) dies of SIGTERM only when the call returns, or of the
SIGKILL launchers send after it (torchrun: 30 s).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from numbers import Number

from hf_dist_recipes.core.event_writer import RunWriter
from hf_dist_recipes.core.gather import gather_objects
from hf_dist_recipes.monitoring import rank_series
from hf_dist_recipes.monitoring.console import warn_once
from hf_dist_recipes.monitoring.system_metrics import RunIdentity, launch_identity
from hf_dist_recipes.runtime import RecipeCallback

RUN_FILENAME = "run.json"
logger = logging.getLogger(__name__)
KEPT = "the earlier attempt's TensorBoard runs (every rank's) are kept in"


def rank_log_dir(logging_dir: str | os.PathLike, rank: int) -> str:
    """The TensorBoard directory of global rank `rank`."""
    return os.path.join(os.fspath(logging_dir), f"rank{rank}")


class PerRankTensorBoardCallback(RecipeCallback):
    """`logging_dir`: the root of the per-rank runs. Reads the run's runtime: its rank metrics, seeding, log sink."""

    def __init__(self, logging_dir: str):
        self.logging_dir = logging_dir
        self.writer = None
        self._rank_scalars_step: int | None = None  # an evaluation log at the same step must not repeat them
        self._previous_sigterm = None

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        identity = launch_identity(args)  # collective: before anything that may raise on one rank only
        if self.writer is None:
            run_dir = rank_log_dir(self.logging_dir, self.runtime.facts.rank)
            resumed = state.global_step > 0
            # Every rank hears of any rank's refusal: a rank that went on alone would wait in its first collective.
            refusal = None if resumed else mixing_refusal(run_dir, identity)
            aside = set_aside(run_dir) if refusal and args.auto_resume else None
            answers = gather_objects((None if aside else refusal, aside))  # every rank's, in rank order
            refusals = [r for r, _ in answers]
            if any(refusals):
                first = next(r for r in refusals if r)
                raise ValueError(
                    first
                    if len(refusals) == 1
                    else f"rank {refusals.index(first)} of "
                    f"{len(refusals)} ({sum(map(bool, refusals))} refusing): {first}"
                )
            if answers[0][1]:
                kept = os.path.dirname(answers[0][1])
                warn_once(logger, f"auto_resume: no checkpoint to resume from: the run starts again; {KEPT} {kept}")
            # Resumed at step k: hide what a previous attempt logged after k (purge_step hides steps >= its value),
            # so each step shows once.
            purge = state.global_step + 1 if resumed else None
            _after_existing_event_files(run_dir)
            self.writer = RunWriter(run_dir, purge_step=purge)
            with open(os.path.join(run_dir, RUN_FILENAME), "w", encoding="utf-8") as f:
                json.dump(identity.as_dict(), f)
            self._install_sigterm_flush()
        self.writer.add_text("run", identity.describe(), state.global_step)
        r = self.runtime.process.seed_report
        if r is not None:
            self.writer.add_text(
                "seed", f"rank {self.runtime.facts.rank}: seed {r.seed}, rng fingerprint {r.fingerprint}"
            )
        self.writer.flush()

    def on_step_end(self, args, state, control, **kwargs):
        self.runtime.require_fed(
            "micro_step", "PerRankTensorBoardCallback", "each micro step's loss and tokens (RankMetrics)"
        )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.writer is None:
            return
        # The log as the integrations saw it, then this rank's own values and texts of the same log.
        for key, value in {**(logs or {}), **self.runtime.logs.last.rank}.items():
            if key.startswith(rank_series.PREFIX):  # every rank's values, for the integrations: this run has its own
                continue
            if isinstance(value, Number) and not isinstance(value, bool):
                self.writer.add_scalar(f"train/{key}", value, state.global_step)
            elif isinstance(value, str):  # events (a skipped non-finite step, a spike) as text at their step
                self.writer.add_text(f"train/{key}", value, state.global_step)
        if self._rank_scalars_step != state.global_step:
            self._rank_scalars_step = state.global_step
            for key, value in self.runtime.rank_metrics.flush_window(state.global_step).items():
                self.writer.add_scalar(f"rank/{key}", value, state.global_step)
        self.writer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def on_train_error(self, args, state, control, error, **kwargs):
        self.close()  # on_train_end does not come: what this rank logged reaches the disk

    def close(self) -> None:
        """Write out and close the writer, and restore the SIGTERM handler (the next train() opens a new one)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _install_sigterm_flush(self) -> None:
        # Signal handlers can only be set from the main thread; a trainer driven from another thread goes without.
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous_sigterm = signal.getsignal(signal.SIGTERM)

        def flush_then_terminate(signum, frame):
            previous = self._previous_sigterm
            if self.writer is not None:
                self.writer.flush()
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
            self._previous_sigterm = None
            if callable(previous):
                previous(signum, frame)
            else:  # SIG_DFL (or SIG_IGN, then nothing happens): the process ends as it would have without us
                os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, flush_then_terminate)


def previous_run_id(run_dir: str) -> str | None:
    """The run id of the launch that wrote `run_dir` (its `run.json`); None when unreadable."""
    try:
        with open(os.path.join(run_dir, RUN_FILENAME), encoding="utf-8") as f:
            return json.load(f)["run_id"]
    except (OSError, ValueError, KeyError):
        return None


def mixing_refusal(run_dir: str | os.PathLike, identity: RunIdentity) -> str | None:
    """Why a new launch may not write into `run_dir` (it holds event files of another run, whose curves would mix
    with the new ones), naming the fixes; None when it may."""
    run_dir = os.fspath(run_dir)
    if not os.path.isdir(run_dir) or not any(n.startswith("events.out.tfevents") for n in os.listdir(run_dir)):
        return None
    previous_id = previous_run_id(run_dir)
    if previous_id == identity.run_id:
        return None
    previous = f"run {previous_id}" if previous_id else "an unknown run"
    return (
        f"{run_dir} already holds TensorBoard event files of {previous}; this launch (run {identity.run_id}) would "
        f"mix its curves into them. Use a new output_dir / logging_dir, delete {run_dir}, or resume with "
        f"trainer.train(resume_from_checkpoint=...)."
    )


def set_aside(run_dir: str) -> str:
    """Move an earlier attempt's `run_dir` (`<logging_dir>/rank<N>`) to `<logging_dir>.attempt-<its run id>/rank<N>`
    (the folder's modification time without a `run.json`); returns where it went."""
    root, rank = os.path.split(os.path.normpath(run_dir))
    target = os.path.join(f"{root}.attempt-{previous_run_id(run_dir) or int(os.path.getmtime(run_dir))}", rank)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    os.replace(run_dir, target)
    return target


def _after_existing_event_files(run_dir: str, *, clock=time.time, sleep=time.sleep) -> None:
    """Wait (at most 1 s) until a new event file's name sorts after every event file already in `run_dir`.

    TensorBoard reads a run's event files in name order, and the name is `events.out.tfevents.<whole seconds>.<host>.
    <pid>.<per-process counter>`, compared as text: a file opened in the same second as an earlier one can sort
    before it (counter "10" < "9"), so a resume's purge is read before the steps it must hide and they show twice.
    Only a relaunch within the same second meets this (notebooks, tests)."""
    latest = -1
    if os.path.isdir(run_dir):
        for name in os.listdir(run_dir):
            if name.startswith("events.out.tfevents."):
                with contextlib.suppress(IndexError, ValueError):
                    latest = max(latest, int(name.split(".")[3]))
    now = clock()
    if latest >= int(now):
        sleep(latest + 1 - now)
