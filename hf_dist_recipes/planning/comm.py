"""Communication and step time of a ParallelPlan: what each rank sends per optimizer step, and how long it takes.

Memory decides which plans fit; traffic decides which of them is fast. For a mixture-of-experts model the plan with
the least parallelism (TP 1, EP 1) is the one with the most traffic: ZeRO-3 gathers every routed expert of a layer
(21 GiB for a DeepSeek-V3 MoE layer) in the forward pass, again in the recomputation and again in the backward pass,
on every micro step. This module states the volume of every collective, splits it into intra-node (NVLink) and
inter-node (network) bytes, and turns it into an estimated step time for given hardware.

Volumes, per rank per micro step unless said otherwise (N: bytes of the full tensor, after TP/EP splits; a group
of G = n x m ranks spread over n nodes with m ranks on each; ranks are numbered node by node, so a group of
consecutive ranks fills a node first and a group with stride s >= ranks per node has one member per node):
- all-gather and reduce-scatter: intra (m-1)/m x N, inter (n-1)/n x N/m. This is the hierarchical schedule (across
  nodes among the ranks with the same local index, then inside the node); NCCL's multi-ring schedule, one ring per
  NIC, puts the same (G-1)/G x N/m on each NIC, which is why nccl-tests' bus bandwidth across nodes approaches the
  node's total NIC bandwidth. all-reduce: twice both. (Rajbhandari et al. 2020, "ZeRO", section 7: all-reduce =
  reduce-scatter + all-gather.)
- all-to-all of D bytes per rank spread evenly over G ranks: intra (m-1)/G x D, inter (G-m)/G x D.
- ZeRO-3 (DeepSpeed 0.19.8 stage3): every parameter tensor at or above `stage3_param_persistence_threshold` (1e5
  elements) is all-gathered in the forward pass, again in the backward pass, and again in the recomputation when
  activation checkpointing is on; gradients are reduce-scattered every micro step in `communication_data_type`
  (`plan.grad_reduce_dtype`, which the generated JSON writes: fp32 by default, 4 bytes per element, twice a bf16
  gather's; stage3.py `__avg_scatter_grads` converts each gradient with `g.to(communication_data_type)` and
  `reduce_scatter_coalesced` reduces that copy, so the collective itself runs in fp32; without the key DeepSpeed
  uses the compute dtype, engine.py `communication_data_type`). Without recomputation and with a bf16 reduction
  that is 3 x the model's bytes against 2 x for plain data parallelism, the ZeRO paper's "1.5x" (section 7.2.2).
  ZeRO-1/2 reduce-scatter the gradients (ZeRO-2 every micro step, ZeRO-1 once per step) and all-gather the updated
  parameters once per step; ZeRO-0 all-reduces the gradients once per step (both reductions in the same dtype).
  Groups as `hf_dist_recipes.planning.memory` states them (TP-split weights over
  world / TP ranks with stride TP, routed experts over world / EP with stride EP, the rest over the world).
  With hierarchical partitioning (`hpz` = ranks per node, ZeRO++ hpZ, Wang et al. 2023 arXiv:2306.10209 section 3.2)
  the backward gather reads the node-local secondary copy: its bytes are intra-node only.
- Tensor parallelism (AutoTP, Megatron layout; Korthikanti et al. 2022 section 3): per decoder layer an all-reduce of
  the s x b x h activations after the attention and after the MLP in the forward pass and one each in the backward
  pass (plus the forward ones again when recomputing); MLA's down-projections, split by output and gathered back,
  add an all-gather of their outputs (q_lora_rank + kv_lora_rank + rope wide); the LM head adds an all-gather of the
  s x b x V logits and a backward all-reduce of s x b x h. Dense and shared-expert MLPs are TP-split; routed experts
  are left to EP, so a MoE layer without shared experts has no MLP all-reduce.
- Expert parallelism (AutoEP): per MoE layer an all-to-all of the s x b x k token copies (k experts per token, h
  wide) to their experts and one back, in the forward pass, the backward pass and the recomputation.
- Sequence parallelism (Ulysses, DeepSpeed's `UlyssesSPAttentionHF`): per decoder layer an all-to-all of the
  query, key and value of the rank's s/sp tokens (head-sharded on the way in) and one of the attention output back:
  D = s/sp x b x `ulysses_exchange_elements` x c bytes per rank, of which (sp-1)/sp leave the rank (inside one
  node), in the forward pass, the backward pass (the gradients of the same tensors, the other way) and the
  recomputation. The group is sp consecutive ranks; ZeRO's groups then include the SP ranks (`ParallelPlan.
  zero_dp_size`).
- Optimizer offload (`offload_parts`): the rank's fp32 gradient partition crosses PCIe 2 x accumulation + 1
  times per step (ZeRO-3 keeps it on the host and adds each micro step's gradient to it on the GPU: down and up
  at the first micro step, up and down at every later one, down into the optimizer at the last), the updated bf16
  parameters (2 bytes) come back once, and the node's CPUs run Adam over its ranks' optimizer states once.
  Parameter offload: the rank's parameter partition comes up from the host before each gather instead.

Step time = max(compute, ZeRO traffic) + TP traffic + EP traffic + SP traffic + offload. ZeRO-3 traffic is
prefetched and reduced while the next module computes (`overlap_comm`), so it hides behind compute until it is the
larger; AutoTP's all-reduces and the AutoEP and Ulysses all-to-alls sit between the matmuls that need them and are not
overlapped. Offload is counted in full: CPU Adam runs after the backward pass, and the gradient copies are queued on
the reduce stream behind the reduce-scatters and share the GPU's PCIe link with the NIC, so how much of them hides is
not modelled (an upper bound on the step). Each collective
takes intra bytes / intra bandwidth + inter bytes / inter bandwidth. Compute: (6 + 2 with recomputation) x active
matmul parameters per token x tokens, divided by TP x SP, plus causal attention 2 x b x s^2 x (q-k width + v width) per
layer forward (x3, x4 with recomputation), at `compute_efficiency` of the GPU's dense peak.

What it leaves out: pipeline parallelism (not planned here), latency terms (small messages), load imbalance
between experts (see `hf_dist_recipes.monitoring`), and NCCL's SHARP/NVLS reductions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from hf_dist_recipes.planning.elements import placements, rank_elements
from hf_dist_recipes.planning.models import ModelShape, component_of
from hf_dist_recipes.planning.plan import ParallelPlan, grad_reduce_bytes

GB = 1e9  # bandwidths in GB/s (10^9 bytes per second), as nccl-tests and NVIDIA's data sheets give them
PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold default: smaller tensors stay whole


@dataclass(frozen=True)
class Hardware:
    """One GPU of a node and its links. Bandwidths in GB/s per GPU as achieved by NCCL (bus bandwidth), not the
    data sheet's peak: `intra_node_gbps` over NVLink, `inter_node_gbps` over the GPU's own NIC; `pcie_gbps`
    host <-> GPU; `gpu_tflops`: dense bf16 peak in TFLOP/s; `compute_efficiency`: fraction of that peak the
    matmuls reach with no communication exposed; `cpu_adam_params_per_s`: parameters per second one node's CPUs
    update with DeepSpeed's CPU Adam; `memory_gib`: GPU memory; `host_memory_gib`: host memory of the node, GiB
    (None: not known for the type)."""

    name: str
    gpu_tflops: float
    intra_node_gbps: float
    inter_node_gbps: float
    memory_gib: float
    pcie_gbps: float = 25.0
    compute_efficiency: float = 0.5
    cpu_adam_params_per_s: float = 2e9
    host_memory_gib: float | None = None

    def __post_init__(self):
        for key in (
            "gpu_tflops",
            "intra_node_gbps",
            "inter_node_gbps",
            "memory_gib",
            "pcie_gbps",
            "cpu_adam_params_per_s",
        ):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key} must be a positive number, got {getattr(self, key)!r}")
        if not 0 < self.compute_efficiency <= 1:
            raise ValueError(
                f"compute_efficiency is a fraction of the GPU's peak in (0, 1], got {self.compute_efficiency!r}"
            )


# Defaults per GPU type. H100 and H200 SXM share the compute (989 dense bf16 TFLOP/s, NVIDIA H100/H200 data sheets)
# and the links (NVLink 4: 450 GB/s each way, of which NCCL's all-reduce reaches about 360 GB/s bus bandwidth on
# a DGX H100; one 400 Gb/s NDR NIC per GPU, about 45 GB/s achieved); they differ in memory (80 vs 141 GB). Memory is
# what CUDA can allocate, nvidia-smi's memory.total: H100 SXM 81,559 MiB (79.6 GiB; "80 GB" is HBM3's 5 x 16 GiB less
# ECC and reserved pages, not 80e9 B), H200 143,771 MiB (140.4 GiB), A100 SXM 80GB 81,920 MiB.
# A100 SXM 80GB: 312 TFLOP/s, NVLink 3 (300 GB/s each way, about 235 achieved), one 200 Gb/s HDR NIC per GPU.
# host_memory_gib: the DGX of each GPU (NVIDIA DGX data sheets): DGX H100 and DGX H200 2 TB (32 x 64 GiB DIMMs),
# DGX A100 1 TB (its 640 GB version 2 TB); other servers with these GPUs differ: --host-memory, or preflight's reading.
# compute_efficiency 0.5: torchtitan reports 51-61% MFU for Llama 2/3 13B-70B with FSDP2 on 64 A100s
# (docs/performance.md). cpu_adam_params_per_s: an assumption for a 2-socket node; set it from a measurement.
HARDWARE = {
    "h100": Hardware(
        "h100", gpu_tflops=989, intra_node_gbps=360, inter_node_gbps=45, memory_gib=81_559 / 1024, host_memory_gib=2048
    ),
    "h200": Hardware(
        "h200", gpu_tflops=989, intra_node_gbps=360, inter_node_gbps=45, memory_gib=143_771 / 1024, host_memory_gib=2048
    ),
    "a100": Hardware(
        "a100", gpu_tflops=312, intra_node_gbps=235, inter_node_gbps=23, memory_gib=81_920 / 1024, host_memory_gib=1024
    ),
}


@dataclass(frozen=True)
class Span:
    """How a process group lies on the nodes: `nodes` nodes with `per_node` members on each."""

    nodes: int
    per_node: int

    @property
    def size(self) -> int:
        return self.nodes * self.per_node


def group_span(size: int, stride: int, procs_per_node: int) -> Span:
    """The span of a group of `size` ranks r0, r0 + stride, ... with ranks numbered node by node."""
    if size <= 1:
        return Span(1, 1)
    if stride >= procs_per_node:
        return Span(size, 1)
    per_node = min(size, procs_per_node // stride)
    return Span(math.ceil(size / per_node), per_node)


def all_gather_bytes(n_bytes: float, span: Span) -> tuple[float, float]:
    """(intra, inter) bytes one rank sends to all-gather (or reduce-scatter) a tensor of `n_bytes` in full."""
    n, m = span.nodes, span.per_node
    return (m - 1) / m * n_bytes, (n - 1) / n * n_bytes / m


def all_to_all_bytes(d_bytes: float, span: Span) -> tuple[float, float]:
    """(intra, inter) bytes one rank sends when spreading `d_bytes` evenly over the group."""
    g, m = span.size, span.per_node
    return (m - 1) / g * d_bytes, (g - m) / g * d_bytes


@dataclass
class Traffic:
    """Bytes one rank sends per optimizer step, by kind ("zero", "tp", "ep", "sp", "offload"), intra- and
    inter-node."""

    intra: dict[str, float] = field(default_factory=dict)
    inter: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, pair: tuple[float, float], times: float = 1.0) -> None:
        self.intra[kind] = self.intra.get(kind, 0.0) + pair[0] * times
        self.inter[kind] = self.inter.get(kind, 0.0) + pair[1] * times

    def seconds(self, kind: str, hw: Hardware) -> float:
        return self.intra.get(kind, 0.0) / (hw.intra_node_gbps * GB) + self.inter.get(kind, 0.0) / (
            hw.inter_node_gbps * GB
        )


def _spans(plan: ParallelPlan) -> dict[str, Span]:
    ppn, world = plan.procs_per_node, plan.world_size
    return {
        "tp": group_span(plan.tp, 1, ppn),
        "dp": group_span(plan.zero_dp_size, plan.tp, ppn),
        "sp": group_span(plan.sp, 1, ppn),
        "world": group_span(world, 1, ppn),
        "ep": group_span(plan.ep, 1, ppn),
        "edp": group_span(plan.edp_size, plan.ep, ppn),
    }


def zero_groups(plan: ParallelPlan, model: ModelShape) -> list[tuple[int, str]]:
    """(elements of the tensor as ZeRO sees it, after TP/EP splits; its ZeRO group: "dp", "edp" or "world") for
    every parameter tensor (`elements.placements`)."""
    return [(piece, group) for _, _, pieces, group in placements(plan, model) for piece in pieces]


def _shape_of(model: ModelShape, suffixes: tuple[str, ...]) -> tuple[int, ...] | None:
    return next((shape for name, shape in model.parameters if name.endswith(suffixes)), None)


def moe_layer_count(model: ModelShape) -> int:
    """Decoder layers that hold routed experts."""
    return len({name.split(".experts.")[0] for name, _ in model.parameters if ".experts." in name})


def attention_widths(model: ModelShape) -> tuple[int, int]:
    """(query-key width, value width) summed over heads, from the projections' shapes: the query projection's output
    (MLA: q_b_proj, or q_proj without a q LoRA) and the output projection's input."""
    q = _shape_of(model, ("self_attn.q_b_proj.weight", "self_attn.q_proj.weight"))
    o = _shape_of(model, ("self_attn.o_proj.weight",))
    if q is None or o is None:
        return model.hidden_size, model.hidden_size
    return q[0], o[1]


