"""Per-rank memory of a ParallelPlan: exact for model states, a stated estimate for activations.

Model states, per parameter, in the order DeepSpeed applies them:
1. AutoTP splits the weights named by `tp_specs` along their column/row dimension (read through DeepSpeed's
   `AutoTPConfig`, as the engine does);
2. AutoEP (EP > 1) keeps routed experts / EP on each rank; the fused `gate_up_proj` becomes two tensors (w1, w3);
3. ZeRO partitions each resulting tensor over a group, ceil(elements / group) per rank (stage 3: parameters,
   stage >= 2: gradients, stage >= 1: optimizer states). The groups, as measured on CPU with DeepSpeed 0.19.8:
   TP-split weights over the data-parallel ranks (world / TP); the MoE layer's routed experts and router under
   EP over world / EP; weights that TP keeps whole (embeddings, norms) over the whole world when the model was
   built under `zero.Init` (`plan.zero_init`, what `from_pretrained` does), else over world / TP.
These element counts match what each rank holds in a real run exactly (tests/distributed/test_tp_ep.py).

Bytes per element: bf16/fp16 -- parameter 2, gradient 2, optimizer 12 (fp32 master copy + Adam's two moments);
fp32 -- 4, 4, 8. ZeRO-3 also gathers one module at a time in full ("gathered": the largest module after TP/EP).
Offload moves optimizer states and gradients (optimizer offload), and parameters (parameter offload), to host RAM.

Activations (an estimate, not a measurement): per transformer layer s*b*h*(10 + 24/t) bytes at 2-byte precision
(Korthikanti et al. 2022, "Reducing Activation Recomputation", without the attention-score term, which
FlashAttention/SDPA kernels do not store; no sequence parallelism), doubled for fp32. With activation
checkpointing: 2*s*b*h bytes per layer plus one layer in full. Plus the logits, s*b*V*(2 + 4) bytes (the fp32 copy
the loss makes). Mixture-of-experts layers are counted as a dense layer of the same hidden size.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from hf_dist_recipes.parallel.models import ModelShape, component_of
from hf_dist_recipes.parallel.plan import ParallelPlan
from hf_dist_recipes.parallel.tp_specs import partition_config, tp_split_dim

GIB = 2**30
BYTES_PER_ELEMENT = {"bf16": (2, 2, 12), "fp16": (2, 2, 12), "fp32": (4, 4, 8)}  # parameter, gradient, optimizer
USABLE_FRACTION = 0.9  # of the device memory; the rest goes to the CUDA context, NCCL buffers and fragmentation


@dataclass(frozen=True)
class RankElements:
    """Elements one rank holds. `sharded`: parameter elements after TP/EP, before ZeRO."""

    params: int
    grads: int
    optimizer: int
    gathered_layer: int
    sharded: int


def rank_elements(plan: ParallelPlan, model: ModelShape) -> RankElements:
    """Exact per-rank element counts of parameters, gradients and optimizer states for `plan` (rank 0; ranks
    differ only by ZeRO padding, at most one element per tensor)."""
    autotp = None
    if plan.tp > 1:
        from deepspeed.module_inject.autotp_config import AutoTPConfig

        autotp = AutoTPConfig.from_dict(partition_config(model.model_type))
    params = grads = optimizer = sharded = 0
    per_module: dict[str, int] = {}
    for name, shape in model.parameters:
        numel = math.prod(shape)
        component = component_of(name)
        pieces, group = [numel], plan.dp_size
        if component in ("routed_experts", "router") and plan.ep > 1:
            group = plan.edp_size
            if component == "routed_experts":
                numel //= plan.ep
                pieces = [numel // 2, numel // 2] if name.endswith("gate_up_proj") else [numel]
        elif autotp is not None and tp_split_dim(name, shape, autotp) is not None:
            numel //= plan.tp
            pieces = [numel]
        elif plan.zero_init:
            group = plan.world_size
        sharded += numel
        module = name.rsplit(".", 1)[0]
        per_module[module] = per_module.get(module, 0) + numel
        partitioned = sum(math.ceil(p / group) for p in pieces)
        params += partitioned if plan.zero_stage == 3 else numel
        grads += partitioned if plan.zero_stage >= 2 else numel
        optimizer += partitioned if plan.zero_stage >= 1 else numel
    gathered = max(per_module.values()) if plan.zero_stage == 3 else 0
    return RankElements(params=params, grads=grads, optimizer=optimizer, gathered_layer=gathered, sharded=sharded)


def activation_bytes(plan: ParallelPlan, model: ModelShape) -> int:
    """The activation estimate of the module docstring, per rank, in bytes."""
    s, b, h, t = plan.seq_len, plan.micro_batch, model.hidden_size, plan.tp
    scale = 2 if plan.precision == "fp32" else 1
    full_layer = s * b * h * (10 + 24 / t) * scale
    if plan.activation_checkpointing:
        layers = model.num_layers * 2 * s * b * h * scale + full_layer
    else:
        layers = model.num_layers * full_layer
    logits = s * b * model.vocab_size * (2 * scale + 4)
    return int(layers + logits)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by kind, where they live, and whether the device holds its share (`device_bytes` of
    memory per GPU, of which USABLE_FRACTION is counted as usable)."""

    plan: ParallelPlan
    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int
    device_total: int
    host_total_per_node: int
    device_bytes: int | None
    elements: RankElements

    @property
    def fits(self) -> bool | None:
        if self.device_bytes is None:
            return None
        return self.device_total <= self.device_bytes * USABLE_FRACTION

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("plan", "elements")}
        return {"plan": self.plan.as_dict(), **out, "fits": self.fits, "elements": asdict(self.elements)}


