"""Damage as a disk or a crash leaves it, for the tests of complete checkpoints (`checkpoint.manifest`)."""

from pathlib import Path


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