def active_matmul_params(model: ModelShape) -> float:
    """Parameters one token multiplies through: everything but the embedding table and the norms, routed experts
    scaled by experts per token / routed experts."""
    total = 0.0
    for name, shape in model.parameters:
        component = component_of(name)
        if component in ("embeddings", "norms") or len(shape) < 2:
            continue
        numel = math.prod(shape)
        if component == "routed_experts":
            numel *= model.experts_per_token / model.routed_experts
        total += numel
    return total


def compute_flops(plan: ParallelPlan, model: ModelShape) -> float:
    """FLOPs one rank performs per optimizer step (see the module docstring)."""
    s, b = plan.seq_len, plan.micro_batch
    passes = 4 if plan.activation_checkpointing else 3  # forward, backward (2 x), recomputed forward
    matmul = 2 * active_matmul_params(model) * s * b
    qk, v = attention_widths(model)
    attention = model.num_layers * 2 * b * s * s * (qk + v) / 2  # causal: half of the score matrix
    # An SP rank runs its s/sp tokens through the matmuls and attention's s x s scores for heads / sp heads.
    return passes * (matmul + attention) * plan.grad_accum / (plan.tp * plan.sp)


def ulysses_exchange_elements(model: ModelShape, sp: int) -> int:
    """Elements per token of one layer's Ulysses exchanges (module docstring): query and key (heads x the query/key
    head width), value and output (heads x the value width). MLA: every one at the query/key width, as
    RecipeTrainer's shim pads the value heads to it (stock Ulysses takes one head size, ulysses_sp.py:299) and the
    output comes back padded. Other models: K and V with max(KV heads, sp) heads, as Ulysses replicates KV heads up
    to sp (ulysses_sp.py:134-186)."""
    if model.is_mla:
        return 4 * model.num_heads * (model.qk_nope_head_dim + model.qk_rope_head_dim)
    return model.head_dim * (2 * model.num_heads + 2 * max(model.num_kv_heads, sp))


