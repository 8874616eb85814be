"""Writing a file that another process may read while it is written: through a temporary file and a rename."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_atomically(path: str | os.PathLike, data: str | bytes, *, durable: bool = False) -> None:
    """Write `data` (text as UTF-8) to `path` so that a reader sees the old file or the new one, never half of one
    (another node's rank reading a shared directory, a report rewritten after each check). The temporary file,
    `.<name>.<pid>.<thread>.tmp` beside `path`, is one per writer: a signal-handling thread and the main thread may
    write the same file at once. `durable` (default False): fsync before the rename, for a process about to end."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
