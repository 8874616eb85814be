"""DeepSpeed ZeRO-3 buffer sizes for a ParallelPlan, chosen once: the generated JSON (`planning.deepspeed_config`)
writes them, the memory estimate (`memory.estimate`) counts them, and `zero_buffer_notes` says why.

What DeepSpeed 0.19.8 does with each (files under deepspeed/runtime/):
- `stage3_prefetch_bucket_size` (default 5e7 elements) and `stage3_max_live_parameters` (1e9):
  zero/partitioned_param_coordinator.py `_fetch_sub_module_impl` (lines 452-472) gathers the current module, walks the
  recorded parameter trace and issues gathers while `numel_prefetching < min(max_live - available, bucket)`.
  The first tensor is admitted whatever its size, so a tensor larger than the bucket is still prefetched when it
  comes first; but nothing more is prefetched while the gathered elements (`available`) exceed max_live, and a
  DeepSeek-V3 MoE layer's experts alone (1.1e10 elements at EP 1, 1.4e9 at EP 8) exceed the 1e9 default: the
  next layer's attention is then fetched on demand, and the experts' gather starts one module (the router) ahead
  of its use, since the 5e7 window is smaller than one attention projection (o_proj: 1.2e8).
  Chosen here: bucket = M, the largest module a rank gathers after TP/EP (`elements.rank_elements`), so the window
  reaches a whole module ahead; max_live = 2 x M, room for the module computing and the next one prefetching.
  Never below DeepSpeed's defaults. Memory: at most max(max_live, M) + T elements are gathered at once (T: the
  largest tensor; the loop admits one past the limit), and never more than the rank's share of the model.
- `stage3_param_persistence_threshold` (1e5): tensors this small are never partitioned; left at the default.
- `reduce_bucket_size` (5e8): zero/stage3.py `_setup_for_real_optimizer` allocates one bucket of this many
  elements in the communication dtype (bf16 under bf16) when `contiguous_gradients`; `__add_grad_to_ipg_bucket`
  copies each gradient in, and `__avg_scatter_grads` -> comm/coalesced_collectives.py `reduce_scatter_coalesced`
  makes an interleaved flat copy (torch.cat) of the bucket before the reduce-scatter. Written at the default.
- `sub_group_size` (1e9): zero/stage3.py `_create_fp16_sub_groups` cuts each optimizer parameter group into
  sub-groups of at least this many partitioned elements; `_prepare_fp32_grad_for_sub_group` flattens one
  sub-group's fp32 gradient partitions into a new tensor for the optimizer step on the GPU (not under optimizer
  offload). Written at the default.
- `zero_hpz_partition_size` (ZeRO++ hpZ, Wang et al. 2023, arXiv:2306.10209 section 3.2): zero/partition_parameters.py
  `_partition_param_sec` keeps a second copy of each parameter partitioned over hpz consecutive ranks
  (`utils/groups.py _create_zero_param_parallel_group`), and `all_gather_coalesced` gathers from it inside the node
  once the forward gather has made it; it costs numel / hpz elements per rank. Set to the GPUs per node for
  multi-node ZeRO-3 plans where DeepSpeed allows it and the copy is small (HPZ_MAX_SECONDARY_BYTES). Not with
  AutoEP: engine.py `_validate_zero3_moe_compatibility` raises ("AutoEP with ZeRO Stage 3 does not support hpZeRO
  secondary tensor groups yet"). Not with AutoTP: DeepSpeed does not refuse it, but the hpZ group is consecutive
  global ranks whatever the parameter's own partition group, so its members hold different TP shards and the
  secondary gather would splice them. Not with parameter offload: the copy would live in host memory
  (`remote_device`), leaving no fast intra-node gather to gain. Checked on 4 CPU ranks (hpz 2, tiny Llama with
  every tensor partitioned): the backward pass reads the secondary copies and the losses equal a run without hpZ.
  `zero.Init` creates the hpZ group without asking whether it exists (partition_parameters.py `Init.__init__`
  -> groups.py asserts "ZeRO parameter intra parallel group is already initialized"), so a second model build in
  one process under the same config (the Trainer's `model_init`, called again by `train()`) would stop there;
  RecipeTrainer forgets the group before each build (`_compat.deepspeed.forget_zero_hpz_group`).
- `tensor_parallel.vocab_parallel_lm_head`: engine.py `_apply_autotp_partitioning` (lines 1057-1100) with an
  explicit `partition_config` replaces `lm_head` by module_inject/layers.py `VocabParallelLinear` (column split,
  no gather) and installs sequence/cross_entropy.py `VocabParallelCausalLMLoss` as the model's `loss_function`,
  which reduces the max, the sum of exponentials and the target logit over the TP group (three s x b vectors)
  instead of all-gathering s x b x V logits; each TP rank then holds V / TP of the logits. It raises if no
  nn.Linear `lm_head` exists. Cost: `outputs.logits` is the rank's vocabulary shard, so code that reads logits
  (label smoothing, compute_metrics, generate) sees a slice. Written when TP > 1 and it saves at least
  VOCAB_PARALLEL_MIN_SAVING_BYTES of logits per GPU. Checked on CPU under ZeRO-3 with RecipeTrainer: tiny Llama at
  TP 2 (2 ranks) and tiny DeepSeek-V3 at TP 2 + EP 2 (4 ranks) give the gathered head's losses within 5e-7 over
  6 steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hf_dist_recipes.core.sizes import GIB
from hf_dist_recipes.environment.alloc_defaults import ALLOC_CONF, ALLOC_CONF_VARIABLE
from hf_dist_recipes.planning.elements import PRECISION_BYTES, head_logits_bytes, rank_elements
from hf_dist_recipes.planning.models import ModelShape
from hf_dist_recipes.planning.plan import ParallelPlan

# DeepSpeed 0.19.8 defaults (runtime/zero/config.py DeepSpeedZeroConfig), in elements.
DEFAULT_PREFETCH_BUCKET = 50_000_000
DEFAULT_MAX_LIVE_PARAMETERS = 1_000_000_000
DEFAULT_REDUCE_BUCKET = 500_000_000
DEFAULT_SUB_GROUP = 1_000_000_000
# hpZ's second copy of the parameters may take at most this much of each GPU: a tenth of an 80 GB H100. Above it
# the memory is worth more to the plan (a larger micro batch, no offload) than intra-node backward gathers.
HPZ_MAX_SECONDARY_BYTES = 8 * GIB
# Logit bytes per GPU (`elements.head_logits_bytes`) the vocabulary-parallel head must save before it is worth sharded
# `outputs.logits`: 1 GiB. Below it the saving is inside the estimate's 2 GiB allowance, and the all-gather it
# avoids (at most 1 GiB per micro step, over NVLink) costs milliseconds.
VOCAB_PARALLEL_MIN_SAVING_BYTES = 1 * GIB


@dataclass(frozen=True)
class ZeroBuffers:
    """The ZeRO settings the generated JSON writes for a plan, in elements (see the module docstring).
    `gathered_module` / `gathered_elements`: the largest module a rank gathers (after TP/EP) and its size;
    `largest_tensor`: the largest single tensor a rank gathers; `hpz_secondary_elements`: hpZ's second copy per
    rank (0 without hpZ). `written`: False when the values are DeepSpeed's defaults, not written to the JSON."""

    prefetch_bucket_size: int = DEFAULT_PREFETCH_BUCKET
    max_live_parameters: int = DEFAULT_MAX_LIVE_PARAMETERS
    reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET
    sub_group_size: int = DEFAULT_SUB_GROUP
    hpz_partition_size: int = 1
    vocab_parallel_lm_head: bool = False
    gathered_module: str = ""
    gathered_elements: int = 0
    largest_tensor: int = 0
    hpz_secondary_elements: int = 0
    written: bool = False

    def live_parameter_elements(self, sharded: int) -> int:
        """The most parameter elements gathered at once (module docstring), capped by the rank's `sharded` share of
        the model (the parameters after TP/EP, before ZeRO)."""
        return min(max(self.max_live_parameters, self.gathered_elements) + self.largest_tensor, sharded)