def traffic(plan: ParallelPlan, model: ModelShape, *, hpz: int = 1, vocab_parallel: bool = False) -> Traffic:
    """Bytes one rank sends per optimizer step, by kind (see the module docstring). `hpz`: ZeRO++ hierarchical
    partition size (1: off; the ranks per node: the backward gather stays inside the node). `vocab_parallel`:
    DeepSpeed's vocabulary-parallel LM head, whose loss reduces three s x b vectors instead of gathering the
    logits (counted as nothing)."""
    spans = _spans(plan)
    width = 4 if plan.precision == "fp32" else 2  # bytes per parameter gathered and per activation
    grad_width = grad_reduce_bytes(plan)
    micro, t = plan.grad_accum, Traffic()
    recompute = 1 if plan.activation_checkpointing else 0
    if plan.zero_stage > 0 or plan.zero_dp_size > 1:
        for numel, group in zero_groups(plan, model):
            span = spans[group]
            if span.size == 1:
                continue
            pair = all_gather_bytes(numel * width, span)
            grads = all_gather_bytes(numel * grad_width, span)  # a reduce-scatter moves what an all-gather does
            if plan.zero_stage == 3:
                if numel >= PERSISTENCE_THRESHOLD:
                    if hpz > 1 and span.nodes > 1:
                        # The backward gather reads the node's secondary copy, partitioned over `hpz` local ranks.
                        t.add("zero", pair, micro * (1 + recompute))
                        t.add("zero", all_gather_bytes(numel * width, Span(1, hpz)), micro)
                    else:
                        t.add("zero", pair, micro * (2 + recompute))
                t.add("zero", grads, micro)  # gradient reduce-scatter
            elif plan.zero_stage == 2:
                t.add("zero", grads, micro)  # reduce-scatter every micro step
                t.add("zero", pair)  # parameter all-gather once per step
            elif plan.zero_stage == 1:
                t.add("zero", grads)
                t.add("zero", pair)
            else:
                t.add("zero", grads, 2)  # one all-reduce
    s, b, h = plan.seq_len, plan.micro_batch, model.hidden_size
    if plan.tp > 1:
        tp = spans["tp"]
        activation = s * b * h * width
        mlp_layers = len(
            {n.split(".mlp.")[0] for n, _ in model.parameters if component_of(n) in ("dense_mlp", "shared_experts")}
        )
        all_reduces = (2 + recompute) * (model.num_layers + mlp_layers)  # forward, backward, recomputation
        ar = all_gather_bytes(activation, tp)
        t.add("tp", ar, 2 * all_reduces * micro)
        down = sum(
            _shape_of(model, (suffix,))[0]
            for suffix in ("q_a_proj.weight", "kv_a_proj_with_mqa.weight")
            if _shape_of(model, (suffix,)) is not None
        )
        if down:
            t.add("tp", all_gather_bytes(s * b * down * width, tp), model.num_layers * (1 + recompute) * micro)
        if not vocab_parallel:
            t.add("tp", all_gather_bytes(s * b * model.vocab_size * width, tp), micro)  # LM head output
        t.add("tp", ar, 2 * micro)  # LM head input gradient
    if plan.ep > 1 and model.is_moe:
        dispatched = s * b * model.experts_per_token * h * width
        t.add("ep", all_to_all_bytes(dispatched, spans["ep"]), moe_layer_count(model) * 2 * (2 + recompute) * micro)
    if plan.sp > 1:
        exchanged = plan.tokens_per_rank * b * ulysses_exchange_elements(model, plan.sp) * width
        t.add("sp", all_to_all_bytes(exchanged, spans["sp"]), model.num_layers * (2 + recompute) * micro)
    return t


