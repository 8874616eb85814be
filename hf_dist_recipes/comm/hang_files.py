"""The hang dumps of a job, found and read back: each rank's flight recorder and stacks, and the frame rule.

`find_dump_dir(path)`: the `flight_recorder/` folder of a job given its output directory, its logging directory
(`<output_dir>/runs/<run>`: the folder is looked for in up to `ANCESTORS` parents too) or the folder itself.
`read_rank_files(directory)`: {rank: RankFiles} from `rank_<N>` (torch's pickle, read with `pickle` alone: plain
dicts, lists and tuples, no torch needed), `stack_rank_<N>.json` (the stacks `comm.flight_recorder` writes,
innermost frame last) and `fatal_rank_<N>.txt` (faulthandler's text of a rank that died of a fatal signal, such as
Gloo's abort on a collective mismatch; an empty one is ignored). A rank may have any of them or none (a lost or
frozen rank writes nothing).

The frame rule (`frame_kind`, `top_frame`), by path only, since the dumps may be read on another machine: a frame is
"torch" (torch's package), "stdlib" (under `lib/pythonX.Y/` outside site-packages, or `<frozen ...>` / `<string>`),
"dumper" (`comm/flight_recorder.py`, `comm/watchdog.py`: the code writing the dump, not the code that hung),
"library" (any other installed package, and hf_dist_recipes itself) or "user" (anything else: the user's script).
A rank's stack top is its innermost frame that is library or user; its user frame, the innermost that is user.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from hf_dist_recipes.comm.flight_recorder import FATAL_PREFIX, FLIGHT_RECORDER_DIR, FLIGHT_RECORDER_PREFIX, STACK_PREFIX

ANCESTORS = 3  # <output_dir>/runs/<run>/rank<N> is three levels under the output directory
FrameKind = Literal["torch", "stdlib", "dumper", "library", "user"]
_PACKAGE = re.compile(r"[/\\](?:site|dist)-packages[/\\]([^/\\]+)")
_STDLIB = re.compile(r"[/\\]lib[/\\]python\d+(?:\.\d+)?[/\\]")
_DUMPERS = ("hf_dist_recipes/comm/flight_recorder.py", "hf_dist_recipes/comm/watchdog.py")
_RANK_FILE = re.compile(rf"^{FLIGHT_RECORDER_PREFIX}(\d+)$")
_STACK_FILE = re.compile(rf"^{STACK_PREFIX}(\d+)\.json$")
_FATAL_FILE = re.compile(rf"^{FATAL_PREFIX}(\d+)\.txt$")
_FAULT_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)", re.MULTILINE)
_FAULT_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')


@dataclass(frozen=True)
class Frame:
    """One Python frame: `file`, `line` (1-based), `function`, `code` (the source line, "" when unknown), and its
    `kind` under the frame rule (module docstring)."""

    file: str
    line: int
    function: str
    code: str
    kind: FrameKind

    def where(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


@dataclass(frozen=True)
class FatalStack:
    """A rank that died of a fatal signal: faulthandler's first line (`error`, "Fatal Python error: Aborted"), the
    thread read (its id; faulthandler lists the main thread last) and its frames, innermost first."""

    error: str
    thread: str
    frames: list[Frame]


@dataclass
class RankFiles:
    """What one rank wrote: `dump` (torch's flight-recorder dict, None without a `rank_<N>` file), `stack` (the
    parsed `stack_rank_<N>.json`, None without one) and `fatal` (a non-empty `fatal_rank_<N>.txt`, else None)."""

    rank: int
    dump: dict | None = None
    stack: dict | None = None
    fatal: FatalStack | None = None


def frame_kind(file: str) -> FrameKind:
    """The kind of a frame in `file` (the frame rule of the module docstring)."""
    path = file.replace("\\", "/")
    if path.startswith("<"):
        return "stdlib"
    if any(path.endswith(d) for d in _DUMPERS):
        return "dumper"
    package = _PACKAGE.search(file)
    if package:
        return "torch" if package.group(1) in ("torch", "torch.py") else "library"
    if _STDLIB.search(file):
        return "stdlib"
    if "/hf_dist_recipes/" in path:  # an editable install: the library, not the user's code
        return "library"
    return "user"


def make_frame(file: str, line: int, function: str, code: str = "") -> Frame:
    """A Frame with its kind; `code` read from `file` when not given and the file is readable here."""
    if not code and file and not file.startswith("<"):
        import linecache

        code = linecache.getline(file, line).strip()
    return Frame(file, int(line), function, code, frame_kind(file))


def top_frame(frames_innermost_first: list[Frame], kinds: tuple[str, ...] = ("library", "user")) -> Frame | None:
    """The first frame whose kind is in `kinds`, innermost first; None when there is none."""
    return next((f for f in frames_innermost_first if f.kind in kinds), None)


def find_dump_dir(path: str | os.PathLike) -> Path:
    """The folder holding the dumps (module docstring). ValueError naming what was looked at when there is none."""
    start = Path(path).resolve()
    if not start.is_dir():
        raise ValueError(f"{path}: no such directory; give the job's output_dir (holding {FLIGHT_RECORDER_DIR}/)")
    if _has_dumps(start):
        return start
    for candidate in [start / FLIGHT_RECORDER_DIR, *(p / FLIGHT_RECORDER_DIR for p in list(start.parents)[:ANCESTORS])]:
        if candidate.is_dir() and _has_dumps(candidate):
            return candidate
    raise ValueError(
        f"{path}: no hang dumps ({FLIGHT_RECORDER_PREFIX}<N> or {STACK_PREFIX}<N>.json) in it, in "
        f"{FLIGHT_RECORDER_DIR}/ under it or in the {ANCESTORS} folders above; a rank writes them when the watchdog "
        f"names a lost rank, when a collective times out, or on SIGUSR1"
    )


def _has_dumps(directory: Path) -> bool:
    return any(_RANK_FILE.match(p.name) or _STACK_FILE.match(p.name) for p in directory.iterdir())


def parse_fatal(text: str) -> FatalStack | None:
    """faulthandler's output (module docstring) -> its last thread's frames; None when it holds no frame."""
    error = text.strip().splitlines()[0] if text.strip() else ""
    starts = list(_FAULT_THREAD.finditer(text))
    for m in reversed(starts):  # the main thread is listed last; a block may hold no Python frame
        block = text[m.end() :].split("\n\n", 1)[0]
        frames = [make_frame(f[1], int(f[2]), f[3]) for f in map(_FAULT_FRAME.match, block.splitlines()) if f]
        if frames:
            return FatalStack(error, m.group(1), frames)
    return None


def read_rank_files(directory: Path) -> dict[int, RankFiles]:
    """{rank: RankFiles} for every rank with a file in `directory`, by rank. ValueError naming a file that cannot be
    read (truncated, not torch's pickle, not JSON)."""
    ranks: dict[int, RankFiles] = {}
    for p in sorted(directory.iterdir()):
        if m := _RANK_FILE.match(p.name):
            rank = int(m.group(1))
            ranks.setdefault(rank, RankFiles(rank)).dump = _read_dump(p)
        elif m := _STACK_FILE.match(p.name):
            rank = int(m.group(1))
            ranks.setdefault(rank, RankFiles(rank)).stack = _read_stack(p)
        elif (m := _FATAL_FILE.match(p.name)) and (fatal := parse_fatal(p.read_text(errors="replace"))):
            ranks.setdefault(int(m.group(1)), RankFiles(int(m.group(1)))).fatal = fatal
    return dict(sorted(ranks.items()))


def _read_dump(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            dump = pickle.load(f)
    except Exception as err:  # a truncated pickle raises EOFError, UnpicklingError, ValueError, ...
        raise ValueError(f"{path}: not a readable flight-recorder dump ({type(err).__name__}: {err})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise ValueError(f"{path}: not torch's flight-recorder pickle (no 'entries' list)")
    return dump


def _read_stack(path: Path) -> dict:
    try:
        stack = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable stack file ({err})") from None
    if not isinstance(stack, dict) or not isinstance(stack.get("threads", []), list):
        raise ValueError(f"{path}: not a stack file (expected an object with 'threads')")
    return stack


def thread_frames(stack: dict) -> tuple[str, list[Frame]]:
    """(thread name, frames innermost first) of the thread a rank's state is read from: the main thread (where the
    training loop runs and blocks), else the first listed."""
    threads = stack.get("threads") or []
    if not threads:
        return "", []
    thread = next((t for t in threads if t.get("is_main")), threads[0])
    frames = [
        make_frame(f.get("file", ""), f.get("line", 0), f.get("function", ""), f.get("code", ""))
        for f in thread.get("frames", [])
    ]
    return str(thread.get("name", "")), frames[::-1]
