"""Practice 2: NCCL for GPU communication.

A process group that silently falls back to Gloo on a GPU host still trains, only many times slower, and nothing
says why. The policy here: NCCL whenever CUDA is visible, Gloo only on CPU-only hosts, and Gloo on a CUDA host is
an error unless the caller opts out explicitly (`allow_gloo_on_cuda=True`, e.g. to debug a NCCL problem).
"""

from __future__ import annotations

import atexit

# torch is imported inside the functions: the CLI imports this module for every subcommand, and doctor/pin/--help
# must not pay torch's start-up.

GPU_BACKEND = "nccl"
CPU_BACKEND = "gloo"
KNOWN_BACKENDS = ("nccl", "gloo", "mpi", "xccl", "hccl", "cncl", "mccl")


def cuda_device_count() -> int:
    """Number of CUDA devices this process can see (0 on a CPU-only host)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(requested: str | None, *, allow_gloo_on_cuda: bool = False, cuda_devices: int | None = None) -> str:
    """The backend to use: `requested` when it is sound for this host, NCCL / Gloo by host when None.

    Raises ValueError, naming the fix, for Gloo on a CUDA host (unless `allow_gloo_on_cuda`) and for NCCL on a
    host without CUDA. `cuda_devices` defaults to what torch sees.
    """
    gpus = cuda_device_count() if cuda_devices is None else cuda_devices
    if requested is None:
        return GPU_BACKEND if gpus else CPU_BACKEND
    if requested not in KNOWN_BACKENDS:
        raise ValueError(f"unknown distributed backend {requested!r}; use one of {', '.join(KNOWN_BACKENDS)}")
    if requested == CPU_BACKEND and gpus and not allow_gloo_on_cuda:
        raise ValueError(
            f"Gloo was requested on a host with {gpus} CUDA GPU(s): GPU collectives over Gloo are many times slower "
            "than NCCL. Remove ddp_backend='gloo' (or --backend gloo) to use NCCL, or pass allow_gloo_on_cuda=True "
            "(--allow-gloo-on-cuda) if Gloo is really meant."
        )
    if requested == GPU_BACKEND and not gpus:
        raise ValueError(
            "NCCL was requested but this host has no CUDA GPU visible (torch.cuda.is_available() is False); "
            "remove ddp_backend='nccl' to use Gloo on this CPU-only host, or check CUDA_VISIBLE_DEVICES and the driver."
        )
    return requested


def check_process_group_backend(*, allow_gloo_on_cuda: bool = False, cuda_devices: int | None = None) -> str | None:
    """Check the backend of the initialised default process group against the policy; returns it (None if no
    process group). A launcher or engine that picked Gloo on a CUDA host is caught here even if the arguments
    never asked for it."""
    import torch

    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    backend = str(torch.distributed.get_backend())
    gpus = cuda_device_count() if cuda_devices is None else cuda_devices
    # A mixed group ("cpu:gloo,cuda:nccl") sends GPU tensors over NCCL, which is what the policy asks for.
    if gpus and GPU_BACKEND not in backend and not allow_gloo_on_cuda:
        raise ValueError(
            f"the process group runs on {backend!r} although {gpus} CUDA GPU(s) are visible. Launch with NCCL "
            "(accelerate config without use_cpu, or ddp_backend='nccl'), or pass allow_gloo_on_cuda=True."
        )
    return backend


def destroy_gloo_group_at_exit() -> None:
    """Register (once) an exit handler that destroys a Gloo default process group before the interpreter shuts
    down. Left to interpreter finalization, Gloo's worker threads can still hold work objects with Python
    references, and destroying them then aborts the process (SIGABRT, "terminate called without an active
    exception") after training has finished: seen here in about 1 of 20 CPU launches with DeepSpeed; PyTorch PR
    179291 describes it and was abandoned. NCCL groups are left to the launcher."""
    global _EXIT_HANDLER_REGISTERED
    if not _EXIT_HANDLER_REGISTERED:
        atexit.register(destroy_gloo_group)
        _EXIT_HANDLER_REGISTERED = True


_EXIT_HANDLER_REGISTERED = False


def destroy_gloo_group() -> bool:
    """Destroy the default process group (and DeepSpeed's subgroups with it) when it runs on Gloo; True if done."""
    import torch

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or CPU_BACKEND not in str(dist.get_backend()):
        return False
    dist.destroy_process_group()
    return True
