"""Tiled MLP: each gated MLP of the model computed a slice of the tokens at a time (ALST's `TiledMLP`,
deepspeed/runtime/sequence_parallel/ulysses_sp.py:955), the recipe's `tiled_mlp_shards`.

Why: at long sequences the MLP's intermediate activations (tokens x intermediate size, three of them: gate, up and
their product) are the largest of a layer, and activation checkpointing recomputes one whole layer at a time, so
they set the peak. `TiledMLP` runs the MLP's forward on `shards` slices of the tokens under `no_grad` and, in the
backward pass, recomputes each slice with gradients and backpropagates it before the next: only one slice's
intermediates are ever alive, at the price of one more MLP forward per step. The planner counts it
(`planning.memory`: the MLP's intermediates divided by the shards).

Exact: the MLP acts on each token alone, so slicing the tokens changes only the order of the weight gradients' sums.
Which modules: every module with `gate_proj`, `up_proj`, `down_proj` and `act_fn` (Llama, Qwen, Mistral, DeepSeek's
dense layers and shared experts); routed experts are not tiled. DeepSpeed only: the slices' gradients reach the
weights one backward at a time, which ZeRO (any stage) is told to wait for (`ds_grad_is_ready`), and DDP or FSDP
would reduce each time (ulysses_sp.py:1050 "DDP, FSDP will need something similar"); one process without an engine
also works.
"""

from __future__ import annotations

import math
import types

import torch
from torch import nn

_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def is_gated_mlp(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in _PARTS) and not hasattr(module, "recipe_untiled_forward")


def tile_mlps(model: nn.Module, shards: int) -> int:
    """Make every gated MLP of `model` compute `shards` slices of its tokens at a time (module docstring); returns
    how many it changed (0 for a model already tiled). `shards` >= 1; 1 leaves the model as it is."""
    if shards < 2:
        return 0
    tiled = 0
    for module in model.modules():
        if is_gated_mlp(module):
            module.recipe_untiled_forward = module.forward
            module.forward = types.MethodType(_tiled_forward(shards), module)
            tiled += 1
    return tiled


def tile_for_trainer(model: nn.Module | None, shards: int | None, *, deepspeed: bool, world_size: int) -> None:
    """The arguments' `tiled_mlp_shards` applied to a trainer's `model` (None, 0 or 1: nothing), or ValueError where
    it cannot hold: several processes without DeepSpeed (module docstring), or a model with no gated MLP."""
    if model is None or (shards or 0) < 2:
        return
    if not deepspeed and world_size > 1:
        raise ValueError(
            f"tiled_mlp_shards={shards} needs DeepSpeed when several processes train: the slices' gradients reach "
            "the weights one backward pass at a time, which ZeRO waits for and DDP or FSDP would reduce each "
            "time; launch with a DeepSpeed config or set tiled_mlp_shards=0"
        )
    if tile_mlps(model, shards) == 0 and not any(hasattr(m, "recipe_untiled_forward") for m in model.modules()):
        raise ValueError(
            f"tiled_mlp_shards={shards}: {type(model).__name__} has no gated MLP (gate_proj, up_proj, down_proj, "
            "act_fn) to tile; set tiled_mlp_shards=0"
        )


def _tiled_forward(shards: int):
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = math.prod(x.shape[:-1])
        # TiledMLP marks the weights' gradients ready after its last slice; torch.chunk makes fewer slices than asked
        # when they do not divide (5 rows in 4 gives 3), so ask for the count it will make.
        count = math.ceil(rows / math.ceil(rows / shards)) if rows else 1
        if count < 2:
            return self.recipe_untiled_forward(x)
        weights = [p for p in self.parameters() if p.requires_grad]
        return TiledMLP.apply(_untiled, self, x, count, weights)

    return forward


def _untiled(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module.recipe_untiled_forward(x)
