"""Warm rank processes for the suite: a launched rank forked from an interpreter that has already imported torch,
transformers, accelerate and DeepSpeed, instead of a fresh `python -u script.py` that imports them again.

Why: every rank of every launch spends about 4 s of one core importing the stack before it runs a line of the
worker, and the suite's ~66 launches are CPU-bound on 2 cores (2026-12-05, 2 cores: the whole suite 926.8 s with
every rank fresh, 758.7 s warm). The ranks stay real processes started by the real launcher: `accelerate launch`
-> torchrun's elastic agent -> `PYTHON_EXEC` (torchrun's documented override of the interpreter it starts) ->
`warm_python.py`, which hands its argv, environment, working directory and stdin/stdout/stderr to one of these
servers and mirrors the rank's fate (exit code, or death by the same signal) back to the agent. Only the
interpreter start differs, and `warm_python.py` starts a fresh interpreter instead whenever the rank asks for
anything an import could have seen differently (PYTHON* variables, CUDA_VISIBLE_DEVICES, OMP threads, offline
flags: `IMPORT_TIME_ENV`).

What a fork shares that a fresh process would not, and what is done about it:
- numpy's global random state and torch's default generator: seeded again in the rank from the OS, as a fresh
  process seeds them (torch 2.13 too draws its default seed from the OS).
- Python's string-hash seed: two servers started with their own random seeds serve even and odd ranks, so
  neighbouring ranks disagree on set order as fresh processes would.
- py-cpuinfo's answer about this host, asked once (`_answer_cpuinfo_once`), instead of a new interpreter per ask.
A test that looks for its ranks in the launch's process tree (to stop one from outside, or to see that none
outlives a timeout) drops `PYTHON_EXEC` from its launch environment (tests.support.launch.fresh_env): a warm rank
lives outside that tree, beside its stand-in, and SIGSTOP cannot be forwarded.

Process layout: server -> (per rank) reaper -> rank. The reaper forwards the signals warm_python.py receives, kills
the rank if warm_python.py disappears (SIGKILL cannot be forwarded), and reports how the rank ended.

    python -u warm_ranks.py SOCKET_PATH     # touches SOCKET_PATH.ready once it accepts ranks
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

HEADER = struct.Struct("!I")  # the request's length in bytes; the three stdio fds ride along with it
SERVERS = 2  # even and odd ranks get different string-hash seeds
READY_TIMEOUT_S = 120  # importing the stack takes ~5 s per server on 2 idle cores
STAND_INS = "stand-ins"  # in the servers' folder: a file per stand-in (named by its pid) holding its rank's pid


def summary_line(counts: Counter) -> str:
    """pytest's summary line for `WarmServers.counts()`: every rank of the session, whichever worker launched it."""
    fresh = Counter({key.split(":", 1)[1]: n for key, n in counts.items() if key.startswith("fresh:")})
    why = ", ".join(f"{n} {reason}" for reason, n in fresh.most_common())
    line = f"ranks: {counts['warm']} forked warm, {fresh.total()} started fresh" + (f" ({why})" if why else "")
    launchers = Counter({key.split(":", 1)[1]: n for key, n in counts.items() if key.startswith("launcher:")})
    if launchers:
        line += f"; launchers: {launchers['warm']} forked warm, {launchers.total() - launchers['warm']} started fresh"
    return line


