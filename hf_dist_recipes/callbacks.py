"""The recipe's callbacks for given arguments, in the order they run: `recipe_callbacks`. The trainer wires them,
the practices act (`RecipeTrainerMixin` adds them after the Trainer's own callbacks).

Most are `RecipeCallback`s (`hf_dist_recipes.runtime`): the trainer hands them the run's `RecipeRuntime` when it adds
them, calls the events no `TrainerCallback` hook carries on them (each micro-batch's loss and batch, the pre-clip
gradient norm, the bytes of a save, a failure), and what they log goes into the runtime's `LogSink`, from which
`RecipeTrainer.log` fills each log. So no callback depends on another's place in the list for its numbers.

Order: one requirement remains, a `Before` entry of `ORDER` with its reason (`order_problems` checks a list against
it: tests/unit/test_callbacks.py). The list runs after the Trainer's own callbacks (flow, `report_to`
integrations, console): `GradientHealthCallback.on_step_end` and the samplers read the flow callback's decision to
log, save or stop, which the trainer guarantees by adding the list after `Trainer.__init__`.

A `RecipeCallback` under a plain `transformers.Trainer` (no runtime) raises ValueError at train begin, naming the fix
(`recipe(YourTrainer)`); `PlanConformanceCallback` and `PreemptionCallback` work with any Trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields

from transformers import TrainerCallback

from hf_dist_recipes.arguments import RecipeTrainingArguments
from hf_dist_recipes.checkpoint.preemption import PreemptionCallback, parse_signals
from hf_dist_recipes.comm.watchdog import HangWatchdogCallback
from hf_dist_recipes.moe.expert_balance import ExpertBiasBalancer, needs_balancing
from hf_dist_recipes.moe.expert_load import ExpertLoadCallback, has_routed_experts
from hf_dist_recipes.monitoring import rank_series
from hf_dist_recipes.monitoring.rank_series import RankSeriesCallback
from hf_dist_recipes.monitoring.stragglers import StragglerCallback
from hf_dist_recipes.monitoring.summary_callback import RankSummaryCallback
from hf_dist_recipes.monitoring.system_metrics import SystemMetricsCallback
from hf_dist_recipes.monitoring.tensorboard import PerRankTensorBoardCallback
from hf_dist_recipes.parallel.checkpoint_bytes import save_timeout_s
from hf_dist_recipes.parallel.plan_record import PlanConformanceCallback
from hf_dist_recipes.reproducibility.rank_agreement import RankAgreementCallback, weights_checksum
from hf_dist_recipes.stability.gradient_health import GradientHealthCallback


@dataclass(frozen=True)
class Before:
    """Instances of `first` come before instances of `then` (a callback is never compared with itself)."""

    first: type | tuple[type, ...]
    then: type | tuple[type, ...]
    because: str


ORDER: tuple[Before, ...] = (
    Before(
        HangWatchdogCallback,
        TrainerCallback,
        "its on_train_begin starts the heartbeat before the other callbacks' train-begin collectives (rank agreement, "
        "launch identity), so that a rank lost in one of them is named",
    ),
    Before(
        (HangWatchdogCallback, PerRankTensorBoardCallback),
        PreemptionCallback,
        "its on_train_begin installs the signal handlers last, so that a SIGTERM asks for a save before the "
        "TensorBoard flush or the state dump ends the process, and the watchdog has handed it its state dump",
    ),
    Before(
        (GradientHealthCallback, RankSummaryCallback),
        RankSeriesCallback,
        "their on_step_end give what the per-rank series report at a logged step: the check of the steps waiting "
        "under ZeRO-3 every rank's local gradient norm, the summary's the end of the step's timing (RankMetrics)",
    ),
)


@dataclass(frozen=True)
class RecipeCallbacks:
    """The recipe's callbacks of one trainer, by role (None: not registered for these arguments or this model)."""

    watchdog: HangWatchdogCallback
    plan_conformance: PlanConformanceCallback
    expert_load: ExpertLoadCallback | None
    expert_balance: ExpertBiasBalancer | None
    rank_agreement: RankAgreementCallback
    gradient_health: GradientHealthCallback
    stragglers: StragglerCallback
    system_metrics: SystemMetricsCallback
    tensorboard: PerRankTensorBoardCallback | None
    summary: RankSummaryCallback
    rank_series: RankSeriesCallback | None
    preemption: PreemptionCallback

    def replaced_by(self, callbacks: Sequence[TrainerCallback]) -> RecipeCallbacks:
        """These roles, each filled by the one of `callbacks` of the same class where there is one (a callback the
        Trainer rebuilt from a checkpoint replaces the instance built here)."""
        by_class = {type(c): c for c in callbacks}
        return dataclasses.replace(
            self,
            **{
                f.name: by_class[type(c)]
                for f in fields(self)
                if (c := getattr(self, f.name)) is not None and type(c) in by_class
            },
        )

    def in_order(self) -> list[TrainerCallback]:
        """The callbacks to add, in the order they run (the fields' order)."""
        return [c for c in (getattr(self, f.name) for f in fields(self)) if c is not None]


