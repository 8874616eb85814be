"""Tokens per routed expert: counted from the routers' top-k choices, summed per optimizer step over all ranks.

A MoE layer whose routing drifts onto a few experts trains those experts on most tokens and, under expert
parallelism, makes the EP ranks holding them the slowest of every all-to-all. This module counts what the routers
chose, so the drift shows in TensorBoard (`ExpertLoadCallback`) and `hf_dist_recipes.moe.expert_balance` can correct it.

What is counted: for every MoE layer, how many (token, expert) assignments each routed expert received, read from
the router's top-k indices by a forward hook (no extra routing work; no host synchronisation). Supported routers:
transformers 5.24 `DeepseekV3TopkRouter` and `DeepseekV2TopkRouter` (output `(logits, weights, indices)`), and the
`TokenChoiceTopKRouter` that DeepSpeed 0.19.8 AutoEP puts in their place (output `(scores, indices, counts)`;
the layer around it, `AutoEPMoELayer`, gives the EP degree).

Counted only inside a forward pass of the model in training mode: evaluation passes are left out, and so is the
recomputation of activation checkpointing, which runs each layer's forward a second time during the backward pass
(its router calls happen outside the model's own forward call, which is what tells them apart).

Across ranks: one all-reduce (sum) of a (MoE layers x experts) int64 tensor over the default process group, then a
division by the tensor-parallel degree. Why that group: a router sees only its own rank's tokens; ranks of one
data-parallel or expert-parallel group see different tokens (AutoEP's EP groups are carved out of the data-parallel
ranks, each feeding its own micro batch), so the global load is their sum; the ranks of one tensor-parallel group
route the same tokens with the same replicated router, so the world's sum counts each token TP times. The whole
world then divided by TP is the data-parallel sum without depending on how DeepSpeed builds its groups, and every
rank ends with identical numbers, which `ExpertBiasBalancer` needs (every rank applies the same bias update).
Cost: for DeepSeek-V3, 58 x 256 x 8 bytes = 119 KB per all-reduce.
"""

from __future__ import annotations

import math
import re
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from hf_dist_recipes._compat import deepspeed as compat_deepspeed
from hf_dist_recipes.core.gather import distributed
from hf_dist_recipes.runtime import RecipeCallback

# Above this many (MoE layer, expert) pairs only the per-layer summaries are logged by default: DeepSeek-V3 would
# otherwise add 14,848 scalars per log step to every rank's TensorBoard.
PER_EXPERT_SCALAR_LIMIT = 512

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class RoutedLayer:
    """One MoE layer's router. `index`: the decoder layer's index (from `...layers.<index>...`); `ep_size`: the
    expert-parallel degree of the layer (1 unless AutoEP replaced it); `indices_at`: the position of the top-k
    indices in the router's output tuple."""

    name: str
    index: int
    router: nn.Module
    num_experts: int
    top_k: int
    ep_size: int
    indices_at: int

    @property
    def bias(self) -> torch.Tensor | None:
        """The correction bias the router adds to its scores to choose experts (DeepSeek-V3), or None."""
        return getattr(self.router, "e_score_correction_bias", None)


def find_routed_layers(model: nn.Module) -> list[RoutedLayer]:
    """The model's MoE routers, in module order (each once, also where AutoEP aliases its router as `gate`)."""
    classes = compat_deepspeed.moe_router_classes()
    ep_sizes = compat_deepspeed.autoep_ep_sizes(model)
    layers = []
    for name, module in model.named_modules():
        at = classes.get(type(module))
        if at is None:
            continue
        found = _LAYER_INDEX.search(name)
        layers.append(
            RoutedLayer(
                name=name,
                index=int(found.group(1)) if found else len(layers),
                router=module,
                num_experts=int(module.num_experts),
                top_k=int(module.top_k),
                ep_size=ep_sizes.get(id(module), 1),
                indices_at=at,
            )
        )
    return layers


def has_routed_experts(model: nn.Module | None) -> bool:
    """True when the model has at least one router `find_routed_layers` can count."""
    return model is not None and bool(find_routed_layers(model))


def max_over_mean(counts: torch.Tensor) -> float:
    """Largest count over the mean count of a 1-D tensor (1.0: perfectly even; the number of entries: all on one).
    NaN when nothing was counted."""
    counts = counts.double()
    mean = counts.mean().item()
    return counts.max().item() / mean if mean > 0 else math.nan