@dataclass(frozen=True)
class StepEstimate:
    """Traffic and time of one optimizer step of `plan` on `hardware`. Bytes per rank; seconds."""

    plan: ParallelPlan
    hardware: Hardware
    comm_intra_bytes: float
    comm_inter_bytes: float
    bytes_by_kind: dict[str, dict[str, float]]
    seconds_by_kind: dict[str, float]
    compute_s: float
    step_time_s: float
    offload_parts: dict[str, float] = field(default_factory=dict)

    @property
    def offload_s(self) -> float:
        """Seconds of the step spent on offload (PCIe copies and CPU Adam; 0 without offload)."""
        return self.seconds_by_kind.get("offload", 0.0)

    @property
    def tokens_per_s(self) -> float:
        """Tokens the whole job trains per second: global batch x sequence length / step time. Plans with more
        model parallelism have fewer data-parallel ranks and so a smaller global batch per step: compare plans by
        this, not by step time."""
        return self.plan.global_batch * self.plan.seq_len / self.step_time_s

    @property
    def exposed_zero_s(self) -> float:
        return max(0.0, self.seconds_by_kind.get("zero", 0.0) - self.compute_s)

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}
        out["hardware"] = asdict(self.hardware)
        return {**out, "tokens_per_s": self.tokens_per_s, "offload_s": self.offload_s}


