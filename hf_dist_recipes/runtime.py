"""One object per run: what the job is, what the trainer feeds each step, where the practices put what they log, and
the callback base class through which the trainer talks to them.

`RecipeTrainer` builds one `RecipeRuntime` when it is constructed and hands it to every `RecipeCallback` it adds
(`set_runtime`: the recipe's own, one the user registered, one the Trainer rebuilt from a checkpoint). From then on
the trainer and the callbacks talk through declared methods, and neither looks the other up:

- `facts` (`JobFacts`): the job's resolved facts, read once: this process's rank and local rank, the rank layout
  (world, TP and EP degrees from the DeepSpeed config the engine uses, and the groups they make), a snapshot of that
  config as the arguments made it, the launch plan. Every rank-side module takes identity and groups from here.
- events: what no `TrainerCallback` hook carries is a method of `RecipeCallback` (`on_micro_batch_loss`,
  `on_micro_step`, `on_grad_norm`, `on_save_begin`/`on_save_end`, `on_train_error`/`on_train_abort`), called by
  `RecipeTrainerMixin.call_recipe_event` on the trainer's callback list the way transformers calls its own events.
- `logs` (`LogSink`): three channels, emptied into each Trainer log by `RecipeTrainer.log`: `history` (numbers a
  resumed run logs again alike: `log_history`, every `report_to` integration, the console), `job` (numbers that are
  the same on every rank but measured, the per-rank spread: the `report_to` integrations and TensorBoard, never
  `log_history`, which a resume must reproduce) and `rank` (this rank's own values and event texts: its TensorBoard
  run and its summary only).
- `rank_metrics`: the per-rank counters (loss, tokens, step time) the micro steps feed, read by the TensorBoard and
  summary callbacks; `process`: what creating the arguments did to this process (the environment variables set,
  each with when, and the seeding: `comm.process_setup.ProcessRecord`), kept off the arguments object.

Tools that read a finished run's files build their own `RankLayout` (checkpoint/zero_files.py, logs/aggregate.py,
preflight/training/verdicts.py): they describe another job, not the running one.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Number

import torch
from transformers import TrainerCallback

from hf_dist_recipes.comm.process_setup import ProcessRecord, current
from hf_dist_recipes.core.layout import RankLayout
from hf_dist_recipes.monitoring.rank_metrics import RankMetrics
from hf_dist_recipes.parallel.deepspeed_view import DeepSpeedView


@dataclass(frozen=True)
class JobFacts:
    """What the running job is, read once when the trainer is built. `deepspeed`: the DeepSpeed config as the
    arguments made it, before an evaluation can finalize it for inference (None without DeepSpeed)."""

    layout: RankLayout = field(default_factory=lambda: RankLayout(1))
    rank: int = 0
    local_rank: int = 0
    deepspeed: dict | None = None
    launch_plan: dict = field(default_factory=dict)
    zero_stage: int = 0  # of the DeepSpeed config (0 without DeepSpeed, as DeepSpeed's own default)

    @classmethod
    def read(cls, args, deepspeed_config: dict | None) -> JobFacts:
        """The facts of a job run with `args` (RecipeTrainingArguments) under `deepspeed_config` (the engine's
        config dict, None without DeepSpeed)."""
        ds = copy.deepcopy(deepspeed_config) if deepspeed_config is not None else None
        world = max(int(getattr(args, "world_size", 1) or 1), 1)
        # Without DeepSpeed nothing to read (and DeepSpeed not imported into a DDP job's rank)
        view = DeepSpeedView.read(ds) if ds is not None else None
        layout = RankLayout(world, view.tp, view.ep) if view is not None else RankLayout(world)
        rank = int(getattr(args, "process_index", 0) or 0)
        local_rank = int(getattr(args, "local_process_index", 0) or 0)
        plan = dict(getattr(args, "launch_plan", None) or {})
        return cls(layout, rank, local_rank, ds, plan, (view.stage or 0) if view is not None else 0)


@dataclass
class LogRecord:
    """What one Trainer log carries from the recipe (see `LogSink`)."""

    history: dict[str, float] = field(default_factory=dict)
    job: dict[str, float] = field(default_factory=dict)
    rank: dict[str, float | str] = field(default_factory=dict)


class LogSink:
    """The three channels of the module docstring. Callbacks `put` into them at step time (the Trainer logs after
    `on_step_end`); `RecipeTrainer.log` `take`s them into the log it is writing, and keeps that record as `last`
    for the callbacks that write this rank's view of the log in `on_log` (TensorBoard, the summary)."""

    def __init__(self):
        self._pending = LogRecord()
        self._standing: dict[str, float] = {}
        self.last = LogRecord()

    def history(self, values: Mapping[str, float]) -> None:
        """Numbers a resumed run logs again exactly (agreement flags, expert loads): the next log and
        `log_history`."""
        self._pending.history.update(_numbers(values, "history"))

    def standing(self, values: Mapping[str, float]) -> None:
        """History numbers that every log carries until they are put again (run-long counters: skipped steps,
        spikes), the end-of-training log included."""
        self._standing.update(_numbers(values, "history"))

    def job(self, values: Mapping[str, float]) -> None:
        """Numbers that are the same on every rank but measured (the slowest rank, the largest memory): the log's
        integrations and TensorBoard, not `log_history`."""
        self._pending.job.update(_numbers(values, "job"))

    def rank(self, values: Mapping[str, float | str]) -> None:
        """This rank's own values and event texts (texts for one key of one log are joined by " | ")."""
        for key, value in values.items():
            earlier = self._pending.rank.get(key)
            if isinstance(value, str) and isinstance(earlier, str):
                value = f"{earlier} | {value}"
            self._pending.rank[key] = value

    def peek(self) -> LogRecord:
        """What the next log will carry (without taking it; the standing numbers are not included)."""
        return self._pending

    def take(self) -> LogRecord:
        """Empty the channels into a record for the log being written; it is also kept as `last`."""
        record, self._pending = self._pending, LogRecord()
        record.history = {**self._standing, **record.history}
        self.last = record
        return record

    def discard(self) -> None:
        """Drop what no log took (put after the last log of a train()): a next train() starts clean."""
        self._pending = LogRecord()


