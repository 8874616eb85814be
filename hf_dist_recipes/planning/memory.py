"""Per-rank memory of a ParallelPlan on a GPU: exact for model states, a stated estimate for everything else.

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

Bytes per element: bf16/fp16 -- parameter 2, gradient 4, optimizer 12 (fp32 master copy + Adam's two moments);
fp32 -- 4, 4, 12 (DeepSpeed's ZeRO keeps an fp32 master partition of its own: `elements.bytes_per_element`; 8
without ZeRO). Gradients take 4 bytes under bf16/fp16 because the generated JSON accumulates them in fp32
(`"data_types": {"grad_accum_dtype": "fp32"}`): DeepSpeed's engine.py `get_data_types` hands that dtype to the
ZeRO optimizer, and stage3.py `_setup_for_real_optimizer` allocates the gradient partitions
(`grad_partitions_flat_buffer`) in it (ZeRO-1: bf16_optimizer.py `fp32_groups_gradients_flat`; ZeRO-2:
stage_1_and_2.py's fp32 partitions). Optimizer offload moves optimizer states and gradient partitions to host RAM
(stage3.py: `self.device` is the CPU), parameter offload the parameters.

DeepSpeed's own estimator (stage3.py `estimate_zero3_model_states_mem_needs`) counts the same 18 bytes per
partitioned parameter (2 + 4 + 12) plus 4 bytes x the largest layer, which are our `gathered` (2) and
`buffers["gathered_grads"]` (2); tests/unit/test_memory.py holds the two side by side.

ZeRO-3 buffers, in elements from `zero_buffers.zero_buffers` (the same values the generated JSON writes):
- gathered: the largest module after TP/EP, whole, at parameter bytes (partitioned_param_coordinator.py
  `fetch_sub_module`: a module's parameters are gathered before it runs).
- buffers["prefetched_params"]: what else is gathered ahead of use: the live-parameter budget, at most
  max(stage3_max_live_parameters, gathered) + the largest tensor, capped by the rank's share of the model, less
  the module computing (partitioned_param_coordinator.py `_fetch_sub_module_impl`, see zero_buffers).
- buffers["gathered_grads"]: the full-size gradient of the gathered module, at compute bytes: autograd makes it
  whole, and stage3.py `__reduce_and_partition_ipg_grads` refuses a gradient whose numel is not `ds_numel`.
- buffers["reduce_bucket"] (persistent): reduce_bucket_size elements at compute bytes (stage3.py
  `_setup_for_real_optimizer`, under `contiguous_gradients`, which the generated JSON sets).
- buffers["reduce_copy"]: the interleaved copy runtime/comm/coalesced_collectives.py `reduce_scatter_coalesced`
  makes of a bucket before reducing it: min(reduce_bucket_size, the rank's share of the model) elements, in the
  reduction dtype (`plan.grad_reduce_dtype`, the JSON's `communication_data_type`); when that differs from the
  compute dtype (fp32 reduction of bf16 gradients, the default) stage3.py `__avg_scatter_grads` first converts
  each gradient of the bucket (`g.to(communication_data_type)`), and both copies are alive during the collective:
  4 + 4 bytes per element instead of 2.
- buffers["subgroup_fp32_grads"] (at the optimizer step): stage3.py `_prepare_fp32_grad_for_sub_group` flattens one
  optimizer sub-group's fp32 gradient partitions into a new tensor: min(sub_group_size + the largest partition,
  the rank's optimizer partition) x 4 bytes; on the GPU only without optimizer offload.
- buffers["hpz_secondary"] (persistent): ZeRO++ hpZ's second copy of the parameters, each tensor / GPUs per node
  at parameter bytes (partition_parameters.py `_partition_param_sec`), where zero_buffers turns hpZ on.
Stages 0-2 are counted without buffers (their gradient buckets are of the same order; not modelled).

Activations (an estimate), bytes per token per layer: what autograd keeps for the backward pass in the
transformers 5.24 modeling code, at compute bytes c (2 for bf16/fp16, 4 for fp32); t = TP, which splits head- and
intermediate-wide tensors (sequence parallelism: below). Checked on CPU by summing the storages autograd saves in one
decoder layer (tests/unit/test_memory.py), with a stand-in attention kernel that keeps what FlashAttention keeps.
- norm(w) = (4 + 2c)*w + 4: RMSNorm (`DeepseekV3RMSNorm`, alike in Llama, Qwen, Mixtral) keeps its fp32 input,
  the normalised values before the weight (for the weight's gradient), its output, and a 4-byte 1/rms.
- attention, MLA (modeling_deepseek_v3.py `DeepseekV3Attention`): norm(h) + norm(q_lora_rank) (none when
  q_lora_rank is None) + norm(kv_lora_rank) + c*heads*(2*(qk_nope + qk_rope) + (qk_nope + v_head) + v_head)/t:
  the query and the key per head after RoPE, the value (a view of kv_b_proj's output, which stays alive whole),
  and the attention output (o_proj's input). DeepSeek-V3 at bf16: 270,348 bytes per token, 2.9 x the 13*h of
  the dense formula (Korthikanti et al. 2022, "Reducing Activation Recomputation", attention without the score
  terms), because 128 heads x 192 = 24,576 > h = 7,168. FlashAttention-2 pads the value to the query's width
  (integrations/flash_attention.py), a little more; SDPA (transformers' default) does not.
- attention, other models: norm(h) + c*(heads + 2*kv_heads)*head_dim/t (query, key, value; K/V heads split over
  min(t, kv_heads)) + c*heads*head_dim/t (output). Scores are not stored (SDPA/flash kernels; eager attention
  would add heads x s^2 per sequence); the kernel's logsumexp and Qwen3's per-head q/k norms are not counted.
- dense MLP (SwiGLU): norm(h) + 4*c*I/t: gate output, its SiLU, up output, and their product (down_proj's input).
  Tiled (`plan.tiled_mlp_shards` = n, `parallel.tiled_mlp`): the forward runs without autograd and keeps only its
  input (the norm's output, counted), so 4*c*I/t leaves every layer's bytes, as do the shared experts' 4*c*I_s/t;
  in the backward pass one slice at a time is recomputed with autograd: `mlp_slice` = ceil(tokens / n) x 4*c*max(I,
  I_s)/t, plus the input's gradient the slices fill, c*h per token, both for the one layer in its backward pass.
- MoE layer: norm(h) + 4*h (DeepSeek's router multiplies an fp32 copy of its input: `DeepseekV3TopkRouter`)
  + c*k*(2*h + 4*I_e) (dispatch: each token's copy for each of its k experts, the expert's four I_e-wide tensors,
  and the expert output that the routing weight scales: `DeepseekV3Experts`) + 4*c*I_s/t (shared experts, width
  I_s). The router's E-wide scores and index tensors are not counted (0.4 % of a DeepSeek-V3 MoE layer). With
  EP > 1 a rank's experts take their tokens from every EP peer: the routed part is sized for the busiest rank,
  f = `routing_imbalance` times the mean (DEFAULT_ROUTING_IMBALANCE, measured); AutoEP's all-to-all send and
  receive copies, (1 + f)*c*k*h per token, once for the layer in flight (not measured: AutoEP needs several ranks).
- sequence parallelism (Ulysses, SP > 1): every term counts the tokens a rank holds, seq_len / sp per sequence
  (`plan.tokens_per_rank`): outside attention a rank holds its slice of the sequence, and inside it the whole
  sequence for heads / sp heads, the same bytes ([s, heads/sp, d] = [s/sp, heads, d]). `sp_exchange`: one layer's
  all-to-all send and receive copies of query, key, value and output, 2 x c x `models.ulysses_exchange_elements`
  per token (MLA's value and output at the query/key width: RecipeTrainer pads the value heads); the attention term
  above keeps MLA's unpadded widths (the padded value adds c x heads x (qk - v) per token and layer).
- layers: without activation checkpointing, every layer's bytes; with it, each layer's input (c*h per token,
  torch.utils.checkpoint) plus the largest layer in full during its recomputation.
- logits (`logits_bytes`): s*b*V*12 bytes: during the loss's backward three fp32 tensors of the logits' shape are
  alive at once (the log-probabilities `log_softmax` saved, their gradient from `nll_loss`, and log_softmax's
  input gradient); the forward peak is lower (bf16 logits + the fp32 copy `ForCausalLMLoss` makes with
  `logits.float()` + the log-probabilities = 10 bytes). With DeepSpeed's vocabulary-parallel head each TP rank
  holds s*b*V/t logits at 14 bytes (sequence/cross_entropy.py `_VocabParallelCrossEntropy`: the logits, their fp32
  copy, the shifted copy and the saved exponentials).
  With the chunked loss (`plan.loss_chunk_tokens`, `chunked_logits_bytes`): the same 12 bytes, for one chunk of
  min(loss_chunk_tokens, s*b) tokens: each chunk's head + cross-entropy runs under activation checkpointing, so
  its logits are freed after its forward and recomputed alone in its backward (`parallel.chunked_loss`; measured
  on CPU: benchmarks/chunked_loss_memory.py). The model's own b x V logits of the last position
  (`logits_to_keep=1`) are left out (0.01 % of a chunk of 4,096 tokens at micro batch 3).

Phases: the ZeRO-3 gathers, gradient buffers and activations peak in the backward pass; the sub-group copy at the
optimizer step, when activations are gone. device_total = model states on the GPU + persistent buffers
+ max(backward peak, step peak) + allowance.

Host memory per node (CUDA plans): `host_memory` (the offloaded states, each rank's process, the resume's peak).

Headroom: a plan `fits` when device_total is at most `device_target` of the GPU (90 % by default where a plan is
chosen or written: `config estimate --suggest`, `config generate`; `--memory-target`), for what the estimate does
not see (uneven routing beyond the imbalance counted, allocator spikes, a longer batch), and its resume peak fits
the host.

Allowance (CUDA plans; a stated margin, not a measurement): ALLOWANCE_FIXED_BYTES (2 GiB) for the CUDA context and
kernels, cuBLAS workspaces and NCCL's buffers for the data-, tensor- and expert-parallel communicators, plus
FRAGMENTATION_FRACTION (10 %) of the transient peak for the caching allocator's rounding and fragmentation
(`zero_buffers.recommended_env` recommends `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, which keeps
fragmentation lower). It replaces the former 10 % of device memory held back (USABLE_FRACTION is now 1).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from hf_dist_recipes.core.sizes import GIB
from hf_dist_recipes.planning.comm import ulysses_exchange_elements
from hf_dist_recipes.planning.elements import (
    LOGIT_BYTES,
    PRECISION_BYTES,
    RankElements,
    bytes_per_element,
    head_logits_bytes,
    rank_elements,
)
from hf_dist_recipes.planning.host_memory import host_bytes_per_node, subgroup_copy_bytes
from hf_dist_recipes.planning.models import ModelShape
from hf_dist_recipes.planning.plan import ParallelPlan, grad_reduce_bytes
from hf_dist_recipes.planning.zero_buffers import use_vocab_parallel_lm_head, zero_buffers

NORM_FP32_BYTES = 4  # RMSNorm computes in fp32 and keeps its upcast input for the backward pass
ALLOWANCE_FIXED_BYTES = 2 * GIB
FRAGMENTATION_FRACTION = 0.10
USABLE_FRACTION = 1.0  # of the device memory: the context, NCCL and fragmentation are in `allowance` now
# The busiest EP rank's expert load over the mean that the routed and dispatch terms are sized for: the worst step
# of a measured run (benchmarks/results/2026-12-06-expert-imbalance.md: the demo's DeepSeek-V3-style model, EP 2,
# 200 steps; 2.0 with the bias balancer and without it, the early steps after a fresh start; 1.39 / 1.76 on average).
DEFAULT_ROUTING_IMBALANCE = 2.0
DEFAULT_DEVICE_TARGET = 0.9  # where a plan is chosen or written; preflight warns above the same fraction


def _norm_bytes(c: int, width: int) -> int:
    """An RMSNorm over `width`, per token: its fp32 input, the normalised values before the weight (kept for the
    weight's gradient), its output at compute bytes `c`, and one fp32 reciprocal square root."""
    return (NORM_FP32_BYTES + 2 * c) * width + NORM_FP32_BYTES


def _attention_bytes_per_token(plan: ParallelPlan, model: ModelShape) -> float:
    c, t, h = PRECISION_BYTES[plan.precision], plan.tp, model.hidden_size
    if model.is_mla:
        nope, rope, v = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
        norms = _norm_bytes(c, h) + _norm_bytes(c, model.kv_lora_rank)
        if model.q_lora_rank:
            norms += _norm_bytes(c, model.q_lora_rank)
        # query and key after RoPE; the value is a view of kv_b_proj's output, which it keeps whole; the output
        return norms + c * model.num_heads * (2 * (nope + rope) + (nope + v) + v) / t
    d, kv_split = model.head_dim, min(t, model.num_kv_heads)
    return _norm_bytes(c, h) + c * d * (2 * model.num_heads / t + 2 * model.num_kv_heads / kv_split)


def _imbalance(plan: ParallelPlan, routing_imbalance: float) -> float:
    """The load factor on what a rank's experts process: under EP a rank receives its experts' tokens from every
    EP peer, as many as the busiest rank's share; without EP each rank routes its own tokens to its own copies."""
    if not routing_imbalance >= 1:
        raise ValueError(f"routing imbalance is the busiest EP rank's load / the mean, >= 1; got {routing_imbalance!r}")
    return routing_imbalance if plan.ep > 1 else 1.0


def _mlp_bytes_per_token(
    plan: ParallelPlan, model: ModelShape, moe: bool, routing_imbalance: float = DEFAULT_ROUTING_IMBALANCE
) -> float:
    c, t, h = PRECISION_BYTES[plan.precision], plan.tp, model.hidden_size
    norm = _norm_bytes(c, h)
    gated = 0 if _tiled(plan) else 4 * c / t  # per unit of a gated MLP's width: its four intermediates
    if not moe:
        return norm + gated * model.intermediate_size
    k = model.experts_per_token
    router = NORM_FP32_BYTES * h if model.is_deepseek else 0
    routed = c * k * (2 * h + 4 * model.moe_intermediate_size) * _imbalance(plan, routing_imbalance)
    return norm + router + routed + gated * model.shared_intermediate_size


def _tiled(plan: ParallelPlan) -> bool:
    return (plan.tiled_mlp_shards or 0) >= 2


def mlp_slice_bytes(plan: ParallelPlan, model: ModelShape, tokens: int) -> int:
    """Bytes of one tiled MLP slice in its backward pass (module docstring), for a rank holding `tokens` tokens: 0
    without tiling."""
    if not _tiled(plan):
        return 0
    c, t = PRECISION_BYTES[plan.precision], plan.tp
    width = max(model.intermediate_size if model.num_layers > model.num_moe_layers else 0,
                model.shared_intermediate_size if model.num_moe_layers else 0)  # fmt: skip
    slice_tokens = -(-tokens // plan.tiled_mlp_shards)
    return int(slice_tokens * 4 * c * width / t + tokens * c * model.hidden_size)


def layer_bytes_per_token(
    plan: ParallelPlan, model: ModelShape, *, moe: bool, routing_imbalance: float = DEFAULT_ROUTING_IMBALANCE
) -> float:
    """Activation bytes one decoder layer keeps per token (module docstring): attention plus the dense MLP, or
    plus the MoE block when `moe`, its routed part at `routing_imbalance` under EP."""
    return _attention_bytes_per_token(plan, model) + _mlp_bytes_per_token(plan, model, moe, routing_imbalance)


def chunked_logits_bytes(plan: ParallelPlan, model: ModelShape) -> int:
    """Bytes of the logits and the loss over them under the chunked loss (module docstring): one chunk's tokens x
    the vocabulary x LOGIT_BYTES, the head whole (the chunked loss refuses DeepSpeed's vocabulary-parallel head)."""
    chunk = min(plan.loss_chunk_tokens, plan.tokens_per_rank * plan.micro_batch)
    return chunk * model.vocab_size * LOGIT_BYTES


def logits_bytes(plan: ParallelPlan, model: ModelShape, *, vocab_parallel: bool | None = None) -> int:
    """Bytes of the logits and the loss over them, per rank (module docstring): all of them, or with
    `plan.loss_chunk_tokens` one chunk's (`chunked_logits_bytes`). `vocab_parallel`: whether the LM head is
    DeepSpeed's vocabulary-parallel one (None: what the generated JSON chooses for the plan)."""
    if plan.loss_chunk_tokens:
        return chunked_logits_bytes(plan, model)
    if vocab_parallel is None:
        vocab_parallel = use_vocab_parallel_lm_head(plan, model)
    return head_logits_bytes(plan, model, vocab_parallel=vocab_parallel)


def activation_parts(
    plan: ParallelPlan, model: ModelShape, *, routing_imbalance: float = DEFAULT_ROUTING_IMBALANCE
) -> dict[str, int]:
    """The activation estimate of the module docstring, per rank, in bytes, by part: `layers` (all decoder
    layers, or with checkpointing their inputs), `recomputed_layer` (the largest layer in full, with
    checkpointing), `dispatch` (AutoEP's all-to-all copies, EP > 1), `logits`; with SP > 1 `sp_exchange` (Ulysses'
    copies); with tiled MLPs `mlp_slice` (one slice in its backward pass). `routing_imbalance`: the busiest EP
    rank's expert load over the mean (module docstring)."""
    tokens = plan.tokens_per_rank * plan.micro_batch
    c = PRECISION_BYTES[plan.precision]
    f = _imbalance(plan, routing_imbalance)
    dense = layer_bytes_per_token(plan, model, moe=False)
    moe = layer_bytes_per_token(plan, model, moe=True, routing_imbalance=routing_imbalance)
    n_moe = model.num_moe_layers
    n_dense = model.num_layers - n_moe
    if plan.activation_checkpointing:
        layers = model.num_layers * c * model.hidden_size
        recomputed = max(dense if n_dense else 0, moe if n_moe else 0)
    else:
        layers = n_dense * dense + n_moe * moe
        recomputed = 0
    # The send copy holds the rank's own tokens, the receive copy its experts' share, `f` times the mean.
    dispatch = (1 + f) * c * model.experts_per_token * model.hidden_size if plan.ep > 1 and n_moe else 0
    parts = {
        "layers": int(tokens * layers),
        "recomputed_layer": int(tokens * recomputed),
        "dispatch": int(tokens * dispatch),
        "logits": logits_bytes(plan, model),
    }
    if _tiled(plan):  # one layer's slice in its backward pass
        parts["mlp_slice"] = mlp_slice_bytes(plan, model, tokens)
    if plan.sp > 1:  # one layer's Ulysses send and receive copies (2 x), in flight alone like AutoEP's dispatch
        parts["sp_exchange"] = int(tokens * 2 * c * ulysses_exchange_elements(model, plan.sp))
    return parts


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank by kind, where they live, and whether the device holds its share (`device_bytes` of
    memory per GPU, of which `device_target` is counted as usable) and the node's host memory its resume peak
    (`host_bytes` per node; None: not checked). `host_total_per_node`: the offloaded states of a node;
    `host_steady_per_node` adds each rank's process; `host_resume_peak_per_node` the optimizer files a resume
    loads at once (module docstring). `buffers`: the ZeRO-3 buffers of the module
    docstring by name (persistent: `reduce_bucket`, `hpz_secondary`; backward peak: `prefetched_params`,
    `gathered_grads`, `reduce_copy`; optimizer step: `subgroup_fp32_grads`, 0 when on the host);
    `activation_parts`: `activations` by part; `allowance`: context, NCCL and fragmentation."""

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
    buffers: dict[str, int] = field(default_factory=dict)
    activation_parts: dict[str, int] = field(default_factory=dict)
    allowance: int = 0
    host_steady_per_node: int = 0
    host_resume_peak_per_node: int = 0
    host_bytes: int | None = None
    device_target: float = USABLE_FRACTION

    @property
    def device_fits(self) -> bool | None:
        """Within `device_target` of the GPU; None without `device_bytes`."""
        if self.device_bytes is None:
            return None
        return self.device_total <= self.device_bytes * self.device_target

    @property
    def host_fits(self) -> bool | None:
        """The resume peak within the node's host memory; None without `host_bytes`."""
        if self.host_bytes is None:
            return None
        return self.host_resume_peak_per_node <= self.host_bytes

    @property
    def fits(self) -> bool | None:
        """The device verdict, and the host's where it is known (a plan whose resume cannot fit does not fit)."""
        if self.host_fits is False:
            return False
        return self.device_fits

    @property
    def stock_resume_peak_per_node(self) -> int:
        """The host peak per node of DeepSpeed's stock resume (each rank loads its whole optimizer file), whichever
        resume `host_resume_peak_per_node` was sized for."""
        on_host = self.host_total_per_node // self.plan.procs_per_node
        return host_bytes_per_node(self.plan, on_host, self.optimizer, memory_mapped=False)[1]

    @property
    def other(self) -> int:
        """Bytes of device_total beyond the model states on the GPU, `gathered` and `activations`: the buffers
        that fall in the peak phase and the allowance."""
        on_host = self.host_total_per_node // self.plan.procs_per_node
        moved = on_host - subgroup_copy_bytes(self.plan, self.elements)  # the states that left the GPU
        states = self.params + self.grads + self.optimizer - moved
        return self.device_total - (states + self.gathered + self.activations)

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("plan", "elements")}
        verdicts = {"fits": self.fits, "device_fits": self.device_fits, "host_fits": self.host_fits}
        return {"plan": self.plan.as_dict(), **out, **verdicts, "elements": asdict(self.elements)}


def zero3_buffer_bytes(plan: ParallelPlan, model: ModelShape, el: RankElements) -> dict[str, int]:
    """The ZeRO-3 buffers of the module docstring, in bytes (empty below stage 3)."""
    if plan.zero_stage != 3:
        return {}
    zb = zero_buffers(plan, model)
    c = PRECISION_BYTES[plan.precision]  # parameters, gathered gradients and buckets alike
    subgroup = min(zb.sub_group_size + el.largest_partition, el.optimizer)
    return {
        "prefetched_params": (zb.live_parameter_elements(el.sharded) - el.gathered_layer) * c,
        "gathered_grads": el.gathered_layer * c,
        "reduce_bucket": zb.reduce_bucket_size * c,
        "reduce_copy": min(zb.reduce_bucket_size, el.sharded) * _reduce_copy_bytes(plan),
        "subgroup_fp32_grads": 0 if plan.offload_optimizer else subgroup * 4,
        "hpz_secondary": zb.hpz_secondary_elements * c,
    }


def _reduce_copy_bytes(plan: ParallelPlan) -> int:
    """Bytes per bucket element alive during ZeRO-3's reduce-scatter (module docstring, `reduce_copy`)."""
    reduce = grad_reduce_bytes(plan)
    return reduce if reduce == PRECISION_BYTES[plan.precision] else 2 * reduce


PERSISTENT_BUFFERS = ("reduce_bucket", "hpz_secondary")
BACKWARD_BUFFERS = ("prefetched_params", "gathered_grads", "reduce_copy")
STEP_BUFFERS = ("subgroup_fp32_grads",)


def estimate(
    plan: ParallelPlan,
    model: ModelShape,
    *,
    device_gib: float | None = None,
    host_gib: float | None = None,
    device_target: float = USABLE_FRACTION,
    memory_mapped_resume: bool = True,
    routing_imbalance: float = DEFAULT_ROUTING_IMBALANCE,
) -> MemoryEstimate:
    """Per-rank memory of `plan` for `model`. `device_gib`: memory of one GPU in GiB (None: no fits verdict);
    `device_target`: the fraction of it a plan may fill (1.0; DEFAULT_DEVICE_TARGET where plans are chosen);
    `host_gib`: host memory per node in GiB (None: not checked); `memory_mapped_resume`: the resume maps the
    checkpoint files (RecipeTrainer's, default) or loads them whole (DeepSpeed's stock load);
    `routing_imbalance`: the busiest EP rank's expert load over the mean (DEFAULT_ROUTING_IMBALANCE)."""
    if not 0 < device_target <= 1:
        raise ValueError(f"the memory target is a fraction of the GPU in (0, 1], got {device_target!r}; e.g. 0.9")
    el = rank_elements(plan, model)
    p_bytes, g_bytes, o_bytes = bytes_per_element(plan)
    params, grads, optimizer = el.params * p_bytes, el.grads * g_bytes, el.optimizer * o_bytes
    gathered = el.gathered_layer * p_bytes
    parts = activation_parts(plan, model, routing_imbalance=routing_imbalance)
    activations = sum(parts.values())
    buffers = zero3_buffer_bytes(plan, model, el)
    moved = 0  # off the GPU
    if plan.offload_optimizer:
        moved += optimizer + grads
    if plan.offload_params:
        moved += params
    on_host = moved + subgroup_copy_bytes(plan, el)
    persistent = sum(buffers.get(k, 0) for k in PERSISTENT_BUFFERS)
    backward = activations + gathered + sum(buffers.get(k, 0) for k in BACKWARD_BUFFERS)
    step = sum(buffers.get(k, 0) for k in STEP_BUFFERS)
    transient = max(backward, step)
    allowance = int(ALLOWANCE_FIXED_BYTES + FRAGMENTATION_FRACTION * transient) if plan.device == "cuda" else 0
    device_total = params + grads + optimizer - moved + persistent + transient + allowance
    steady, resume = host_bytes_per_node(plan, on_host, optimizer, memory_mapped_resume)
    return MemoryEstimate(
        plan=plan,
        params=params,
        grads=grads,
        optimizer=optimizer,
        gathered=gathered,
        activations=activations,
        device_total=device_total,
        host_total_per_node=on_host * plan.procs_per_node,
        device_bytes=int(device_gib * GIB) if device_gib else None,
        elements=el,
        buffers=buffers,
        activation_parts=parts,
        allowance=allowance,
        host_steady_per_node=steady,
        host_resume_peak_per_node=resume,
        host_bytes=int(host_gib * GIB) if host_gib else None,
        device_target=device_target,
    )


def fit_word(e: MemoryEstimate) -> str:
    """yes; "host" when the device fits and the resume peak does not fit the host; "tight" when over the target
    but within the GPU; no; "?" without the GPU's memory."""
    if e.device_fits is None:
        return "?"
    if e.device_fits:
        return "host" if e.host_fits is False else "yes"
    within_gpu = e.device_bytes is not None and e.device_total <= e.device_bytes
    return "tight" if within_gpu and e.device_target < 1 else "no"


def layout_label(plan: ParallelPlan) -> str:
    """A plan's layout in a table row: "Z3 TP1 EP16 off:opt"; under SP (TP and EP are 1 there) "Z3 SP8 off:-", with
    "rc" where it recomputes activations, as the SP search of `suggest` may turn recomputation on."""
    off = "+".join(k for k, on in (("opt", plan.offload_optimizer), ("param", plan.offload_params)) if on) or "-"
    if plan.sp > 1:
        return f"Z{plan.zero_stage} SP{plan.sp}{' rc' if plan.activation_checkpointing else ''} off:{off}"
    return f"Z{plan.zero_stage} TP{plan.tp} EP{plan.ep} off:{off}"


def render_table(estimates: list[MemoryEstimate], *, chosen: MemoryEstimate | None = None) -> str:
    """Plain-text table, GiB per rank; host RAM per node (steady, and the resume peak). `other`: ZeRO-3 buffers
    and the allowance."""
    head = (
        f"{'plan':<28} {'params':>8} {'grads':>8} {'optim':>8} {'gather':>8} {'activ':>8} {'other':>8} "
        f"{'total':>8} {'host/node':>10} {'resume':>7} {'fits?':>6}"
    )
    lines = [head, "-" * len(head)]
    for e in estimates:
        label = layout_label(e.plan)
        fits = fit_word(e)
        mark = " <" if chosen is not None and e is chosen else ""
        lines.append(
            f"{label:<28} {e.params / GIB:8.1f} {e.grads / GIB:8.1f} {e.optimizer / GIB:8.1f} {e.gathered / GIB:8.1f} "
            f"{e.activations / GIB:8.1f} {e.other / GIB:8.1f} {e.device_total / GIB:8.1f} "
            f"{e.host_steady_per_node / GIB:10.0f} {e.host_resume_peak_per_node / GIB:7.0f} {fits:>6}{mark}"
        )
    return "\n".join(lines)