class WarmServers:
    """The running servers and the environment that points torchrun at them (`env`, to add to os.environ).

    One process starts them (`WarmServers(...)`: pytest's xdist controller for the whole session, or a serial pytest
    for itself); the xdist workers `attach` to them with what `handover` gives. Each server imports the stack
    (about 5 s of one core), so one pair for the session instead of one per worker saves 4 of those imports on
    `make test`'s 3 workers, all at the start, when every worker waits for its servers.

    `count` servers (ranks go to server RANK % count); `inside` wraps each server's command line, to start it in
    another network namespace (tests.support.netns.Host.command), whose ranks must be forked there."""

    def __init__(
        self,
        directory: Path,
        server_env: dict[str, str],
        *,
        count: int = SERVERS,
        inside: Callable[[list[str]], list[str]] | None = None,
    ) -> None:
        from tests.support import warm_python

        self.directory = directory
        self.log = directory / "servers.log"
        client = directory / "python"
        # -I: the client needs only the standard library, and no PYTHON* variable of the rank's may change it.
        client.write_text(f"#!{sys.executable} -I\n" + Path(warm_python.__file__).read_text())
        client.chmod(0o755)
        self.sockets = [str(directory / f"rank{i}.sock") for i in range(count)]
        wrap = inside or (lambda argv: argv)
        with self.log.open("w") as log:
            self.processes = [
                subprocess.Popen(wrap([sys.executable, "-u", __file__, path]), env=server_env, stdout=log, stderr=log)
                for path in self.sockets
            ]
        self.pids = [process.pid for process in self.processes]
        self.ranks_log = directory / "ranks.log"  # warm_python.py's line per rank
        self.env = {
            "PYTHON_EXEC": str(client),
            warm_python.LOG: str(self.ranks_log),
            warm_python.SOCKETS: os.pathsep.join(self.sockets),
            warm_python.PYTHON: sys.executable,
            warm_python.SERVER_ENV: json.dumps(
                dict(warm_python.import_time_env(server_env), PYTHONPATH=server_env.get("PYTHONPATH", ""))
            ),
        }

    def handover(self) -> dict:
        """What another process needs to `attach` (JSON-serialisable: it travels in xdist's workerinput)."""
        return {"directory": str(self.directory), "pids": self.pids, "env": self.env}

    @classmethod
    def attach(cls, handed: dict) -> WarmServers:
        """The servers another process started (`handover`): this process uses them, never stops them."""
        from tests.support import warm_python

        servers = cls.__new__(cls)
        servers.directory = Path(handed["directory"])
        servers.log = servers.directory / "servers.log"
        servers.sockets = handed["env"][warm_python.SOCKETS].split(os.pathsep)
        servers.processes = []
        servers.pids = list(handed["pids"])
        servers.ranks_log = servers.directory / "ranks.log"
        servers.env = dict(handed["env"])
        return servers

    def wait_ready(self) -> None:
        """Block until every server accepts ranks (its socket's `.ready` file); raise with the servers' log if one
        died or took too long."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(os.path.exists(path + ".ready") for path in self.sockets):
            if time.monotonic() > deadline or not all(_alive(pid) for pid in self.pids):
                self.stop()
                log = self.log.read_text() if self.log.exists() else "(no log)"
                raise RuntimeError(f"a warm rank server did not start:\n{log[-3000:]}")
            time.sleep(0.1)

    def rank_behind(self, stand_in_pid: int) -> int | None:
        """The pid of the rank that `stand_in_pid` (a warm_python.py process: what the launch's process tree holds)
        stands in for, or None for a process that stands in for none. For a test that signals a rank itself with what
        cannot be forwarded (SIGSTOP): the rank is a child of a server, not of its stand-in."""
        try:
            return int((self.directory / STAND_INS / str(stand_in_pid)).read_text())
        except (OSError, ValueError):
            return None

    def counts(self) -> Counter:
        """How this session's ranks started: {"warm": N, "fresh:<why>": M, ...}, and its launchers under "launcher:"
        keys (tests.support.launch.accelerate_launch, and the launchers of commands: warm_python.LAUNCHERS);
        `summary_line` renders it."""
        from tests.support.warm_python import LAUNCHERS

        lines = self.ranks_log.read_text().splitlines() if self.ranks_log.exists() else []
        return Counter(
            ("launcher:" if line.split()[-1] in LAUNCHERS else "")
            + ("warm" if line.startswith("warm ") else f"fresh:{line.split()[1]}")
            for line in lines
        )

    def stop(self) -> None:
        """End the servers this process started (an attached process has none to end)."""
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a server that died but is not yet reaped by the process that started it
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _die_with_parent() -> None:
    """The server goes when pytest goes, however pytest ends (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _preimport() -> None:
    """Import what every worker imports.

    That includes DeepSpeed's Muon optimizer: every ZeRO engine's start imports it (0.19.8 runtime/zero/utils.py
    `is_zero_supported_optimizer`, on purpose not at `import deepspeed`), and its `torch.compile` decorators import
    torch._dynamo and torch._inductor (and networkx): about 1 s of one core in each rank, nearly all that a forked
    rank still imported (measured 2026-12-06: 1.05 s of the 1.3 s of CPU a rank spent importing after the fork).
    Decorating compiles nothing; the variables those configs read are among warm_python.IMPORT_TIME_PREFIXES.

    And the package's trainer, which nearly every rank imports (about 0.15 s of one core each, measured with py-spy
    over a run of 4 launching files, 2026-12-07). None of its modules reads the environment at import; a rank whose
    PYTHONPATH brings another copy of the package starts fresh (warm_python._shadowing)."""
    import accelerate  # noqa: F401
    import datasets  # noqa: F401
    import deepspeed  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments  # noqa: F401

    import hf_dist_recipes.trainer  # noqa: F401

    _answer_cpuinfo_once()
    _build_weight_conversions()


def _build_weight_conversions() -> None:
    """transformers builds its table of checkpoint weight conversions (270 model types, about 1,000 renamings and
    conversions, each compiling its regular expressions) the first time a process loads or saves a model
    (`from_pretrained`, `save_pretrained`, the HF weights of a checkpoint): 0.06 s of one core in each rank that does.
    The table is the same in every process of one installation (transformers 5.23, the floor, builds it the same way);
    a rank that registers its own conversion adds to it here as in a fresh one
    (`register_checkpoint_conversion_mapping`)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # a transformers without the table: nothing to build
        return
    get_checkpoint_conversion_mapping("llama")  # builds the table for every type, returns a copy of one


def weight_conversions(model_type: str) -> list:
    """What this process's transformers converts when it loads a `model_type` checkpoint (kind, source and target
    patterns): test_warm_ranks compares a warm rank's answer with the test process's own."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    return [
        [type(t).__name__, list(t.source_patterns), list(t.target_patterns)]
        for t in get_checkpoint_conversion_mapping(model_type) or []
    ]


