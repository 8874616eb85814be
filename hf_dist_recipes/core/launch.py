"""Launching local ranks, once for every launcher: `accelerate launch` (or torchrun) of a module or a script.

`Launch` describes one launch (the accelerate config or the process count, the machine rank and main address, what
each rank runs, environment overrides, the timeout, a log file); `Launch.argv()` is the command line and
`Launch.child_env()` the ranks' environment, with this package's root first on PYTHONPATH so the ranks import it
from the same place as the caller, installed or not. `run_launch` (or `run_process` for any command line) runs it
in a session of its own and waits, with a deadline; on the deadline, on `stop()`, or on Ctrl-C it ends the whole
process tree: SIGTERM to the launcher's process group, then, after a grace, SIGKILL to every process the launcher
had started. The tree, not the launcher alone: torch elastic starts each rank in a session of its own, which a
signal to the launcher's group does not reach, and a rank left behind keeps its port and its cores.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

KILL_GRACE_S = 15.0  # after SIGTERM, the launcher's time to end its ranks before everything is SIGKILLed
POLL_S = 1.0  # how often the wait looks at `stop()` and the deadline
READER_JOIN_S = 10.0  # after the launch ends, the time its output readers get to drain the pipes

Launcher = Literal["accelerate", "torchrun"]
# inherit: this terminal (a progress bar stays a bar); to_stderr: the ranks' stdout on this process's stderr (its
# stdout stays for a result); discard; capture: stdout and stderr kept apart; merged: one stream, line by line.
Output = Literal["inherit", "to_stderr", "discard", "capture", "merged"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now: a job already training on this machine holds the launchers' default
    port 29500, and two launches must not share a rendezvous."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def package_root() -> Path:
    """The directory this package is imported from (a checkout's root, or site-packages)."""
    import hf_dist_recipes

    return Path(hf_dist_recipes.__file__).parents[1]


@dataclass(frozen=True)
class Launch:
    """One launch of local ranks. Exactly one of `module` (run as `-m module`) and `script` (a path); `args` follow it.

    accelerate: `config_file` (YAML), and optionally `num_processes`, `machine_rank`, `main_address`, `main_port`
    overriding it (None: the config's value). torchrun: `num_processes` ranks on this node (required),
    `main_address` (default 127.0.0.1), `main_port` (default: a free port, picked by `argv()`).
    `env` overrides the caller's environment; `env_defaults` applies only where the caller's environment lacks the
    variable; `python_path` adds import roots after this package's. `cwd`: the ranks' working directory (None: this
    process's). `timeout_s`: seconds for the whole launch (None: no deadline). `output`: a log file that receives the
    launch's output when `run_launch` reads it (output "capture" or "merged")."""

    module: str | None = None
    script: str | None = None
    args: tuple[str, ...] = ()
    launcher: Launcher = "accelerate"
    config_file: Path | None = None
    num_processes: int | None = None
    machine_rank: int | None = None
    main_address: str | None = None
    main_port: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    env_defaults: Mapping[str, str] = field(default_factory=dict)
    python_path: tuple[str, ...] = ()
    cwd: Path | None = None
    timeout_s: float | None = None
    output: Path | None = None

    def __post_init__(self) -> None:
        if (self.module is None) == (self.script is None):
            raise ValueError(
                f"a launch runs one module or one script, got module={self.module!r} script={self.script!r}"
            )
        if self.launcher == "torchrun" and not self.num_processes:
            raise ValueError("a torchrun launch needs num_processes (one rank per process on this node), e.g. 2")
        if self.launcher == "accelerate" and self.config_file is None:
            raise ValueError("an accelerate launch needs config_file, e.g. accelerate_configs/cpu_zero3_2proc.yaml")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds or None for no deadline, got {self.timeout_s!r}")

    @classmethod
    def of(cls, program: Sequence[str], **fields) -> Launch:
        """The launch of `program`, a script's command line (`[script, *args]`) or a module's (`["-m", module,
        *args]`), with the other fields as keywords."""
        program = [str(a) for a in program]
        if program[:1] == ["-m"]:
            return cls(module=program[1], args=tuple(program[2:]), **fields)
        return cls(script=program[0], args=tuple(program[1:]), **fields)

    def program(self) -> list[str]:
        """What each rank runs: `-m module args...` or `script args...`."""
        head = ["-m", self.module] if self.module is not None else [str(self.script)]
        return [*head, *self.args]

    def argv(self) -> list[str]:
        """The command line, with this interpreter (so the launcher is the one installed next to this package)."""
        if self.launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(self.num_processes)]
            if self.machine_rank is not None:
                cmd += ["--node-rank", str(self.machine_rank)]
            cmd += ["--master-addr", self.main_address or "127.0.0.1"]
            cmd += ["--master-port", str(self.main_port if self.main_port is not None else free_port())]
            return cmd + self.program()
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(self.config_file)]
        for flag, value in (
            ("--num_processes", self.num_processes),
            ("--machine_rank", self.machine_rank),
            ("--main_process_ip", self.main_address),
            ("--main_process_port", self.main_port),
        ):
            if value is not None:
                cmd += [flag, str(value)]
        return cmd + self.program()

    def child_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The ranks' environment: `base` (default this process's), this package's root and `python_path` first on
        PYTHONPATH (the ranks import the package from where the caller does, even uninstalled), `env_defaults`
        where `base` lacks them, then `env`."""
        env = dict(os.environ if base is None else base)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(package_root()), *map(str, self.python_path), env.get("PYTHONPATH")])
        )
        for key, value in self.env_defaults.items():
            env.setdefault(key, value)
        env.update(self.env)
        return env


@dataclass(frozen=True)
class LaunchResult:
    """How a launch ended. `returncode` is the launcher's (negative: the signal that ended it); `stdout` and
    `stderr` are what output "capture" kept ("merged" keeps the one stream in `stdout`); `timed_out`: ended by the
    deadline of `timeout_s` seconds; `stopped`: ended because `stop()` said so; `seconds`: wall time."""

    argv: list[str]
    returncode: int
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    stopped: bool = False
    seconds: float = 0.0
    timeout_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not (self.timed_out or self.stopped)

    def describe(self) -> str:
        """How it ended, for an error message: the timeout named when it was the cause."""
        if self.timed_out:
            return f"was stopped after its timeout of {self.timeout_s:g} s (the whole process tree was killed)"
        return f"ended with exit code {self.returncode}"


def run_launch(launch: Launch, *, base_env: Mapping[str, str] | None = None, **options) -> LaunchResult:
    """Run `launch` (its argv, environment, working directory, timeout and log file) with `run_process`, whose
    `output`, `on_line`, `stop`, `stop_grace_s` and `kill_grace_s` `options` may set."""
    return run_process(
        launch.argv(),
        env=launch.child_env(base_env),
        cwd=launch.cwd,
        timeout_s=launch.timeout_s,
        log_path=launch.output,
        **options,
    )


def run_process(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout_s: float | None = None,
    output: Output = "capture",
    log_path: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    stop: Callable[[], bool] | None = None,
    stop_grace_s: float = 2.0,
    kill_grace_s: float = KILL_GRACE_S,
) -> LaunchResult:
    """Run `argv` in a session of its own and wait for it. Output per `output` (see `Output`); with "capture" or
    "merged", each line also goes to `on_line` (without its newline) and to `log_path` as it arrives. The process
    tree is ended (`kill_tree`) after `timeout_s` seconds (`kill_grace_s` of grace), when `stop()` (polled every
    POLL_S) returns True (`stop_grace_s`: the caller has waited already), and on KeyboardInterrupt, which is then
    raised again: a Ctrl-C reaches only this process, the launch runs in its own session."""
    if log_path is not None and output not in ("capture", "merged"):
        raise ValueError(
            f"a log file needs output 'capture' or 'merged' (the launch's output read here), got {output!r}"
        )
    pipe = subprocess.PIPE
    stdout, stderr = {
        "inherit": (None, None),
        "to_stderr": (sys.stderr, None),
        "discard": (subprocess.DEVNULL, subprocess.DEVNULL),
        "capture": (pipe, pipe),
        "merged": (pipe, subprocess.STDOUT),
    }[output]
    start = time.perf_counter()
    log = open(log_path, "w") if log_path is not None else None  # noqa: SIM115 (closed in the finally below)
    lock = threading.Lock()
    kept: dict[str, list[str]] = {"stdout": [], "stderr": []}
    readers = []
    timed_out = stopped = False
    try:
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=None if env is None else dict(env),
            stdout=stdout,
            stderr=stderr,
            text=True,
            errors="replace",
            start_new_session=True,
        )

        def pump(stream: IO[str], into: list[str]) -> None:
            for line in stream:
                into.append(line)
                with lock:
                    if log is not None:
                        log.write(line)
                        log.flush()
                    if on_line is not None:
                        on_line(line.rstrip("\n"))

        for name in ("stdout", "stderr"):
            stream = getattr(proc, name)
            if stream is not None:
                readers.append(threading.Thread(target=pump, args=(stream, kept[name]), daemon=True))
                readers[-1].start()
        deadline = None if timeout_s is None else start + timeout_s
        try:
            while True:
                if stop is not None and stop():
                    kill_tree(proc, grace_s=stop_grace_s)
                    stopped = True
                    break
                now = time.perf_counter()
                if deadline is not None and now >= deadline:
                    kill_tree(proc, grace_s=kill_grace_s)
                    timed_out = True
                    break
                try:
                    proc.wait(timeout=POLL_S if deadline is None else min(POLL_S, deadline - now))
                    break
                except subprocess.TimeoutExpired:
                    continue
        except KeyboardInterrupt:
            kill_tree(proc, grace_s=kill_grace_s)
            raise
        for reader in readers:
            reader.join(timeout=READER_JOIN_S)
    finally:
        if log is not None:
            log.close()
    return LaunchResult(
        argv=list(argv),
        returncode=proc.returncode,
        stdout="".join(kept["stdout"]),
        stderr="".join(kept["stderr"]),
        timed_out=timed_out,
        stopped=stopped,
        seconds=time.perf_counter() - start,
        timeout_s=timeout_s,
    )


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:  # already gone
        return []


def kill_tree(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """End `proc` (started in its own session) and everything it started: SIGTERM to its process group (a launcher
    then ends its ranks itself), up to `grace_s` seconds for it to end (a second Ctrl-C cuts the grace short), then
    SIGKILL to every process of the tree that is still there (a rank in a session of its own, stopped or stuck)."""
    import psutil

    tree = set(_descendants(proc.pid))
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        pass
    # Processes started during the grace, and those started by ranks already listed (orphans leave the tree).
    tree.update(_descendants(proc.pid))
    for child in list(tree):
        try:
            tree.update(child.children(recursive=True))
        except psutil.Error:  # already ended
            pass
    for child in tree:
        try:
            child.kill()
        except psutil.Error:  # already ended
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
