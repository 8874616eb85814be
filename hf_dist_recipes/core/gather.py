"""One object from every rank, on every rank: the one `all_gather_object` the practices share.

Without a process group (one process, a notebook, a unit test) the answer is `[obj]`, so every caller runs the same
code in a single process. Objects, not tensors: Gloo cannot all-gather CUDA tensors, and the records the checks
compare (seeds, checksums, host names, fingerprints) are small Python values. Every rank must call it, or the ranks
that do wait for the collective timeout."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def distributed() -> bool:
    """True inside an initialised default process group (torch.distributed imported only here, on first use)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


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
