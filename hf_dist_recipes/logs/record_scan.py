"""TFRecord framing and the scalar events of a chunk of an event file, decoded with numpy instead of one protobuf
object per record.

`frame_file(path, chunk_bytes)` yields, per chunk read, the buffer and where its complete records start; every
record's length is checked against its masked CRC-32C (a wrong length would derail every later record). The records
are found at once where they can be (`_frame_at_once`: every position that could start an event record, kept if they
chain from the first; ~4x faster), else walked one by one. The data CRC is not checked: a damaged payload is caught
by the decoders (a flipped bit inside a float goes unnoticed).

`scan_scalars(buf, starts, lengths)` decodes, all at once, the records that are exactly what torch's and
tensorboardX's `add_scalar` write, `Event{wall_time, step, summary{value{tag, simple_value}}}` (the encoding protobuf
gives them: fields in order, one-byte lengths): the records of one payload length and one step width share a byte
layout, so a check of a few columns of their bytes accepts them and the step, the float and the tag are read from fixed
columns. Any other record (the file_version event, text, tensors, several values in one event, long tags) is left to
the caller, which decodes it with protobuf.
"""

from __future__ import annotations

import os
import struct
from array import array
from dataclasses import dataclass

import numpy as np

from hf_dist_recipes.core.crc32c import crc32c_rows, masked, masked_crc32c

_LENGTH = struct.Struct("<Q").unpack_from


class CorruptRecordError(ValueError):
    pass


def _length_crc(length: int, cache: dict[int, int]) -> int:
    crc = cache.get(length)
    if crc is None:
        crc = cache[length] = masked_crc32c(struct.pack("<Q", length))
    return crc


def _gather(buf: bytes, starts: np.ndarray, width: int) -> np.ndarray:
    """(N, width) uint8: `width` bytes of `buf` at each of `starts`. The buffer is seen as overlapping `width`-byte
    items, one at each byte, so numpy copies one item a row (not one index a byte: ~4x faster)."""
    if not len(starts):
        return np.zeros((0, width), np.uint8)
    items = np.ndarray(shape=(len(buf) - width + 1,), dtype=f"V{width}", buffer=buf, strides=(1,))
    return items[starts].view(np.uint8).reshape(len(starts), width)


