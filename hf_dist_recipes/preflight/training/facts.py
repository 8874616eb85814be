"""What one rank measured in one preflight run, as typed records: the runs write them (`run.run_once`), every rank's
are gathered (`core.gather.gather_objects`, pickled), and the verdicts (`verdicts`) read their fields, never their
texts. A text (a rank-agreement message, the logged `nonfinite_event`) is carried only to be shown in the report."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepFacts:
    """One optimizer step on one rank (1-based step). `lr`: the learning rate the step applies, read from the
    optimizer before it; `applied`: whether the engine took the step (DeepSpeed `was_step_applied()`, else not
    marked skipped); `clip`: the engine's (or the Trainer's `max_grad_norm`) clip value; `zero_clip`: the value the
    ZeRO optimizer holds (None without one); `weights`: SHA-256 (16 hex digits) of the full weights after the step,
    when the run records digests."""

    lr: float | None = None
    applied: bool | None = None
    clip: float | None = None
    zero_clip: float | None = None
    weights: str | None = None

    def clip_values(self) -> set[float]:
        """The clip values this step saw (engine and ZeRO optimizer), None left out."""
        return {v for v in (self.clip, self.zero_clip) if v is not None}


@dataclass(frozen=True)
class ExpectedSettings:
    """What the engine should use, from the arguments and the DeepSpeed JSON (never read back from the engine).
    `clip`: max_grad_norm (the JSON's gradient_clipping when a number); `peak_lr`; the schedule's settings
    (`warmup_steps`, `total_steps`, `num_cycles`, `min_lr_ratio`, `restart_warmup_steps`, `scheduler_type`);
    `ds_scheduler`: the JSON has a `scheduler` section; `tp`: the TP degree of the launch; `deepspeed`: the
    Trainer runs the DeepSpeed engine."""

    clip: float
    peak_lr: float
    scheduler_type: str
    warmup_steps: int
    total_steps: int
    num_cycles: int | None
    min_lr_ratio: float
    restart_warmup_steps: int
    ds_scheduler: bool
    tp: int
    deepspeed: bool


@dataclass(frozen=True)
class AgreementMismatch:
    """One finding of the rank-agreement check: at `step` (None: at train begin) the `ranks` disagree with their
    group on `what`; `message`: its sentence, for the report; `fix`: what to do."""

    step: int | None
    what: str
    ranks: tuple[int, ...]
    message: str
    fix: str


@dataclass(frozen=True)
class NonFiniteSkip:
    """One step the gradient-health callback refused for a non-finite value: `ranks` whose loss or gradient was
    non-finite, `loss_ranks` those whose loss was (the callback's `NonFiniteReport`)."""

    step: int
    ranks: tuple[int, ...]
    loss_ranks: tuple[int, ...]


@dataclass
class RunFacts:
    """One rank's record of one RecipeTrainer run, or `error` (the exception's type and text) when it raised.
    `steps`, `loss`, `grad_norm`, `batches` (SHA-256 of the step's input ids) are keyed by optimizer step;
    `events`: the `nonfinite_event` texts this rank's logs carried, by step; `skipped_steps` and `skips`: the
    gradient-health callback's count and reports; `mismatches` and `rank_check`: the rank-agreement check's
    findings and its train-begin report."""

    rank: int = 0
    world_size: int = 1
    steps: dict[int, StepFacts] = field(default_factory=dict)
    loss: dict[int, float] = field(default_factory=dict)
    grad_norm: dict[int, float] = field(default_factory=dict)
    batches: dict[int, str] = field(default_factory=dict)
    events: dict[int, str] = field(default_factory=dict)
    skipped_steps: int = 0
    skips: list[NonFiniteSkip] = field(default_factory=list)
    mismatches: list[AgreementMismatch] = field(default_factory=list)
    rank_check: dict[str, float] = field(default_factory=dict)
    expected: ExpectedSettings | None = None
    error: str | None = None

    @classmethod
    def failed(cls, error: str) -> RunFacts:
        return cls(error=error)
