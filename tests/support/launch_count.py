"""How many multi-process launches a pytest session makes: the number the suite's length follows (each rank
imports torch, transformers and DeepSpeed, about 8 s of one core, before it does anything).

A daemon thread polls /proc every 0.2 s for processes new since the last look that descend from this pytest
process, and counts
- a launched rank 0: RANK=0 in its starting environment while its parent's has none (so a rank's own children,
  DataLoader workers or the op build, which inherit RANK=0, do not count), one per `accelerate launch`, torchrun,
  demo or preflight launch; an `accelerate launch` forked from a warm rank server counts as its stand-in instead
  (its ranks descend from the server);
- a `notebook_launcher` launch inside a notebook kernel: its ranks are forks of the kernel, whose environment shows
  no RANK, so the first forked child of a kernel while none of its others is alive counts as one launch.
Each launch is charged to the test that was running (module-scoped fixtures to the first test of their module).
Linux only; elsewhere the count says it was not taken."""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

from tests.support.warm_python import LAUNCHERS

POLL_S = 0.2
EXEC_GRACE_S = 3.0  # a process this young without RANK=0 may not have exec'd yet
PROC = Path("/proc")


def _read(pid: int, name: str) -> bytes | None:
    try:
        return (PROC / str(pid) / name).read_bytes()
    except OSError:  # gone already, or not ours to read
        return None


def _parent(pid: int) -> int | None:
    status = _read(pid, "status")
    if status is None:
        return None
    for line in status.splitlines():
        if line.startswith(b"PPid:"):
            return int(line.split()[1])
    return None


def _has_rank0(pid: int) -> bool:
    environ = _read(pid, "environ")
    return environ is not None and b"RANK=0" in environ.split(b"\0")


def _age_s(pid: int) -> float:
    """Seconds since `pid` started (0 when unknown: it is looked at again)."""
    stat = _read(pid, "stat")
    try:
        start_ticks = int(stat.rsplit(b")", 1)[1].split()[19])  # field 22, after the command name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (AttributeError, IndexError, ValueError, OSError):
        return 0.0
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


LAUNCHER_MODULE = LAUNCHERS[0]  # accelerate launch


# Our commands that make one launch each (a --dry-run makes none), started by a test through the warm servers'
# client (tests.support.launch.python_for): their launcher and ranks then descend from a server.
LAUNCHING_COMMANDS = (b"demo", b"preflight", b"commbench", b"calibrate")


def _is_warm_launcher(pid: int) -> bool:
    """A launcher run by the warm rank servers' client (tests.support.launch.accelerate_launch, or a command's own
    launcher: warm_python.start_launchers_warm), or one of
    our LAUNCHING_COMMANDS run by it: the stand-in of a process forked from a server, whose launch is then the
    server's descendant, counted as this stand-in."""
    client = os.environ.get("PYTHON_EXEC")
    cmdline = _read(pid, "cmdline")
    if not client or cmdline is None:
        return False
    args = cmdline.split(b"\0")
    if client.encode() not in args[:3]:
        return False
    if any(module.encode() in args for module in LAUNCHERS):  # a test's own launch, or a command's launcher
        return True
    cli = b"hf_dist_recipes.cli.main" in args and b"--dry-run" not in args
    return cli and any(command in args for command in LAUNCHING_COMMANDS)


def _is_kernel(pid: int) -> bool:
    cmdline = _read(pid, "cmdline")
    return cmdline is not None and b"ipykernel_launcher" in cmdline


class LaunchCounter:
    """Counts launches made by descendants of `root` (this process) while `start()`ed."""

    def __init__(self, root: int | None = None) -> None:
        self.root = root or os.getpid()
        self.current = "(session)"  # the test running now, set by the pytest_runtest_logstart hook
        self.by_test: Counter[str] = Counter()
        self._seen: set[int] = set()
        # Warm rank servers (tests.support.warm_ranks): their forks show the server's starting environment, so a
        # program a rank execs would look like a new rank 0; the rank was counted as its warm_python.py stand-in.
        self.excluded: set[int] = set()
        # Launchers forked from those servers are counted as their stand-ins (`_is_warm_launcher`); one that fell back
        # to a fresh interpreter (the same process, exec'd) has ranks of its own, not counted again.
        self._warm_launchers: set[int] = set()
        self._kernel_forks: dict[int, set[int]] = {}  # kernel pid -> its forked children alive at the last look
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def total(self) -> int:
        return sum(self.by_test.values())

    def available(self) -> bool:
        return (PROC / str(self.root) / "status").exists()

    def start(self) -> None:
        if not self.available():
            return
        self._seen = set(self._pids())
        self._thread = threading.Thread(target=self._run, name="launch-counter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self.poll()

    def _pids(self) -> list[int]:
        return [int(p) for p in os.listdir(PROC) if p.isdigit()]

    def _ours(self, pid: int) -> bool:
        for _ in range(64):  # ancestry depth bound: pytest -> CLI -> accelerate -> agent -> rank is 5
            parent = _parent(pid)
            if parent is None or parent <= 1 or parent in self.excluded:
                return False
            if parent == self.root:
                return True
            pid = parent
        return False

    def poll(self) -> None:
        """One look at /proc: count the launches among the processes started since the last look."""
        pids = self._pids()
        alive = set(pids)
        for forks in self._kernel_forks.values():
            forks &= alive
        for pid in pids:
            if pid in self._seen:
                continue
            parent = _parent(pid)
            if parent is None or not self._ours(pid):
                self._seen.add(pid)
                continue
            if _has_rank0(pid) and not _has_rank0(parent):
                if parent not in self._warm_launchers:
                    self.by_test[self.current] += 1
            elif _is_warm_launcher(pid):
                self.by_test[self.current] += 1
                self._warm_launchers.add(pid)
            elif _is_kernel(pid) and _is_kernel(parent):  # a fork of a notebook kernel: a notebook_launcher rank
                forks = self._kernel_forks.setdefault(parent, set())
                if not forks:
                    self.by_test[self.current] += 1
                forks.add(pid)
            elif _age_s(pid) < EXEC_GRACE_S:
                # Caught between fork and exec, it still shows its parent's environment: look again next time.
                continue
            self._seen.add(pid)
        self._seen &= alive
        self._warm_launchers &= alive

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def summary_lines(self) -> list[str]:
        if not self.available():
            return ["launches: not counted (no /proc on this platform)"]
        by_file: Counter[str] = Counter()
        for test, n in self.by_test.items():
            by_file[test.split("::")[0]] += n
        lines = [f"launches: {self.total} (rank-0 processes started)"]
        lines += [f"  {n:3d} {path}" for path, n in sorted(by_file.items())]
        return lines


COUNTER = LaunchCounter()
