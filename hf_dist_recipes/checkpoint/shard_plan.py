"""Several writers, one checkpoint: the shard plan every writer computes alike, and the writer of one's share.

`ShardedSafetensorsWriter` (writer.py) decides the shard boundaries while it streams: a tensor that would take the
buffer past `max_shard_bytes` starts a new shard, and a group that ends with the buffer at or over the limit closes
it. Those decisions depend only on the tensors' names and byte sizes in order, so `plan_shards` replays them on
metadata (meta tensors: no data) before anything is gathered. Every writer (a rank of the job, or a process of the
offline export) computes the same plan, owns a contiguous block of shards (`k * writers // shards == index`: the
blocks differ by at most one shard, so the writers share the bytes about equally), converts only the groups holding
a tensor of its shards and writes those files under their final names; one writer then writes the index. Contiguous,
not round-robin: a decoder layer is usually larger than a shard (DeepSeek-V3: 21 GiB against 5 GB), and round-robin
would hand one layer's shards to several writers, each converting (and, live, receiving) the whole layer; in blocks
a layer is shared only where two writers' blocks meet. The files are the single writer's, byte for byte
(same names, same tensor order inside each file, same header), which tests/unit/test_checkpoint.py checks by hash.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hf_dist_recipes.checkpoint.writer import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WRITERS_RECORD,
    ExportResult,
    write_safetensors,
)

if TYPE_CHECKING:
    import torch


@dataclass
class ShardPlan:
    """The shards of one checkpoint: `shards[k]` is the list of tensor names of file `files[k]`, in file order."""

    shards: list[list[str]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    shard_of: dict[str, int] = field(default_factory=dict)
    tensors: int = 0
    parameters: int = 0
    bytes: int = 0

    def owner(self, shard: int, writers: int) -> int:
        """The writer (0..writers-1) of shard `shard`: contiguous blocks of ceil or floor(shards / writers)."""
        return shard * writers // len(self.shards)

    def owners_of(self, names: Iterable[str], writers: int) -> set[int]:
        return {self.owner(self.shard_of[n], writers) for n in names}


def plan_shards(groups: Iterable[dict[str, torch.Tensor]], max_shard_bytes: int) -> ShardPlan:
    """The shard boundaries `ShardedSafetensorsWriter` would choose for these groups (on-disk names, in order);
    the tensors may be on the meta device, only names, element counts and dtypes are read."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    plan = ShardPlan()
    current: list[str] = []
    current_bytes = 0

    def close() -> None:
        nonlocal current, current_bytes
        if current:
            plan.shards.append(current)
            current, current_bytes = [], 0

    for group in groups:
        for name, tensor in group.items():
            if name in plan.shard_of:
                raise ValueError(f"tensor {name!r} written twice: two parameters map to one checkpoint name")
            nbytes = tensor.numel() * tensor.element_size()
            if current and current_bytes + nbytes > max_shard_bytes:
                close()
            current.append(name)
            plan.shard_of[name] = len(plan.shards)
            current_bytes += nbytes
            plan.tensors += 1
            plan.parameters += tensor.numel()
            plan.bytes += nbytes
        if current_bytes >= max_shard_bytes:
            close()
    close()
    n = len(plan.shards)
    plan.files = [SAFE_WEIGHTS_NAME] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    return plan


class PlannedShardWriter:
    """Writes writer `index`'s shards of `plan` (of `writers`) as their tensors arrive, in any group granularity.

    Tensors of other writers' shards are ignored. A shard is written (under a temporary name, then renamed) as soon
    as its last tensor arrived; at most one shard of this writer is open at a time, since a shard's tensors are
    consecutive in the stream. The caller removes an earlier checkpoint's weights once, before any writer starts
    (`writer.remove_previous_weights`, which also removes an earlier `WRITERS_RECORD`), and has one writer call
    `write_index` after all have finished."""

    def __init__(self, output_dir: str, plan: ShardPlan, index: int, writers: int):
        if not 0 <= index < writers:
            raise ValueError(f"writer index {index} is not in 0..{writers - 1}")
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir, self.plan, self.index, self.writers = output_dir, plan, index, writers
        self._open: dict[int, dict[str, torch.Tensor]] = {}
        self.written: list[str] = []

    def wants(self, names: Iterable[str]) -> bool:
        return self.index in self.plan.owners_of(names, self.writers)

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            if name not in self.plan.shard_of:
                raise ValueError(f"tensor {name!r} is not in the shard plan: the plan was made from other groups")
            shard = self.plan.shard_of[name]
            if self.plan.owner(shard, self.writers) != self.index:
                continue
            buffer = self._open.setdefault(shard, {})
            buffer[name] = tensor.contiguous()
            if len(buffer) == len(self.plan.shards[shard]):
                self._write(shard)

    def _write(self, shard: int) -> None:
        buffer = self._open.pop(shard)
        names = self.plan.shards[shard]
        if list(buffer) != names:  # the file's order is the stream's; another order would change its bytes
            raise ValueError(f"shard {shard}: tensors arrived as {list(buffer)[:3]}..., the plan has {names[:3]}...")
        tmp = os.path.join(self.output_dir, f".partial-{shard:05d}.safetensors")
        write_safetensors(tmp, buffer, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(self.output_dir, self.plan.files[shard]))
        self.written.append(self.plan.files[shard])

    def close(self) -> list[str]:
        """The files this writer wrote; ValueError if one of its shards never received all its tensors."""
        if self._open:
            missing = {self.plan.files[k]: len(self.plan.shards[k]) - len(b) for k, b in self._open.items()}
            raise ValueError(f"shards left incomplete (tensors missing): {missing}")
        return list(self.written)


def write_index(output_dir: str, plan: ShardPlan, written_by: dict[int, list[str]] | None = None) -> ExportResult:
    """The index (as `ShardedSafetensorsWriter.close` writes it; none for a single file) and, when given, the record
    of which writer wrote which file. Returns the whole checkpoint's `ExportResult`."""
    if len(plan.files) > 1:
        weight_map = {n: plan.files[k] for n, k in plan.shard_of.items()}
        index = {
            "metadata": {"total_size": plan.bytes, "total_parameters": plan.parameters},
            "weight_map": dict(sorted(weight_map.items())),
        }
        with open(os.path.join(output_dir, SAFE_WEIGHTS_INDEX_NAME), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2) + "\n")
    if written_by is not None:
        with open(os.path.join(output_dir, WRITERS_RECORD), "w", encoding="utf-8") as f:
            f.write(json.dumps({str(w): files for w, files in sorted(written_by.items())}, indent=2) + "\n")
    by = {str(w): files for w, files in sorted((written_by or {}).items())}
    return ExportResult(output_dir, list(plan.files), plan.tensors, plan.parameters, plan.bytes, by)
