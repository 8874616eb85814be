"""Each rank's state at a hang, on disk: torch's flight recorder (the last collectives) and every thread's stack.

`dump_rank_state(output_dir, reason, message)` writes, into `<output_dir>/flight_recorder/` (`FLIGHT_RECORDER_DIR`,
where NCCL's own dump on timeout also lands, `comm.nccl_defaults`):
- `rank_<N>`: torch's own pickle of its flight recorder (torch 2.13 records every collective of Gloo and NCCL: op,
  sequence id, process group, sizes, the Python frames that called it), the file `python -m
  torch.distributed.flight_recorder.fr_trace` reads (`_compat.torch.flight_recorder_trace`);
- `stack_rank_<N>.json`: `{"rank", "reason" ("lost_peer" | "timeout" | "signal"), "time" (unix seconds), "message",
  "pid", "host", "flight_recorder" (the pickle's file name, null when the recorder gave none), "threads": [{"name",
  "is_main", "frames": [{"file", "line", "function", "code"}]}]}`, innermost frame LAST;
- `stack_rank_<N>.txt`: the same stacks as text for people, faulthandler's layout (most recent call first).
Each file is written to a temporary name and renamed, so a reader never sees half a file.

A rank that Gloo itself aborts writes none of them: a collective whose peer sent more bytes than it expects (the
same op with other shapes; a skipped collective whose neighbour is larger) ends the process with SIGABRT from a
Gloo thread ("op.preamble.length <= op.nbytes ... Is there a distributed collective mismatch in your code?"), where
no Python runs. `FatalStacks` keeps `fatal_rank_<N>.txt` open for `faulthandler`, which writes every thread's
Python stack into it on SIGABRT, SIGSEGV, SIGFPE, SIGBUS or SIGILL; the file is removed when it stayed empty.

Who calls it (`comm.watchdog.HangWatchdogCallback`): every surviving rank when the heartbeat names a lost rank
(before the process ends with exit code 3), a rank whose collective failed or timed out (from `RecipeTrainer.train`;
the main thread's stack is then the failed call's, from the exception), and any rank sent `DUMP_SIGNAL` (SIGUSR1;
`SignalDump`: a thread does the dump, because Python runs signal handlers only in the main thread, which a hung rank
has blocked inside a C++ collective). `hf-dist-recipes logs hang <output_dir>` reads the files of all ranks.

No torch.distributed or transformers import at module level: the offline reader imports the constants.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import linecache
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hf_dist_recipes.core.files import write_atomically
from hf_dist_recipes.core.gather import process_rank

FLIGHT_RECORDER_DIR = "flight_recorder"
FLIGHT_RECORDER_PREFIX = "rank_"  # torch's dump (ours and NCCL's own) is <prefix><global rank>
STACK_PREFIX = "stack_rank_"
FATAL_PREFIX = "fatal_rank_"  # faulthandler's text of a rank that died of a fatal signal (FatalStacks)
REASONS = ("lost_peer", "timeout", "signal")
# SIGUSR1: neither torchrun (its agent handles SIGTERM, SIGINT, SIGHUP, SIGQUIT unless --signals-to-handle says
# otherwise), accelerate, DeepSpeed nor transformers installs a handler for it (read in their sources, the versions in
# _compat.PROVEN). Send it to the rank processes, not to the launcher (whose default action for it is to exit).
DUMP_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str
    code: str


@dataclass(frozen=True)
class ThreadStack:
    name: str
    is_main: bool
    frames: list[Frame] = field(default_factory=list)  # innermost last


def flight_recorder_dir(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / FLIGHT_RECORDER_DIR


def set_aside_dumps(output_dir: str | os.PathLike) -> str | None:
    """Before a launch's ranks write into `<output_dir>/flight_recorder/` (once, rank 0, at the first train() of the
    process): what an earlier launch or attempt left there goes aside, so that `logs hang` reads one launch's dumps.
    Empty files (the `FatalStacks` file of a rank that was killed) are removed; the rest moves to
    `flight_recorder.attempt-<unix time of its newest file>`, which is returned (None: nothing was kept)."""
    folder = flight_recorder_dir(output_dir)
    if not folder.is_dir():
        return None
    for path in folder.iterdir():
        if path.is_file() and path.stat().st_size == 0:
            path.unlink(missing_ok=True)
    left = list(folder.iterdir())
    if not left:
        return None
    target = folder.with_name(f"{FLIGHT_RECORDER_DIR}.attempt-{max(int(p.stat().st_mtime) for p in left)}")
    while target.exists():  # two attempts ended in the same second
        target = target.with_name(target.name + "+")
    os.replace(folder, target)
    return str(target)


def hang_report_hint(output_dir: str | None) -> str:
    """The sentence that points a failure message at the dumps and the command that reads them."""
    if not output_dir:
        return ""
    return (
        f" Each surviving rank wrote its flight recorder and stacks to {flight_recorder_dir(output_dir)}: run "
        f"`hf-dist-recipes logs hang {output_dir}` for the collective where the ranks part, which rank never "
        "arrived and each rank's line of code."
    )


def _frames(summary: traceback.StackSummary) -> list[Frame]:
    return [
        Frame(f.filename, f.lineno or 0, f.name, (f.line or linecache.getline(f.filename, f.lineno or 0)).strip())
        for f in summary
    ]


def error_frames(error: BaseException) -> list[Frame] | None:
    """The stack of the call that raised `error`, outermost first: the frames above the one that caught it, then
    the traceback down to the raise. None without a traceback."""
    tb = error.__traceback__
    if tb is None:
        return None
    return _frames(traceback.extract_stack(tb.tb_frame.f_back)) + _frames(traceback.extract_tb(tb))


def is_collective_error(error: BaseException) -> bool:
    """An error a failed collective raises: torch's DistError family, or the RuntimeError Gloo raises when a peer's
    connection closes or resets or a collective times out (torch 2.13 raises a plain RuntimeError from
    gloo/transport/tcp)."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in ("connection closed by peer", "connection reset by peer", "gloo", "nccl")
    )


