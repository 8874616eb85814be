"""SystemMetricsCallback (RSS, CPU, CUDA and NVML keys) and the run identity / refusal of the per-rank TensorBoard
callback, through a real RecipeTrainer on a tiny model."""

from __future__ import annotations

import json
import logging
import os
import socket
from types import SimpleNamespace

import psutil
import pytest
import torch

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.monitoring import SystemMetricsCallback, read_scalars, read_texts
from hf_dist_recipes.runtime import JobFacts, RecipeRuntime
from tests.support.hosts import NVML_NOTE
from tests.support.models import SMALL

STEPS, BATCH, SEQ = 4, 2, 16
GIB = 1024**3


def _trainer(out, **overrides) -> RecipeTrainer:
    kw = dict(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        logging_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
    )
    kw.update(overrides)
    return RecipeTrainer(
        model_init=lambda: build_tiny_deepseek(**SMALL),
        args=RecipeTrainingArguments(**kw),
        train_dataset=stdlib_dataset(seq_len=SEQ, max_bytes=4_000),
    )


def _system(trainer) -> SystemMetricsCallback:
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, SystemMetricsCallback))


def test_system_keys_reach_the_rank_run_not_log_history_and_nvml_only_on_a_gpu_run(tmp_path, caplog):
    # Nothing faked. A run on the CPU says nothing about NVML: no text, no warning (issue 30: every rank of `make
    # demo` printed "NVML unavailable" on a host without a GPU). A run on CUDA: where NVML answers
    # (tests.support.hosts.NVML_NOTE, asked of pynvml directly) its keys are asserted, elsewhere the note that says
    # why, once (no driver: nvmlInit fails; a GPU refusing a query). This rank's measurements go to its TensorBoard
    # run only: log_history holds what a resumed run logs again alike (tests/unit/test_log_history.py), and no text.
    trainer = _trainer(tmp_path)
    with caplog.at_level(logging.WARNING, logger="hf_dist_recipes.monitoring.system_metrics"):
        trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in logs] == [2, 4]
    assert not [k for e in trainer.state.log_history for k in e if k.startswith(("system/", "gpu/"))]
    rss_now = psutil.Process().memory_info().rss / GIB
    scalars = read_scalars(tmp_path / "tensorboard" / "rank0")
    assert [s for s, _ in scalars["train/system/rss_gib"]] == [2, 4]
    for _, rss in scalars["train/system/rss_gib"]:
        # Independent bound: this very process's RSS read here, after training (RSS moves a little between).
        assert 0.05 < rss <= rss_now * 1.5
    assert all(cpu >= 0 for _, cpu in scalars["train/system/cpu_percent"])
    texts = read_texts(tmp_path / "tensorboard" / "rank0")
    if trainer.args.device.type != "cuda":
        assert "train/system/nvml/text_summary" not in texts and "train/gpu/power_w" not in scalars
        assert not [r for r in caplog.records if "NVML" in r.getMessage()]
    elif NVML_NOTE is None:
        assert "train/system/nvml/text_summary" not in texts
        assert 0 <= scalars["train/gpu/utilization_percent"][0][1] <= 100 and scalars["train/gpu/power_w"][0][1] > 0
    else:
        assert [step for step, _ in texts["train/system/nvml/text_summary"]] == [2]  # once
        assert texts["train/system/nvml/text_summary"][0][1].startswith(NVML_NOTE)
        assert "train/gpu/power_w" not in scalars
        assert sum(NVML_NOTE in r.getMessage() for r in caplog.records) == 1
    assert ("train/gpu/max_allocated_gib" in scalars) is (torch.cuda.is_available() and torch.cuda.is_initialized())


class FakeNvml:
    """Fakes NVML (hardware this machine lacks: an NVIDIA GPU and its driver) with the pynvml calls the callback
    makes; values in pynvml's units (bytes, milliwatts)."""

    def __init__(self):
        self.indices = []

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        self.indices.append(index)
        return f"handle{index}"

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=87, memory=40)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=3 * GIB + GIB // 2, total=80 * GIB, free=0)

    def nvmlDeviceGetPowerUsage(self, handle):
        return 251_500  # mW


def test_nvml_values_are_converted_to_the_units_in_the_key_names(monkeypatch):
    # Rank with local index 1 and CUDA_VISIBLE_DEVICES=4,5: NVML ignores that variable, so the handle is of device 5.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # fakes a host without torch CUDA but with NVML
    fake = FakeNvml()
    cb = SystemMetricsCallback(nvml=fake)
    cb.set_runtime(RecipeRuntime(JobFacts(rank=1, local_rank=1)))
    args = SimpleNamespace(process_index=1, local_process_index=1, device=torch.device("cuda", 1))
    cb.on_train_begin(args, None, None)
    sample = cb.sample()
    assert fake.indices == [5]
    assert sample["gpu/utilization_percent"] == 87.0
    assert sample["gpu/memory_used_gib"] == 3.5
    assert sample["gpu/power_w"] == 251.5
    assert cb.runtime.logs.peek().rank == {}  # nothing to report: NVML worked


