"""`hf_dist_recipes.callbacks`: the recipe's callbacks in order, each built with the run's runtime, and what the fed
ones do under a plain Trainer.

The order rule is checked against the list `recipe_callbacks` returns and against a real RecipeTrainer's handler;
the plain-Trainer cases train a tiny DeepSeek model through `transformers.Trainer` itself, one process."""

from __future__ import annotations

import pytest
from transformers import Trainer, TrainingArguments
from transformers.integrations import TensorBoardCallback
from transformers.trainer_callback import DefaultFlowCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.callbacks import ORDER, Before, order_problems, recipe_callbacks
from hf_dist_recipes.checkpoint.preemption import PreemptionCallback
from hf_dist_recipes.comm.watchdog import HangWatchdogCallback
from hf_dist_recipes.core.layout import RankLayout
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.moe.expert_balance import ExpertBiasBalancer
from hf_dist_recipes.moe.expert_load import ExpertLoadCallback
from hf_dist_recipes.monitoring.stragglers import StragglerCallback
from hf_dist_recipes.monitoring.summary_callback import RankSummaryCallback
from hf_dist_recipes.monitoring.system_metrics import SystemMetricsCallback
from hf_dist_recipes.monitoring.tensorboard import PerRankTensorBoardCallback
from hf_dist_recipes.parallel.plan_record import PlanConformanceCallback
from hf_dist_recipes.reproducibility.rank_agreement import RankAgreementCallback
from hf_dist_recipes.runtime import JobFacts, RecipeRuntime
from hf_dist_recipes.stability.gradient_health import GradientHealthCallback
from tests.support.models import SMALL

FULL = [
    HangWatchdogCallback,
    PlanConformanceCallback,
    ExpertLoadCallback,
    ExpertBiasBalancer,
    RankAgreementCallback,
    GradientHealthCallback,
    StragglerCallback,
    SystemMetricsCallback,
    PerRankTensorBoardCallback,
    RankSummaryCallback,
    PreemptionCallback,
]


def _args(tmp_path, **fields) -> RecipeTrainingArguments:
    kw = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, report_to="none", seed=7)
    return RecipeTrainingArguments(**{**kw, **fields})


@pytest.fixture(scope="module")
def moe_model():
    return build_tiny_deepseek(**SMALL)


@pytest.mark.parametrize("per_rank_tensorboard", [True, False])
def test_the_list_for_given_arguments_keeps_every_order_rule(tmp_path, moe_model, per_rank_tensorboard):
    args = _args(tmp_path, per_rank_tensorboard=per_rank_tensorboard)
    runtime = RecipeRuntime()
    callbacks = recipe_callbacks(args, moe_model, runtime).in_order()
    expected = FULL if per_rank_tensorboard else [c for c in FULL if c is not PerRankTensorBoardCallback]
    assert [type(c) for c in callbacks] == expected
    assert order_problems(callbacks) == []
    # Every callback that takes the runtime got this one (the watchdog listens to it instead of keeping it).
    assert all(c.runtime is runtime for c in callbacks if hasattr(c, "runtime"))
    # all but watchdog, plan, the balancer (which logs nothing) and the preemption (which only reads signals)
    assert sum(hasattr(c, "runtime") for c in callbacks) == len(expected) - 4
    # A dense model has no experts to count or balance; one the user registered is not doubled.
    dense = recipe_callbacks(args, None, RecipeRuntime()).in_order()
    assert not {ExpertLoadCallback, ExpertBiasBalancer} & {type(c) for c in dense} and order_problems(dense) == []
    mine = [ExpertLoadCallback(), ExpertBiasBalancer()]
    users = recipe_callbacks(args, moe_model, RecipeRuntime(), registered=mine).in_order()
    assert not {ExpertLoadCallback, ExpertBiasBalancer} & {type(c) for c in users}


def test_order_problems_names_a_broken_rule(tmp_path):
    swapped = [RankSummaryCallback(str(tmp_path)), HangWatchdogCallback(0, 0, 0)]
    (problem,) = order_problems(swapped)
    assert problem.startswith("HangWatchdogCallback must come before RankSummaryCallback: ")
    assert order_problems([HangWatchdogCallback(0, 0, 0)]) == []  # never compared with itself
    # Every rule names classes the list can hold, and a reason.
    assert all(isinstance(rule, Before) and rule.because for rule in ORDER)


