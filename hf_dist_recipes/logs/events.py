"""Read TensorBoard event files fast: our own TFRecord framing, scalar events decoded with numpy
(`record_scan`), tensorboard's compiled `Event` proto for any other event. Two readers on it:
- `read_rank` (`logs summarize`): a rank's curves, one value a step (the last write wins);
- `read_run`: one run directory as TensorBoard's EventAccumulator shows it (every write, a resume's purge applied,
  tensor summaries apart; see its docstring), as lists in `read_scalars` / `read_texts` (`monitoring.read_scalars`).

A TFRecord is `length: u64 | masked crc32c(length): u32 | data | masked crc32c(data): u32` (little endian). Every
length is checked against its CRC (a wrong length would derail every later record). `read_rank` does not check the
data CRC (checking it makes `read_run` ~1.45x slower, benchmarks/results/2026-12-06-event-reader-cpu.md): a damaged
payload is caught by the decoders instead (a flipped bit inside a float goes unnoticed); `read_run` checks it. A file
cut short (a rank killed mid-write) or a damaged record ends the reading of that file with a warning naming it;
what was read before stays.

Scalars come from `simple_value` (torch's and tensorboardX's SummaryWriter) or from a rank-0 float tensor (the
`scalars` plugin of `tf.summary`). Text summaries (`add_text`) are kept only to find the host name a run recorded.
protobuf is imported only when a file holds an event other than plain scalars and the file_version header.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hf_dist_recipes.logs.record_scan import CorruptRecordError, first_bad_data, frame_file, scan_scalars

__all__ = [
    "CorruptRecordError",
    "RankEvents",
    "RunEvents",
    "find_rank_files",
    "iter_records",
    "read_rank",
    "read_run",
    "read_scalars",
    "read_texts",
]

CHUNK_BYTES = 4 * 1024 * 1024  # read size; a file is never held whole, at most one chunk plus one record
_RANK_DIR = re.compile(r"^rank(\d+)$")
_HOST_IN_TEXT = re.compile(r"\bhost(?:name)?\s*[=:]\s*([A-Za-z0-9_.-]+)")


def iter_records(path: str | os.PathLike):
    """Yield the data of each TFRecord in `path`, streaming: at most a chunk and one record are held. Raises
    CorruptRecordError, after yielding every good record before it, on a truncated record or one whose length fails
    its checksum."""
    for buf, starts, lengths in frame_file(path, CHUNK_BYTES):
        for p, n in zip(starts.tolist(), lengths.tolist(), strict=True):
            yield buf[p + 12 : p + 12 + n]


@dataclass
class RankEvents:
    """The scalars of one rank: per tag, sorted unique steps and their values (the last write of a step wins, as
    when a resumed run rewrote it). `warnings`: one line per unreadable file or record."""

    rank: int
    scalars: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    host: str | None = None
    records: int = 0
    warnings: list[str] = field(default_factory=list)


def _tensor_value(v, out: RankEvents) -> float | None:
    """The scalar of a tensor-valued summary (tf.summary's scalars plugin); a text one only updates `out.host`."""
    if v.WhichOneof("value") != "tensor":
        return None
    if v.metadata.plugin_data.plugin_name == "text":
        text = v.tensor.string_val[0].decode("utf-8", "replace") if v.tensor.string_val else ""
        m = _HOST_IN_TEXT.search(text)
        if m:
            out.host = m.group(1)
        elif "host" in v.tag.lower() and text.strip():
            out.host = text.strip().split()[0]
        return None
    t = v.tensor
    if t.tensor_shape.dim:
        return None  # not a scalar
    if t.float_val:
        return t.float_val[0]
    if t.double_val:
        return t.double_val[0]
    if t.tensor_content and t.dtype in (1, 2):  # DT_FLOAT, DT_DOUBLE
        return float(np.frombuffer(t.tensor_content, np.float32 if t.dtype == 1 else np.float64)[0])
    return None


def _has_summary(data: bytes) -> bool:
    """Whether an Event's encoding holds a summary (field 5), walking its top-level fields without protobuf: the
    file_version and source_metadata header of every file then costs no protobuf import."""
    pos, n = 0, len(data)
    try:
        while pos < n:
            key, pos = _varint(data, pos)
            number, kind = key >> 3, key & 7
            if number == 5:
                return True
            if kind == 0:
                _, pos = _varint(data, pos)
            elif kind == 1:
                pos += 8
            elif kind == 5:
                pos += 4
            elif kind == 2:
                size, pos = _varint(data, pos)
                pos += size
            else:
                return True  # not a shape we walk: let protobuf judge it
    except IndexError:
        return True
    return False


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7


class _Curves:
    """One rank's scalars as they are read: per tag, arrays of (record number, step, value) pieces, 24 B a value
    until `finish` (the record number orders two writes of one step; the result keeps 16 B a value)."""

    def __init__(self):
        self.pieces: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

    def add(self, tag: str, seq: np.ndarray, steps: np.ndarray, values: np.ndarray) -> None:
        self.pieces.setdefault(tag, []).append((seq, steps, values))

    def finish(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per tag, sorted unique steps and their values; the last record of a step wins."""
        out = {}
        for tag, pieces in self.pieces.items():
            seq, st, va = (np.concatenate([p[k] for p in pieces]) for k in range(3))
            order = np.lexsort((seq, st))  # by step, then by record order
            st, va = st[order].astype(np.int64), va[order].astype(np.float64)
            last = np.ones(len(st), dtype=bool)
            last[:-1] = st[1:] != st[:-1]
            out[tag] = (st[last], va[last])
        return out


def _decode_events(records, curves: _Curves, out: RankEvents) -> tuple[int, Exception] | None:
    """The events the scan left (anything but plain scalars), through tensorboard's `Event` proto: `records` are
    (record number, data), in order. At the first record that does not decode (protobuf's DecodeError) it stops and
    returns (its number, the error); what came before it is kept."""
    found: dict[str, tuple[list, list, list]] = {}  # tag -> record numbers, steps, values
    failure = None
    for n, data in records:
        if not _has_summary(data):
            continue
        from tensorboard.compat.proto.event_pb2 import Event  # here: a file of plain scalars never needs it

        try:
            event = Event.FromString(data)
        except Exception as err:
            failure = (n, err)
            break
        for v in event.summary.value:
            x = v.simple_value
            # 0.0 is also what an unset simple_value reads as: only then look at which field is set.
            if x == 0.0 and v.WhichOneof("value") != "simple_value":
                x = _tensor_value(v, out)
                if x is None:
                    continue
            seq, steps, values = found.setdefault(v.tag, ([], [], []))
            seq.append(n)
            steps.append(event.step)
            values.append(x)
    for tag, (seq, steps, values) in found.items():
        curves.add(tag, np.array(seq, np.int64), np.array(steps, np.int64), np.array(values, np.float64))
    return failure


def read_rank(rank: int, files: list[str]) -> RankEvents:
    """Read every event file of one rank (in name order: TensorBoard names them by creation time)."""
    out = RankEvents(rank=rank)
    curves = _Curves()
    seen = 0  # records of the rank before this chunk: orders the writes of one step across chunks and files
    for path in sorted(files):
        n = 0
        try:
            for buf, starts, lengths in frame_file(path, CHUNK_BYTES):
                scan = scan_scalars(buf, starts, lengths)
                failure = None
                if len(scan.other):
                    others = ((int(i), int(starts[i]) + 12, int(lengths[i])) for i in scan.other)
                    failure = _decode_events(((seen + i, buf[p : p + k]) for i, p, k in others), curves, out)
                keep = len(starts) if failure is None else failure[0] - seen  # a sequential read stops there
                ok = scan.record < keep
                for t, tag in enumerate(scan.tags):
                    mine = ok & (scan.tag == t)
                    curves.add(tag, seen + scan.record[mine], scan.step[mine], scan.value[mine])
                n += keep
                seen += len(starts)
                if failure is not None:
                    raise failure[1]
        except CorruptRecordError as err:
            out.warnings.append(f"{path}: {err}; kept the {n} record(s) read before it")
        except Exception as err:  # a damaged payload: protobuf's DecodeError, or a file that vanished
            out.warnings.append(f"{path}: unreadable ({type(err).__name__}: {err}); kept what was read before it")
        out.records += n
    out.scalars = curves.finish()
    return out


def find_rank_files(logdir: str | os.PathLike) -> dict[int, list[str]]:
    """Event files under `logdir` by rank: a file belongs to the nearest enclosing `rank<N>` directory.

    Raises ValueError when `logdir` is missing, holds no rank directory with event files, or holds several
    launches (the same rank under two different parent paths), which would mix their curves.
    """
    root = Path(logdir)
    if not root.is_dir():
        raise ValueError(f"{logdir} is not a directory; pass the logging_dir that holds the rank<N> folders")
    by_rank: dict[int, list[str]] = {}
    launch_of: dict[int, Path] = {}
    for path in root.rglob("*tfevents*"):
        if not path.is_file():
            continue
        rel = path.relative_to(root).parts[:-1]
        idx = next((i for i in range(len(rel) - 1, -1, -1) if _RANK_DIR.match(rel[i])), None)
        if idx is None:
            continue
        rank = int(_RANK_DIR.match(rel[idx]).group(1))
        launch = Path(*rel[:idx]) if idx else Path(".")
        if launch_of.setdefault(rank, launch) != launch:
            raise ValueError(
                f"{logdir} holds rank{rank} twice ({launch_of[rank]} and {launch}): several launches; "
                f"pass the directory of one launch"
            )
        by_rank.setdefault(rank, []).append(str(path))
    if not by_rank:
        raise ValueError(f"no event files in rank<N> directories under {logdir}; pass the run's logging_dir")
    return dict(sorted(by_rank.items()))


# --- One run directory read as TensorBoard's EventAccumulator reads it (read_scalars, read_texts) ---


@dataclass
class RunEvents:
    """One run directory as TensorBoard's `EventAccumulator` (purge_orphaned_data=True, nothing sampled) keeps it.
    `scalars`: tag -> (steps, values) of every `simple_value`, in the order written, duplicates of a step kept, less
    what a restart purged; tags in order of first appearance (a tag whose points were all purged stays, empty).
    `tensors`: tag -> [(step, TensorProto)] of every tensor-valued summary (text included), never purged, as there.
    `warnings`: one line per file whose reading stopped early."""

    scalars: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    tensors: dict[str, list] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def run_files(run_dir: str | os.PathLike) -> list[str]:
    """The event files TensorBoard reads for `run_dir`, in its order: names holding "tfevents" (not
    ".profile-empty"), this directory only, sorted by name; an event file's own path names that file alone."""
    run_dir = os.fspath(run_dir)
    if os.path.isfile(run_dir) and "tfevents" in os.path.basename(run_dir):
        return [run_dir]
    names = [n for n in os.listdir(run_dir) if "tfevents" in n and not n.endswith(".profile-empty")]
    return [os.path.join(run_dir, n) for n in sorted(names) if os.path.isfile(os.path.join(run_dir, n))]


def _events_in_order(files: list[str], out: RunEvents, *, scan: bool = True):
    """Yield per chunk (first record number, ScalarScan or None, [(record number, Event)] of the rest), the records
    of `files` numbered in reading order. With `scan` the plain scalar events come as a numpy ScalarScan and only the
    others are decoded; without it every record is decoded. A file stops at a cut record or one whose length or data
    fails its CRC (both are checked here, as TensorBoard's reader checks them; `read_rank` checks lengths only): the
    rest of it is skipped, as there, with a warning."""
    from tensorboard.compat.proto.event_pb2 import Event

    seen = 0
    for path in files:
        try:
            for buf, starts, lengths in frame_file(path, CHUNK_BYTES):
                bad = first_bad_data(buf, starts, lengths)
                if bad is not None:
                    starts, lengths = starts[:bad], lengths[:bad]
                found = scan_scalars(buf, starts, lengths) if scan else None
                rest = found.other.tolist() if found is not None else range(len(starts))
                decoded = []
                for i in rest:
                    p, k = int(starts[i]) + 12, int(lengths[i])
                    decoded.append((seen + i, Event.FromString(buf[p : p + k])))
                yield seen, found, decoded
                seen += len(starts)
                if bad is not None:
                    raise CorruptRecordError("record data fails its checksum")
        except CorruptRecordError as err:
            out.warnings.append(f"{path}: {err}; kept the records read before it")


def _needs_replay(files: list[str]) -> bool:
    """Whether any summary may be read while the accumulator holds no file_version >= 2: then TensorBoard purges by
    out-of-order steps per tag, which `read_run` replays event by event. Every writer we know (torch, tensorboardX,
    tf.summary, core/event_writer.py) starts each file with `brain.Event:2`, so this reads one record per file."""
    from tensorboard.compat.proto.event_pb2 import Event

    for path in files:
        with open(path, "rb") as f:
            head = f.read(12)
            if len(head) < 12:
                continue
            data = f.read(struct.unpack("<Q", head[:8])[0])
        try:
            version = Event.FromString(data).file_version
        except Exception:
            return True
        if not version.startswith("brain.Event:") or _file_version(version) < 2:
            return True
    return False


def _file_version(text: str) -> float:
    try:
        return float(text.split(":")[-1])
    except ValueError:
        return 0.0


def read_run(run_dir: str | os.PathLike, *, tensors: bool = False) -> RunEvents:
    """Read one TensorBoard run directory (see RunEvents), with `tensors` also its tensor summaries.

    Same scalars as `EventAccumulator(run_dir, size_guidance={"scalars": 0}).Reload()`: a `SessionLog.START` at step
    s (what torch's `SummaryWriter(purge_step=s)` writes on a resume) drops every scalar read before it at a step >= s;
    in files without a `brain.Event:2` header, a summary at a step below the latest drops its tags' later points.
    Wall times are not kept (TensorBoard keeps them; our callers never used them)."""
    out = RunEvents()
    files = run_files(run_dir)
    if _needs_replay(files):
        _replay(files, out, tensors)
        return out
    tag_id: dict[str, int] = {}
    pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # order, tag, step, value
    purges: list[tuple[int, int]] = []  # (record number, step) of each START
    for first, found, decoded in _events_in_order(files, out):
        if len(found.record):
            ids = np.array([tag_id.setdefault(t, len(tag_id)) for t in found.tags], np.int64)
            rec = first + found.record
            pieces.append((rec, np.zeros(len(rec), np.int64), ids[found.tag], found.step, found.value))
        rec, sub, tg, st, va = [], [], [], [], []
        for n, event in decoded:
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                purges.append((n, event.step))
            for j, v in enumerate(event.summary.value):
                kind = v.WhichOneof("value")
                if kind == "simple_value":
                    rec.append(n)
                    sub.append(j)
                    tg.append(tag_id.setdefault(v.tag, len(tag_id)))
                    st.append(event.step)
                    va.append(v.simple_value)
                elif kind == "tensor" and tensors:
                    out.tensors.setdefault(v.tag or v.node_name, []).append((event.step, v.tensor))
        if rec:
            ints = [np.array(x, np.int64) for x in (rec, sub, tg, st)]
            pieces.append((*ints, np.array(va, np.float64)))
    if not pieces:
        return out
    rec, sub, tg, st, va = (np.concatenate([p[k] for p in pieces]) for k in range(5))
    # First-appearance order of the tags (the scan numbers them per chunk, protobuf per record: sort by record).
    order = np.lexsort((sub, rec))
    rec, tg, st, va = rec[order], tg[order], st[order], va[order]
    names = list(tag_id)
    first_at = np.full(len(names), np.iinfo(np.int64).max)
    np.minimum.at(first_at, tg, np.arange(len(tg)))
    keep = np.ones(len(rec), bool)
    if purges:
        # A point dies if a START later than it has a step <= its step: the smallest step of the later STARTs.
        p_rec = np.array([p[0] for p in purges], np.int64)
        p_min = np.minimum.accumulate(np.array([p[1] for p in purges], np.int64)[::-1])[::-1]
        later = np.searchsorted(p_rec, rec, side="right")
        has = later < len(p_rec)
        keep[has] = st[has] < p_min[later[has]]
    by_tag = np.argsort(tg, kind="stable")
    bounds = np.searchsorted(tg[by_tag], np.arange(len(names) + 1))
    for t in sorted(range(len(names)), key=lambda t: first_at[t]):
        rows = by_tag[bounds[t] : bounds[t + 1]]
        rows = rows[keep[rows]]
        out.scalars[names[t]] = (st[rows], va[rows])
    return out


def read_scalars(run_dir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """All scalars of one TensorBoard run directory: tag -> [(step, value), ...] in the order written, what a resume
    purged left out (`read_run`: the same lists as TensorBoard's EventAccumulator)."""
    return {
        tag: list(zip(steps.tolist(), values.tolist(), strict=True))
        for tag, (steps, values) in read_run(run_dir).scalars.items()
    }


def read_texts(run_dir: str | os.PathLike) -> dict[str, list[tuple[int, str]]]:
    """All text entries of one TensorBoard run directory: tag -> [(step, text), ...] in the order written (every
    tensor summary is taken for text, as TensorBoard's EventAccumulator lists them; `read_run`)."""
    tensors = read_run(run_dir, tensors=True).tensors
    return {tag: [(step, t.string_val[0].decode()) for step, t in entries] for tag, entries in tensors.items()}


def _replay(files: list[str], out: RunEvents, tensors: bool) -> None:
    """EventAccumulator's `_ProcessEvent` purge logic, event by event (files without a version-2 header)."""
    points: dict[str, list[tuple[int, float]]] = {}
    file_version = None
    most_recent = -1
    for _, _, decoded in _events_in_order(files, out, scan=False):
        for _, event in decoded:
            if event.HasField("file_version"):
                file_version = _file_version(event.file_version)
            if file_version and file_version >= 2:
                if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                    for tag in points:
                        points[tag] = [p for p in points[tag] if p[0] < event.step]
            elif event.step < most_recent and event.HasField("summary"):
                for v in event.summary.value:
                    if v.tag in points:
                        points[v.tag] = [p for p in points[v.tag] if p[0] < event.step]
            else:
                most_recent = event.step
            for v in event.summary.value:
                kind = v.WhichOneof("value")
                if kind == "simple_value":
                    points.setdefault(v.tag, []).append((event.step, v.simple_value))
                elif kind == "tensor" and tensors:
                    out.tensors.setdefault(v.tag or v.node_name, []).append((event.step, v.tensor))
    out.scalars = {
        tag: (np.array([p[0] for p in pts], np.int64), np.array([p[1] for p in pts], np.float64))
        for tag, pts in points.items()
    }
