"""TensorBoard event files written with plain file I/O: a whole scalar run at once, or a run as it trains.

Both are shared by the live job and the offline CLI: `RunWriter`, the per-rank runs every rank writes while training
(`monitoring/tensorboard.py`); `write_scalar_run`, the aggregate run of `logs summarize` (`logs/aggregate.py`).
An event file is a sequence of TFRecords, `length: u64 | masked crc32c(length): u32 | data | masked crc32c(data): u32`
(little endian), each `data` the bytes protobuf would write for one `Event`; the field numbers are tensorboard's
(`tensorboard/compat/proto/event.proto`, `summary.proto`, `tensor.proto`). The first event of a file is the header
`Event(wall_time, file_version="brain.Event:2")`.

Why not tensorboard's `EventFileWriter` (or torch's SummaryWriter on it): above all, a flush from the per-rank
callback's SIGTERM handler (a preempted rank's last logs) that lands inside one of its writes hangs the rank for good
(its `_AsyncWriter` takes a non-reentrant lock in `write` and again in `flush`; tests/unit/test_event_writer.py shows
it), where `RunWriter` takes that flush anywhere. Also, it builds a protobuf object per event and runs tensorboard's
pure-Python crc32c over every byte (~5 MB/s), seconds for a long run's aggregate (issue 21: 3.6 s of a 6.5 s `logs
summarize`), importing it starts tensorboard's tensorflow stub (~0.3 s), and it writes from a thread of its own; the
live writing itself saves only ~0.7 ms per log (benchmarks/event_writer.py, ~0.07% of a run). Here:
- `write_scalar_run(run_dir, columns)`: one event per step holding every column's value at that step. The events of
  one layout (the same columns present, a step of the same varint length) have the same length and the same bytes
  except the step and the values: they are filled in as rows of a numpy structured array, their CRCs computed
  together (`crc32c.crc32c_rows`), and written in step order, CHUNK_STEPS steps at a time (memory: CHUNK_STEPS x the
  event size, ~0.6 KB for 20 values).
- `RunWriter(run_dir, purge_step)`: the records torch's `SummaryWriter` writes for `add_scalar` (one event per
  value) and `add_text` (a string tensor with the text plugin's metadata, tag `<tag>/text_summary`), and for
  `purge_step` on a resume; held in memory until `flush()` / `close()`, on the caller's thread.

Values are stored as float32 (`simple_value`'s type), rounded to nearest, beyond its range as +-inf, as protobuf does.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import socket
import struct
import time

import numpy as np

from hf_dist_recipes.core.crc32c import crc32c_rows, masked, masked_crc32c

CHUNK_STEPS = 4096
FILE_VERSION = b"brain.Event:2"
_uid = itertools.count()


def varint(n: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int (int64 fields: negatives as their uint64)."""
    n &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _field(number, 2) + varint(len(payload)) + payload


@functools.lru_cache(maxsize=4096)
def _length_header(n: int) -> bytes:
    """A TFRecord's first 12 bytes for `n` bytes of data: the length and its masked CRC (few lengths recur)."""
    header = struct.pack("<Q", n)
    return header + struct.pack("<I", masked_crc32c(header))


def record(data: bytes) -> bytes:
    """One TFRecord around `data`."""
    return _length_header(len(data)) + data + struct.pack("<I", masked_crc32c(data))


def file_version_event(wall_time: float) -> bytes:
    """The first event of every event file: `Event(wall_time, file_version="brain.Event:2")`."""
    return _field(1, 1) + struct.pack("<d", wall_time) + _length_delimited(3, FILE_VERSION)


def _varint_bytes(steps: np.ndarray, width: int) -> np.ndarray:
    """(N, width) uint8: the varints of `steps` (int64, each `width` bytes long as varints)."""
    u = steps.astype(np.uint64)
    shifts = np.arange(width, dtype=np.uint64) * np.uint64(7)
    groups = ((u[:, None] >> shifts) & np.uint64(0x7F)).astype(np.uint8)
    groups[:, :-1] |= 0x80
    return groups