def offload_parts(plan: ParallelPlan, optimizer_elements: int, param_elements: int, hw: Hardware) -> dict[str, float]:
    """Seconds per optimizer step that offload adds, by part (empty without offload); see the module docstring.
    `optimizer_elements`: the rank's optimizer (= fp32 gradient) partition; `param_elements`: its parameter
    partition.
    - "gradient copies": ZeRO-3 (stage3.py `partition_grads`) keeps the fp32 gradient partition in pinned host
      memory. Micro step 0 copies the reduced partition down and back up (`grad_buffer.copy_`, then
      `grad_buffer.to(device)`); every later micro step brings it up, adds the new partition on the GPU and copies
      the sum down ("adding directly to cpu is very slow"); the last micro step also copies it into the
      optimizer's fp32 gradient on the host (`_offload_grad_partition_at_boundary`): 4 x (2 x accumulation + 1)
      bytes per element over PCIe. ZeRO-1/2 (`async_accumulate_grad_in_cpu_via_gpu`) round-trip alike.
    - "parameter copies": the updated parameter partition back to the GPU once per step (stage3.py
      `_reassign_or_swap_out_partitioned_parameters`, a blocking copy that converts on the host, so 2 bytes under
      bf16); under parameter offload instead the partition comes up before every gather (forward, backward,
      recomputation) of every micro step.
    - "CPU Adam": the node's CPUs update the optimizer partitions of its `procs_per_node` ranks once per step."""
    if not plan.offload_optimizer:
        return {}
    pcie = hw.pcie_gbps * GB
    width = 4 if plan.precision == "fp32" else 2
    grads = optimizer_elements * 4 * (2 * plan.grad_accum + 1)
    if plan.offload_params:
        gathers = (3 if plan.activation_checkpointing else 2) * plan.grad_accum
        params = param_elements * width * gathers
    else:
        params = param_elements * width
    return {
        "gradient copies": grads / pcie,
        "parameter copies": params / pcie,
        "CPU Adam": optimizer_elements * plan.procs_per_node / hw.cpu_adam_params_per_s,
    }


