"""One contract for the per-rank callbacks RecipeTrainer registers (in the way composer tests its callbacks): the
TensorBoard and summary callbacks, SystemMetricsCallback, StragglerCallback (idle in one process: its contract here
is to stay out of the way), and the ExpertLoad, GradientHealth and RankAgreement callbacks that come with them on a
MoE model. Each scenario drives a real RecipeTrainer on a tiny model:
train twice in one process, a run with no logging step, a run resumed from a checkpoint, and rank > 0."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from transformers import TrainingArguments

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.monitoring import (
    ExpertLoadCallback,
    PerRankTensorBoardCallback,
    RankSummaryCallback,
    SystemMetricsCallback,
    read_scalars,
    read_texts,
    system_metrics,
)
from hf_dist_recipes.monitoring.stragglers import StragglerCallback
from hf_dist_recipes.reproducibility.rank_agreement import RankAgreementCallback
from hf_dist_recipes.stability.gradient_health import GradientHealthCallback
from tests.support.models import SMALL

CONTRACT = (
    PerRankTensorBoardCallback,
    RankSummaryCallback,
    SystemMetricsCallback,
    ExpertLoadCallback,
    GradientHealthCallback,
    RankAgreementCallback,
    StragglerCallback,
)


def _trainer(out, **overrides) -> RecipeTrainer:
    kw = dict(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed=7,
    )
    kw.update(overrides)
    trainer = RecipeTrainer(
        model_init=lambda: build_tiny_deepseek(**SMALL),
        args=RecipeTrainingArguments(**kw),
        train_dataset=stdlib_dataset(seq_len=16, max_bytes=4_000),
    )
    registered = {type(c) for c in trainer.callback_handler.callbacks}
    assert set(CONTRACT) <= registered, set(CONTRACT) - registered
    return trainer


def _tensorboard(trainer) -> PerRankTensorBoardCallback:
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, PerRankTensorBoardCallback))


def _after_train_end(trainer, rank: int = 0) -> dict:
    """What every scenario requires once train() returned; the rank's summary."""
    assert _tensorboard(trainer).writer is None  # closed: nothing left to flush
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # our SIGTERM flush handler is uninstalled
    for callback in trainer.callback_handler.callbacks:
        if hasattr(callback, "pop_pending") and not isinstance(callback, GradientHealthCallback):
            assert callback.pop_pending() == {}, type(callback)  # nothing stale for a next train()
        if hasattr(callback, "pop_rank_pending"):
            assert callback.pop_rank_pending() == {}, type(callback)
    summary = json.loads((Path(trainer.args.output_dir) / "rank_summaries" / f"rank{rank}.json").read_text())
    assert summary["rank"] == rank and summary["steps"] == trainer.state.global_step
    return summary


@pytest.fixture(autouse=True)
def _fresh_launch(monkeypatch):
    # Each test is its own launch (in a real job a new process): forget the process-wide run id.
    monkeypatch.setattr(system_metrics, "_run_id", None)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_train_begin_and_end_twice_in_one_process(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.train()
    first_history = list(trainer.state.log_history)
    trainer.train()  # the same trainer again: every callback starts over without leftovers
    _after_train_end(trainer)
    for history in (first_history, trainer.state.log_history):
        logs = [e for e in history if "loss" in e]
        assert [e["step"] for e in logs] == [2, 4]
        # The expert load is in log_history; this rank's system metrics are in its TensorBoard run only.
        assert all("experts/max_over_mean" in e and "system/rss_gib" not in e for e in logs)
    rss_steps = [step for step, _ in read_scalars(tmp_path / "tensorboard" / "rank0")["train/system/rss_gib"]]
    assert rss_steps == [2, 4, 2, 4]  # both calls' logs
    run = read_texts(tmp_path / "tensorboard" / "rank0")["run/text_summary"]
    assert len(run) == 2 and run[0][1] == run[1][1]  # one launch: the same identity written by both calls


def test_a_run_with_no_logging_step(tmp_path):
    trainer = _trainer(tmp_path, max_steps=2, logging_steps=10)
    trainer.train()
    summary = _after_train_end(trainer)
    assert summary["steps"] == 2 and summary["first_loss"] is None  # no log: no cross-rank loss
    assert summary["first_rank_loss"] is not None  # the window closed at train end
    assert not any("system/rss_gib" in e for e in trainer.state.log_history)
    run_dir = tmp_path / "tensorboard" / "rank0"
    scalars = read_scalars(run_dir)
    # The only log is the Trainer's end-of-training one (train_loss, runtime) at step 2: no loss curve, no sample.
    assert [s for s, _ in scalars["train/train_loss"]] == [2]
    assert "train/loss" not in scalars and not any(tag.startswith("train/system/") for tag in scalars)
    assert "run/text_summary" in read_texts(run_dir)


def test_a_run_resumed_from_a_checkpoint(tmp_path, monkeypatch):
    _trainer(tmp_path, save_strategy="steps", save_steps=2).train()
    monkeypatch.setattr(system_metrics, "_run_id", None)  # the resume is a new launch: accepted, not refused
    trainer = _trainer(tmp_path, save_strategy="steps", save_steps=2, max_steps=6)
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    summary = _after_train_end(trainer)
    assert summary["steps"] == 6
    scalars = read_scalars(tmp_path / "tensorboard" / "rank0")
    # Steps 3 and 4 of the first launch are purged: each step once, the resumed launch's 4 and 6 after its 2.
    assert [s for s, _ in scalars["train/loss"]] == [2, 4, 6]
    assert [s for s, _ in scalars["train/system/rss_gib"]] == [2, 4, 6]
    run = json.loads((tmp_path / "tensorboard" / "rank0" / "run.json").read_text())
    assert run["run_id"] == summary["run_id"]  # the resumed launch's id


def test_rank_above_zero(tmp_path, monkeypatch):
    # One process plays global rank 1 / local rank 1 of a job: the arguments say so (process_index and
    # local_process_index are properties read from the accelerate state; patched on the class for this test).
    monkeypatch.setattr(TrainingArguments, "process_index", property(lambda self: 1))
    monkeypatch.setattr(TrainingArguments, "local_process_index", property(lambda self: 1))
    trainer = _trainer(tmp_path)
    trainer.train()
    summary = _after_train_end(trainer, rank=1)
    assert summary["local_rank"] == 1
    assert not (tmp_path / "tensorboard" / "rank0").exists()
    run = json.loads((tmp_path / "tensorboard" / "rank1" / "run.json").read_text())
    assert (run["rank"], run["local_rank"]) == (1, 1)
    assert [s for s, _ in read_scalars(tmp_path / "tensorboard" / "rank1")["train/system/rss_gib"]] == [2, 4]