def _varint_width(steps: np.ndarray) -> np.ndarray:
    """Varint length of each step (int64 as uint64); 0 for step 0, which protobuf leaves out (proto3 default)."""
    u = steps.astype(np.uint64)
    width = np.ones(len(u), np.int64)
    for k in range(1, 10):
        width += (u >> np.uint64(7 * k)) != 0
    width[u == 0] = 0
    return width


def _layout_rows(
    wall_time: float, steps: np.ndarray, prefixes: list[bytes], values: np.ndarray, width: int
) -> np.ndarray:
    """(N, record size) uint8: the records of N events that share a layout (the columns of `prefixes`, a step of
    `width` varint bytes, 0 for step 0); `values`: (N, columns) float32."""
    summary_len = sum(len(p) + 4 for p in prefixes)
    summary_head = _field(5, 2) + varint(summary_len)
    event_head = _field(1, 1) + struct.pack("<d", wall_time) + (_field(2, 0) if width else b"")
    data_len = len(event_head) + width + len(summary_head) + summary_len
    head = _length_header(data_len) + event_head
    fields = [("head", f"S{len(head)}")]
    if width:
        fields.append(("step", "u1", (width,)))
    fields.append(("summary_head", f"S{len(summary_head)}"))
    for k, p in enumerate(prefixes):
        fields += [(f"p{k}", f"S{len(p)}"), (f"v{k}", "<f4")]
    fields.append(("crc", "<u4"))
    rec = np.zeros(len(steps), np.dtype(fields))
    rec["head"] = head
    if width:
        rec["step"] = _varint_bytes(steps, width)
    rec["summary_head"] = summary_head
    for k, p in enumerate(prefixes):
        rec[f"p{k}"] = p
        rec[f"v{k}"] = values[:, k]
    rows = rec.view(np.uint8).reshape(len(steps), rec.dtype.itemsize)
    rec["crc"] = masked(crc32c_rows(rows[:, 12:-4]))
    return rows


def _value_prefix(tag: str) -> bytes:
    """`Summary.value` entry up to the float: field 1 (a Value) holding tag and the simple_value field key."""
    value_len = len(_length_delimited(1, tag.encode())) + 5
    return _field(1, 2) + varint(value_len) + _length_delimited(1, tag.encode()) + _field(2, 5)


def encode_chunk(
    wall_time: float, steps: np.ndarray, present: np.ndarray, values: np.ndarray, prefixes: list[bytes]
) -> bytes:
    """The records of the events at `steps` (sorted), in step order. `present`: (N, columns) bool, which columns
    have a value at each step; `values`: (N, columns) float32 (ignored where not present)."""
    n = len(steps)
    if n == 0:
        return b""
    width = _varint_width(steps)
    # One layout per distinct (which columns, varint width): usually one or two per chunk.
    _, pattern = np.unique(np.packbits(present, axis=1), axis=0, return_inverse=True)
    _, layout = np.unique(pattern.reshape(-1) * 16 + width, return_inverse=True)
    layouts = [np.flatnonzero(layout == g) for g in range(int(layout.max()) + 1)]
    parts = []
    for rows_idx in layouts:
        cols = np.flatnonzero(present[rows_idx[0]])
        rows = _layout_rows(
            wall_time,
            steps[rows_idx],
            [prefixes[c] for c in cols],
            values[np.ix_(rows_idx, cols)],
            int(width[rows_idx[0]]),
        )
        parts.append((rows_idx, rows))
    if len(parts) == 1:
        return parts[0][1].tobytes()
    # Scatter each layout's rows to their place in step order.
    size = np.zeros(n, np.int64)
    for rows_idx, rows in parts:
        size[rows_idx] = rows.shape[1]
    start = np.concatenate([[0], np.cumsum(size)[:-1]])
    out = np.empty(int(size.sum()), np.uint8)
    for rows_idx, rows in parts:
        out[start[rows_idx][:, None] + np.arange(rows.shape[1])] = rows
    return out.tobytes()


def event_file_name(run_dir: str | os.PathLike, suffix: str = "") -> str:
    """TensorBoard's naming (`events.out.tfevents.<time>.<host>.<pid>.<n><suffix>`): runs are found by it."""
    name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_uid)}{suffix}"
    return os.path.join(os.fspath(run_dir), name)


