"""A save the disk cannot hold, said in one line: the folder, the bytes a checkpoint of this job takes and the bytes
free. Stock, a full disk reads as torch's `unexpected pos 385216 vs 385104` (issue 41), and "No space left on device"
showed only in a later, unrelated line.

Before the save (`shortage`, every rank, agreed by RecipeTrainer before any rank writes): when the file system of
`output_dir` has fewer bytes free than a checkpoint of this job takes, the save is not begun: an OSError(ENOSPC)
with the line, and the checkpoints already there stay as they are. The bytes needed are the newest complete
checkpoint's (its manifest), else the estimate from the model (`parallel.checkpoint_bytes`). After a write failed
(`explain`): the line is added to the error as a note (its type and message kept, for a script that matches on
them) when the error says so (ENOSPC, EDQUOT) or the space is short now, and for a folder this process may not write.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from hf_dist_recipes.core.sizes import format_size

SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_SPACE_WORDS = ("No space left on device", "Disk quota exceeded")


def needed_bytes(output_dir: str | os.PathLike, estimate: int) -> tuple[int, str]:
    """(bytes, where the number comes from): the newest complete checkpoint's files in `output_dir`, else `estimate`."""
    from hf_dist_recipes.checkpoint.manifest import check_checkpoint, checkpoints, read_manifest

    for checkpoint in reversed(checkpoints(output_dir)):
        if not check_checkpoint(checkpoint):
            return sum(read_manifest(checkpoint).files.values()), f"as {os.path.basename(checkpoint)} took"
    return estimate, "estimated from the model"


def free_bytes(folder: str | os.PathLike) -> int:
    """Bytes free to this process on the file system of `folder` (or of its nearest existing parent)."""
    path = Path(folder).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def line(folder: str | os.PathLike, free: int, needed: int, source: str) -> str:
    return (
        f"{folder}: not enough disk space for a checkpoint: {_bytes(free)} free, a checkpoint of this job takes "
        f"{_bytes(needed)} ({source}); free space, lower save_total_limit, or set output_dir on a larger disk"
    )


def _bytes(n: int) -> str:
    return f"{n:,} bytes ({format_size(n)})"


def shortage(folder: str | os.PathLike, needed: int, source: str) -> str | None:
    """The line when `folder`'s file system has fewer than `needed` bytes free; None when it has enough."""
    free = free_bytes(folder)
    return line(folder, free, needed, source) if free < needed else None


def explain(error: BaseException, folder: str | os.PathLike, needed: int, source: str) -> str | None:
    """Add the line to `error` (a failed save into `folder`) as a note, and return it, when the disk is why: the
    error's chain names a full disk or quota, or the space is short now; or when `folder` is not writable."""
    chain, seen = [], error
    while seen is not None and len(chain) < 8:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if any(isinstance(e, PermissionError) for e in chain):
        said = f"{folder}: this process (uid {os.getuid()}) may not write there; set output_dir to a writable folder"
    elif any(getattr(e, "errno", None) in SPACE_ERRNOS or any(w in str(e) for w in _SPACE_WORDS) for e in chain) or (
        free_bytes(folder) < needed
    ):
        said = line(folder, free_bytes(folder), needed, source)
    else:
        return None
    error.add_note(said)
    return said