def test_recipe_trainer_adds_them_after_the_stock_callbacks_in_order(tmp_path, moe_model):
    trainer = RecipeTrainer(model=moe_model, args=_args(tmp_path, report_to="tensorboard"))
    held = trainer.callback_handler.callbacks
    ours = [c for c in held if type(c) in FULL]
    assert [type(c) for c in ours] == FULL and order_problems(ours) == []
    first_ours = held.index(ours[0])
    assert isinstance(held[0], DefaultFlowCallback) and all(type(c) not in FULL for c in held[:first_ours])
    assert held[first_ours:] == ours  # nothing stock after ours
    assert not any(isinstance(c, TensorBoardCallback) for c in held)  # replaced by the per-rank one
    assert trainer.rank_agreement is ours[4] and trainer.plan_conformance is ours[1]
    assert all(c.runtime is trainer.runtime for c in ours if hasattr(c, "runtime"))


def test_an_expert_load_callback_the_user_registered_logs_through_the_trainers_runtime(tmp_path, moe_model):
    mine = ExpertLoadCallback(per_expert=True)
    trainer = RecipeTrainer(model=moe_model, args=_args(tmp_path), callbacks=[mine])
    assert [c for c in trainer.callback_handler.callbacks if isinstance(c, ExpertLoadCallback)] == [mine]
    assert mine.runtime is trainer.runtime and trainer.recipe_callbacks.expert_load is None  # not doubled


def _plain_trainer(tmp_path, callbacks, **fields) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=7,
        **fields,
    )
    return Trainer(
        model=build_tiny_deepseek(**SMALL),
        args=args,
        train_dataset=stdlib_dataset(seq_len=16, max_bytes=2_000),
        callbacks=callbacks,
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda tmp: GradientHealthCallback(),
        lambda tmp: RankSummaryCallback(str(tmp / "tb")),
        lambda tmp: PerRankTensorBoardCallback(str(tmp / "tb")),
    ],
    ids=["gradient_health", "rank_summary", "per_rank_tensorboard"],
)
def test_a_fed_callback_under_a_plain_trainer_names_the_fix(tmp_path, make):
    trainer = _plain_trainer(tmp_path, [make(tmp_path)])
    with pytest.raises(ValueError, match=r"only RecipeTrainer hands it.*recipe\(YourTrainer\)"):
        trainer.train()
    assert trainer.state.global_step <= 1  # stopped at the first optimizer step (before or after it counted)


def test_rank_agreement_inside_a_tp_group_needs_feeding_under_a_plain_trainer(tmp_path):
    # With tp_size 2 the periodic checks compare each micro step's loss and batch, which only RecipeTrainer observes.
    tp2 = RecipeRuntime(JobFacts(layout=RankLayout(2, tp=2)))
    trainer = _plain_trainer(tmp_path, [RankAgreementCallback(seed=7, rank_check_steps=1, runtime=tp2)])
    with pytest.raises(ValueError, match="RankAgreementCallback with tp_size > 1 needs"):
        trainer.callback_handler.on_step_end(trainer.args, trainer.state, trainer.control)


def test_the_unfed_callbacks_work_under_a_plain_trainer(tmp_path):
    # One process: the rank agreement's train-begin record and periodic check (step, learning rate) need no feeding,
    # nor do the stragglers (idle in one process), the system metrics and the watchdog.
    runtime = RecipeRuntime()
    agreement = RankAgreementCallback(seed=7, rank_check_steps=1, weights=(1.0, 2.0), runtime=runtime)
    others = [
        SystemMetricsCallback(runtime=runtime),
        StragglerCallback(1, 0.2, 2),
        HangWatchdogCallback(120, 600, 7200),
    ]
    trainer = _plain_trainer(tmp_path, [agreement, *others])
    trainer.train()
    assert trainer.state.global_step == 2
    assert agreement.begin_report["rank_check/seed_ok"] == 1.0 and agreement.last_agreed_step == 2
    # Under a plain Trainer nothing takes the runtime's channels into the logs: they wait there, not in log_history.
    pending = runtime.logs.peek()
    assert pending.history == {"rank_check/ok": 1.0} and "system/rss_gib" in pending.rank
    assert not any("rank_check/ok" in e or "system/rss_gib" in e for e in trainer.state.log_history)