def zero_buffers(plan: ParallelPlan, model: ModelShape | None) -> ZeroBuffers:
    """The buffer sizes for `plan` (DeepSpeed's defaults below ZeRO-3 or without a model)."""
    if model is None:
        return ZeroBuffers()
    vocab_parallel = use_vocab_parallel_lm_head(plan, model)
    if plan.zero_stage != 3:
        return ZeroBuffers(vocab_parallel_lm_head=vocab_parallel)
    el = rank_elements(plan, model)
    hpz = hpz_partition_size(plan, model)
    secondary = sum(math.ceil(math.prod(shape) / hpz) for _, shape in model.parameters) if hpz > 1 else 0
    return ZeroBuffers(
        prefetch_bucket_size=max(DEFAULT_PREFETCH_BUCKET, el.gathered_layer),
        max_live_parameters=max(DEFAULT_MAX_LIVE_PARAMETERS, 2 * el.gathered_layer),
        hpz_partition_size=hpz,
        vocab_parallel_lm_head=vocab_parallel,
        gathered_module=el.gathered_module,
        gathered_elements=el.gathered_layer,
        largest_tensor=el.largest_tensor,
        hpz_secondary_elements=secondary,
        written=True,
    )


def _hpz_refusal(plan: ParallelPlan) -> str | None:
    """Why hpZ is not used for `plan` on grounds other than its size (None: it may be)."""
    if plan.zero_stage != 3:
        return "it partitions parameters, which only ZeRO-3 does"
    if plan.nodes == 1 or plan.procs_per_node == 1:
        return "every gather already stays inside one node" if plan.nodes == 1 else "one GPU per node has no peer"
    if plan.ep > 1:
        return "DeepSpeed 0.19.8 refuses it with AutoEP (engine.py _validate_zero3_moe_compatibility)"
    if plan.tp > 1:
        return "under AutoTP its consecutive-rank groups would mix TP shards (DeepSpeed does not check)"
    if plan.offload_params:
        return "under parameter offload its copy would sit in host memory"
    return None