def ep_rank_tokens(counts: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Tokens per EP rank from tokens per expert (last dimension): EP rank r holds the contiguous experts
    [r * E / ep_size, (r + 1) * E / ep_size), as DeepSpeed AutoEP places them."""
    experts = counts.shape[-1]
    if ep_size < 1 or experts % ep_size:
        raise ValueError(f"{experts} experts cannot be split evenly over EP degree {ep_size}")
    return counts.reshape(*counts.shape[:-1], ep_size, experts // ep_size).sum(-1)


class ExpertLoadTracker:
    """Counts tokens per expert of every MoE layer of one model; shared by `ExpertLoadCallback` and
    `ExpertBiasBalancer` (get it with `for_model`, which attaches the hooks once).

    `step_counts(step)` closes an optimizer step: it returns the (MoE layers x experts) int64 counts gathered since
    the previous step (all micro steps of gradient accumulation) and starts the next. `reduce` sums a count tensor
    over the ranks (module docstring: which group, why)."""

    def __init__(self, layers: list[RoutedLayer], *, tp_size: int = 1, device: torch.device | str | None = None):
        if not layers:
            raise ValueError("the model has no routed experts to count (no DeepSeek-V2/V3 router or AutoEP layer)")
        experts = {layer.num_experts for layer in layers}
        if len(experts) != 1:
            raise ValueError(f"MoE layers with different expert counts {sorted(experts)} are not supported")
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.layers = layers
        self.tp_size = tp_size
        if device is None:
            device = next(layers[0].router.buffers(), next(layers[0].router.parameters())).device
        self._micro = torch.zeros(len(layers), experts.pop(), dtype=torch.int64, device=device)
        self._counting = False
        self._step: int | None = None
        self._step_local: torch.Tensor | None = None
        self._step_global: torch.Tensor | None = None
        self._handles: list = []

    _by_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def for_model(
        cls, model: nn.Module, *, tp_size: int = 1, device: torch.device | str | None = None
    ) -> ExpertLoadTracker | None:
        """The model's tracker, hooks attached; None when it has no routed experts. Call it once the model has its
        final modules (after DeepSpeed AutoEP replaced the MoE blocks: `on_train_begin` is such a point). A model
        whose routers changed since the last call gets a new tracker, and the old one's hooks are removed."""
        layers = find_routed_layers(model)
        tracker = cls._by_model.get(model)
        if tracker is not None and [id(x.router) for x in tracker.layers] == [id(x.router) for x in layers]:
            tracker.tp_size = tp_size
            return tracker
        if tracker is not None:
            tracker.detach()
            del cls._by_model[model]
        if not layers:
            return None
        tracker = cls(layers, tp_size=tp_size, device=device)
        tracker._attach(model)
        cls._by_model[model] = tracker
        return tracker

    def _attach(self, model: nn.Module) -> None:
        def enter(module, args):
            self._counting = module.training

        def leave(module, args, output):
            self._counting = False

        # always_call: an exception inside forward must not leave counting switched on.
        self._handles.append(model.register_forward_pre_hook(enter))
        self._handles.append(model.register_forward_hook(leave, always_call=True))
        for row, layer in enumerate(self.layers):
            self._handles.append(layer.router.register_forward_hook(self._counter(row, layer.indices_at)))

    def _counter(self, row: int, indices_at: int):
        def count(module, args, output):
            if not self._counting:
                return
            flat = output[indices_at].reshape(-1).to(self._micro.device, torch.int64)
            # scatter_add_ rather than bincount: bincount sizes its output from max+1, a device-to-host copy.
            self._micro[row].scatter_add_(0, flat, torch.ones_like(flat))

        return count

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self) -> None:
        """Forget what was counted so far (a training run starts: passes before it are no step of it)."""
        self._micro.zero_()
        self._step = self._step_local = self._step_global = None

    def step_counts(self, step: int, *, reduce: bool = False) -> torch.Tensor:
        """Counts of optimizer step `step` (the Trainer's `global_step` after the step): this rank's, or every
        rank's with `reduce=True` (a collective: every rank must ask for the same steps). The first call for a new
        step closes it; later calls for the same step return the same counts."""
        if step != self._step:
            self._step, self._step_local, self._step_global = step, self._micro.clone(), None
            self._micro.zero_()
        if not reduce:
            return self._step_local
        if self._step_global is None:
            self._step_global = self.reduce(self._step_local)
        return self._step_global

    def reduce(self, counts: torch.Tensor) -> torch.Tensor:
        """`counts` summed over the data-parallel ranks (module docstring); a copy, on every rank the same."""
        counts = counts.clone()
        if not distributed():
            return counts
        torch.distributed.all_reduce(counts)
        # Each token was counted once by every rank of its TP group.
        return counts // self.tp_size if self.tp_size > 1 else counts


