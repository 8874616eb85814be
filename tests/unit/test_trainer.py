"""RecipeTrainer in one process (no launcher): drop-in construction, seeding, schedule, per-rank logs."""

import inspect
import json

import pytest
from transformers import Trainer, TrainingArguments
from transformers.integrations import TensorBoardCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.monitoring import read_scalars
from tests.support.models import SMALL


def _trainer(tmp_path, args=None, **overrides):
    if args is None:
        args = RecipeTrainingArguments(
            output_dir=str(tmp_path),
            max_steps=30,
            per_device_train_batch_size=4,
            learning_rate=3e-3,
            warmup_steps=3,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            **overrides,
        )
    return RecipeTrainer(
        model_init=lambda: build_tiny_deepseek(**SMALL),
        args=args,
        train_dataset=stdlib_dataset(seq_len=32, max_bytes=100_000),
    )


def test_constructor_is_the_trainers_with_nothing_reordered():
    ours = list(inspect.signature(RecipeTrainer.__init__).parameters)
    stock = list(inspect.signature(Trainer.__init__).parameters)
    assert ours[: len(stock)] == stock


def test_plain_trainingarguments_are_upgraded(tmp_path):
    plain = TrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to="tensorboard")
    trainer = _trainer(tmp_path, args=plain)
    assert isinstance(trainer.args, RecipeTrainingArguments)
    assert trainer.args.max_steps == 2
    # rank 0's stock TensorBoard writer is replaced by the per-rank one
    assert not any(isinstance(cb, TensorBoardCallback) for cb in trainer.callback_handler.callbacks)


def test_model_init_is_seeded_identically(tmp_path):
    a = _trainer(tmp_path / "a").model.state_dict()
    b = _trainer(tmp_path / "b").model.state_dict()
    assert all((a[k] == b[k]).all() for k in a)
    c = _trainer(tmp_path / "c", seed=7).model.state_dict()
    assert any((a[k] != c[k]).any() for k in a)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    trainer = _trainer(out)
    trainer.train()
    return trainer, out


def test_loss_falls_and_schedule_restarts(trained):
    trainer, _ = trained
    logs = [e for e in trainer.state.log_history if "loss" in e]
    losses = [e["loss"] for e in logs]
    assert losses[-1] < losses[0] - 0.5
    lrs = [e["learning_rate"] for e in logs]  # logged after each step's scheduler step
    assert max(lrs) == pytest.approx(3e-3)
    # 3 cosine cycles over 27 post-warm-up steps: the lr rises back to the peak twice after the first descent
    jumps = [i for i in range(1, len(lrs)) if lrs[i] > lrs[i - 1] * 5 and i > 3]
    assert len(jumps) == 2


def test_rank0_tensorboard_holds_loss_lr_and_rank_metrics(trained):
    trainer, out = trained
    scalars = read_scalars(out / "tensorboard" / "rank0")
    for tag in ("train/loss", "train/learning_rate", "train/grad_norm", "rank/loss", "rank/step_time_s"):
        assert len(scalars[tag]) == 30, tag
    # one process: its own loss is the logged loss
    own = [v for _, v in scalars["rank/loss"]]
    logged = [v for _, v in scalars["train/loss"]]
    assert own == pytest.approx(logged, rel=1e-4)


def test_rank_summary_is_written(trained):
    trainer, out = trained
    summary = json.loads((out / "rank_summaries" / "rank0.json").read_text())
    assert summary["steps"] == 30 and summary["tokens"] == 30 * 4 * 32
    assert summary["rng_fingerprint"] == trainer.seed_report.fingerprint
    assert summary["param_elements"] == summary["param_elements_local"] == trainer.model.num_parameters()


def test_min_lr_ratio_floors_every_cycle(tmp_path):
    trainer = _trainer(tmp_path, min_lr_ratio=0.2)
    trainer.train()
    lrs = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    after_warmup = lrs[3:]
    assert min(after_warmup) >= 0.2 * 3e-3 * (1 - 1e-6)
    assert min(after_warmup) < 0.25 * 3e-3  # and the cycles do reach down to the floor


def test_a_custom_logging_dir_holds_the_rank_runs_and_the_summary_stays_in_output_dir(tmp_path):
    """README practice 7: TensorBoard into `<logging_dir>/rank<N>`, the JSON summary in
    `<output_dir>/rank_summaries/rank<N>.json`, whatever logging_dir is (here outside output_dir)."""
    from hf_dist_recipes.logs.events import read_texts
    from hf_dist_recipes.monitoring.tensorboard import RUN_FILENAME

    out, logs = tmp_path / "out", tmp_path / "elsewhere" / "tb"
    args = RecipeTrainingArguments(
        output_dir=str(out),
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        logging_dir=str(logs),
        seed=7,
    )
    trainer = _trainer(out, args=args)
    trainer.train()
    scalars = read_scalars(logs / "rank0")
    assert [step for step, _ in scalars["rank/loss"]] == [1, 2, 3]
    assert (logs / "rank0" / RUN_FILENAME).is_file()
    ((_, seed_text),) = read_texts(logs / "rank0")["seed/text_summary"]
    assert seed_text.startswith("rank 0: seed 7,")  # the seed given above, not the default 42
    assert not (out / "tensorboard").exists()  # the default location is not written as well
    summary = json.loads((out / "rank_summaries" / "rank0.json").read_text())
    assert summary["logging_dir"] == str(logs) and summary["steps"] == 3
