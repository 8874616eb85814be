"""Read TensorBoard event files fast: our own TFRecord framing, tensorboard's compiled `Event` proto.

A TFRecord is `length: u64 | masked crc32c(length): u32 | data | masked crc32c(data): u32` (little endian). Every
length is checked against its CRC (a wrong length would derail every later record); the data CRC is not, because
crc32c in pure Python costs more than decoding the record, and a damaged payload is caught by the proto decoder
instead (a flipped bit inside a float goes unnoticed). A file
cut short (a rank killed mid-write) or a damaged record ends the reading of that file with a warning naming it;
what was read before stays.

Scalars come from `simple_value` (torch's and tensorboardX's SummaryWriter) or from a rank-0 float tensor (the
`scalars` plugin of `tf.summary`). Text summaries (`add_text`) are kept only to find the host name a run recorded.
"""

from __future__ import annotations

import os
import re
import struct
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hf_dist_recipes.logs.crc32c import masked_crc32c

CHUNK_BYTES = 4 * 1024 * 1024  # read size; a file is never held whole, at most one chunk plus one record
_HEADER = struct.Struct("<QI")
_LENGTH = struct.Struct("<Q")
_RANK_DIR = re.compile(r"^rank(\d+)$")
_HOST_IN_TEXT = re.compile(r"\bhost(?:name)?\s*[=:]\s*([A-Za-z0-9_.-]+)")


class CorruptRecordError(ValueError):
    pass


def iter_record_batches(path: str | os.PathLike):
    """Yield lists of the data of consecutive TFRecords in `path`, one list per chunk read (streaming: at most a
    chunk and one record are held). Raises CorruptRecordError, after yielding every good record before it, on a
    truncated record or one whose length fails its checksum."""
    # Headers already verified: records of one writer have few distinct lengths, so the pure-Python CRC runs a
    # handful of times per file instead of once per record.
    good_headers: set[bytes] = set()
    unpack_length = _LENGTH.unpack_from
    with open(path, "rb") as f:
        buf = b""
        while True:
            more = f.read(CHUNK_BYTES)
            buf = buf + more if buf else more
            if not more:
                if buf:
                    raise CorruptRecordError(f"truncated record ({len(buf)} bytes at the end of the file)")
                return
            batch = []
            pos, n = 0, len(buf)
            while n - pos >= 12:
                header = buf[pos : pos + 12]
                if header not in good_headers:
                    length, length_crc = _HEADER.unpack(header)
                    if masked_crc32c(header[:8]) != length_crc:
                        yield batch
                        raise CorruptRecordError("record length fails its checksum")
                    good_headers.add(header)
                end = pos + 16 + unpack_length(buf, pos)[0]
                if end > n:
                    break
                batch.append(buf[pos + 12 : end - 4])
                pos = end
            buf = buf[pos:]
            yield batch


def iter_records(path: str | os.PathLike):
    """Yield the data of each TFRecord in `path` (see `iter_record_batches`)."""
    for batch in iter_record_batches(path):
        yield from batch


@dataclass
class RankEvents:
    """The scalars of one rank: per tag, sorted unique steps and their values (the last write of a step wins, as
    when a resumed run rewrote it). `warnings`: one line per unreadable file or record."""

    rank: int
    scalars: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    host: str | None = None
    records: int = 0
    warnings: list[str] = field(default_factory=list)


def _text_of(value) -> str:
    vals = value.tensor.string_val
    return vals[0].decode("utf-8", "replace") if vals else ""


def _tensor_value(v, out: RankEvents) -> float | None:
    """The scalar of a tensor-valued summary (tf.summary's scalars plugin); a text one only updates `out.host`."""
    if v.WhichOneof("value") != "tensor":
        return None
    if v.metadata.plugin_data.plugin_name == "text":
        text = _text_of(v)
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


def read_rank(rank: int, files: list[str]) -> RankEvents:
    """Read every event file of one rank (in name order: TensorBoard names them by creation time)."""
    from tensorboard.compat.proto.event_pb2 import Event

    # array, not list: 8 B per step and per value while a rank is read, instead of a Python object each.
    steps: dict[str, array] = {}
    values: dict[str, array] = {}
    appenders: dict[str, tuple] = {}  # tag -> (steps.append, values.append): the hot loop does no lookups
    out = RankEvents(rank=rank)
    decode = Event.FromString
    for path in sorted(files):
        n = 0
        try:
            for batch in iter_record_batches(path):
                for data in batch:
                    n += 1
                    event = decode(data)
                    vals = event.summary.value  # empty for the other kinds of event (file_version, graph, ...)
                    if not vals:
                        continue
                    step = event.step
                    for v in vals:
                        x = v.simple_value
                        # 0.0 is also what an unset simple_value reads as: only then look at which field is set.
                        if x == 0.0 and v.WhichOneof("value") != "simple_value":
                            x = _tensor_value(v, out)
                            if x is None:
                                continue
                        tag = v.tag
                        app = appenders.get(tag)
                        if app is None:
                            steps[tag], values[tag] = array("q"), array("d")
                            app = appenders[tag] = (steps[tag].append, values[tag].append)
                        app[0](step)
                        app[1](x)
        except CorruptRecordError as err:
            out.warnings.append(f"{path}: {err}; kept the {n} record(s) read before it")
        except Exception as err:  # a damaged payload: protobuf's DecodeError, or a file that vanished
            out.warnings.append(f"{path}: unreadable ({type(err).__name__}: {err}); kept what was read before it")
        out.records += n
    for tag, s in steps.items():
        st = np.asarray(s, dtype=np.int64)
        va = np.asarray(values[tag], dtype=np.float64)
        # Stable sort, then keep the last occurrence of each step: a rewritten step replaces the older value.
        order = np.argsort(st, kind="stable")
        st, va = st[order], va[order]
        last = np.ones(len(st), dtype=bool)
        last[:-1] = st[1:] != st[:-1]
        out.scalars[tag] = (st[last], va[last])
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
