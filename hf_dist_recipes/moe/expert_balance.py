"""Auxiliary-loss-free expert load balancing for DeepSeek-V3-style routers: `ExpertBiasBalancer`.

DeepSeek-V3 chooses a token's experts by its affinity scores plus a per-expert bias (transformers 5.24:
`DeepseekV3TopkRouter.e_score_correction_bias`, a float32 buffer; DeepSpeed 0.19.8 AutoEP copies it into the
`TokenChoiceTopKRouter` that replaces the router and adds it the same way). The bias steers only which experts are
chosen; the gating weights still come from the unbiased scores. In the report the bias is not learnt by gradient
but moved after every step towards balance. Nothing upstream does that: transformers trains with the bias frozen,
and DeepSpeed's AutoEP presets for DeepSeek-V2/V3 refuse their own balancing (`load_balance_coeff` must be null). A
long run's routing can then drift onto a few experts, and under EP the ranks holding them lag every all-to-all.

The rule (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, section 2.1.2 "Auxiliary-Loss-Free Load
Balancing"): "at the end of each step, we will decrease the bias term by gamma if its corresponding expert is
overloaded, and increase it by gamma if its corresponding expert is underloaded, where gamma is a hyper-parameter
called bias update speed". Overloaded means above the layer's mean load over the step's batch, as in the method's
paper (L. Wang et al., "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts", arXiv:2408.15664,
Algorithm 1: b_i += u * sign(mean load - load_i)). DeepSeek-V3 used gamma = 0.001 for the first 14.3T tokens and
0 for the last 500B (report, section 4.2).

On by default: RecipeTrainer adds an `ExpertBiasBalancer()` for every model whose routers choose by such a bias
(`needs_balancing`), unless the arguments say `expert_bias_balancing=False` or the user registered one (theirs,
with their gamma, takes its place). Why by default: the memory estimate (`planning/memory.py`) sizes the routed
activations and AutoEP's dispatch buffers for even routing, and without the update nothing keeps the load near
even (benchmarks/results/2026-12-06-expert-imbalance.md: what the demo model's routing does with and without it).
Turned off on such a model, the trainer says so once (`BALANCING_OFF`), naming that memory risk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection

import torch
from torch import nn

from hf_dist_recipes._compat.deepspeed import is_zero_partitioned
from hf_dist_recipes.moe.expert_load import ExpertLoadTracker, RoutedLayer, find_routed_layers
from hf_dist_recipes.runtime import RecipeCallback

# Said once, on rank 0, by RecipeTrainer when the arguments turn the default balancer off on a model that has one
# to balance (`needs_balancing`).
BALANCING_OFF = (
    "expert_bias_balancing=False: this model's MoE routers choose experts with DeepSeek-V3's correction bias "
    "(e_score_correction_bias), which now stays frozen, and nothing else keeps the expert load even (transformers' "
    "DeepSeek-V3 has no auxiliary loss; DeepSpeed AutoEP refuses one). Memory risk: an EP rank whose experts get "
    "more than the mean load holds more routed activations and all-to-all buffers than the memory estimate "
    "(config estimate), which assumes even routing, gives it (on the demo model under EP 2 the busiest EP rank "
    "averaged 1.76 x the mean load without balancing, 1.39 x with it); watch experts/ep_max_over_mean in the logs. "
    "Leave expert_bias_balancing at True, or register ExpertBiasBalancer(gamma) with your own gamma"
)


def bias_update(counts: torch.Tensor, gamma: float) -> torch.Tensor:
    """The report's bias change for tokens per expert `counts` (last dimension: experts): -gamma for each expert
    above the mean load, +gamma below it, 0 at it. float32, on `counts`' device."""
    counts = counts.double()
    return (gamma * torch.sign(counts.mean(-1, keepdim=True) - counts)).float()


def needs_balancing(model: nn.Module | None, registered: Collection[type] = ()) -> bool:
    """True when `model` has MoE routers and every one chooses its experts with a correction bias (DeepSeek-V3's
    `e_score_correction_bias`: the routers `ExpertBiasBalancer` balances), and `registered` (the classes of the
    callbacks a trainer holds already) has no `ExpertBiasBalancer`. DeepSeek-V2-style routers (auxiliary losses, no
    bias) and dense models: False."""
    if model is None or ExpertBiasBalancer in registered:
        return False
    layers = find_routed_layers(model)
    return bool(layers) and all(layer.bias is not None for layer in layers)