def step_estimate(
    plan: ParallelPlan,
    model: ModelShape,
    hardware: Hardware | str = "h100",
    *,
    hpz: int = 1,
    vocab_parallel: bool = False,
    elements=None,
) -> StepEstimate:
    """Traffic and step time of `plan` on `hardware` (a `Hardware` or a key of HARDWARE). `hpz`, `vocab_parallel`:
    as `traffic`. `elements`: the `elements.RankElements` of the plan, for the offload term (computed when not
    given)."""
    hw = HARDWARE[hardware] if isinstance(hardware, str) else hardware
    t = traffic(plan, model, hpz=hpz, vocab_parallel=vocab_parallel)
    seconds = {kind: t.seconds(kind, hw) for kind in sorted(set(t.intra) | set(t.inter))}
    offload: dict[str, float] = {}
    if plan.offload_optimizer:
        if elements is None:
            elements = rank_elements(plan, model)
        offload = offload_parts(plan, elements.optimizer, elements.params, hw)
        seconds["offload"] = sum(offload.values())
    compute = compute_flops(plan, model) / (hw.gpu_tflops * 1e12 * hw.compute_efficiency)
    step = (
        max(compute, seconds.get("zero", 0.0))
        + seconds.get("tp", 0.0)
        + seconds.get("ep", 0.0)
        + seconds.get("sp", 0.0)
        + seconds.get("offload", 0.0)
    )
    kinds = {"intra": dict(t.intra), "inter": dict(t.inter)}
    return StepEstimate(
        plan=plan,
        hardware=hw,
        comm_intra_bytes=sum(t.intra.values()),
        comm_inter_bytes=sum(t.inter.values()),
        bytes_by_kind=kinds,
        seconds_by_kind=seconds,
        compute_s=compute,
        step_time_s=step,
        offload_parts=offload,
    )


def describe(step: StepEstimate) -> str:
    """One line: step time and where it goes."""
    parts = [f"compute {step.compute_s:.2f} s"]
    labels = {
        "zero": "ZeRO gathers/reduce-scatters",
        "tp": "TP all-reduces",
        "ep": "EP all-to-alls",
        "sp": "SP all-to-alls",
        "offload": "optimizer offload",
    }
    for kind, label in labels.items():
        if kind in step.seconds_by_kind and step.seconds_by_kind[kind] > 0:
            hidden = " (hidden behind compute)" if kind == "zero" and step.exposed_zero_s == 0 else ""
            if kind == "offload" and step.offload_parts:
                hidden = " (" + ", ".join(f"{k} {v:.2f} s" for k, v in step.offload_parts.items() if v) + ")"
            parts.append(f"{label} {step.seconds_by_kind[kind]:.2f} s{hidden}")
    return (
        f"{step.step_time_s:.2f} s/step, {step.tokens_per_s:,.0f} tokens/s ({', '.join(parts)}; "
        f"{step.comm_inter_bytes / 1e9:.1f} GB across nodes, {step.comm_intra_bytes / 1e9:.1f} GB inside the node "
        "per rank)"
    )