def _answer_cpuinfo_once() -> None:
    """DeepSpeedCPUAdam asks py-cpuinfo for the CPU's vendor each time one is built (0.19.8 ops/adam/cpu_adam.py),
    and py-cpuinfo answers from a new interpreter each time (`get_cpu_info` runs `python cpuinfo.py`: about 0.55 s
    of one core; 31 of them in a `make test`, measured 2026-12-07). A rank forked from here gets this host's answer,
    asked once, as a copy: the same host, so the same answer a fresh rank would get."""
    try:
        import cpuinfo  # DeepSpeed's requirement; absent, there is nothing to answer
    except ImportError:
        return
    cpuinfo.get_cpu_info = asked_once(cpuinfo.get_cpu_info)


def asked_once(get_cpu_info: Callable[[], dict]) -> Callable[[], dict]:
    """py-cpuinfo's `get_cpu_info`, asked now, answering each later call with its own copy (a caller's edit does not
    reach the next caller). The servers install it for their ranks; a test that builds several DeepSpeedCPUAdam
    in its own process sets it with monkeypatch."""
    import copy
    import functools

    return functools.partial(copy.deepcopy, get_cpu_info())


def _serve(listener: socket.socket) -> socket.socket:
    """Accept ranks forever; returns only in a forked reaper, with that rank's connection."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the reapers are reaped by the kernel
    while True:
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            return conn
        conn.close()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
    while len(head) < HEADER.size:
        head += conn.recv(HEADER.size - len(head))
    (size,) = HEADER.unpack(head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise EOFError("warm_python.py went away mid-request")
        body += chunk
    return json.loads(body), fds


def _reap(conn: socket.socket, rank_pid: int, test: str) -> None:
    """Forward signal numbers from warm_python.py to the rank until it ends, then report how it ended (and its CPU
    time, charged to `test`: tests.support.cpu_time). First, which rank the stand-in at the other end of `conn`
    stands in for (`WarmServers.rank_behind`)."""
    stand_ins = Path(sys.argv[1]).parent / STAND_INS
    stand_in_pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    try:
        stand_ins.mkdir(exist_ok=True)
        (stand_ins / f"{stand_in_pid}.tmp").write_text(str(rank_pid))
        os.replace(stand_ins / f"{stand_in_pid}.tmp", stand_ins / str(stand_in_pid))  # whole or absent to a reader
    except OSError:
        pass
    pidfd = os.pidfd_open(rank_pid)
    while True:
        ready, _, _ = select.select([conn, pidfd], [], [])
        if pidfd in ready:
            _, status, rusage = os.wait4(rank_pid, 0)
            try:
                cpu_time.record_rank(Path(sys.argv[1]).parent, test, rusage)
            except OSError:
                pass
            report = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"code": os.WEXITSTATUS(status)}
            try:
                conn.sendall(json.dumps(report).encode() + b"\n")
            except OSError:
                pass
            os._exit(0)
        data = conn.recv(64)
        if not data:  # warm_python.py is gone (SIGKILLed): its rank must not outlive it
            os.kill(rank_pid, signal.SIGKILL)
            os.waitpid(rank_pid, 0)
            os._exit(0)
        for number in data.split():
            try:
                os.kill(rank_pid, int(number))
            except ProcessLookupError:
                pass


def _become_rank(request: dict, fds: list[int]) -> str:
    """Turn this fork into the rank warm_python.py would have been; returns the script (or module) to run."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]  # [SCRIPT, ARGS...] or ["-m", MODULE, ARGS...]
    module = argv[1] if argv[0] == "-m" else None
    # As a fresh interpreter builds it: the script's directory (the working directory for -m), the rank's
    # PYTHONPATH, then the installation's.
    sys.argv = ["-m", *argv[2:]] if module else list(argv)  # run_module puts the module's file in argv[0]
    first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
    server_path = os.path.dirname(os.path.abspath(__file__)), *_PYTHONPATH.split(os.pathsep)
    rank_path = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    sys.path[:] = [first, *rank_path] + [e for e in sys.path[1:] if e not in server_path]

    import numpy
    import torch

    _start_launchers_warm()  # a command's own launcher (preflight, demo) forked warm too, by the same rules
    torch.seed()  # from the OS, as torch seeds a new process's default generator
    numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
    return module or argv[0]


