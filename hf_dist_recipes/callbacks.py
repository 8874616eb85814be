"""The recipe's callbacks for given arguments, in the order they run: `recipe_callbacks`. The trainer wires them,
the practices act (`RecipeTrainerMixin` adds this list after the Trainer's own callbacks).

Order: each requirement is one `Before` entry of `ORDER`, with its reason (`order_problems` checks a list against
them: tests/unit/test_callbacks.py). One more holds for the whole list: it runs after the Trainer's own callbacks
(flow, `report_to` integrations, console), which the trainer guarantees by adding it after `Trainer.__init__`,
because the `PendingLogs` callbacks add per-rank keys and texts to `logs` in `on_log` that must reach neither the
integrations nor `log_history`, and `GradientHealthCallback.on_step_end` reads the flow callback's decision to log,
save or stop.
Where no requirement is stated, the order carries none (`RankMetrics.flush_window` gives the TensorBoard and summary
callbacks the same numbers in either order).

Callbacks that need RecipeTrainer to feed them (`core.feeding`): `GradientHealthCallback` (each micro-batch's loss),
`RankAgreementCallback` with `tp_size` > 1 (each micro step's loss and batch), `PerRankTensorBoardCallback` and
`RankSummaryCallback` (their `RankMetrics`). Under a plain `transformers.Trainer` they raise ValueError at the first
optimizer step, naming the fix (`recipe(YourTrainer)`). The others work with any Trainer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback

from hf_dist_recipes.arguments import RecipeTrainingArguments
from hf_dist_recipes.comm.watchdog import HangWatchdogCallback
from hf_dist_recipes.moe.expert_load import ExpertLoadCallback, has_routed_experts
from hf_dist_recipes.monitoring.pending import PendingLogs
from hf_dist_recipes.monitoring.rank_metrics import RankMetrics
from hf_dist_recipes.monitoring.stragglers import StragglerCallback
from hf_dist_recipes.monitoring.summary_callback import RankSummaryCallback
from hf_dist_recipes.monitoring.system_metrics import SystemMetricsCallback
from hf_dist_recipes.monitoring.tensorboard import PerRankTensorBoardCallback
from hf_dist_recipes.parallel.plan_record import PlanConformanceCallback
from hf_dist_recipes.reproducibility.rank_agreement import RankAgreementCallback, weights_checksum
from hf_dist_recipes.reproducibility.seeding import SeedReport
from hf_dist_recipes.stability.gradient_health import GradientHealthCallback

# Stock callbacks a recipe callback replaces: the stock TensorBoard callback writes rank 0 only, into the same root.
REPLACES: dict[type[TrainerCallback], type[TrainerCallback]] = {PerRankTensorBoardCallback: TensorBoardCallback}


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
        PendingLogs,
        (PerRankTensorBoardCallback, RankSummaryCallback),
        "in on_log these write (TensorBoard) and keep (the summary's events) the keys the PendingLogs callbacks add",
    ),
)


def recipe_callbacks(
    args: RecipeTrainingArguments,
    model,
    *,
    rank_metrics: RankMetrics,
    seed_report: SeedReport | None = None,
    tp_size: int = 1,
    registered: Sequence[TrainerCallback] = (),
) -> list[TrainerCallback]:
    """The recipe's callbacks for `args`, in order (module docstring), to add after the Trainer's own.

    `model`: the model as this rank built it (before any engine): its weights' checksum goes to the rank agreement
    check, and a model with routed experts gets the expert-load callback unless `registered` (the callbacks the
    Trainer holds already) has one. `rank_metrics`: the counters the trainer feeds (`RankMetrics.add_micro_step`),
    read by the TensorBoard and summary callbacks. `tp_size`: the DeepSpeed AutoTP degree (1 without)."""
    callbacks: list[TrainerCallback] = [
        # A dead or stuck rank ends every rank within a bound instead of a silent wait in a collective.
        HangWatchdogCallback(args.peer_timeout, args.step_timeout, args.ddp_timeout),
        PlanConformanceCallback(args.launch_plan, allow=args.allow_no_recompute),
    ]
    if has_routed_experts(model) and not any(isinstance(c, ExpertLoadCallback) for c in registered):
        callbacks.append(ExpertLoadCallback())
    callbacks += [
        RankAgreementCallback(
            seed=args.seed,
            policy=args.seed_check,
            rank_check_steps=args.rank_check_steps,
            tp_size=tp_size,
            per_rank_dropout=args.per_rank_dropout,
            # The weights as this rank built them, before the engine's broadcast from rank 0 makes every rank agree.
            weights=None if args.seed_check == "off" else weights_checksum(model),
        ),
        GradientHealthCallback(
            nonfinite_policy=args.nonfinite_policy,
            max_consecutive_skips=args.max_consecutive_skips,
            spike_window=args.spike_window,
            spike_threshold=args.spike_threshold,
        ),
        StragglerCallback(args.straggler_check_steps, args.straggler_threshold, args.straggler_windows),
        SystemMetricsCallback(),
    ]
    if args.per_rank_tensorboard:
        callbacks.append(PerRankTensorBoardCallback(args.logging_dir, rank_metrics, seed_report))
    callbacks.append(RankSummaryCallback(rank_metrics, args.logging_dir, seed_report))
    return callbacks


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
