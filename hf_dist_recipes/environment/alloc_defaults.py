"""The CUDA caching allocator's expandable segments, set where the user has not configured the allocator; under
DeepSpeed offload, exact pinning and CPU Adam's threads (`apply_offload_defaults`).

`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`: under ZeRO-3 and for mixture-of-experts models the gathered
modules, the per-expert token batches and the all-to-all buffers change size from one allocation to the next, which
fragments the caching allocator into blocks too small to reuse; expandable segments grow one mapping per stream
instead (`planning.zero_buffers.recommended_env`). The memory estimate's allowance (`planning.memory`: 2 GiB plus
10% of the transient peak) assumes it, so `RecipeTrainingArguments` sets it on hosts where CUDA is used (the same
place and order as the NCCL defaults of `nccl_defaults`: before anything initialises CUDA) and records it in the
process's `env_applied` (`comm.process_setup.current()`).

A user value is kept: torch 2.13 reads `PYTORCH_CUDA_ALLOC_CONF`, else `PYTORCH_ALLOC_CONF` (its newer, generic
name), and on ROCm `PYTORCH_HIP_ALLOC_CONF` (`c10/cuda/CUDAAllocatorConfig.h`, `CUDAAllocatorConfig::instance`);
any of them set means the allocator was configured by someone, and nothing is added to it.

Setting the variable is not enough inside a process that has imported torch: the allocator reads it once, and some
torch 2.x releases read it while `import torch` loads the CUDA library (their `BackendStaticInitializer` asks the
allocator config which backend to use). So the value is also handed to the running allocator config
(`_compat.torch.set_allocator_settings`); the variable stays for the processes this one starts.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, MutableMapping

from hf_dist_recipes._compat import torch as compat_torch

logger = logging.getLogger(__name__)

ALLOC_CONF_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
ALLOC_CONF = "expandable_segments:True"  # also what `planning.zero_buffers.recommended_env` names for a launch
# Every name torch reads the allocator settings from: one of them set means the user chose.
ALLOC_CONF_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def apply_alloc_conf_default(
    environ: MutableMapping[str, str] | None = None, *, apply: Callable[[str], None] | None = None
) -> dict[str, str]:
    """Set `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` in `environ` (default `os.environ`) unless a name of
    `ALLOC_CONF_NAMES` is set, and hand it to the running allocator through `apply` (default
    `_compat.torch.set_allocator_settings`). Returns what was set ({} when the user had configured the allocator); logs
    it once, on global rank 0 (`RANK`). Call it only on hosts that train on CUDA."""
    env = os.environ if environ is None else environ
    if any(name in env for name in ALLOC_CONF_NAMES):
        return {}
    env[ALLOC_CONF_VARIABLE] = ALLOC_CONF
    (apply or compat_torch.set_allocator_settings)(ALLOC_CONF)
    if env.get("RANK", "0") == "0":
        logger.info("CUDA allocator default applied (unset before): %s=%s", ALLOC_CONF_VARIABLE, ALLOC_CONF)
    return {ALLOC_CONF_VARIABLE: ALLOC_CONF}


PIN_BACKEND_ENV = "DS_PIN_MEMORY_BACKEND"  # deepspeed/utils/pin_memory.py reads it when it pins


def adam_threads(cores: int, local_ranks: int) -> int:
    """OpenMP threads per rank for CPU Adam: the node's `cores` shared by its `local_ranks`, 2 each left for the data
    loader and the host side of the step, at least 1 (112 cores, 8 ranks: 12)."""
    share = cores // max(1, local_ranks)
    return share - 2 if share > 3 else 1


def apply_offload_defaults(
    environ: MutableMapping[str, str] | None = None,
    *,
    optimizer: bool,
    params: bool,
    cores: int | None = None,
    set_threads: Callable[[int], None] | None = None,
) -> dict[str, str]:
    """For a CUDA run under DeepSpeed offload (`optimizer`, `params`), what the generated scripts export, where the
    user has not set it: `DS_PIN_MEMORY_BACKEND=native` (DeepSpeed's own page-locked allocator pins the offloaded
    states at their size, where torch's rounds each block up to a power of two; it JIT-builds the pin_memory op),
    and under optimizer offload `adam_threads` OpenMP threads for CPU Adam when `OMP_NUM_THREADS` is unset or 1
    (torchrun and accelerate set 1 for every rank), given to this process (`set_threads`, default
    `torch.set_num_threads`, which sets OpenMP's count for the thread that steps the optimizer) and exported.
    `cores`: the CPUs this process may run on (default its affinity). Returns what was set."""
    env = os.environ if environ is None else environ
    applied = {}
    if (optimizer or params) and PIN_BACKEND_ENV not in env:
        applied[PIN_BACKEND_ENV] = "native"
    if optimizer and env.get("OMP_NUM_THREADS", "1") == "1":
        cores = len(os.sched_getaffinity(0)) if cores is None else cores
        threads = adam_threads(cores, int(env.get("LOCAL_WORLD_SIZE", "1")))
        if threads > 1:
            applied["OMP_NUM_THREADS"] = str(threads)
            if set_threads is None:
                import torch

                set_threads = torch.set_num_threads
            set_threads(threads)
    env.update(applied)
    if applied and env.get("RANK", "0") == "0":
        logger.info("DeepSpeed offload defaults applied (unset before): %s", applied)
    return applied
