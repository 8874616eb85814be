"""What goes where (issue 19, section 2), through the real RecipeTrainer in one process with a real tiny
DeepSeek-V3-style model, so every callback that adds keys runs: expert load, gradient health (with spikes), rank
agreement (a periodic check), system metrics (with NVML's keys, or its text note on a host without a driver),
per-rank TensorBoard, the rank summary.

- `log_history` of a run resumed from a checkpoint equals the uninterrupted run's, every key, except the Trainer's
  own timing keys (the list transformers' `check_trainer_state_are_the_same` skips in its resume tests:
  train_runtime, train_samples_per_second, train_steps_per_second, train_loss); no value in it is a string;
- what left `log_history` (wall-clock, memory, the first-log rank checks, event texts) is still in the per-rank
  TensorBoard run, and the texts in the rank summary;
- the console (ProgressCallback under tqdm, PrinterCallback without) prints loss, learning rate, gradient norm,
  the skipped-step and spike counts, and the TensorBoard folder once.

(Straggler keys need several ranks: tests/distributed/test_straggler_ranks.py reads them from TensorBoard.)"""

from __future__ import annotations

import ast
import contextlib
import io
import json

import pytest

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.monitoring import read_scalars, read_texts
from tests.support.hosts import NVML_NOTE
from tests.support.models import SMALL

STEPS, SAVE_AT = 8, 4
# transformers tests/trainer/test_trainer.py, check_trainer_state_are_the_same: what a resumed run may log differently
TIMING_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss")
# What a person reads on the console (the issue): loss, learning rate, gradient norm, skipped steps and spikes.
CONSOLE_KEYS = {"loss", "learning_rate", "grad_norm", "epoch", "skipped_steps", "loss_spikes", "grad_norm_spikes"}


def _run(out, *, resume=None, tqdm: bool):
    args = RecipeTrainingArguments(
        output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, learning_rate=3e-3, logging_steps=1,
        save_strategy="steps", save_steps=SAVE_AT, disable_tqdm=not tqdm, report_to="none", seed=7,
        rank_check_steps=2,  # rank_check/ok at steps 2, 4, 6, 8: before and after the checkpoint
        spike_window=3, spike_threshold=1.0,  # low on purpose: spikes (counts and event texts) in 8 steps
        use_cpu=True,  # the histories are compared bit for bit: the CPU's fp32 kernels, on a GPU host too
    )  # fmt: skip
    trainer = RecipeTrainer(model_init=lambda: build_tiny_deepseek(**SMALL), args=args,
                            train_dataset=stdlib_dataset(seq_len=16, max_bytes=4_000))  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # tqdm.write and print both write to sys.stdout at call time
        trainer.train(resume_from_checkpoint=resume)
    return trainer, printed.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("history")
    full, full_out = _run(root / "full", tqdm=True)
    resumed, resumed_out = _run(root / "resumed", resume=str(root / "full" / f"checkpoint-{SAVE_AT}"), tqdm=False)
    return {"full": (full, full_out, root / "full"), "resumed": (resumed, resumed_out, root / "resumed")}


def _without_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in entry.items() if k not in TIMING_KEYS} for entry in history]


def test_a_resumed_run_logs_the_uninterrupted_runs_history(runs):
    full = runs["full"][0].state.log_history
    resumed = runs["resumed"][0].state.log_history
    assert [e["step"] for e in resumed] == [e["step"] for e in full] == list(range(1, STEPS + 1)) + [STEPS]
    assert _without_timing(resumed) == _without_timing(full)
    # The comparison covers our callbacks' keys, not only the Trainer's: the expert load, the gradient-health
    # counters (restored from the checkpoint) and the periodic rank check are all in it.
    keys = set().union(*full)
    assert {"experts/max_over_mean", "experts/layer1/expert0_tokens", "rank_check/ok"} <= keys
    assert {"skipped_steps", "loss_spikes", "grad_norm_spikes"} <= keys
    assert full[-2]["loss_spikes"] + full[-2]["grad_norm_spikes"] > 0  # spike_threshold=1: some were found
    # Tokens per step, all experts of a layer together: 2 sequences x 16 tokens, each routed to top_k experts.
    model = runs["full"][0].model
    per_layer = 2 * 16 * model.config.num_experts_per_tok
    assert sum(full[0][f"experts/layer1/expert{e}_tokens"] for e in range(model.config.n_routed_experts)) == per_layer


