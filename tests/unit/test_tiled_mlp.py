"""`tiled_mlp_shards` (hf_dist_recipes.parallel.tiled_mlp): the gated MLPs of a model computed a slice of the tokens
at a time give the untiled losses and gradient norms through RecipeTrainer (one process; under ZeRO-3 + SP on 2 and
4 ranks: tests/distributed/test_sequence_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.parallel.tiled_mlp import tile_mlps
from tests.support.models import SMALL


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, seq: int = 20):
        self.ids = torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(3))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(tmp_path, **overrides) -> RecipeTrainer:
    args = RecipeTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        warmup_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        **overrides,
    )
    trainer = RecipeTrainer(model_init=lambda: build_tiny_deepseek(**SMALL), args=args, train_dataset=_Rows())
    trainer.train()
    return trainer


def test_tiled_mlps_train_to_the_untiled_losses(tmp_path):
    plain = _train(tmp_path / "plain")
    # 3 slices of 2 x 20 = 40 rows: 14, 14, 12; with activation checkpointing, the third forward (its recomputation)
    tiled = _train(tmp_path / "tiled", tiled_mlp_shards=3, activation_checkpointing=True)
    logs = [[e for e in t.state.log_history if "loss" in e] for t in (plain, tiled)]
    assert len(logs[0]) == 4
    for a, b in zip(*logs, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5
    # Independently of the code: the model's gated MLPs are its first (dense) layer's and each MoE layer's shared
    # experts: one per layer of the tiny model.
    layers = tiled.model.config.num_hidden_layers
    assert sum(hasattr(m, "recipe_untiled_forward") for m in tiled.model.modules()) == layers
    assert not any(hasattr(m, "recipe_untiled_forward") for m in plain.model.modules())


def test_slices_that_torch_cannot_make_evenly_still_reach_the_weights():
    # 5 rows in 4 slices: torch.chunk makes 3 (2, 2, 1); the weights' gradients must still arrive, and equal.
    torch.manual_seed(0)
    model = build_tiny_deepseek(**SMALL)
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 5, SMALL["hidden_size"], requires_grad=True)
    mlp(x).square().sum().backward()
    expected = [p.grad.clone() for p in mlp.parameters()]
    expected_x = x.grad.clone()
    mlp.zero_grad()
    x.grad = None
    assert tile_mlps(model, 4) == model.config.num_hidden_layers
    assert tile_mlps(model, 4) == 0  # tiled once
    mlp(x).square().sum().backward()
    for got, want in zip((p.grad for p in mlp.parameters()), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(x.grad, expected_x, rtol=0, atol=1e-6)
    # What ZeRO reads before it takes a weight's gradient: set after the last slice only (a slice count torch does
    # not make would leave it False, and ZeRO would never reduce those gradients).
    assert all(p.ds_grad_is_ready is True for p in mlp.parameters())


@pytest.mark.parametrize("value", [-1, 2.5, True])
def test_tiled_mlp_shards_is_a_slice_count(value, tmp_path):
    with pytest.raises(ValueError, match="tiled_mlp_shards must be a whole number of slices >= 0"):
        RecipeTrainingArguments(output_dir=str(tmp_path), tiled_mlp_shards=value)