class ExpertBiasBalancer(RecipeCallback):
    """After every optimizer step, moves each MoE layer's expert-selection bias by `bias_update` of the step's token
    counts (module docstring: the rule and its sources). RecipeTrainer adds one with the default gamma to a model
    that `needs_balancing` (arguments: `expert_bias_balancing`); for another gamma pass your own, which takes its
    place: `RecipeTrainer(..., callbacks=[ExpertBiasBalancer(gamma=0.002)])` (a recipe callback: RecipeTrainer hands it
    the run's layout).

    The counts are the step's, summed over its gradient accumulation micro steps and over all ranks
    (`hf_dist_recipes.moe.expert_load`), so every rank applies the same update to its copy of the bias: the
    bias is a buffer, which neither ZeRO-3 nor AutoEP partitions (each rank holds it whole). It is saved with the
    model (a persistent buffer), so a resumed run continues from the balanced bias. The update is accumulated in
    float32 even where the bias is stored in lower precision (a 0.001 step vanishes in bf16 above 0.25). Cost: one
    all-reduce per optimizer step of the (MoE layers x experts) int64 counts (119 KB for DeepSeek-V3).

    Args:
        gamma: bias update speed, in units of the router's affinity scores (sigmoid, 0 to 1) per optimizer step;
            >= 0. Default 0.001, DeepSeek-V3's value (report, section 4.2, with batches of up to 15,360 sequences
            of 4K tokens; a smaller batch measures the load with more noise, and gamma is not scaled for it). 0
            leaves the bias unchanged.

    Raises ValueError at train start when the model has no routers of this kind (DeepSeek-V2 balances with
    auxiliary losses and has no bias; remove the callback there).
    """

    def __init__(self, gamma: float = 0.001):
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma >= 0:
            raise ValueError(
                f"ExpertBiasBalancer(gamma={gamma!r}): gamma must be a number >= 0 (0.001 in the "
                "DeepSeek-V3 report; 0 turns the update off)"
            )
        self.gamma = float(gamma)
        self.tracker: ExpertLoadTracker | None = None
        self._master: list[torch.Tensor | None] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        tracker = (
            ExpertLoadTracker.for_model(model, tp_size=self.runtime.facts.layout.tp, device=args.device)
            if model is not None
            else None
        )
        if tracker is None:
            raise ValueError(
                "ExpertBiasBalancer: the model has no MoE router to balance (DeepSeek-V3 routers, or "
                "the AutoEP layers that replace them); remove ExpertBiasBalancer from callbacks"
            )
        missing = [f"{layer.name} ({type(layer.router).__name__})" for layer in tracker.layers if layer.bias is None]
        if missing:
            raise ValueError(
                "ExpertBiasBalancer needs routers that choose experts with a correction bias (DeepSeek-V3's "
                f"e_score_correction_bias); these have none: {', '.join(missing)}. DeepSeek-V2-style models balance "
                "with auxiliary losses instead: remove ExpertBiasBalancer from callbacks"
            )
        for layer in tracker.layers:
            _check_not_trained(layer)
        tracker.reset()
        self.tracker = tracker
        # float32 masters only where the bias is stored in lower precision (module docstring of the class).
        self._master = []
        for layer in tracker.layers:
            with _writable(layer.bias, modify=False):
                low = layer.bias.dtype in (torch.float16, torch.bfloat16)
                self._master.append(layer.bias.detach().float().clone() if low else None)

    def on_step_end(self, args, state, control, **kwargs):
        if self.tracker is None:
            return
        if self.gamma == 0:  # every rank has the same gamma: all skip the collective together
            return
        counts = self.tracker.step_counts(state.global_step, reduce=True)
        delta = bias_update(counts, self.gamma)
        for row, layer in enumerate(self.tracker.layers):
            self._apply(row, layer, delta[row])

    def _apply(self, row: int, layer: RoutedLayer, delta: torch.Tensor) -> None:
        bias = layer.bias
        with torch.no_grad(), _writable(bias):
            delta = delta.to(bias.device)
            master = self._master[row]
            if master is None:
                bias.add_(delta)
            else:
                master.add_(delta.to(master.device))
                bias.copy_(master)


def _check_not_trained(layer: RoutedLayer) -> None:
    bias = layer.bias
    if isinstance(bias, torch.nn.Parameter) and bias.requires_grad:
        # The optimizer would also own it: its weight decay and moments would fight the rule every step.
        raise ValueError(
            f"{layer.name}.e_score_correction_bias is a trainable parameter; ExpertBiasBalancer sets it "
            "by the load rule instead: call .requires_grad_(False) on it before training, or, to train it by "
            "gradient, set expert_bias_balancing=False (RecipeTrainingArguments) and register no ExpertBiasBalancer"
        )


def _writable(bias: torch.Tensor, modify: bool = True):
    """A context in which `bias` holds its full value on this rank: a ZeRO-3 partitioned parameter is gathered and,
    when `modify`, rank 0's value is partitioned again on exit (every rank computes the same one). transformers 5.24
    and DeepSpeed 0.19.8 keep the bias a buffer, which ZeRO-3 does not partition: then nothing to do."""
    if not is_zero_partitioned(bias):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([bias], modifier_rank=0 if modify else None)
