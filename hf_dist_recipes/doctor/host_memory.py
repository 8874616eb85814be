"""The host memory this process may use: the machine's (MemTotal) or, when smaller, its cgroup's limit.

A Slurm job (`--mem`), a container (`docker --memory`) or a systemd slice caps what the ranks of a node may hold
below what the machine has; the kernel's OOM killer acts at the cgroup's limit, not at MemTotal. Both cgroup
layouts are read: v2 (`0::/path` in /proc/self/cgroup, `memory.max` in that folder and every folder above it; the
tightest wins, as the kernel applies each) and v1 (`N:memory:/path`, `memory.limit_in_bytes`). A limit of "max",
or v1's "no limit" (2^63 rounded down to a page), is no limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NO_LIMIT = 2**62  # above this a cgroup v1 limit means "none" (the kernel writes 9223372036854771712)


@dataclass(frozen=True)
class HostMemory:
    """`total`: MemTotal in bytes (None when unreadable); `cgroup_limit`: the tightest cgroup memory limit of this
    process in bytes (None: none set); `cgroup_path`: the folder that sets it."""

    total: int | None
    cgroup_limit: int | None = None
    cgroup_path: str | None = None

    @property
    def usable(self) -> int | None:
        """What the ranks of this node may hold together: the smaller of the two."""
        known = [v for v in (self.total, self.cgroup_limit) if v is not None]
        return min(known) if known else None

    def describe(self) -> str:
        if self.cgroup_limit is not None and (self.total is None or self.cgroup_limit < self.total):
            return f"the cgroup limit of {self.cgroup_path}"
        return "MemTotal of /proc/meminfo"


def mem_total(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemTotal in bytes, None when the file cannot be read (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB, meaning KiB
    except OSError:
        return None
    return None


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit() or int(text) >= NO_LIMIT:
        return None
    return int(text)


def cgroup_limit(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")):
    """(limit in bytes, the folder setting it) of the tightest memory limit on this process, (None, None) if none.
    `proc_cgroup`, `root`: the files to read (tests hand over a tree of their own)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    found: list[tuple[int, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2: the one unified hierarchy
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        folder = base / rel.lstrip("/")
        # Inside a container the path named may not exist (its own cgroup is mounted as the root): read the root.
        for d in [folder, *folder.parents] if folder.is_dir() else [base]:
            if not str(d).startswith(str(base)):
                break
            limit = _read_limit(d / name)
            if limit is not None:
                found.append((limit, str(d)))
    if not found:
        return None, None
    return min(found)


def host_memory() -> HostMemory:
    """This process's host memory facts."""
    limit, path = cgroup_limit()
    return HostMemory(total=mem_total(), cgroup_limit=limit, cgroup_path=path)