def hpz_partition_size(plan: ParallelPlan, model: ModelShape | None = None) -> int:
    """ZeRO++ hpZ partition size for `plan` (1: off). `model` decides whether the second copy is small enough
    (HPZ_MAX_SECONDARY_BYTES); without it the size rule is not applied, so pass it wherever the model is known."""
    if _hpz_refusal(plan) is not None:
        return 1
    # The secondary copy: every parameter over the node's ranks, in the training precision.
    secondary = math.ceil(model.total_params / plan.procs_per_node) * PRECISION_BYTES[plan.precision] if model else 0
    if secondary > HPZ_MAX_SECONDARY_BYTES:
        return 1
    return plan.procs_per_node


def vocab_parallel_saving_bytes(plan: ParallelPlan, model: ModelShape) -> int:
    """Logit bytes per GPU the vocabulary-parallel head saves against the gathered one (0 at TP 1)."""
    if plan.tp == 1:
        return 0
    return head_logits_bytes(plan, model, vocab_parallel=False) - head_logits_bytes(plan, model, vocab_parallel=True)


def use_vocab_parallel_lm_head(plan: ParallelPlan, model: ModelShape) -> bool:
    """Whether the generated JSON turns on DeepSpeed's vocabulary-parallel LM head (module docstring); never with the
    chunked loss (`plan.loss_chunk_tokens`), which needs the whole vocabulary's logits of each chunk and refuses it."""
    if plan.loss_chunk_tokens:
        return False
    return plan.engine == "deepspeed" and vocab_parallel_saving_bytes(plan, model) >= VOCAB_PARALLEL_MIN_SAVING_BYTES


def recommended_env(plan: ParallelPlan, model: ModelShape | None = None) -> dict[str, str]:
    """Environment variables worth setting for `plan`'s launch. `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`
    on CUDA under ZeRO-3 or for a mixture-of-experts model: the gathered modules, the per-expert token batches and
    the all-to-all buffers change size from one allocation to the next, which fragments PyTorch's caching
    allocator into blocks too small to reuse; expandable segments grow one mapping per stream instead."""
    if plan.device != "cuda" or not (plan.zero_stage == 3 or (model is not None and model.is_moe)):
        return {}
    return {ALLOC_CONF_VARIABLE: ALLOC_CONF}


def _e(n: int) -> str:
    """5e7, 1.41e9: how DeepSpeed's documentation writes element counts."""
    if n < 1000:
        return str(n)
    exp = int(math.floor(math.log10(n)))
    return f"{n / 10**exp:.3g}e{exp}"


def zero_buffer_notes(plan: ParallelPlan, model: ModelShape | None) -> list[str]:
    """One short line per choice of `zero_buffers`, with its reason, for the generated file's header."""
    b = zero_buffers(plan, model)
    lines: list[str] = []
    if b.written:
        lines += [
            f"stage3_prefetch_bucket_size {_e(b.prefetch_bucket_size)} = {b.gathered_module}, the largest gather: "
            f"prefetched whole (default {_e(DEFAULT_PREFETCH_BUCKET)})",
            f"stage3_max_live_parameters {_e(b.max_live_parameters)} = 2 x that: one module computing, the next one "
            f"prefetching (default {_e(DEFAULT_MAX_LIVE_PARAMETERS)})",
            f"reduce_bucket_size {_e(b.reduce_bucket_size)}, sub_group_size {_e(b.sub_group_size)}: DeepSpeed's "
            "defaults, written so the memory estimate counts them",
        ]
    if plan.zero_stage == 3 and model is not None:
        if b.hpz_partition_size > 1:
            secondary = b.hpz_secondary_elements * PRECISION_BYTES[plan.precision]
            lines.append(
                f"zero_hpz_partition_size {b.hpz_partition_size}: a node-local copy of the parameters "
                f"({secondary / GIB:.1f} GiB/GPU) keeps backward gathers in the node"
            )
        elif plan.nodes > 1:
            why = _hpz_refusal(plan) or f"its copy would take more than {HPZ_MAX_SECONDARY_BYTES / GIB:.0f} GiB per GPU"
            lines.append(f"no zero_hpz_partition_size: {why}")
    if plan.tp > 1 and model is not None:
        saving = vocab_parallel_saving_bytes(plan, model)
        if b.vocab_parallel_lm_head:
            lines.append(
                f"vocab_parallel_lm_head: each TP rank keeps 1/{plan.tp} of the {model.vocab_size}-wide "
                f"logits, {saving / GIB:.1f} GiB less; outputs.logits is a shard"
            )
        else:
            lines.append(
                f"no vocab_parallel_lm_head: it would save {saving / GIB:.2f} GiB per GPU "
                f"(< {VOCAB_PARALLEL_MIN_SAVING_BYTES / GIB:.0f} GiB), not worth sharded outputs.logits"
            )
    env = recommended_env(plan, model)
    if env:
        lines.append(
            f"PYTORCH_CUDA_ALLOC_CONF={env['PYTORCH_CUDA_ALLOC_CONF']}: gathers and expert batches vary in "
            "size and fragment memory"
        )
    return lines