_PYTHONPATH = os.environ.get("PYTHONPATH", "")  # the server's, to tell its entries from the installation's

if __name__ == "__main__":
    _die_with_parent()
    _preimport()
    import cpu_time  # this file's folder, sys.path[0]
    from warm_python import start_launchers_warm as _start_launchers_warm

    # The imported stack (about 430,000 objects) moves to the permanent generation: a rank's full collections
    # then neither scan it nor write its GC headers, which would copy every page of it out of the shared fork
    # (the CPython docs' advice for fork without exec).
    gc.collect()
    gc.freeze()
    # What the servers imported, by top-level name, for warm_python.py to tell whether a rank's PYTHONPATH brings
    # another copy of any of it (then the rank starts fresh).
    Path(sys.argv[1] + ".modules").write_text("\n".join(sorted({name.split(".")[0] for name in sys.modules})))
    # The accelerator DeepSpeed chose while being imported, for warm_python.py: a rank whose DS_ACCELERATOR names
    # that one (the demo names "cpu" on a host without CUDA) would import the same state.
    from deepspeed.accelerator import get_accelerator

    Path(sys.argv[1] + ".accelerator").write_text(get_accelerator().device_name())
    _listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _listener.bind(sys.argv[1])
    _listener.listen(128)
    Path(sys.argv[1] + ".ready").touch()  # WarmServers.wait_ready, in whichever process waits
    _conn = _serve(_listener)
    _request, _fds = _receive(_conn)
    _rank_pid = os.fork()
    if _rank_pid != 0:
        for _fd in _fds:
            os.close(_fd)
        _reap(_conn, _rank_pid, _request["env"].get("PYTEST_CURRENT_TEST", ""))
    _conn.close()
    _request_is_module = _request["argv"][0] == "-m"
    _script = _become_rank(_request, _fds)
    # At module level, outside any try: the script's SystemExit and uncaught exceptions end this process exactly as
    # they end `python -u script.py` (traceback, sys.last_value, atexit handlers, exit code 1).
    import runpy

    del _conn, _request, _fds, _listener
    if _request_is_module:
        runpy.run_module(_script, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(_script, run_name="__main__")
