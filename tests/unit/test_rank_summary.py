"""Rank summaries keep their numbers without the per-rank TensorBoard callback (per_rank_tensorboard=False)."""

import json

import pytest

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.monitoring import PerRankTensorBoardCallback
from tests.support.models import SMALL

STEPS, BATCH, SEQ = 6, 4, 32


@pytest.mark.parametrize("tensorboard", [False, True])
def test_summary_has_time_and_losses_with_or_without_tensorboard(tmp_path, tensorboard):
    args = RecipeTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=3e-3,
        warmup_steps=1,
        logging_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        per_rank_tensorboard=tensorboard,
    )
    trainer = RecipeTrainer(
        model_init=lambda: build_tiny_deepseek(**SMALL),
        args=args,
        train_dataset=stdlib_dataset(seq_len=SEQ, max_bytes=20_000),
    )
    assert any(isinstance(c, PerRankTensorBoardCallback) for c in trainer.callback_handler.callbacks) is tensorboard
    trainer.train()

    summary = json.loads((tmp_path / "rank_summaries" / "rank0.json").read_text())
    assert summary["train_seconds"] > 0
    assert summary["tokens"] == STEPS * BATCH * SEQ
    assert summary["tokens_per_s"] == pytest.approx(summary["tokens"] / summary["train_seconds"])
    # One process: the rank's own loss at the first and last log is the Trainer's logged (cross-rank) loss.
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == STEPS // 2
    assert summary["first_rank_loss"] == pytest.approx(logged[0], rel=1e-4)
    assert summary["last_rank_loss"] == pytest.approx(logged[-1], rel=1e-4)
    assert summary["first_rank_loss"] != pytest.approx(summary["last_rank_loss"], rel=1e-4)
    assert (tmp_path / "tensorboard" / "rank0").is_dir() is tensorboard


def test_new_event_file_waits_until_its_name_sorts_last(tmp_path):
    # An event file opened in the same whole second as an existing one would sort before it ("...10" < "...9").
    from hf_dist_recipes.monitoring.tensorboard import _after_existing_event_files

    (tmp_path / "events.out.tfevents.0000001000.host.7.9").write_bytes(b"")
    slept = []
    _after_existing_event_files(str(tmp_path), clock=lambda: 1000.25, sleep=slept.append)
    assert slept == [0.75]  # to second 1001, where the new name's time field is larger
    slept.clear()
    _after_existing_event_files(str(tmp_path), clock=lambda: 1001.0, sleep=slept.append)
    assert slept == []
