"""`tiled_mlp_shards` (hf_dist_recipes.parallel.tiled_mlp): the gated MLPs of a model computed a slice of the tokens
at a time give the untiled losses and gradient norms through RecipeTrainer (one process; under ZeRO-3 + SP on 2 and
4 ranks: tests/distributed/test_sequence_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from hf_dist_recipes import RecipeTrainingArguments
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.parallel.tiled_mlp import tile_mlps
from tests.support.models import SMALL
from tests.unit.test_chunked_loss import _train  # the chunked loss's run: accumulation 2, ignored labels


def test_tiled_mlps_train_to_the_untiled_losses(tmp_path):
    plain = _train(tmp_path / "plain")
    # 5 slices of 2 x 24 = 48 rows: 10, 10, 10, 10, 8; activation checkpointing on, so each MLP runs a third time
    # (the recomputation) inside the tiling
    tiled = _train(tmp_path / "tiled", tiled_mlp_shards=5, activation_checkpointing=True)
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
