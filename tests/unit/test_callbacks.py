"""`hf_dist_recipes.callbacks`: the recipe's callbacks in order, each handed the run's runtime when the trainer adds
it, the recipe's events reaching them by name, and what a recipe callback does under a plain Trainer.

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
from hf_dist_recipes.runtime import RecipeCallback
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
    callbacks = recipe_callbacks(args, moe_model).in_order()
    expected = FULL if per_rank_tensorboard else [c for c in FULL if c is not PerRankTensorBoardCallback]
    assert [type(c) for c in callbacks] == expected
    assert order_problems(callbacks) == []
    # All but the plan check and the preemption (which only read the arguments and signals) take the runtime.
    assert [type(c) for c in callbacks if not isinstance(c, RecipeCallback)] == [
        PlanConformanceCallback,
        PreemptionCallback,
    ]
    # A dense model has no experts to count or balance; one the user registered is not doubled.
    dense = recipe_callbacks(args, None).in_order()
    assert not {ExpertLoadCallback, ExpertBiasBalancer} & {type(c) for c in dense} and order_problems(dense) == []
    users = recipe_callbacks(args, moe_model, registered={ExpertLoadCallback, ExpertBiasBalancer}).in_order()
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
    assert all(c.runtime is trainer.runtime for c in ours if isinstance(c, RecipeCallback))
    later = GradientHealthCallback()
    trainer.add_callback(later)  # a recipe callback added later gets the runtime too
    assert later.runtime is trainer.runtime


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


@pytest.mark.parametrize("recipe_callback", [c for c in FULL if issubclass(c, RecipeCallback)])
def test_a_recipe_callback_under_a_plain_trainer_names_the_fix_at_train_begin(tmp_path, recipe_callback):
    made = {
        HangWatchdogCallback: lambda: HangWatchdogCallback(120, 600, 7200),
        RankAgreementCallback: lambda: RankAgreementCallback(seed=7),
        RankSummaryCallback: lambda: RankSummaryCallback(str(tmp_path / "tb")),
        PerRankTensorBoardCallback: lambda: PerRankTensorBoardCallback(str(tmp_path / "tb")),
    }.get(recipe_callback, recipe_callback)
    trainer = _plain_trainer(tmp_path, [made()])
    with pytest.raises(ValueError, match=rf"^{recipe_callback.__name__} has no runtime.*recipe\(YourTrainer\)"):
        trainer.train()
    assert trainer.state.global_step == 0


class Heard(RecipeCallback):
    """A user's recipe callback: records every recipe event it hears, by name."""

    def __init__(self):
        self.heard: list[tuple[str, int]] = []

    def on_micro_batch_loss(self, args, state, control, loss, **kwargs):
        self.heard.append(("on_micro_batch_loss", state.global_step))
        return loss * 2  # the loss the next callback and the backward pass see

    def on_micro_step(self, args, state, control, loss, inputs, **kwargs):
        self.heard.append(("on_micro_step", state.global_step))

    def on_grad_norm(self, args, state, control, grad_norm, **kwargs):
        self.heard.append(("on_grad_norm", state.global_step))


def test_the_recipe_events_reach_a_users_callback_in_step_order_and_a_removed_one_hears_nothing(tmp_path):
    heard, removed = Heard(), Heard()
    args = _args(tmp_path, logging_steps=1, gradient_accumulation_steps=2, disable_tqdm=True, seed_check="off")
    trainer = RecipeTrainer(
        model=build_tiny_deepseek(**SMALL),
        args=args,
        train_dataset=stdlib_dataset(seq_len=16, max_bytes=2_000),
        callbacks=[heard, removed],
    )
    trainer.remove_callback(removed)
    trainer.train()
    step = [("on_micro_batch_loss", 0), ("on_micro_step", 0)] * 2 + [("on_grad_norm", 0)]
    assert heard.heard == step + [(event, 1) for event, _ in step]
    assert removed.heard == []
    # The doubled loss is what trained: the Trainer's logged loss is the mean of the returned micro-batch losses.
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 2 and all(value > 2 * 4.0 for value in logged)  # ln(vocab) ~ 4.8 at random init, doubled
