"""Where each parameter lands and how many elements a rank holds: the counting layer under the memory estimate
(`memory`), the ZeRO-3 buffer sizes (`zero_buffers`) and the traffic model (`planning.comm`), which all read it and
which it imports none of; and a plan's checkpoint bytes (`plan_save_bytes`). The placement rules (TP/EP splits,
ZeRO groups) are stated in `memory`'s module docstring."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hf_dist_recipes.parallel.checkpoint_bytes import (
    DEFAULT_SHARD_BYTES,
    ENGINE_BYTES_PER_ELEMENT,
    PRECISION_BYTES,
    SaveBytes,
    save_bytes,
)
from hf_dist_recipes.planning.models import ModelShape, component_of
from hf_dist_recipes.planning.plan import ParallelPlan
from hf_dist_recipes.planning.tp_specs import partition_config, tp_split_dim

BYTES_PER_ELEMENT = {"bf16": (2, 4, 12), "fp16": (2, 4, 12), "fp32": (4, 4, 8)}  # parameter, gradient, optimizer
LOGIT_BYTES = 12  # per logit element, gathered head (`memory` module docstring)
VOCAB_PARALLEL_LOGIT_BYTES = 14  # per local logit element, DeepSpeed's vocabulary-parallel head


@dataclass(frozen=True)
class RankElements:
    """Elements one rank holds. `sharded`: parameter elements after TP/EP, before ZeRO. `gathered_layer`: the
    largest module a rank gathers under ZeRO-3 (`gathered_module`, 0 / "" below stage 3); `largest_tensor`: the
    largest single tensor after TP/EP; `largest_partition`: the largest per-rank optimizer partition of one."""

    params: int
    grads: int
    optimizer: int
    gathered_layer: int
    sharded: int
    gathered_module: str = ""
    largest_tensor: int = 0
    largest_partition: int = 0


def bytes_per_element(plan: ParallelPlan) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per partitioned element of `plan`. DeepSpeed's ZeRO optimizers keep
    an fp32 master partition of their own even when the parameters are fp32 (0.19.8 stage3.py
    `_create_fp32_partitions`, stage_1_and_2.py: `.clone().float()`): 12 optimizer bytes at every precision, as a real
    fp32 run's buffers show (tests/distributed/test_offload_autoep.py); elsewhere fp32's parameter is the master."""
    p_bytes, g_bytes, o_bytes = BYTES_PER_ELEMENT[plan.precision]
    if plan.engine == "deepspeed" and plan.zero_stage >= 1:
        o_bytes = ENGINE_BYTES_PER_ELEMENT
    return p_bytes, g_bytes, o_bytes


def placements(plan: ParallelPlan, model: ModelShape) -> list[tuple[str, int, list[int], str]]:
    """Where each parameter lands, by the rules of `memory`'s module docstring: (name, elements on a rank after TP/EP,
    the tensors ZeRO partitions them as, ZeRO group "dp" | "edp" | "world"). The one place these rules live:
    `rank_elements` and the traffic model (`planning.comm.zero_groups`) both read them."""
    autotp = None
    if plan.tp > 1:
        from deepspeed.module_inject.autotp_config import AutoTPConfig

        autotp = AutoTPConfig.from_dict(partition_config(model.model_type))
    out = []
    for name, shape in model.parameters:
        numel = math.prod(shape)
        component = component_of(name)
        pieces, group = [numel], "dp"
        if component in ("routed_experts", "router") and plan.ep > 1:
            group = "edp"
            if component == "routed_experts":
                numel //= plan.ep
                # AutoEP stores the fused gate_up_proj as two tensors (w1, w3)
                pieces = [numel // 2, numel // 2] if name.endswith("gate_up_proj") else [numel]
        elif autotp is not None and tp_split_dim(name, shape, autotp) is not None:
            numel //= plan.tp
            pieces = [numel]
        elif plan.zero_init:
            group = "world"
        out.append((name, numel, pieces, group))
    return out


def rank_elements(plan: ParallelPlan, model: ModelShape) -> RankElements:
    """Exact per-rank element counts of parameters, gradients and optimizer states for `plan` (rank 0; ranks
    differ only by ZeRO padding, at most one element per tensor)."""
    group_sizes = {"dp": plan.zero_dp_size, "edp": plan.edp_size, "world": plan.world_size}
    params = grads = optimizer = sharded = largest_tensor = largest_partition = 0
    per_module: dict[str, int] = {}
    for name, numel, pieces, kind in placements(plan, model):
        group = group_sizes[kind]
        sharded += numel
        module = name.rsplit(".", 1)[0]
        per_module[module] = per_module.get(module, 0) + numel
        partitioned = sum(math.ceil(p / group) for p in pieces)
        params += partitioned if plan.zero_stage == 3 else numel
        grads += partitioned if plan.zero_stage >= 2 else numel
        optimizer += partitioned if plan.zero_stage >= 1 else numel
        largest_tensor = max(largest_tensor, *pieces)
        largest_partition = max(
            largest_partition, *(math.ceil(p / group) if plan.zero_stage >= 1 else p for p in pieces)
        )
    module = max(per_module, key=per_module.get) if plan.zero_stage == 3 else ""
    return RankElements(
        params=params,
        grads=grads,
        optimizer=optimizer,
        gathered_layer=per_module[module] if module else 0,
        sharded=sharded,
        gathered_module=module,
        largest_tensor=largest_tensor,
        largest_partition=largest_partition,
    )


def head_logits_bytes(plan: ParallelPlan, model: ModelShape, *, vocab_parallel: bool) -> int:
    """Bytes of the logits and the loss over them, per rank, for a gathered head or (`vocab_parallel`, TP > 1)
    DeepSpeed's vocabulary-parallel one (`memory` module docstring, logits)."""
    tokens = plan.tokens_per_rank * plan.micro_batch
    if vocab_parallel and plan.tp > 1:
        return tokens * math.ceil(model.vocab_size / plan.tp) * VOCAB_PARALLEL_LOGIT_BYTES
    return tokens * model.vocab_size * LOGIT_BYTES


def plan_save_bytes(plan: ParallelPlan, model: ModelShape, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> SaveBytes:
    """`parallel.checkpoint_bytes.save_bytes` for a parallel plan: the partition of the busiest rank from the exact
    counts of `rank_elements`; below ZeRO-3 the TP-local weights in `*_model_states.pt`."""
    el = rank_elements(plan, model)
    model_states = 0 if plan.zero_stage == 3 else el.sharded * PRECISION_BYTES[plan.precision]
    # Below ZeRO-3 only data-parallel rank 0 of each TP rank writes model states: per rank the busiest, in total tp.
    out = save_bytes(
        model.total_params,
        plan.world_size,
        precision=plan.precision,
        max_shard_bytes=max_shard_bytes,
        engine_elements_per_rank=el.optimizer if plan.zero_stage >= 1 else el.sharded,
        model_states_per_rank=model_states,
    )
    if model_states:
        total = out.engine_total - model_states * plan.world_size + model_states * plan.tp
        out = SaveBytes(out.world_size, out.engine_per_rank, total, out.hf_per_rank, out.hf_total)
    return out
