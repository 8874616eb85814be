"""Resume of a MoE model without DeepSpeed, through RecipeTrainer, proven by equal losses.

transformers 5.24's Trainer resumes by loading the checkpoint's tensors by name; `save_pretrained` writes experts one
tensor each while the model holds them fused, so the stock resume keeps the experts' fresh values (issue 48805).
One process, a real tiny DeepSeek-V3-style model (8 routed experts), nothing faked."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments, _compat
from hf_dist_recipes._compat import transformers as compat_transformers
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from tests.support.models import SMALL


def _run(out, resume=None) -> dict[int, float]:
    # use_cpu=True: the comparison below needs the CPU's fp32 kernels, on a GPU host too (its default, bf16 on CUDA,
    # need not repeat a step's loss to 1e-6).
    args = RecipeTrainingArguments(output_dir=str(out), max_steps=4, per_device_train_batch_size=2, learning_rate=3e-3,
                                   logging_steps=1, save_strategy="steps", save_steps=2, disable_tqdm=True,
                                   report_to="none", seed=7, use_cpu=True)  # fmt: skip
    trainer = RecipeTrainer(model_init=lambda: build_tiny_deepseek(**SMALL), args=args,
                            train_dataset=stdlib_dataset(seq_len=16, max_bytes=4_000))  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def test_resumed_run_repeats_the_uninterrupted_losses(tmp_path):
    full = _run(tmp_path / "full")
    resumed = _run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-2"))
    assert sorted(resumed) == [1, 2, 3, 4]  # 1-2 restored from the checkpoint's trainer state, 3-4 trained
    # Same state, same batches, one process on the CPU: the same numbers. With the experts left fresh (the stock
    # path, measured) step 3 gave 5.39720 against 5.39568: a relative difference of 3e-4, 300 times the tolerance.
    assert [resumed[s] for s in (3, 4)] == pytest.approx([full[s] for s in (3, 4)], rel=1e-6, abs=0)


def test_stock_resume_loses_the_experts_exactly_where_the_workaround_says(tmp_path):
    # The contract of _compat.WORKAROUNDS["moe_resume_conversion"] at the installed transformers: the stock resume
    # loses the experts where the entry says it is needed, and keeps them where it says not. Fails when upstream
    # converts on resume (transformers PR 48822): then close the entry's `affected` below that release.
    _run(tmp_path / "full")
    checkpoint = str(tmp_path / "full" / "checkpoint-2")
    torch.manual_seed(0)
    model = build_tiny_deepseek(**SMALL)
    names = compat_transformers.checkpoint_tensor_names(checkpoint)
    assert "model.layers.1.mlp.experts.gate_up_proj" in model.state_dict()
    assert (
        "model.layers.1.mlp.experts.gate_up_proj" not in names
        and "model.layers.1.mlp.experts.0.up_proj.weight" in names
    )
    stock = Trainer(
        model=model, args=TrainingArguments(output_dir=str(tmp_path / "stock"), report_to="none", use_cpu=True)
    )
    stock._load_from_checkpoint(checkpoint)
    saved = type(model).from_pretrained(checkpoint).state_dict()
    expert = "model.layers.1.mlp.experts.gate_up_proj"
    lost = not torch.equal(model.state_dict()[expert], saved[expert])
    assert lost == _compat.needed("moe_resume_conversion"), f"stock resume lost the experts: {lost}"
    dense = "model.layers.0.mlp.up_proj.weight"  # same name on both sides: loaded
    assert torch.equal(model.state_dict()[dense], saved[dense])
