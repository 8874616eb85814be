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
    """Register (once) an exit handler that ends a Gloo default process group before the interpreter shuts down:
    `destroy_gloo_group`, whose docstring says why. NCCL groups are left to the launcher."""
    global _EXIT_HANDLER_REGISTERED
    if not _EXIT_HANDLER_REGISTERED:
        atexit.register(destroy_gloo_group)
        _EXIT_HANDLER_REGISTERED = True


_EXIT_HANDLER_REGISTERED = False
EXIT_BARRIER_TIMEOUT_S = 60.0  # how long a rank exiting cleanly waits for the others before it leaves anyway


def exiting_cleanly() -> bool:
    """False once an exception has ended the main program: Python has printed it (sys.last_exc / last_value)."""
    import sys

    return getattr(sys, "last_exc", None) is None and getattr(sys, "last_value", None) is None


def destroy_gloo_group(*, barrier_timeout_s: float = EXIT_BARRIER_TIMEOUT_S) -> bool:
    """Destroy the default process group (and DeepSpeed's subgroups with it) when it runs on Gloo; True if done.

    Why at exit, and why the barrier first: a rank whose Gloo group is still alive when the interpreter finalizes
    aborts (SIGABRT, "terminate called without an active exception") after the job has finished, often enough that
    our CI saw it twice in about six runs of the suite (a 4-rank resume, a 2-machine preflight). PyTorch PR 179291
    describes the abort and was abandoned. Destroying the group at exit is not enough: what matters is that no rank
    tears its group down while a peer's is still working. Measured on the 2-core machine with 2 plain Gloo ranks
    doing 200 all_reduces then exiting (20 jobs each, 2026-12-04): 8/20 aborted with no destroy, 7/20 and 9/20 with
    a destroy at exit, 0/20 with `monitored_barrier` then destroy, 0/20 with `barrier` then destroy; rerun with
    benchmarks/gloo_exit.py (results in benchmarks/results/).

    So a rank exiting cleanly (no uncaught exception) first meets the others at `monitored_barrier`, which is
    point to point with a timeout (unlike `barrier`, it cannot be mistaken for a peer's collective): after
    `barrier_timeout_s` seconds (default 60), or at once when a peer is gone, it leaves as before. A rank ending
    in an exception skips the wait: its peers are failing too, or the launcher is stopping them."""
    import torch

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or CPU_BACKEND not in str(dist.get_backend()):
        return False
    if str(dist.get_backend()) == CPU_BACKEND and dist.get_world_size() > 1 and exiting_cleanly():
        from datetime import timedelta

        try:
            dist.monitored_barrier(timeout=timedelta(seconds=barrier_timeout_s))
        except RuntimeError:  # a peer gone, stuck or failing (DistBackendError is a RuntimeError): leave anyway
            pass
    dist.destroy_process_group()
    return True
