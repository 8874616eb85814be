"""What this host has, counted once in the pytest process (where no test hid the GPUs), and the skips that follow
from it, each written once."""

from __future__ import annotations

import pytest
import torch

from hf_dist_recipes.environment.cuda_host import inspect_host

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

# The NVIDIA GPUs as the device files and nvidia-smi show them (a host whose torch cannot use them still counts).
NVIDIA_HOST = bool(inspect_host().gpu_count)


def needs_gpus(count: int) -> pytest.MarkDecorator:
    """Skip the NCCL variant of a CPU test unless this host has `count` CUDA GPUs, naming how many it has."""
    need = "a CUDA GPU" if count == 1 else f">= {count} CUDA GPUs"
    return pytest.mark.skipif(GPUS < count, reason=f"NCCL variant: needs {need}, this host has {GPUS}")


needs_two_gpus = needs_gpus(2)

# A DeepSpeed launch on the CPU of a machine with NVIDIA GPUs needs a CPU request for RecipeTrainingArguments
# (ACCELERATE_USE_CPU), and that request makes accelerate 1.16 drop DeepSpeed (the preflight's backend check
# reports it). Until the arguments take the YAML's use_cpu another way, the preflight's launches run on CPU-only hosts.
cpu_only_host = pytest.mark.skipif(
    NVIDIA_HOST,
    reason="a DeepSpeed CPU launch on a GPU host needs ACCELERATE_USE_CPU, which drops DeepSpeed (tests.support.hosts)",
)
