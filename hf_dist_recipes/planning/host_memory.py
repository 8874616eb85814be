"""Host memory per node of a CUDA plan (`memory.estimate` reports it), checked against the node's memory
(`host_bytes`: `--host-memory`, a DGX preset's, or what preflight reads: MemTotal and the cgroup limit).

Steady (`host_steady_per_node`): the offloaded states of the node's P ranks plus HOST_ALLOWANCE_PER_RANK for each
rank's own process. Per partitioned element (`host_bytes_per_element`): optimizer offload holds the fp32 master copy
and Adam's two moments (12 bytes), and the fp32 gradients twice (4 + 4): DeepSpeed 0.19.8 accumulates them into the
flat partition (stage3.py `grad_partitions_flat_buffer`) and, at the step, copies each optimizer sub-group's share
into a `.grad` buffer of its own (`_prepare_fp32_grad_for_sub_group`) that offload never frees; parameter offload
holds the parameter (2 at bf16). Both offloads at bf16: 22 bytes, held against a real run's buffers in
tests/distributed/test_offload_autoep.py. Pinned exactly: the generated scripts and the arguments of a generated
plan set `DS_PIN_MEMORY_BACKEND=native` (DeepSpeed's page-locked allocator, deepspeed/utils/pin_memory.py) for
offload on GPUs; torch's pinning, DeepSpeed's default, rounds each block up to a power of two (up to twice the bytes).

Resume peak (`host_resume_peak_per_node`): resuming reads each rank's `*_optim_states.pt` (F = the rank's optimizer
partition, `optimizer` bytes: the fp32 master copy and the two moments). DeepSpeed's stock load is a plain
`torch.load` into each rank's memory; DeepSpeed 0.19.8 creates Adam's moments at the first step, so at a job's resume
a rank holds its states less the moments (2F/3) plus the whole file: the node peaks at steady + P x F/3 (steady +
P x F where the moments already exist, e.g. a reload after training). RecipeTrainer's resume maps the files
(`memory_mapped_resume`, `hf_dist_recipes.checkpoint.resume_loading`): their pages are page cache the kernel can
drop, and the peak stays at the steady state (measured on 2 CPU ranks, ZeRO-3 + optimizer offload: +0 MiB of
anonymous memory against +83 MiB per rank stock, F = 248 MiB; benchmarks/results/2026-12-06-resume-host-memory.md).
"""

from __future__ import annotations

from hf_dist_recipes.core.sizes import GIB
from hf_dist_recipes.planning.elements import RankElements, bytes_per_element
from hf_dist_recipes.planning.plan import ParallelPlan

# Each rank process's host memory besides offloaded states: Python, the torch / CUDA / NCCL libraries and the CUDA
# context's host side, DeepSpeed's pinned staging buffers, a dataloader worker. A stated margin: a CPU rank of the
# demo (torch, transformers, deepspeed imported, a tiny model) holds about 1.5 GiB of RSS here, and a CUDA context
# adds 1-2 GiB of host memory per process.
HOST_ALLOWANCE_PER_RANK = 4 * GIB


SUBGROUP_GRAD_BYTES = 4  # the fp32 `.grad` of each optimizer sub-group on the host under offload (docstring)


def subgroup_copy_bytes(plan: ParallelPlan, el: RankElements) -> int:
    """Bytes of the sub-group gradient copies a rank keeps on the host (module docstring); 0 without offload."""
    return el.optimizer * SUBGROUP_GRAD_BYTES if plan.offload_optimizer else 0


def host_bytes_per_element(plan: ParallelPlan) -> int:
    """Host bytes per partitioned element that `plan`'s offloads hold (module docstring): with optimizer offload the
    optimizer states, the gradient partition and the sub-group gradient copy; with parameter offload the parameter."""
    p_bytes, g_bytes, o_bytes = bytes_per_element(plan)
    optimizer = o_bytes + g_bytes + SUBGROUP_GRAD_BYTES if plan.offload_optimizer else 0
    return optimizer + (p_bytes if plan.offload_params else 0)


def host_bytes_per_node(plan: ParallelPlan, on_host_per_rank: int, optimizer_per_rank: int, memory_mapped: bool):
    """(steady, resume peak) host bytes per node of a CUDA plan (module docstring); (0, 0) for CPU plans, whose
    device memory is the host's."""
    if plan.device != "cuda":
        return 0, 0
    steady = plan.procs_per_node * (on_host_per_rank + HOST_ALLOWANCE_PER_RANK)
    if plan.engine != "deepspeed" or memory_mapped:  # FSDP2 resumes through torch.distributed.checkpoint
        return steady, steady
    # The stock load: each rank's whole file in its memory, less the moments (2/3 of it) not yet created.
    return steady, steady + plan.procs_per_node * optimizer_per_rank // 3