def load_scalars(tokens: torch.Tensor, layers: list[RoutedLayer], *, per_expert: bool) -> dict[str, float]:
    """The logged scalars (`ExpertLoadCallback`) from tokens per expert per step, shape (MoE layers x experts)."""
    out: dict[str, float] = {}
    ratios, ep_ratios, ep_total = [], [], None
    tokens = tokens.double().cpu()
    for row, layer in zip(tokens, layers, strict=True):
        prefix = f"experts/layer{layer.index}"
        ratios.append(max_over_mean(row))
        out[f"{prefix}/max_over_mean"] = ratios[-1]
        if per_expert:
            out.update({f"{prefix}/expert{e}_tokens": v for e, v in enumerate(row.tolist())})
        if layer.ep_size > 1:
            per_rank = ep_rank_tokens(row, layer.ep_size)
            ep_ratios.append(max_over_mean(per_rank))
            out[f"{prefix}/ep_max_over_mean"] = ep_ratios[-1]
            if per_expert:
                out.update({f"{prefix}/ep_rank{r}_tokens": v for r, v in enumerate(per_rank.tolist())})
            ep_total = per_rank if ep_total is None or ep_total.shape != per_rank.shape else ep_total + per_rank
    out["experts/max_over_mean"] = max(ratios)
    if ep_ratios:
        out["experts/ep_max_over_mean"] = max(ep_ratios)
        total = ep_total.sum().item()
        out.update(
            {f"experts/ep_rank{r}_share": (v / total if total else math.nan) for r, v in enumerate(ep_total.tolist())}
        )
    return out


class ExpertLoadCallback(RecipeCallback):
    """Logs how evenly the routers spread tokens over the experts, through the Trainer's logs (RecipeTrainer adds
    it, before its per-rank TensorBoard callback, when the model has routed experts; each key then shows as
    `train/<key>` on every rank's TensorBoard, with identical values: the counts are summed over all ranks).

    | key | meaning |
    |---|---|
    | `experts/layer{L}/max_over_mean` | decoder layer L: busiest expert's tokens / mean tokens per expert (1: even) |
    | `experts/max_over_mean` | the largest of the layers' values |
    | `experts/layer{L}/expert{e}_tokens` | tokens routed to expert e per optimizer step, all ranks (per_expert) |
    | `experts/layer{L}/ep_max_over_mean` | under EP: the busiest EP rank's tokens / the mean over EP ranks |
    | `experts/ep_max_over_mean` | under EP: the largest of the layers' values |
    | `experts/ep_rank{r}_share` | under EP: share of all layers' routed tokens that EP rank r's experts receive |
    | `experts/layer{L}/ep_rank{r}_tokens` | under EP: tokens per optimizer step to EP rank r's experts (per_expert) |

    Token numbers are means over the optimizer steps since the previous log, each step summing its gradient
    accumulation micro steps; a token routed to k experts counts k times. The counts are summed over the ranks once
    per log, in `on_step_end` (every rank reaches it at the same steps).

    Args:
        per_expert: log the per-expert and per-EP-rank token counts too; None (default): when the model has at most
            `PER_EXPERT_SCALAR_LIMIT` (512) MoE layer x expert pairs.

    The keys go to the runtime's `history` channel (RecipeTrainer hands the runtime to one the user registered):
    `log_history`, every `report_to` integration and the per-rank TensorBoard get them.
    """

    def __init__(self, per_expert: bool | None = None):
        self.per_expert = per_expert
        self.tracker: ExpertLoadTracker | None = None
        self._window: torch.Tensor | None = None
        self._window_steps = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self.tracker = (
            ExpertLoadTracker.for_model(model, tp_size=self.runtime.facts.layout.tp, device=args.device)
            if model is not None
            else None
        )
        if self.tracker is not None:
            self.tracker.reset()
        self._window, self._window_steps = None, 0

    def on_step_end(self, args, state, control, **kwargs):
        if self.tracker is None:
            return
        counts = self.tracker.step_counts(state.global_step)
        self._window = counts.clone() if self._window is None else self._window + counts
        self._window_steps += 1
        if control.should_log:
            self._close_window()

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.tracker is not None and control.should_log and self._window_steps:  # logging_strategy="epoch"
            self._close_window()

    def _close_window(self) -> None:
        tokens = self.tracker.reduce(self._window).double() / self._window_steps
        layers = self.tracker.layers
        per_expert = self.per_expert
        if per_expert is None:
            per_expert = len(layers) * layers[0].num_experts <= PER_EXPERT_SCALAR_LIMIT
        self.runtime.logs.history(load_scalars(tokens, layers, per_expert=per_expert))
        self._window, self._window_steps = None, 0
