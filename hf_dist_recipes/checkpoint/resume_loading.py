"""Resume without a second copy of the optimizer states in host memory: DeepSpeed's checkpoint files memory-mapped.

DeepSpeed 0.19.8 reads each rank's `*_optim_states.pt` on resume with a plain `torch.load` (its
`TorchCheckpointEngine`), every rank of a node at once, into memory of the rank's own. Under ZeRO-3 the file holds
the rank's fp32 master partition and its Adam moments, F = 12 bytes per parameter of the partition. With optimizer
offload the host holds the steady state S (per node: master, moments and both fp32 gradient copies of every rank,
`planning.host_memory`) except the moments, which DeepSpeed 0.19.8 creates at the first step: a resume needs
`S + P x F / 3` per node (P processes), and `S + P x F` where the moments exist already (`load_best_model_at_end`
reloading after training; 1,566 + 8 x 117 = 2,502 GiB on a DeepSeek-V3 node, more than a 2 TiB DGX H100).

`MappedLoads` wraps the engine's checkpoint engine and changes only its `load`: a zip-format file (what
`torch.save` writes by default, and DeepSpeed unless `checkpoint_serialization` is false) is opened with
`torch.load(mmap=True)`, privately mapped (copy-on-write: nothing the rank does reaches the file). Its tensors are
the file's pages, read when touched, held in the page cache, which the kernel can drop, not in the process's own
(anonymous) memory. DeepSpeed then copies the fp32 master partition into its buffers and
`torch.optim.Optimizer.load_state_dict` keeps the loaded moments as the new state (freeing the old ones, if any).
After the engine's `load_checkpoint` returns, `materialize` copies each moment still backed by the file into memory
of its own, one tensor at a time: the anonymous memory of a rank never exceeds its steady state (`S` per node, plus
small objects), and no file stays mapped (a later save may rewrite or delete it; a tensor still mapped would see a
rewritten file or fault on a truncated one). Each file read is recorded (`CheckpointLoad`); `RecipeTrainer` installs
this on its engine before a resume (`memory_mapped_resume`, default True) and shows the record as
`trainer.resume_loads`.

Staggered loads (the ranks of a node in turn) were not taken: they bound the peak to `S + F`, not `S`, and need an
order across ranks inside `load_checkpoint`, whose ZeRO-3 path has collectives (the epilogue's
all-gather), so that a rank waiting its turn there would deadlock the others. DeepSpeed's own serial loading
(`zero_optimization.pipeline_loading_checkpoint`) passes the turn to global rank + 1 after comparing the local rank
with the world size: one node only. The mapped load needs no order at all.

The measurement (2 CPU ranks, ZeRO-3 + optimizer offload, before and after): benchmarks/resume_host_memory.py.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import zipfile
from dataclasses import dataclass

import torch

from hf_dist_recipes._compat import deepspeed as compat_deepspeed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointLoad:
    """One file the engine read. `mapped`: with `torch.load(mmap=True)`; else DeepSpeed's own load (a legacy,
    non-zip file, or a checkpoint engine whose load is not a plain `torch.load`)."""

    path: str
    bytes: int
    mapped: bool


@dataclass(frozen=True)
class ResumeLoads:
    """What a resume read (`files`, in order), the bytes of optimizer state `materialize` copied out of mapped files
    into the process's own memory, and the checkpoint files the process still maps afterwards (none, unless
    something other than the optimizer holds a loaded tensor)."""

    files: tuple[CheckpointLoad, ...]
    copied_bytes: int
    still_mapped: tuple[str, ...]


class MappedLoads:
    """A checkpoint engine that memory-maps what `inner` would read whole, and delegates everything else (save,
    commit, ...) to it, so that writes are DeepSpeed's own. `inner`'s load is replaced only when it is a plain
    `torch.load` (`_compat.deepspeed.loads_with_plain_torch_load`)."""

    def __init__(self, inner):
        self.inner = inner
        self.maps_loads = compat_deepspeed.loads_with_plain_torch_load(inner)
        self.loads: list[CheckpointLoad] = []
        self.copied_bytes = 0
        self.still_mapped: tuple[str, ...] = ()
        self._ranges: list[tuple[int, int]] = []  # host address ranges of the mappings not yet materialized

    def __getattr__(self, name):
        if name == "inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)  # only called for what this class does not define

    def load(self, path: str, map_location=None):
        if not (self.maps_loads and zipfile.is_zipfile(path)):
            self.loads.append(CheckpointLoad(str(path), os.path.getsize(path), mapped=False))
            return self.inner.load(path, map_location=map_location)
        # MAP_PRIVATE whatever the process default is: with MAP_SHARED, a write into a loaded tensor would change
        # the checkpoint on disk.
        with torch.serialization.set_default_mmap_options(mmap.MAP_PRIVATE):
            loaded = torch.load(path, map_location=map_location, weights_only=False, mmap=True)
        storages = [t.untyped_storage() for t in _tensors(loaded) if t.device.type == "cpu"]
        if storages:  # every storage of one file lies inside its single mapping
            start = min(s.data_ptr() for s in storages)
            self._ranges.append((start, max(s.data_ptr() + s.nbytes() for s in storages)))
        self.loads.append(CheckpointLoad(str(path), os.path.getsize(path), mapped=True))
        return loaded

    def is_mapped(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` lies in a file this engine mapped and `materialize` has not copied out yet."""
        if tensor.device.type != "cpu" or not self._ranges:
            return False
        address = tensor.untyped_storage().data_ptr()
        return any(start <= address < end for start, end in self._ranges)

    def materialize(self, optimizers) -> ResumeLoads:
        """Copy every state tensor of `optimizers` that still lies in a mapped file into memory of its own, one
        tensor at a time, and forget the mappings. The load freed the states these replaced, so the copies only
        take their place (or fill in moments that did not exist yet): the rank's own memory comes back to its steady
        state, never above it."""
        for optimizer in optimizers:
            for state in optimizer.state.values():
                self.copied_bytes += self._copy_out(state)
        self._ranges.clear()
        mapped = {os.path.realpath(load.path) for load in self.loads if load.mapped}
        if mapped & mapped_files():  # a loaded object may sit in a reference cycle until the next collection
            gc.collect()
        self.still_mapped = tuple(sorted(mapped & mapped_files()))
        if self.still_mapped:  # their pages are the page cache's, not the rank's own memory, but the files stay open
            logger.warning("after the resume, still memory-mapped: %s", ", ".join(self.still_mapped))
        return self.record()

    def _copy_out(self, state: dict) -> int:
        """Replace each mapped tensor of one parameter's `state` by a copy; returns the bytes copied. A function
        of its own so that no local keeps an original (and so its file) mapped after it returns."""
        copied = 0
        for key in list(state):
            if isinstance(state[key], torch.Tensor) and self.is_mapped(state[key]):
                copied += state[key].nbytes
                state[key] = state[key].clone()
        return copied

    def record(self) -> ResumeLoads:
        return ResumeLoads(tuple(self.loads), self.copied_bytes, self.still_mapped)