def test_nvml_that_fails_mid_run_is_reported_and_dropped():
    class Dying(FakeNvml):
        def nvmlDeviceGetPowerUsage(self, handle):
            raise RuntimeError("GPU is lost")  # fakes a driver error we cannot cause without a GPU

    cb = SystemMetricsCallback(nvml=Dying())
    cb.set_runtime(RecipeRuntime())
    cb.on_train_begin(
        SimpleNamespace(process_index=0, local_process_index=0, device=torch.device("cuda", 0)), None, None
    )
    assert "gpu/power_w" not in cb.sample()
    assert "gpu/utilization_percent" not in cb.sample()  # not asked again
    assert "system/rss_gib" in cb.sample()


def test_nvml_is_tried_only_on_a_gpu_run_and_its_absence_said_once_naming_the_ranks(caplog):
    class Missing(FakeNvml):
        def nvmlInit(self):
            raise ImportError("No module named 'pynvml'")  # fakes a GPU host without nvidia-ml-py

    tried = FakeNvml()
    cpu_run = SystemMetricsCallback(nvml=tried)
    cpu_run.set_runtime(RecipeRuntime())
    cpu_run.on_train_begin(SimpleNamespace(process_index=0, local_process_index=0, device=torch.device("cpu")), 0, 0)
    assert tried.indices == [] and "gpu/power_w" not in cpu_run.sample()  # a CPU run: no GPU to ask about
    gpu_run = SystemMetricsCallback(nvml=Missing())
    gpu_run.set_runtime(RecipeRuntime())
    with caplog.at_level(logging.WARNING, logger="hf_dist_recipes.monitoring.system_metrics"):
        gpu_run.on_train_begin(
            SimpleNamespace(process_index=0, local_process_index=0, device=torch.device("cuda")), 0, 0
        )
    assert [r.getMessage() for r in caplog.records] == [
        "NVML unavailable on rank(s) 0, no gpu/utilization_percent, gpu/memory_used_gib, gpu/power_w: "
        "ImportError: No module named 'pynvml'"
    ]
    gpu_run.on_step_end(None, None, SimpleNamespace(should_log=True))
    assert gpu_run.runtime.logs.peek().rank["system/nvml"].startswith("NVML unavailable, no gpu/utilization_percent")


def _new_launch(monkeypatch):
    """A new launch is a new process; here the process-wide run id is forgotten instead (a real second process is
    launched in tests/distributed/test_crash_safe_logs.py)."""
    from hf_dist_recipes.monitoring import system_metrics

    monkeypatch.setattr(system_metrics, "_run_id", None)


def test_run_identity_is_recorded_and_a_second_launch_into_the_same_dir_is_refused(tmp_path, monkeypatch):
    _new_launch(monkeypatch)
    first = _trainer(tmp_path)
    first.train()
    run_dir = tmp_path / "tensorboard" / "rank0"
    identity = json.loads((run_dir / "run.json").read_text())
    summary = json.loads((tmp_path / "rank_summaries" / "rank0.json").read_text())
    assert identity == {"host": socket.gethostname(), "rank": 0, "local_rank": 0, "run_id": identity["run_id"]}
    assert summary["run_id"] == identity["run_id"] and summary["host"] == socket.gethostname()
    assert summary["local_rank"] == 0
    ((step, text),) = read_texts(run_dir)["run/text_summary"]
    assert step == 0 and f"run_id={identity['run_id']}" in text and "rank=0 local_rank=0" in text

    # A second train() in the same process is the same launch: accepted, same run id.
    _trainer(tmp_path).train()
    assert json.loads((run_dir / "run.json").read_text())["run_id"] == identity["run_id"]

    _new_launch(monkeypatch)
    events_before = sorted(os.listdir(run_dir))
    with pytest.raises(ValueError, match=f"run {identity['run_id']}.*new output_dir / logging_dir"):
        _trainer(tmp_path).train()
    assert sorted(os.listdir(run_dir)) == events_before  # nothing written by the refused launch

    # Another logging_dir is the fix the message names.
    _trainer(tmp_path, logging_dir=str(tmp_path / "tb2")).train()
    assert (tmp_path / "tb2" / "rank0" / "run.json").is_file()


def test_events_written_by_someone_else_are_refused_too(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / "tensorboard" / "rank0")) as w:  # no run.json: an unknown run
        w.add_scalar("x", 1.0, 0)
    with pytest.raises(ValueError, match="an unknown run"):
        _trainer(tmp_path).train()
