"""Practice 2 through RecipeTrainer: a live Gloo process group on a host that looks like it has CUDA GPUs stops the
trainer at construction with the fix; `allow_gloo_on_cuda=True` trains. The group is real (Gloo, one process, a
FileStore); the GPUs are faked, because this machine has none: `backend.cuda_device_count` is patched only after the
arguments are built (they resolve backend and precision for the real host), and `use_cpu` is set as a GPU host's
arguments would have it. On a real GPU host the fake only repeats what is true."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.comm import backend
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from tests.support.models import SMALL


@pytest.fixture
def gloo_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _args(tmp_path, **kw) -> RecipeTrainingArguments:
    args = RecipeTrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=2,
        per_device_train_batch_size=2,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed_check="off",
        **kw,
    )
    if not kw.get("use_cpu"):
        args.use_cpu = False  # what the arguments say on a host with GPUs
    return args


def _trainer(args) -> RecipeTrainer:
    return RecipeTrainer(
        model_init=lambda: build_tiny_deepseek(**SMALL),
        args=args,
        train_dataset=stdlib_dataset(seq_len=16, max_bytes=4_000),
    )


def test_gloo_group_on_a_cuda_host_stops_the_trainer(tmp_path, gloo_group, monkeypatch):
    args = _args(tmp_path)
    assert str(dist.get_backend()) == "gloo"
    monkeypatch.setattr(backend, "cuda_device_count", lambda: 2)  # faked: no GPU on this machine
    with pytest.raises(ValueError, match=r"runs on 'gloo' although 2 CUDA GPU\(s\) are visible.*allow_gloo_on_cuda"):
        _trainer(args)


def test_allow_gloo_on_cuda_trains(tmp_path, gloo_group, monkeypatch):
    args = _args(tmp_path, allow_gloo_on_cuda=True)
    monkeypatch.setattr(backend, "cuda_device_count", lambda: 2)  # faked: no GPU on this machine
    trainer = _trainer(args)
    assert trainer.train().global_step == 2


def test_the_same_group_without_gpus_trains(tmp_path, gloo_group):
    """The control, nothing faked: Gloo is right for a CPU run and nothing stops -- on a CPU host as the arguments
    leave it, on a GPU host when the run asks for the CPU (use_cpu=True: environment.cuda_host.cpu_request)."""
    args = _args(tmp_path, use_cpu=True) if backend.cuda_device_count() else _args(tmp_path)
    assert _trainer(args).train().global_step == 2
