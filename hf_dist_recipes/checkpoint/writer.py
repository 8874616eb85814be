"""Writing a HuggingFace checkpoint a group of tensors at a time: sharded safetensors, an index, the config.

The tensors arrive in groups (one decoder layer, the embeddings, ...). A group is first reverted to the names and
layout `from_pretrained` expects on disk (transformers' own `revert_weight_conversion`: DeepSeek's fused
`experts.gate_up_proj` back to one `experts.<i>.gate_proj.weight` per expert, as `save_pretrained` writes them),
then buffered; a shard file is written as soon as the buffer reaches `max_shard_bytes`. So at most one shard plus
one group is held in memory, never the model.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hf_dist_recipes.core.sizes import parse_size

if TYPE_CHECKING:  # the CLI imports this module for --help: no torch at import time
    import torch

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WRITERS_RECORD = "shard_writers.json"  # which writer wrote which file, when several did (checkpoint.shard_plan)
# The writing rank holds at most one shard plus one group, so the shard size bounds its memory: 5 GB, where
# save_pretrained's default is 50GB.
DEFAULT_MAX_SHARD_SIZE = "5GB"
DEFAULT_MAX_SHARD_BYTES = parse_size(DEFAULT_MAX_SHARD_SIZE, "save_shard_size")


@dataclass
class ExportResult:
    """What was written: the directory, its weight files, tensor and byte counts (bytes of tensor data), and with
    several writers which writer (rank or worker) wrote which file and, for the export's writer processes, the
    CPU seconds each took (the export's critical path where cores are free)."""

    output_dir: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    parameters: int = 0
    bytes: int = 0
    written_by: dict[str, list[str]] = field(default_factory=dict)
    writer_cpu_seconds: dict[str, float] = field(default_factory=dict)


class ShardedSafetensorsWriter:
    """Writes `model-0000i-of-0000N.safetensors` files (or one `model.safetensors`) and the index.

    `add()` takes a group of tensors already in on-disk names; `close()` names the shards, writes the index and
    returns an `ExportResult`. Shard names are final only at the end (N is not known while streaming), so shards
    are written under temporary names and renamed.
    """

    def __init__(self, output_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        os.makedirs(output_dir, exist_ok=True)
        remove_previous_weights(output_dir)
        self.output_dir = output_dir
        self.max_shard_bytes = max_shard_bytes
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # temporary file name, tensor names
        self.result = ExportResult(output_dir)

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            if name in self._buffer or any(name in names for _, names in self._shards):
                raise ValueError(f"tensor {name!r} written twice: two parameters map to one checkpoint name")
            nbytes = tensor.numel() * tensor.element_size()
            if self._buffer and self._buffer_bytes + nbytes > self.max_shard_bytes:
                self._flush()
            self._buffer[name] = tensor.contiguous()
            self._buffer_bytes += nbytes
            self.result.tensors += 1
            self.result.parameters += tensor.numel()
            self.result.bytes += nbytes
        if self._buffer_bytes >= self.max_shard_bytes:  # a full shard is written before the next group arrives
            self._flush()

    def _flush(self) -> None:
        if not self._buffer:
            return
        tmp = f".partial-{len(self._shards):05d}.safetensors"
        write_safetensors(os.path.join(self.output_dir, tmp), self._buffer, metadata={"format": "pt"})
        self._shards.append((tmp, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def close(self) -> ExportResult:
        self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, (tmp, names) in enumerate(self._shards, start=1):
            final = SAFE_WEIGHTS_NAME if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.output_dir, tmp), os.path.join(self.output_dir, final))
            self.result.files.append(final)
            weight_map.update(dict.fromkeys(names, final))
        if n > 1:
            index = {
                "metadata": {"total_size": self.result.bytes, "total_parameters": self.result.parameters},
                "weight_map": dict(sorted(weight_map.items())),
            }
            with open(os.path.join(self.output_dir, SAFE_WEIGHTS_INDEX_NAME), "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2) + "\n")
        return self.result


_ST_DTYPES = {
    "float32": "F32",
    "bfloat16": "BF16",
    "float16": "F16",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """The safetensors format (8-byte header length, JSON header, raw little-endian data), written tensor by tensor
    from the tensors' own memory. `safetensors.torch.save_file` first copies every tensor into a bytes object,
    which doubles the writing rank's peak for a shard."""
    import torch

    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in tensors.items():
        kind = str(t.dtype).removeprefix("torch.")
        if kind not in _ST_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be written to safetensors")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[kind], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for t in tensors.values():
            if t.numel():
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def remove_previous_weights(output_dir: str) -> None:
    """A second save into the same directory must not leave shards of the first one for from_pretrained to mix in."""
    for name in os.listdir(output_dir):
        if name.endswith(".safetensors") or name in (SAFE_WEIGHTS_INDEX_NAME, WRITERS_RECORD):
            os.remove(os.path.join(output_dir, name))


def save_config_files(model_config, output_dir: str, generation_config=None) -> None:
    """config.json (and generation_config.json) beside the weights, so `from_pretrained(output_dir)` works."""
    model_config.save_pretrained(output_dir)
    if generation_config is not None:
        generation_config.save_pretrained(output_dir)