def estimate(plan: ParallelPlan, model: ModelShape, *, device_gib: float | None = None) -> MemoryEstimate:
    """Per-rank memory of `plan` for `model`. `device_gib`: memory of one GPU in GiB (None: no fits verdict)."""
    el = rank_elements(plan, model)
    p_bytes, g_bytes, o_bytes = BYTES_PER_ELEMENT[plan.precision]
    params, grads, optimizer = el.params * p_bytes, el.grads * g_bytes, el.optimizer * o_bytes
    gathered = el.gathered_layer * p_bytes
    activations = activation_bytes(plan, model)
    on_host = 0
    if plan.offload_optimizer:
        on_host += optimizer + grads
    if plan.offload_params:
        on_host += params
    device_total = params + grads + optimizer + gathered + activations - on_host
    return MemoryEstimate(
        plan=plan, params=params, grads=grads, optimizer=optimizer, gathered=gathered, activations=activations,
        device_total=device_total, host_total_per_node=on_host * plan.procs_per_node,
        device_bytes=int(device_gib * GIB) if device_gib else None, elements=el,
    )


def render_table(estimates: list[MemoryEstimate], *, chosen: MemoryEstimate | None = None) -> str:
    """Plain-text table, GiB per rank; host RAM per node."""
    head = (f"{'plan':<28} {'params':>8} {'grads':>8} {'optim':>8} {'gather':>8} {'activ':>8} {'total':>8} "
            f"{'host/node':>10} {'fits?':>6}")
    lines = [head, "-" * len(head)]
    for e in estimates:
        p = e.plan
        off = "+".join(k for k, on in (("opt", p.offload_optimizer), ("param", p.offload_params)) if on) or "-"
        label = f"Z{p.zero_stage} TP{p.tp} EP{p.ep} off:{off}"
        fits = {True: "yes", False: "no", None: "?"}[e.fits]
        mark = " <" if chosen is not None and e is chosen else ""
        lines.append(
            f"{label:<28} {e.params / GIB:8.1f} {e.grads / GIB:8.1f} {e.optimizer / GIB:8.1f} {e.gathered / GIB:8.1f} "
            f"{e.activations / GIB:8.1f} {e.device_total / GIB:8.1f} {e.host_total_per_node / GIB:10.0f} {fits:>6}{mark}"
        )
    return "\n".join(lines)