def recipe_callbacks(
    args: RecipeTrainingArguments,
    model,
    *,
    registered: Collection[type] = (),
) -> RecipeCallbacks:
    """The recipe's callbacks for `args`, to add after the Trainer's own in `in_order()` (adding hands each recipe
    callback the run's runtime: module docstring).

    `model`: the model as this rank built it (before any engine): its weights' checksum goes to the rank agreement
    check, a model with routed experts gets the expert-load callback, and one whose routers choose by DeepSeek-V3's
    correction bias the bias balancer (under `expert_bias_balancing`), each unless `registered` (the classes of the
    callbacks the Trainer holds already) has one."""
    # Last: its handlers are installed after the TensorBoard flush's and the watchdog's, so a signal it takes
    # asks for a save first; the watchdog's state dump ends a rank stuck past the grace.
    preemption = PreemptionCallback(parse_signals(args.preemption_signals))
    wants_expert_load = has_routed_experts(model) and ExpertLoadCallback not in registered
    gradient_health = GradientHealthCallback(
        nonfinite_policy=args.nonfinite_policy,
        max_consecutive_skips=args.max_consecutive_skips,
        spike_window=args.spike_window,
        spike_threshold=args.spike_threshold,
    )
    return RecipeCallbacks(
        # A dead or stuck rank ends every rank within a bound instead of a silent wait in a collective.
        watchdog=HangWatchdogCallback(
            args.peer_timeout,
            args.step_timeout,
            args.ddp_timeout,
            save_bound=save_timeout_s,
            preemption=preemption,
        ),
        plan_conformance=PlanConformanceCallback(args.launch_plan, allow=args.allow_no_recompute),
        expert_load=ExpertLoadCallback() if wants_expert_load else None,
        # The memory estimate assumes even routing; this keeps the load near it (hf_dist_recipes.moe.expert_balance).
        expert_balance=(
            ExpertBiasBalancer() if args.expert_bias_balancing and needs_balancing(model, registered) else None
        ),
        rank_agreement=RankAgreementCallback(
            seed=args.seed,
            policy=args.seed_check,
            rank_check_steps=args.rank_check_steps,
            per_rank_dropout=args.per_rank_dropout,
            # The weights as this rank built them, before the engine's broadcast from rank 0 makes every rank agree.
            weights=None if args.seed_check == "off" else weights_checksum(model),
        ),
        gradient_health=gradient_health,
        stragglers=StragglerCallback(args.straggler_check_steps, args.straggler_threshold, args.straggler_windows),
        system_metrics=SystemMetricsCallback(),
        tensorboard=PerRankTensorBoardCallback(args.logging_dir) if args.per_rank_tensorboard else None,
        summary=RankSummaryCallback(args.logging_dir),
        rank_series=RankSeriesCallback(gradient_health) if rank_series.wanted(args.report_to) else None,
        preemption=preemption,
    )


def order_problems(callbacks: Sequence[TrainerCallback], rules: Sequence[Before] = ORDER) -> list[str]:
    """Each rule of `rules` that `callbacks` (in the order they run) breaks, as a sentence; [] when none."""
    problems = []
    for rule in rules:
        for i, early in enumerate(callbacks):
            if not isinstance(early, rule.then):
                continue
            for late in callbacks[i + 1 :]:
                if isinstance(late, rule.first) and late is not early:
                    problems.append(f"{type(late).__name__} must come before {type(early).__name__}: {rule.because}")
    return problems