def _groups(keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(key, the indices holding it) for each distinct non-negative int in `keys`, ascending."""
    if not len(keys):
        return []
    if int(keys.max()) < 1 << 16:
        distinct = np.flatnonzero(np.bincount(keys))  # no sort: a chunk's records have a handful of lengths
    else:
        distinct = np.unique(keys)
    return [(int(k), np.flatnonzero(keys == k)) for k in distinct.tolist()]


def _distinct_rows(rows: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    """The distinct rows of an (N, t) uint8 array as bytes, and each row's index into them. Peels one value at a time
    (a few passes: the records of one length and step width hold one or two tags), sorting only past 8 of them."""
    items = np.ascontiguousarray(rows).view(f"V{rows.shape[1]}").reshape(-1)  # one comparable item a row
    ids = np.full(len(rows), -1, np.int64)
    distinct: list[bytes] = []
    left = np.arange(len(rows))
    while len(left) and len(distinct) < 8:
        first = items[left[0]]
        same = items[left] == first
        ids[left[same]] = len(distinct)
        distinct.append(bytes(first))
        left = left[~same]
    if len(left):
        values, inverse = np.unique(items[left], return_inverse=True)
        ids[left] = len(distinct) + inverse.reshape(-1)
        distinct += [bytes(v) for v in values]
    return distinct, ids


def _frame_at_once(buf: bytes) -> tuple[np.ndarray, np.ndarray, int] | None:
    """The complete records of `buf` found without walking them: every position where an event record could start
    (the 5 high bytes of a length are 0: under 16 MiB; the data begins with an Event's wall_time key, 0x09) whose
    length passes its CRC, kept only if they chain from byte 0, each record ending where the next starts. Returns
    (starts, lengths, end of the last complete record), or None when they do not chain (a damaged length, a record
    of 16 MiB or more, one that is not an Event, or, once in ~4e9 positions, a false start): then the caller walks.
    ~4x faster than the walk; the CRC of each candidate is computed in one batch (`crc32c_rows`)."""
    n = len(buf)
    if n < 16:
        return None
    length_at = np.ndarray(shape=(n - 12,), dtype="<u8", buffer=buf, strides=(1,))
    crc_at = np.ndarray(shape=(n - 12,), dtype="<u4", buffer=buf, offset=8, strides=(1,))
    head = np.frombuffer(buf, np.uint8, offset=12)
    cand = np.flatnonzero((length_at < 1 << 24) & (head == 0x09))
    cand = cand[masked(crc32c_rows(_gather(buf, cand, 8))) == crc_at[cand]]
    lengths = length_at[cand].astype(np.int64)
    ends = cand + 16 + lengths
    complete = ends <= n
    starts, lengths, ends = cand[complete], lengths[complete], ends[complete]
    if not len(starts) or starts[0] != 0 or (ends[:-1] != starts[1:]).any():
        return None
    pos = int(ends[-1])
    if pos + 12 <= n and pos + 16 + _LENGTH(buf, pos)[0] <= n:
        return None  # a complete record after the chain that was no candidate: only the walk can tell what it is
    return starts, lengths, pos


def _frame_one_by_one(buf: bytes, crc_of: dict[int, int]) -> tuple[np.ndarray, np.ndarray, int, int | None]:
    """The complete records of `buf`, walked: each length gives the next start (~0.5 us a record). Returns
    (starts, lengths, end of the last, index of the first record whose length fails its CRC or None)."""
    found = array("q")
    add = found.append
    pos, n = 0, len(buf)
    while pos + 12 <= n:
        end = pos + 16 + _LENGTH(buf, pos)[0]
        if end > n:
            break
        add(pos)
        pos = end
    starts = np.frombuffer(found, np.int64)
    lengths = _gather(buf, starts, 8).view("<u8").reshape(-1).astype(np.int64)
    crcs = _gather(buf, starts + 8, 4).view("<u4").reshape(-1)
    expected = np.zeros(len(starts), np.uint32)
    for length, rows in _groups(lengths):
        expected[rows] = _length_crc(length, crc_of)
    bad = np.flatnonzero(expected != crcs)
    return starts, lengths, pos, (int(bad[0]) if len(bad) else None)


def frame_file(path: str | os.PathLike, chunk_bytes: int):
    """Yield (buffer, record starts, data lengths) per `chunk_bytes` read: the complete records in `buffer` (int64
    arrays; a record's data is buffer[start + 12 : start + 12 + length]); at most a chunk and one record are held.
    Raises CorruptRecordError, after yielding every good record before it, on a truncated record or one whose length
    fails its checksum."""
    crc_of: dict[int, int] = {}  # length -> its masked CRC, verified lengths only
    with open(path, "rb") as f:
        buf = b""
        while True:
            more = f.read(chunk_bytes)
            buf = buf + more if buf else more
            if not more:
                if buf:
                    raise CorruptRecordError(f"truncated record ({len(buf)} bytes at the end of the file)")
                return
            n = len(buf)
            framed = _frame_at_once(buf)
            if framed is None:
                starts, lengths, pos, bad = _frame_one_by_one(buf, crc_of)
            else:
                (starts, lengths, pos), bad = framed, None
            if bad is not None:
                # Lengths after a damaged one are garbage: keep what precedes it.
                yield buf, starts[:bad], lengths[:bad]
                raise CorruptRecordError("record length fails its checksum")
            if pos + 12 <= n:
                # An incomplete record waits for the next chunk, unless its length is damaged (then it could point
                # past the end of the file and turn a checksum error into a "truncated" one).
                length, crc = struct.unpack_from("<QI", buf, pos)
                if _length_crc(length, crc_of) != crc:
                    yield buf, starts, lengths
                    raise CorruptRecordError("record length fails its checksum")
            yield buf, starts, lengths
            buf = buf[pos:]


def first_bad_data(buf: bytes, starts: np.ndarray, lengths: np.ndarray) -> int | None:
    """The index of the first record at `starts` whose data fails its CRC, None when all pass. The CRCs of the records
    of one length are computed at once (`crc32c_rows`)."""
    bad = len(starts)
    for length, rows in _groups(lengths):
        data = _gather(buf, starts[rows] + 12, length) if length else np.zeros((len(rows), 0), np.uint8)
        stored = _gather(buf, starts[rows] + 12 + length, 4).view("<u4").reshape(-1)
        wrong = rows[masked(crc32c_rows(data)) != stored]
        if len(wrong):
            bad = min(bad, int(wrong[0]))
    return None if bad == len(starts) else bad


@dataclass
class ScalarScan:
    """The plain scalar events of a chunk, one entry per record in `record` (its index in the chunk), `tag` (an
    index into `tags`), `step` and `value`; `other`: the indices of the records left to protobuf, ascending."""

    tags: list[str]
    record: np.ndarray  # int64, index of the record in the chunk
    tag: np.ndarray  # int64, index into tags
    step: np.ndarray  # int64
    value: np.ndarray  # float64 (a float32 widened)
    other: np.ndarray  # int64


_MAX_VARINT = 10


def _scan_layout(slab: np.ndarray, length: int, width: int):
    """For records of `length` data bytes and a step varint of `width` bytes (0: no step field, i.e. step 0), which
    rows match the scalar layout, and their step, value and tag bytes."""
    o = 10 + width if width else 9  # where the summary field starts
    t = length - o - 11  # tag length: summary key + len, value key + len, tag key + len, tag, float key + float
    if t <= 0 or length - o - 2 >= 128:
        return None
    ok = slab[:, 0] == 0x09
    if width:
        ok &= slab[:, 9] == 0x10
    for col, byte in ((o, 0x2A), (o + 1, length - o - 2), (o + 2, 0x0A), (o + 3, length - o - 4), (o + 4, 0x0A)):
        ok &= slab[:, col] == byte
    ok &= (slab[:, o + 5] == t) & (slab[:, o + 6 + t] == 0x15)
    step = np.zeros(len(slab), np.uint64)
    for k in range(width):
        step |= (slab[:, 10 + k] & 0x7F).astype(np.uint64) << np.uint64(7 * k)
    value = np.ascontiguousarray(slab[:, length - 4 :]).view("<f4").reshape(-1)
    return ok, step.view(np.int64), value, slab[:, o + 6 : o + 6 + t]


def scan_scalars(buf: bytes, starts: np.ndarray, lengths: np.ndarray) -> ScalarScan:
    """Decode the plain scalar events among the records at `starts` (see the module docstring)."""
    records, tags_at, steps, values, tag_bytes = [], [], [], [], []
    other = []
    for length, rows in _groups(lengths):
        if length < 21:  # shorter than any scalar event with a 1-byte tag
            other.append(rows)
            continue
        slab = _gather(buf, starts[rows] + 12, length)
        # Step width: 0 when the step field is absent (step 0), else up to the first byte without the high bit.
        has_step = slab[:, 9] == 0x10
        head = slab[:, 10 : min(length, 10 + _MAX_VARINT)] < 0x80
        width = np.where(has_step & head.any(axis=1), head.argmax(axis=1) + 1, 0)
        width[has_step & ~head.any(axis=1)] = -1  # no varint end in reach: not ours
        for w1, at in _groups(width + 1):
            w, sub = w1 - 1, rows[at]
            found = _scan_layout(slab[at], length, w) if w >= 0 else None
            if found is None:
                other.append(sub)
                continue
            ok, step, value, tag = found
            other.append(sub[~ok])
            records.append(sub[ok])
            steps.append(step[ok])
            values.append(value[ok])
            tag_bytes.append(tag[ok])
    tags: dict[str, int] = {}
    for tb in tag_bytes:
        distinct_tags, inv = _distinct_rows(tb)
        ids = np.array([tags.setdefault(x.decode("utf-8", "replace"), len(tags)) for x in distinct_tags], np.int64)
        tags_at.append(ids[inv] if len(ids) else np.zeros(0, np.int64))
    empty_i = np.zeros(0, np.int64)
    return ScalarScan(
        tags=list(tags),
        record=np.concatenate(records) if records else empty_i,
        tag=np.concatenate(tags_at).astype(np.int64) if tags_at else empty_i,
        step=np.concatenate(steps) if steps else empty_i,
        value=np.concatenate(values).astype(np.float64) if values else np.zeros(0),
        other=np.sort(np.concatenate(other)) if other else empty_i,
    )
