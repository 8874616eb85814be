"""One contract for every `TrainerCallback` of the package (in the way composer tests its callbacks), found by
walking `hf_dist_recipes` (`CONTRACT`): each scenario drives a real RecipeTrainer on a tiny MoE model holding all of
them (the recipe's own, the console one, and the opt-in `ExpertBiasBalancer`): train twice in one process, a run
with no logging step, a run resumed from a checkpoint, and rank > 0. StragglerCallback is idle in one process: its
contract here is to stay out of the way. Every scenario reports to MLflow (a local file store in the test's folder),
so that the per-rank series callback, registered only with an integration in `report_to`, is held too. A new
callback that no scenario holds fails every scenario until it is
registered (or added to `OUTSIDE_THE_CONTRACT` with the reason)."""

from __future__ import annotations

import importlib
import json
import pkgutil
import signal
from pathlib import Path

import pytest
from transformers import TrainerCallback, TrainingArguments

import hf_dist_recipes
from hf_dist_recipes import ExpertBiasBalancer, RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.monitoring import (
    PerRankTensorBoardCallback,
    read_scalars,
    read_texts,
    system_metrics,
)
from hf_dist_recipes.monitoring.console import RecipePrinterCallback, RecipeProgressCallback
from hf_dist_recipes.runtime import LogRecord
from hf_dist_recipes.stability.gradient_health import GradientHealthCallback
from tests.support.models import SMALL


def package_callbacks() -> set[type]:
    """Every `TrainerCallback` subclass defined in `hf_dist_recipes`, after importing each of its modules."""
    for info in pkgutil.walk_packages(hf_dist_recipes.__path__, "hf_dist_recipes."):
        importlib.import_module(info.name)
    found, todo = set(), [TrainerCallback]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return {c for c in found if c.__module__.startswith("hf_dist_recipes.")}


# Callbacks no RecipeTrainer of these scenarios holds, each with the reason and where it is tested instead.
OUTSIDE_THE_CONTRACT = {
    "hf_dist_recipes.preflight.training.trainer.StepRecorder": "the preflight runner's own recorder, inside its "
    "launch (tests/distributed/test_preflight_training.py, tests/cli/test_preflight_cli.py)",
    "hf_dist_recipes.parallel.sequence_parallel._AfterPrepare": "registered only under Ulysses SP with an MLA model, "
    "which needs two ranks or more (tests/distributed/test_sequence_parallel.py; its shim: tests/unit/"
    "test_ulysses_pieces.py)",
    "hf_dist_recipes.runtime.RecipeCallback": "the base class of the recipe's callbacks, never registered itself "
    "(its events: tests/unit/test_callbacks.py, tests/unit/test_runtime.py)",
}
# The console callback follows disable_tqdm: the first scenario shows the progress bar, the others print.
CONSOLE = {True: RecipePrinterCallback, False: RecipeProgressCallback}
DISCOVERED = package_callbacks()
CONTRACT = {c for c in DISCOVERED if f"{c.__module__}.{c.__qualname__}" not in OUTSIDE_THE_CONTRACT}


def test_discovery_finds_the_package_callbacks():
    names = {f"{c.__module__}.{c.__qualname__}" for c in DISCOVERED}
    assert set(OUTSIDE_THE_CONTRACT) <= names  # no stale exemption
    assert {GradientHealthCallback, PerRankTensorBoardCallback, ExpertBiasBalancer, RecipeProgressCallback} <= CONTRACT
    assert len(CONTRACT) >= 12


@pytest.fixture(autouse=True)
def _mlflow_store(tmp_path, monkeypatch):
    """MLflow's local file store in the test's folder (its opt-in; no telemetry), for report_to=["mlflow"]."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    for name, value in {
        "MLFLOW_ALLOW_FILE_STORE": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DISABLE_MLFLOW_INTEGRATION", raising=False)


def _trainer(out, **overrides) -> RecipeTrainer:
    kw = dict(
        output_dir=str(out),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        report_to=["mlflow"],
        seed=7,
    )
    kw.update(overrides)
    trainer = RecipeTrainer(
        model_init=lambda: build_tiny_deepseek(**SMALL),
        args=RecipeTrainingArguments(**kw),
        train_dataset=stdlib_dataset(seq_len=16, max_bytes=4_000),
        callbacks=[ExpertBiasBalancer()],
    )
    registered = {type(c) for c in trainer.callback_handler.callbacks}
    expected = CONTRACT - {CONSOLE[not kw["disable_tqdm"]]}
    assert expected <= registered, f"no scenario holds {expected - registered}: register it or say why not"
    return trainer


def _tensorboard(trainer) -> PerRankTensorBoardCallback:
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, PerRankTensorBoardCallback))


def _after_train_end(trainer, rank: int = 0) -> dict:
    """What every scenario requires once train() returned; the rank's summary."""
    assert _tensorboard(trainer).writer is None  # closed: nothing left to flush
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # our SIGTERM flush handler is uninstalled
    # Nothing stale in the runtime's channels for a next train() (the standing counters stay, by design).
    assert trainer.runtime.logs.peek() == LogRecord()
    summary = json.loads((Path(trainer.args.output_dir) / "rank_summaries" / f"rank{rank}.json").read_text())
    assert summary["rank"] == rank and summary["steps"] == trainer.state.global_step
    return summary


@pytest.fixture(autouse=True)
def _fresh_launch(monkeypatch):
    # Each test is its own launch (in a real job a new process): forget the process-wide run id.
    monkeypatch.setattr(system_metrics, "_run_id", None)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_train_begin_and_end_twice_in_one_process(tmp_path):
    trainer = _trainer(tmp_path, disable_tqdm=False)
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


@pytest.mark.parametrize("restore", [False, True], ids=["own_state", "restore_callback_states"])
def test_a_run_resumed_from_a_checkpoint(tmp_path, monkeypatch, restore):
    _trainer(tmp_path, save_strategy="steps", save_steps=2).train()
    monkeypatch.setattr(system_metrics, "_run_id", None)  # the resume is a new launch: accepted, not refused
    trainer = _trainer(
        tmp_path, save_strategy="steps", save_steps=2, max_steps=6, restore_callback_states_from_checkpoint=restore
    )
    built = trainer.gradient_health
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    # With restore, the Trainer rebuilt the stateful gradient-health callback from its saved arguments: the new
    # instance is the one in use, fed through the trainer's runtime (else its first step would stop, unfed).
    held = [c for c in trainer.callback_handler.callbacks if isinstance(c, GradientHealthCallback)]
    assert held == [trainer.gradient_health] and (held[0] is not built) == restore
    assert held[0].runtime is trainer.runtime
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