def write_scalar_run(
    run_dir: str | os.PathLike,
    columns: list[tuple[str, np.ndarray, np.ndarray]],
    filename_suffix: str = "",
    wall_time: float | None = None,
) -> str:
    """Write `columns` (tag, sorted unique int steps, values) into a new event file in `run_dir`: one event per step
    of the union of the columns' steps, carrying each column's value at that step in column order. `wall_time`:
    seconds since the epoch stamped on every event (default: now). Returns the file's path."""
    for tag, steps, values in columns:
        if len(steps) != len(values):
            raise ValueError(f"{tag}: {len(steps)} steps but {len(values)} values; pass one value per step")
    os.makedirs(run_dir, exist_ok=True)
    wall_time = time.time() if wall_time is None else float(wall_time)
    prefixes = [_value_prefix(tag) for tag, _, _ in columns]
    steps_of = [np.asarray(s, np.int64) for _, s, _ in columns]
    values_of = [np.asarray(v, np.float64) for _, _, v in columns]
    grid = np.unique(np.concatenate(steps_of)) if columns else np.zeros(0, np.int64)
    path = event_file_name(run_dir, filename_suffix)
    with open(path, "wb") as f:
        f.write(record(file_version_event(wall_time)))
        for lo in range(0, len(grid), CHUNK_STEPS):
            chunk = grid[lo : lo + CHUNK_STEPS]
            present = np.zeros((len(chunk), len(columns)), bool)
            values = np.zeros((len(chunk), len(columns)), np.float32)
            for k, (s, v) in enumerate(zip(steps_of, values_of, strict=True)):
                # The grid is the union of the columns' steps: this column's steps in the chunk's range are in it.
                a, b = np.searchsorted(s, chunk[0], "left"), np.searchsorted(s, chunk[-1], "right")
                at = np.searchsorted(chunk, s[a:b])
                present[at, k] = True
                with np.errstate(over="ignore"):  # beyond float32's range: inf, as protobuf stores it
                    values[at, k] = v[a:b]
            f.write(encode_chunk(wall_time, chunk, present, values, prefixes))
    return path


# --- RunWriter: a run written as it trains ---------------------------------------------------------------------------

SOURCE_WRITER = b"hf_dist_recipes.core.event_writer"  # the header's source_metadata.writer (EventAccumulator keeps it)
TEXT_SUFFIX = "/text_summary"  # torch's add_text stores `<tag>/text_summary`; the readers and users know that tag
# A text's Summary.Value after its tag: tensor {dtype: DT_STRING (7), tensor_shape {dim {size: 1}}, string_val: ...},
# metadata {plugin_data {plugin_name: "text"}} (TextPluginData holds only version 0, a proto3 default: no content).
_STRING_TENSOR_HEAD = _field(1, 0) + varint(7) + _length_delimited(2, _length_delimited(2, _field(1, 0) + varint(1)))
_TEXT_METADATA = _length_delimited(9, _length_delimited(1, _length_delimited(1, b"text")))
_SESSION_START = _length_delimited(7, _field(1, 0) + varint(1))  # session_log {status: START}
_pack_double = struct.Struct("<d").pack
_pack_float = struct.Struct("<f").pack


def _event_head(wall_time: float, step: int) -> bytes:
    """`Event.wall_time` (seconds since the epoch) and `Event.step` (left out at 0: proto3's default)."""
    return b"\x09" + _pack_double(wall_time) + (b"\x10" + varint(step) if step else b"")


def _float32(value: float) -> bytes:
    try:
        return _pack_float(value)
    except OverflowError:  # beyond float32's range: protobuf's C cast gives inf
        return _pack_float(math.copysign(math.inf, value))


