"""DeepSpeed's op builds seen from outside a job: the stale build lock that hangs every later run, and the ninja
the builds use. `doctor` reports both; the demo refuses to launch over a stale lock. Where a rank builds its ops
(node-local, per user and build) is `environment/extensions.py`.

A lock older than a few minutes while no compiler runs is the leftover of a killed build: `check_no_stale_locks`.
Only where the file itself blocks (torch 2.13; `_compat.WORKAROUNDS["jit_build_lock_file"]`): torch 2.14 locks the
same file at the OS level and leaves it behind after every load, harmless.

torch builds with the `ninja` first on PATH (cpp_extension `verify_ninja_availability` runs `ninja --version`), not
the one installed beside the interpreter (DeepSpeed's `ninja` requirement). A job script that runs `.venv/bin/python`
without activating the environment can therefore find another ninja than a job that activates it, or none at all
("Ninja is required to load C++ extensions"). Two ninja versions do not trust each other's `.ninja_log` (1.13 writes
log v7 with another command hash, ninja-build/ninja 2519; older ones v6, 2240), so jobs that alternate between them
rebuild every op each time: measured in this repository's suite, deepspeed_shm_comm (about 25 s of both cores) was
rebuilt on about every other launch until every launch used one ninja. `ninjas` finds both for the doctor.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from hf_dist_recipes import _compat
from hf_dist_recipes.environment.extensions import ENV, node_local_extensions_dir

STALE_AFTER_S = 300  # a CPU build of one op takes about 60 s on 2 cores
BUILD_PROCESSES = ("ninja", "cc1plus", "c++", "g++", "nvcc")


def extensions_root() -> Path:
    """Where torch (and so DeepSpeed) builds ops: $TORCH_EXTENSIONS_DIR, else the node-local folder
    `RecipeTrainingArguments` will set it to, else torch's default (~/.cache/torch_extensions)."""
    explicit = os.environ.get(ENV)
    if explicit:
        return Path(explicit)
    local = node_local_extensions_dir()
    if local is not None:
        return local
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def build_running() -> bool:
    """Whether a compiler or ninja process runs on this machine now."""
    for proc in psutil.process_iter(["name"]):
        if (proc.info.get("name") or "") in BUILD_PROCESSES:
            return True
    return False


def lock_file_blocks() -> bool:
    """Whether the installed torch's JIT build waits while a `lock` file exists (torch 2.13; not 2.14)."""
    return _compat.needed("jit_build_lock_file")


def stale_locks(root: str | Path | None = None, *, older_than_s: float = STALE_AFTER_S) -> list[Path]:
    """Lock files under `root` (default `extensions_root()`) older than `older_than_s` seconds, when no build runs and
    the installed torch waits on such a file; [] elsewhere."""
    if not lock_file_blocks():
        return []
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


@dataclass(frozen=True)
class Ninja:
    """A ninja executable and what `--version` printed ("" when it would not run)."""

    path: Path
    version: str


def _ninja(path: str | Path | None) -> Ninja | None:
    if path is None or not os.path.isfile(path) or not os.access(path, os.X_OK):
        return None
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return Ninja(Path(path), out)


def ninjas(search_path: str | None = None, interpreter: str | None = None) -> tuple[Ninja | None, Ninja | None]:
    """(the ninja torch builds with: first on `search_path`, default $PATH; the one in `interpreter`'s folder,
    default sys.executable's, which an activated environment puts first). Either is None when absent."""
    path = os.environ.get("PATH", "") if search_path is None else search_path
    beside = Path(interpreter or sys.executable).parent / "ninja"  # the venv's bin, not the resolved base Python
    return _ninja(shutil.which("ninja", path=path)), _ninja(beside)
