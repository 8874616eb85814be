"""DeepSpeed's JIT-built ops and the stale build lock that hangs every later run.

DeepSpeed builds its ops (fused_adam, deepspeed_shm_comm, ...) under torch's extensions root behind a `lock` file.
A rank killed while building or loading leaves the file behind, and every later DeepSpeed run on the machine then
waits on it forever, with no message and no CPU use (verified-on-cpu.md; transformers issue 26015). A lock older
than a few minutes while no compiler runs is such a leftover.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

STALE_AFTER_S = 300  # a CPU build of one op takes about 60 s on 2 cores
BUILD_PROCESSES = ("ninja", "cc1plus", "c++", "g++", "nvcc")


def extensions_root() -> Path:
    """Where torch (and so DeepSpeed) builds ops: $TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")


def build_running() -> bool:
    """Whether a compiler or ninja process runs on this machine now."""
    for proc in psutil.process_iter(["name"]):
        if (proc.info.get("name") or "") in BUILD_PROCESSES:
            return True
    return False


def stale_locks(root: str | Path | None = None, *, older_than_s: float = STALE_AFTER_S) -> list[Path]:
    """Lock files under `root` (default `extensions_root()`) older than `older_than_s` seconds, when no build runs."""
    base = Path(root) if root is not None else extensions_root()
    if not base.is_dir():
        return []
    now = time.time()
    old = [p for p in base.rglob("lock") if p.is_file() and now - p.stat().st_mtime > older_than_s]
    return old if old and not build_running() else []


def check_no_stale_locks(root: str | Path | None = None) -> None:
    """Raise ValueError naming the files to delete when a stale lock would hang the next DeepSpeed run."""
    locks = stale_locks(root)
    if locks:
        raise ValueError(
            f"stale DeepSpeed build lock(s) {', '.join(map(str, locks))}: a run killed while building left them, and "
            "every DeepSpeed run would wait on them forever. No build is running now; delete them "
            f"(rm {' '.join(map(str, locks))}) and start again"
        )