def _numbers(values: Mapping[str, float], channel: str) -> dict[str, float]:
    for key, value in values.items():
        if not isinstance(value, Number) or isinstance(value, bool):
            raise ValueError(f"{key}={value!r}: the {channel} channel takes numbers; put texts into LogSink.rank")
    return dict(values)


class RecipeRuntime:
    """See the module docstring. Built by `RecipeTrainer` (`for_trainer`); one built by hand (no facts: a one-process
    job) serves a test or a tool that drives the callbacks itself."""

    def __init__(self, facts: JobFacts | None = None, process: ProcessRecord | None = None):
        self.facts = facts if facts is not None else JobFacts()  # default: a one-process job
        self.process = process if process is not None else ProcessRecord()
        self.logs = LogSink()
        self.rank_metrics = RankMetrics()
        # What the trainer fed so far ("loss", "micro_step"): an override of compute_loss or training_step that
        # does not call super() feeds nothing, and the callbacks that need it say so (`require_fed`).
        self.fed: set[str] = set()

    @classmethod
    def for_trainer(cls, trainer) -> RecipeRuntime:
        """The runtime of `trainer`, after `Trainer.__init__` (the accelerator knows the DeepSpeed config)."""
        ds = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config if trainer.is_deepspeed_enabled else None
        return cls(JobFacts.read(trainer.args, ds), current())

    def micro_step(self, loss: torch.Tensor, inputs) -> None:
        """What `training_step` returned for one micro-batch, and the batch: this rank's counters."""
        self.fed.add("micro_step")
        self.rank_metrics.add_micro_step(loss, count_tokens(inputs))

    def require_fed(self, signal: str, callback: str, needs: str) -> None:
        """Raise ValueError unless the trainer fed `signal` ("loss" or "micro_step"), naming `callback` and what it
        `needs`: a subclass whose `compute_loss` or `training_step` does not call `super()` feeds nothing."""
        if signal not in self.fed:
            raise ValueError(
                f"{callback} needs {needs}, which RecipeTrainer hands it from compute_loss and training_step, and "
                f"nothing did: an override of compute_loss or training_step must call super()"
            )


class RecipeCallback(TrainerCallback):
    """A `TrainerCallback` that also hears what only the recipe's trainer sees: the events declared below, which
    `RecipeTrainerMixin.call_recipe_event` calls by name on every callback of the trainer's list, in order, with
    `args, state, control` first (transformers' `CallbackHandler.call_event`); a removed callback hears nothing.

    RecipeTrainer hands the run's `RecipeRuntime` over when it adds the callback (`set_runtime`; also to one passed in
    `callbacks=` or rebuilt from a checkpoint). Without one (a plain `transformers.Trainer`) it stops at train begin
    naming the fix; a subclass that overrides `on_train_begin` calls `super().on_train_begin` first."""

    _runtime: RecipeRuntime | None = None

    def set_runtime(self, runtime: RecipeRuntime) -> None:
        self._runtime = runtime

    @property
    def runtime(self) -> RecipeRuntime:
        if self._runtime is None:
            raise ValueError(
                f"{type(self).__name__} has no runtime, which only RecipeTrainer hands over: use RecipeTrainer, "
                f"or recipe(YourTrainer) from hf_dist_recipes for another Trainer class"
            )
        return self._runtime

    def on_train_begin(self, args, state, control, **kwargs):
        self.runtime  # noqa: B018 (raises without one: said at train begin, not at the first step that needs it)

    # The recipe's events (RecipeTrainerMixin.call_recipe_event)
    def on_micro_batch_loss(self, args, state, control, loss: torch.Tensor, **kwargs) -> torch.Tensor | None:
        """A training micro-batch's loss (`compute_loss`); a tensor returned replaces it for the next callback and
        the backward pass (the gradient-health check poisons a non-finite one)."""

    def on_micro_step(self, args, state, control, loss: torch.Tensor, inputs, **kwargs):
        """What `training_step` returned for one micro-batch, and the batch."""

    def on_grad_norm(self, args, state, control, grad_norm, **kwargs):
        """The global gradient norm of this optimizer step before clipping (a tensor or float; None where the
        Trainer computes none), clipped or not (`max_grad_norm=0`)."""

    def on_save_begin(self, args, state, control, bytes_per_rank: int, **kwargs):
        """A save starts: the busiest rank writes about `bytes_per_rank` bytes."""

    def on_save_end(self, args, state, control, **kwargs):
        """The save begun last ended (`save_model` outside a checkpoint; a checkpoint's ends in `on_save`)."""

    def on_train_error(self, args, state, control, error: BaseException, **kwargs):
        """`train()` raised `error`: write out what you hold (no `on_train_end` follows)."""

    def on_train_abort(self, args, state, control, error: BaseException, **kwargs):
        """After every callback's `on_train_error`: the last word on `error` (the hang watchdog names a lost rank
        here, which ends the process)."""


def count_tokens(inputs) -> int:
    """Tokens of a batch: the elements of its `input_ids` (0 when it has none)."""
    if isinstance(inputs, Mapping):
        ids = inputs.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids.numel()
    return 0