def install(engine) -> MappedLoads:
    """Make `engine` (a DeepSpeed engine) read its checkpoint files memory-mapped, and copy the loaded optimizer
    states out of the files when its `load_checkpoint` returns. Idempotent; returns the installed loader."""
    current = compat_deepspeed.checkpoint_engine(engine)
    if isinstance(current, MappedLoads):
        return current
    loads = MappedLoads(current)
    compat_deepspeed.set_checkpoint_engine(engine, loads)
    load_checkpoint = engine.load_checkpoint  # the public method transformers' resume calls

    def load_then_materialize(*args, **kwargs):
        try:
            return load_checkpoint(*args, **kwargs)
        finally:
            loads.materialize(compat_deepspeed.engine_optimizers(engine))

    engine.load_checkpoint = load_then_materialize
    return loads


def installed(engine) -> MappedLoads | None:
    current = compat_deepspeed.checkpoint_engine(engine) if engine is not None else None
    return current if isinstance(current, MappedLoads) else None


def mapped_files() -> set[str]:
    """Paths of the files this process memory-maps (Linux `/proc/self/maps`; empty elsewhere)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    paths = set()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            paths.add(fields[5].removesuffix(" (deleted)"))
    return paths


def _tensors(value):
    """Every tensor inside a loaded checkpoint (dicts, lists, tuples, nested)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
