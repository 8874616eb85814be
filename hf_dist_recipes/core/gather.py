"""One value from every rank, on every rank: the one `all_gather_object` (and the one float all-gather) the
practices share.

Without a process group (one process, a notebook, a unit test) the answer is `[obj]`, so every caller runs the same
code in a single process. Objects for the records the checks compare (seeds, checksums, host names, fingerprints:
small Python values, and Gloo cannot all-gather CUDA tensors); `gather_floats` for a short vector gathered often
(the periodic rank check), as one tensor all-gather without pickling. Every rank must call them, or the ranks that
do wait for the collective timeout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def distributed() -> bool:
    """True inside an initialised default process group (torch.distributed imported only here, on first use)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def process_rank() -> int:
    """This process's global rank where no runtime holds it (the arguments' seeding, a hang's dump, a CLI worker):
    the process group's when one exists, else the launcher's `RANK`, else 0."""
    import os

    import torch.distributed as dist

    return dist.get_rank() if distributed() else int(os.environ.get("RANK", "0"))


def gather_objects(obj: T, group=None) -> list[T]:
    """Every rank's `obj`, in rank order (of `group`, default the world); `[obj]` without a process group."""
    import torch.distributed as dist

    if not distributed():
        return [obj]
    size = dist.get_world_size(group)
    if size == 1:
        return [obj]
    out: list = [None] * size
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_floats(values: Sequence[float]) -> list[list[float]]:
    """Every rank's `values` (the same length on every rank), in rank order, as float64; `[values]` without a
    process group. One all-gather of a float64 tensor, on the current CUDA device under NCCL (which has no CPU
    tensors), else on the CPU."""
    if not distributed():
        return [list(values)]
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    local = torch.tensor(list(values), dtype=torch.float64, device=device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]
