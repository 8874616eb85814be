"""One object per run: what the job is, what the trainer feeds each step, and where the practices put what they log.

`RecipeTrainer` builds one `RecipeRuntime` when it is constructed and hands it to every recipe callback's
constructor (the shape of trl's `SyncRefModelCallback(ref_model=..., accelerator=...)`). From then on the trainer
and the callbacks talk through it in one plain way, and neither looks the other up:

- `facts` (`JobFacts`): the job's resolved facts, read once: the rank layout (world, TP and EP degrees from the
  DeepSpeed config the engine uses), a snapshot of that config as the arguments made it, the launch plan.
- events: the trainer *emits* what no `TrainerCallback` hook carries, and the callbacks *listen* (`listen`):
  `loss` (each training micro-batch's loss from `compute_loss`; a listener may return a changed loss: the gradient
  health check poisons a non-finite one), `micro_step` (the loss `training_step` returned, and the batch),
  `grad_norm` (the pre-clip global gradient norm of the clip call), `begin_save`/`end_save` (the bytes a rank is
  about to write), `flush` and `explain` (train() failed: first every listener writes out what it holds, then the
  hang watchdog may name a lost rank and end the process). Listeners register when their callback's training
  begins, so a callback the user removed never hears anything.
- `logs` (`LogSink`): three channels, emptied into each Trainer log by `RecipeTrainer.log`: `history` (numbers a
  resumed run logs again alike: `log_history`, every `report_to` integration, the console), `job` (numbers that are
  the same on every rank but measured, the per-rank spread: the `report_to` integrations and TensorBoard, never
  `log_history`, which a resume must reproduce) and `rank` (this rank's own values and event texts: its TensorBoard
  run and its summary only).
- `rank_metrics`: the per-rank counters (loss, tokens, step time) the micro steps feed, read by the TensorBoard and
  summary callbacks; `seed_report`: this process's seeding.

A recipe callback built without a runtime (under a plain `transformers.Trainer`) gets one of its own that nothing
feeds: the callbacks that need the trainer's numbers then stop at the first optimizer step with the fix
(`require_fed`). Tools that read a finished run's files build their own `RankLayout` (checkpoint/zero_files.py,
logs/aggregate.py, preflight/training/verdicts.py): they describe another job, not the running one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from numbers import Number

import torch

from hf_dist_recipes.core.layout import RankLayout
from hf_dist_recipes.monitoring.rank_metrics import RankMetrics
from hf_dist_recipes.parallel.batch import tensor_parallel_size
from hf_dist_recipes.reproducibility.seeding import SeedReport

EVENTS = ("loss", "micro_step", "grad_norm", "begin_save", "end_save", "flush", "explain")


@dataclass(frozen=True)
class JobFacts:
    """What the running job is, read once when the trainer is built. `deepspeed`: the DeepSpeed config as the
    arguments made it, before an evaluation can finalize it for inference (None without DeepSpeed)."""

    layout: RankLayout = field(default_factory=lambda: RankLayout(1))
    rank: int = 0
    deepspeed: dict | None = None
    launch_plan: dict = field(default_factory=dict)

    @property
    def zero(self):
        """The config's `zero_optimization` section as DeepSpeed's own typed model (`DeepSpeedZeroConfig`: its
        defaults filled, the offload sections typed); None without DeepSpeed. Parsed on first use."""
        if self.deepspeed is None:
            return None
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        return DeepSpeedZeroConfig(**(self.deepspeed.get("zero_optimization") or {}))

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the DeepSpeed config (0 without DeepSpeed, as DeepSpeed's own default)."""
        return int(self.zero.stage) if self.deepspeed is not None else 0

    @classmethod
    def from_args(cls, args) -> JobFacts:
        """The facts of Trainer arguments alone: their DeepSpeed config (`args.hf_deepspeed_config`), if any."""
        ds = getattr(args, "hf_deepspeed_config", None)
        return cls.read(args, ds.config if ds is not None else None)

    @classmethod
    def read(cls, args, deepspeed_config: dict | None) -> JobFacts:
        """The facts of a job run with `args` (RecipeTrainingArguments) under `deepspeed_config` (the engine's
        config dict, None without DeepSpeed)."""
        ds = copy.deepcopy(deepspeed_config) if deepspeed_config is not None else None
        ep = (ds or {}).get("expert_parallel") or {}
        ep_size = ep.get("autoep_size", 1) if isinstance(ep, dict) and ep.get("enabled") else 1
        world = max(int(getattr(args, "world_size", 1) or 1), 1)
        layout = RankLayout(world, tensor_parallel_size(ds or {}), int(ep_size or 1))
        rank = int(getattr(args, "process_index", 0) or 0)
        return cls(layout, rank, ds, dict(getattr(args, "launch_plan", None) or {}))


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
    """See the module docstring. Built by `RecipeTrainer` (`for_trainer`); a bare `RecipeRuntime()` is a one-process
    job that nothing feeds (what a recipe callback gets under a plain Trainer)."""

    def __init__(self, facts: JobFacts | None = None, seed_report: SeedReport | None = None):
        self.facts = facts
        self.seed_report = seed_report
        self.logs = LogSink()
        self.rank_metrics = RankMetrics()
        self._listeners: dict[str, dict[type, Callable]] = {name: {} for name in EVENTS}
        self._fed: set[str] = set()
        self.listen(self, micro_step=self._count_micro_step)

    @classmethod
    def for_trainer(cls, trainer, seed_report: SeedReport | None) -> RecipeRuntime:
        """The runtime of `trainer` (after `Trainer.__init__`: the accelerator knows the DeepSpeed config)."""
        ds = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config if trainer.is_deepspeed_enabled else None
        return cls(JobFacts.read(trainer.args, ds), seed_report)

    def job(self, args) -> JobFacts:
        """The job's facts: the trainer's, read when it was built; a bare runtime reads them from `args` once."""
        if self.facts is None:
            self.facts = JobFacts.from_args(args)
        return self.facts

    # Listening
    def listen(self, owner, **handlers: Callable) -> None:
        """Register `owner`'s handlers by event name (`EVENTS`). One listener per class: a second call by the same
        owner, or by another instance of its class (the Trainer's rebuild of a callback restored from a checkpoint),
        replaces the handlers, so a callback may listen again at every train() and a replaced one stops hearing."""
        for event, handler in handlers.items():
            if event not in self._listeners:
                raise ValueError(f"unknown runtime event {event!r}; the events are {', '.join(EVENTS)}")
            self._listeners[event][type(owner)] = handler

    def listening(self, event: str) -> bool:
        return bool(self._listeners[event])

    def _emit(self, event: str, *values) -> None:
        for handler in list(self._listeners[event].values()):
            handler(*values)

    # Fed by the trainer
    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A training micro-batch's loss (`compute_loss`); returns it as the listeners leave it."""
        self._fed.add("loss")
        for handler in list(self._listeners["loss"].values()):
            loss = handler(loss)
        return loss

    def micro_step(self, loss: torch.Tensor, inputs) -> None:
        """What `training_step` returned for one micro-batch, and the batch."""
        self._fed.add("micro_step")
        self._emit("micro_step", loss, inputs)

    def grad_norm(self, norm) -> None:
        """The pre-clip global gradient norm of this optimizer step (the Trainer's clip call)."""
        self._emit("grad_norm", norm)

    def begin_save(self, bytes_per_rank: int) -> None:
        self._emit("begin_save", bytes_per_rank)

    def end_save(self) -> None:
        self._emit("end_save")

    def failed(self, error: BaseException) -> None:
        """train() raised `error`: first every listener writes out what it holds (`flush`), then `explain` (the hang
        watchdog names a lost rank, which ends the process)."""
        self._emit("flush")
        self._emit("explain", error)

    def _count_micro_step(self, loss: torch.Tensor, inputs) -> None:
        self.rank_metrics.add_micro_step(loss, count_tokens(inputs))

    def require_fed(self, signal: str, callback: str, needs: str) -> None:
        """Raise ValueError unless the trainer fed `signal` ("loss" or "micro_step") into this runtime: `callback`
        names who needs it, `needs` what. Checked at the first optimizer step, where a plain Trainer has fed
        nothing, and so has a subclass whose `compute_loss` or `training_step` does not call `super()`."""
        if signal not in self._fed:
            raise ValueError(
                f"{callback} needs {needs}, which only RecipeTrainer hands it, and nothing did: use RecipeTrainer, or "
                f"recipe(YourTrainer) from hf_dist_recipes for another Trainer class, which register this callback "
                f"and feed it (do not add a second one; an override of compute_loss or training_step must call super())"
            )

    def adopt(self, callbacks) -> list:
        """Hand this runtime to the recipe callbacks among `callbacks` that hold another, and return them: the one
        place that looks through a trainer's callbacks, for those the user registered (an `ExpertLoadCallback`) and
        those the Trainer rebuilt from a checkpoint's saved arguments (`restore_callback_states_from_checkpoint`),
        which were built without it."""
        adopted = []
        for callback in callbacks:
            if isinstance(getattr(callback, "runtime", None), RecipeRuntime) and callback.runtime is not self:
                callback.runtime = self
                adopted.append(callback)
        return adopted


def count_tokens(inputs) -> int:
    """Tokens of a batch: the elements of its `input_ids` (0 when it has none)."""
    if isinstance(inputs, Mapping):
        ids = inputs.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids.numel()
    return 0