def test_no_string_ever_reaches_log_history(runs):
    for trainer, _, _ in runs.values():
        texts = {(e["step"], k) for e in trainer.state.log_history for k, v in e.items() if isinstance(v, str)}
        assert texts == set()
        saved = json.loads((runs["full"][2] / f"checkpoint-{SAVE_AT}" / "trainer_state.json").read_text())
        assert not [k for e in saved["log_history"] for k, v in e.items() if isinstance(v, str)]


def test_what_left_log_history_is_in_the_rank_tensorboard_run_and_summary(runs):
    trainer, _, out = runs["full"]
    history_keys = set().union(*trainer.state.log_history)
    scalars = read_scalars(out / "tensorboard" / "rank0")
    texts = read_texts(out / "tensorboard" / "rank0")
    for key in ("system/rss_gib", "system/cpu_percent", "rank_check/seed_ok", "rank_check/weights_ok"):
        assert key not in history_keys and f"train/{key}" in scalars, key
    assert len(scalars["train/system/rss_gib"]) == STEPS  # every log step
    assert [s for s, _ in scalars["train/rank_check/seed_ok"]] == [1]  # the first log of the train() call
    # The history's keys are there too, as before.
    for key in ("loss", "grad_norm", "skipped_steps", "loss_spikes", "experts/max_over_mean", "rank_check/ok"):
        assert f"train/{key}" in scalars, key
    spikes = texts["train/spike_event/text_summary"]
    assert spikes and all(text.startswith(f"step {step}: ") for step, text in spikes)
    # NVML only on a run that trains on CUDA (a CPU run has no GPU to sample and says nothing of it): there its keys
    # where it answers on this host, else its note (tests.support.hosts.NVML_NOTE: the host's driver).
    if trainer.args.device.type != "cuda":
        assert "train/system/nvml/text_summary" not in texts and "train/gpu/power_w" not in scalars
    elif NVML_NOTE is None:
        assert "train/system/nvml/text_summary" not in texts and "train/gpu/power_w" in scalars
    else:
        assert texts["train/system/nvml/text_summary"][0][1].startswith(NVML_NOTE)
    summary = json.loads((out / "rank_summaries" / "rank0.json").read_text())
    assert [(e["step"], e["text"]) for e in summary["events"] if e["key"] == "spike_event"] == spikes


def _printed_logs(text: str) -> list[dict]:
    return [ast.literal_eval(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("run", ["full", "resumed"])  # ProgressCallback (tqdm), PrinterCallback
def test_the_console_shows_what_a_person_reads(runs, run):
    trainer, printed, out = runs[run]
    logs = _printed_logs(printed)
    training = [log for log in logs if "loss" in log]
    trained = STEPS if run == "full" else STEPS - SAVE_AT
    assert len(training) == trained
    assert all(set(log) == CONSOLE_KEYS for log in training), training[0]
    # The values are the history's (4 significant digits, as the stock callbacks print floats).
    last = trainer.state.log_history[-2]
    assert float(training[-1]["loss"]) == pytest.approx(last["loss"], rel=1e-3)
    assert training[-1]["skipped_steps"] == last["skipped_steps"] == 0
    # The run's summary line keeps the Trainer's keys.
    assert "train_runtime" in logs[-1]
    folder = str(out / "tensorboard")
    assert [line for line in printed.splitlines() if folder in line] == [
        f"Per-rank logs (system, experts, rank checks, events): tensorboard --logdir {folder}"
    ]


def test_the_console_keeps_the_users_keys_and_replaces_only_the_stock_printers(tmp_path):
    from transformers import PrinterCallback

    from hf_dist_recipes.monitoring.console import RecipePrinterCallback, console_logs

    logs = {"loss": 1.0, "my/metric": 2.0, "experts/max_over_mean": 1.5, "system/rss_gib": 0.4, "spike_event": "x"}
    assert console_logs(logs) == {"loss": 1.0, "my/metric": 2.0}  # a user's own key stays, ours go
    assert len(logs) == 5  # the dict the other callbacks see is unchanged

    class Mine(PrinterCallback):
        pass

    args = RecipeTrainingArguments(output_dir=str(tmp_path), disable_tqdm=True, report_to="none")
    trainer = RecipeTrainer(model=build_tiny_deepseek(**SMALL), args=args, callbacks=[Mine()])
    printers = [type(c) for c in trainer.callback_handler.callbacks if isinstance(c, PrinterCallback)]
    assert printers == [Mine, RecipePrinterCallback]  # the user's own printer is left alone