def _handled_collective_error(ident: int) -> BaseException | None:
    """The collective error thread `ident` is handling now, if any (CPython's `sys._current_exceptions`: a
    (type, value, traceback) tuple on 3.11, the exception from 3.12)."""
    current = getattr(sys, "_current_exceptions", dict)().get(ident)
    error = current[1] if isinstance(current, tuple) else current
    return error if error is not None and is_collective_error(error) else None


def thread_stacks(main_frames: list[Frame] | None = None) -> list[ThreadStack]:
    """Every Python thread's stack now (the calling thread's too); `main_frames` replaces the main thread's (the
    stack of a failed collective, whose frames have unwound by the time the failure is handled). Without it, a
    main thread that is handling a collective error (a signal or the heartbeat came between the raise and the
    recipe's own dump) shows that error's stack, where it waited, not the error handling's."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    if main_frames is None and (handled := _handled_collective_error(main)) is not None:
        main_frames = error_frames(handled)
    stacks = []
    for ident, frame in sys._current_frames().items():
        frames = _frames(traceback.extract_stack(frame))
        if ident == main and main_frames is not None:
            frames = main_frames
        stacks.append(ThreadStack(names.get(ident, f"thread {ident}"), ident == main, frames))
    stacks.sort(key=lambda s: (not s.is_main, s.name))
    return stacks


def stacks_text(stacks: list[ThreadStack]) -> str:
    """faulthandler's layout: one block per thread, the current thread's calls most recent first."""
    blocks = []
    for s in stacks:
        lines = [f'Thread "{s.name}"{" (main)" if s.is_main else ""} (most recent call first):']
        for f in reversed(s.frames):
            lines.append(f'  File "{f.file}", line {f.line} in {f.function}')
            if f.code:
                lines.append(f"    {f.code}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def dump_rank_state(
    output_dir: str | os.PathLike,
    reason: str,
    message: str,
    *,
    error: BaseException | None = None,
    rank: int | None = None,
) -> Path:
    """Write this rank's flight recorder and stacks into `<output_dir>/flight_recorder/`; returns the path of its
    `stack_rank_<N>.json`. `error`: the collective's exception, whose traceback becomes the main thread's stack.
    `rank` defaults to the global rank (the `RANK` variable before a process group exists). Never raises for a
    recorder that cannot dump (off: `TORCH_FR_BUFFER_SIZE=0`): the stacks are written all the same."""
    from hf_dist_recipes._compat import torch as compat_torch

    if reason not in REASONS:
        raise ValueError(f"reason={reason!r}: use one of {', '.join(REASONS)}")
    rank = process_rank() if rank is None else rank
    directory = flight_recorder_dir(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    stacks = thread_stacks(error_frames(error) if error is not None else None)
    recorder = f"{FLIGHT_RECORDER_PREFIX}{rank}"
    try:
        trace = compat_torch.flight_recorder_trace()
    except Exception as err:  # a dump must not fail for want of the recorder's part
        trace, message = None, f"{message} [flight recorder not dumped: {err}]"
    if trace:
        write_atomically(directory / recorder, trace, durable=True)
    record = {
        "rank": rank,
        "reason": reason,
        "time": time.time(),
        "message": message,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "flight_recorder": recorder if trace else None,
        "threads": [asdict(s) for s in stacks],
    }
    path = directory / f"{STACK_PREFIX}{rank}.json"
    write_atomically(
        directory / f"{STACK_PREFIX}{rank}.txt", f"# {reason}: {message}\n\n{stacks_text(stacks)}", durable=True
    )
    write_atomically(path, json.dumps(record, indent=1), durable=True)
    return path


class AutomaticDump:
    """One automatic dump per process (a lost peer, a failed collective): the first failure's state is the one
    that explains the hang; what follows it (the heartbeat naming the peer after a collective already failed) would
    overwrite it with the stack of the error handling."""

    def __init__(self, output_dir: str | os.PathLike):
        self.output_dir = output_dir
        self.path: Path | None = None
        self._lock = threading.Lock()

    def __call__(self, reason: str, message: str, error: BaseException | None = None) -> Path | None:
        with self._lock:
            if self.path is None:
                try:
                    self.path = dump_rank_state(self.output_dir, reason, message, error=error)
                except Exception as err:  # a full disk must not keep the rank from ending
                    print(f"[hf_dist_recipes] could not write the hang dump: {err}", file=sys.stderr, flush=True)
            return self.path


class SignalDump:
    """Dump this rank's state each time it receives `signum` (default `DUMP_SIGNAL`), also while its main thread
    is blocked in a collective: the signal's C-level handler writes its number to the wakeup fd
    (`signal.set_wakeup_fd`), which a daemon thread reads. The Python-level handler only chains to the handler that
    was installed before, if any. Where another wakeup fd is already set (an asyncio loop), that one is kept and
    the dump runs in the Python-level handler instead (when the main thread next runs Python).

    With `on_terminate` (an `AutomaticDump`) and SIGTERM at its default action, SIGTERM first writes this rank's
    state through it (unless a failure already did), then ends the process as before: torchrun ends the other ranks
    with SIGTERM as soon as one fails, which would otherwise kill a rank that is still waiting out its own timeout
    before it could say where it waits. `defer(signum)`: when it returns seconds rather than None, the SIGTERM
    asked this rank to save and stop instead (`checkpoint.preemption`, whose timer calls `terminate` if the rank is
    stuck). Install from the main thread; `close()` restores what was there."""

    def __init__(
        self,
        output_dir: str | os.PathLike,
        signum: int = DUMP_SIGNAL,
        describe=lambda: "",
        on_terminate: AutomaticDump | None = None,
        defer: Callable[[int], float | None] | None = None,
    ):
        self.output_dir, self.signum, self.describe, self._defer = output_dir, signum, describe, defer
        self.dumps: list[Path] = []
        self._previous = {signum: signal.signal(signum, self._handler)}
        self._on_terminate = None
        if on_terminate is not None and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._on_terminate = on_terminate
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handler)
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        old_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._in_thread = old_fd == -1
        if not self._in_thread:
            signal.set_wakeup_fd(old_fd)
        self._thread = threading.Thread(target=self._run, name="hf_dist_recipes-dump-on-signal", daemon=True)
        self._thread.start()

    def _message(self, signum: int) -> str:
        return f"{signal.Signals(signum).name} received by pid {os.getpid()}{self.describe()}"

    def _dump(self) -> None:
        message = self._message(self.signum)
        try:
            self.dumps.append(dump_rank_state(self.output_dir, "signal", message))
            print(f"[hf_dist_recipes] {message}: state written to {self.dumps[-1].parent}", file=sys.stderr, flush=True)
        except Exception as err:
            print(f"[hf_dist_recipes] could not write the dump: {err}", file=sys.stderr, flush=True)

    def _deferred(self) -> bool:
        return self._defer is not None and self._defer(signal.SIGTERM) is not None

    def terminate(self, signum: int = signal.SIGTERM) -> None:
        """Write this rank's state (unless a failure already did) and end the process, from any thread."""
        if self._on_terminate is not None:
            self._terminate()
        os._exit(128 + signum)

    def _terminate(self) -> None:
        message = self._message(signal.SIGTERM) + " (the launcher ends this rank: another rank failed, or the job)"
        self._on_terminate("signal", message)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        # Only the main thread may restore the default action: end as a shell reports a SIGTERM death (128 + 15),
        # without Python's cleanup, as the default action would.
        os._exit(128 + signal.SIGTERM)

    def _handler(self, signum, frame):
        if signum == signal.SIGTERM:
            # in a thread: the thread writes and ends the process; the main thread goes on meanwhile
            if not self._in_thread and not self._deferred():
                self._terminate()
            return
        if not self._in_thread:
            self._dump()
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)

    def _run(self) -> None:
        while True:
            try:
                data = self._reader.recv(64)
            except OSError:
                return
            if not data:
                return
            if self._in_thread and self._on_terminate is not None and signal.SIGTERM in data and not self._deferred():
                self._terminate()
            if self._in_thread and self.signum in data:
                self._dump()

    def close(self) -> None:
        if self._in_thread:
            current = signal.set_wakeup_fd(-1)
            if current != self._writer.fileno():  # someone replaced ours since: keep theirs
                signal.set_wakeup_fd(current)
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._writer.close()  # the thread's recv then returns b"" and it ends
        self._thread.join(timeout=5)
        self._reader.close()


class FatalStacks:
    """While open, a fatal signal (Gloo's abort on a collective mismatch, a segfault) writes every thread's Python
    stack into `<output_dir>/flight_recorder/fatal_rank_<rank>.txt` (`faulthandler`). Left alone when faulthandler
    is already on (`python -X faulthandler`, PYTHONFAULTHANDLER: its stderr output is the user's choice).
    `close()` (also at exit) turns it off and removes the file if nothing was written."""

    def __init__(self, output_dir: str | os.PathLike, rank: int):
        self.path: Path | None = None
        self._file = None
        if faulthandler.is_enabled():
            return
        directory = flight_recorder_dir(output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{FATAL_PREFIX}{rank}.txt"
        self._file = open(self.path, "w")  # noqa: SIM115 -- faulthandler writes to it until close()
        faulthandler.enable(self._file, all_threads=True)
        atexit.register(self.close)

    def close(self) -> None:
        if self._file is None:
            return
        faulthandler.disable()
        self._file.close()
        self._file = None
        atexit.unregister(self.close)
        if self.path is not None and self.path.exists() and self.path.stat().st_size == 0:
            self.path.unlink()
