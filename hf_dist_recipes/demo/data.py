"""The demo's data: the Python standard library's own source files, read as bytes (a 256-symbol vocabulary).

The text exists on every machine that runs Python, so nothing is downloaded and every rank builds the same
dataset in the same order.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset


def stdlib_source_files(root: str | Path | None = None) -> list[Path]:
    """The `*.py` files directly under the standard library directory (`root`, default: this interpreter's),
    sorted by name so that every rank and every run sees the same order."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in base.glob("*.py") if p.is_file())
    if not files:
        raise ValueError(f"no *.py files under {base}; pass root= pointing at a directory of Python sources")
    return files


def stdlib_bytes(max_bytes: int = 2_000_000, root: str | Path | None = None) -> bytes:
    """Concatenated source bytes of the standard library, at most `max_bytes` (default 2 MB)."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    chunks, total = [], 0
    for path in stdlib_source_files(root):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


class ByteBlockDataset(Dataset):
    """Non-overlapping blocks of `seq_len` bytes; `labels` equal `input_ids` (the model shifts them).

    Token ids are the byte values 0-255, so no tokenizer is trained or fetched.
    """

    def __init__(self, data: bytes, seq_len: int = 128):
        if seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {seq_len}")
        n_blocks = len(data) // seq_len
        if n_blocks == 0:
            raise ValueError(f"{len(data)} bytes give no block of seq_len={seq_len}; use more data or a shorter seq_len")
        self.seq_len = seq_len
        self.tokens = torch.frombuffer(bytearray(data[: n_blocks * seq_len]), dtype=torch.uint8).long()
        self.tokens = self.tokens.view(n_blocks, seq_len)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        block = self.tokens[idx]
        return {"input_ids": block, "labels": block}


def stdlib_dataset(seq_len: int = 128, max_bytes: int = 2_000_000) -> ByteBlockDataset:
    """The demo dataset: standard-library source as byte blocks (about 15,600 blocks of 128 at the defaults)."""
    return ByteBlockDataset(stdlib_bytes(max_bytes), seq_len)