class RunWriter:
    """One new event file in `run_dir`, holding what torch's `SummaryWriter(run_dir, purge_step=...)` would hold for
    the same calls: TensorBoard, `logs.events.read_run` and its `read_scalars` / `read_texts` show
    the same points. Events are stamped with the time (seconds since the epoch) of the add_* call.

    `purge_step`: the first step of a resumed run; TensorBoard then hides every point earlier files of the run hold at
    a step >= it (written as SummaryWriter does: an `Event(step, file_version)` and a `SessionLog.START` at it).
    `filename_suffix`: appended to the file name (`events.out.tfevents.<s>.<host>.<pid>.<n><suffix>`).

    The file is created (empty) at once, which reserves its name; records are held in memory and written at
    `flush()` and `close()`, one write each, so a killed process loses what it added since its last flush. One thread
    writes; a signal handler of that thread may flush (not add) at any point (the per-rank callback's SIGTERM
    handler): a flush writes the records after its mark at the mark's offset (`os.pwrite`), so a flush interrupted
    and redone writes the same bytes at the same place, and the mark, one attribute, is stored after the write.
    add_* after close() raise ValueError.
    """

    def __init__(self, run_dir: str | os.PathLike, purge_step: int | None = None, filename_suffix: str = ""):
        os.makedirs(run_dir, exist_ok=True)
        self._fd = None
        while self._fd is None:
            self.path = event_file_name(run_dir, filename_suffix)
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            except FileExistsError:  # tensorboard's writer in this process counts on its own: take the next number
                continue
        now = time.time()
        source = _length_delimited(10, _length_delimited(1, SOURCE_WRITER))
        records = [record(file_version_event(now) + source)]
        if purge_step is not None:
            head = _event_head(now, int(purge_step))
            records += [record(head + _length_delimited(3, FILE_VERSION)), record(head + _SESSION_START)]
        # (records, how many of them are on disk, the file size they end at): replaced whole, never edited in place
        # except by appending a record, so a flush that interrupts an add (or another flush) sees a consistent mark.
        self._state: tuple[list[bytes], int, int] = (records, 0, 0)
        self._scalar_heads: dict[str, bytes] = {}
        self._text_heads: dict[str, bytes] = {}

    def add_scalar(self, tag: str, value: float, step: int = 0) -> None:
        """One event: `value` (a real number: int, float, numpy or 0-d torch scalar; stored as float32) at `step`."""
        head = self._scalar_heads.get(tag)
        if head is None:
            prefix = _value_prefix(tag)
            head = self._scalar_heads[tag] = _field(5, 2) + varint(len(prefix) + 4) + prefix
        self._add(_event_head(time.time(), int(step)) + head + _float32(float(value)))

    def add_text(self, tag: str, text: str, step: int = 0) -> None:
        """One event: `text` at `step`, under the tag `<tag>/text_summary` (TensorBoard's Text tab; torch's tag)."""
        head = self._text_heads.get(tag)
        if head is None:
            head = self._text_heads[tag] = _length_delimited(1, (tag + TEXT_SUFFIX).encode())
        tensor = _length_delimited(8, _STRING_TENSOR_HEAD + _length_delimited(8, str(text).encode()))
        summary = _length_delimited(1, head + tensor + _TEXT_METADATA)
        self._add(_event_head(time.time(), int(step)) + _length_delimited(5, summary))

    def _add(self, data: bytes) -> None:
        if self._fd is None:
            raise ValueError(f"{self.path} was closed; open a new RunWriter to write more")
        records, done, size = self._state
        if done >= 256:  # drop what is on disk; only here, never in a flush (which may run inside this call)
            self._state = records, done, size = records[done:], 0, size
        records.append(record(data))

    def flush(self) -> None:
        """Write what was added since the last flush to the file (the OS holds it from then on: a process killed
        later loses none of it; no fsync). Nothing to do after close()."""
        fd = self._fd
        records, done, size = self._state
        if fd is None or done == len(records):
            return
        pending = records[done:]
        data = memoryview(b"".join(pending))
        written = 0
        while written < len(data):
            written += _pwrite(fd, data[written:], size + written)
        self._state = (records, done + len(pending), size + len(data))

    def close(self) -> None:
        """Flush and close the file; a second close does nothing."""
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            fd, self._fd = self._fd, None
            if fd is not None:
                os.close(fd)

    def __enter__(self) -> RunWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pwrite(fd: int, data: memoryview, offset: int) -> int:
    """os.pwrite (POSIX); elsewhere a seek and a write (not safe against a flush from a signal handler)."""
    if hasattr(os, "pwrite"):
        return os.pwrite(fd, data, offset)
    os.lseek(fd, offset, os.SEEK_SET)
    return os.write(fd, data)
