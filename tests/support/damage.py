"""Damage as a disk or a crash leaves it, for the tests of complete checkpoints (`checkpoint.manifest`)."""

import contextlib
import subprocess
from pathlib import Path

import pytest


def zero_the_middle(path: Path, length: int = 64 * 1024) -> None:
    """Zero `length` bytes (at most half the file) in the middle of `path`, its size kept: a flipped disk block."""
    size = path.stat().st_size
    length = min(length, size // 2)
    with open(path, "r+b") as f:
        f.seek((size - length) // 2)
        before = f.read(length)
        assert before != bytes(length), "those bytes were zero already: nothing would change"
        f.seek((size - length) // 2)
        f.write(bytes(length))
    assert path.stat().st_size == size


@contextlib.contextmanager
def small_disk(folder: Path, size: str):
    """A tmpfs of `size` (mount's `size=`, e.g. "1m") mounted at `folder`: a disk that fills, for real. Mounting needs
    root (CAP_SYS_ADMIN), as on the build and CI machines; elsewhere the test is skipped, saying why."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"a small disk needs a tmpfs mount, which this user may not make: {mounted.stderr.decode()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)
