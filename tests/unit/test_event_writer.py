"""Our TensorBoard event files (core/event_writer.py, core/crc32c.py) read back by tensorboard's own code, and our
fast reader (logs/record_scan.py) against protobuf's decoding of the same files."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest

from hf_dist_recipes.core import event_writer
from hf_dist_recipes.core.crc32c import crc32c, crc32c_rows, masked, masked_crc32c
from hf_dist_recipes.core.event_writer import write_scalar_run
from hf_dist_recipes.logs.events import read_rank

# Columns with what varies the byte layout: steps 0 (field left out), 1-byte to 6-byte varints, a negative step
# (10 bytes), values beyond float32 (inf), NaN, -0.0, a tag over 127 bytes (2-byte lengths), non-ASCII, a column
# present at some steps only.
COLUMNS = [
    ("loss/mean", np.array([0, 1, 5, 127, 128, 300, 20000, 2**40]), np.arange(8) * 1.1),
    ("lr", np.array([1, 128, 129, 130]), np.array([1e40, -0.0, np.nan, 3.0])),
    ("ünï/" + "x" * 130, np.array([-5, 7]), np.array([1.0, 2.0])),
]


def _expected_bytes(columns, wall_time: float) -> bytes:
    """The same events built with tensorboard's protobuf classes and framed by tensorboard's RecordWriter."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.record_writer import RecordWriter

    buf = io.BytesIO()
    writer = RecordWriter(buf)
    writer.write(Event(wall_time=wall_time, file_version="brain.Event:2").SerializeToString())
    for step in np.unique(np.concatenate([s for _, s, _ in columns])).tolist():
        values = [
            Summary.Value(tag=tag, simple_value=float(v[list(s).index(step)]))
            for tag, s, v in columns
            if step in list(s)
        ]
        writer.write(Event(wall_time=wall_time, step=step, summary=Summary(value=values)).SerializeToString())
    return buf.getvalue()


def test_bytes_equal_protobuf_and_tensorboards_record_writer(tmp_path):
    path = write_scalar_run(tmp_path, COLUMNS, filename_suffix=".agg", wall_time=1234.5)
    assert Path(path).name.startswith("events.out.tfevents.") and path.endswith(".agg")
    assert Path(path).read_bytes() == _expected_bytes(COLUMNS, 1234.5)


def test_chunks_and_layouts_interleaved_read_back_by_tensorboard(tmp_path, monkeypatch):
    # Several chunks of steps, and in each, events of three layouts interleaved (a tag every step, one every 3rd
    # step, one every 7th; varints of 1, 2 and 3 bytes): TensorBoard's EventAccumulator, which checks both CRCs of
    # every record, reads every (tag, step, value) back.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setattr(event_writer, "CHUNK_STEPS", 1000)
    rng = np.random.default_rng(0)
    steps = np.arange(0, 20000, 4)
    columns = [
        ("a/mean", steps, rng.standard_normal(len(steps))),
        ("b/max", steps[::3], rng.standard_normal(len(steps[::3]))),
        ("c/spread", steps[::7], 1e-3 * rng.standard_normal(len(steps[::7]))),
    ]
    write_scalar_run(tmp_path, columns)
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["a/mean", "b/max", "c/spread"]
    for tag, s, v in columns:
        got = acc.Scalars(tag)
        assert [e.step for e in got] == s.tolist()
        assert [e.value for e in got] == v.astype(np.float32).astype(np.float64).tolist()


def test_crc32c_known_value_and_tensorboards_masked_crc():
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tb_masked_crc32c

    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
    rng = np.random.default_rng(1)
    for length in (0, 1, 3, 4, 5, 8, 13, 64, 641):
        rows = rng.integers(0, 256, (20, length), dtype=np.uint8)
        expected = [tb_masked_crc32c(r.tobytes()) for r in rows]
        assert masked(crc32c_rows(rows)).tolist() == expected
        assert [masked_crc32c(r.tobytes()) for r in rows] == expected


def test_a_flipped_byte_fails_the_crc_tensorboard_checks(tmp_path):
    # Our CRCs are the ones TensorBoard verifies: intact, its record reader reads every record; one byte of a value
    # flipped, it stops at that record with a data-loss error naming the CRC check.
    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

    path = write_scalar_run(tmp_path, [("x", np.arange(5), np.arange(5.0))], wall_time=1.0)

    def records(p):
        reader, out = PyRecordReader_New(p), []
        try:
            while True:
                reader.GetNext()
                out.append(reader.record())
        except errors.OutOfRangeError:
            return out

    assert len(records(path)) == 6  # file_version + 5 steps
    data = bytearray(Path(path).read_bytes())
    first = 16 + struct.unpack_from("<Q", data, 0)[0]  # the second record (step 0)
    second = first + 16 + struct.unpack_from("<Q", data, first)[0]  # the third (step 1)
    data[second - 5] ^= 0x40  # the last byte of step 1's float
    Path(path).write_bytes(bytes(data))
    with pytest.raises(errors.DataLossError, match="crc32 check"):
        records(path)


def test_our_reader_reads_what_our_writer_wrote(tmp_path):
    write_scalar_run(tmp_path / "rank0", COLUMNS, wall_time=5.0)
    (path,) = (tmp_path / "rank0").iterdir()
    got = read_rank(0, [str(path)])
    assert got.warnings == [] and got.records == 1 + 12  # file_version + one event per step (12 distinct)
    for tag, s, v in COLUMNS:
        steps, values = got.scalars[tag]
        assert steps.tolist() == s.tolist()
        with np.errstate(over="ignore"):  # 1e40 is inf in float32, as written
            np.testing.assert_array_equal(values, v.astype(np.float32).astype(np.float64))


def _reference(files: list[str]) -> dict[str, dict[int, float]]:
    """Every scalar of the files decoded by protobuf, one record at a time: tag -> step -> the last value written."""
    from tensorboard.compat.proto.event_pb2 import Event

    from hf_dist_recipes.logs.events import iter_records

    out: dict[str, dict[int, float]] = {}
    for path in sorted(files):
        for data in iter_records(path):
            event = Event.FromString(data)
            for v in event.summary.value:
                if v.WhichOneof("value") == "simple_value":
                    out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


@pytest.mark.parametrize("chunk_bytes", [4 * 1024 * 1024, 333])
def test_fast_reader_equals_protobuf_on_summarywriter_files(tmp_path, monkeypatch, chunk_bytes):
    # torch's SummaryWriter: plain scalars (the numpy path), text and a two-value event (protobuf's path), steps
    # rewritten by a second file (a resumed run: the later write wins), long and short tags, steps 0 to 70,000;
    # read in one chunk and in chunks of 333 bytes (records cut across reads, chains that restart mid-chunk).
    from tensorboard.compat.proto.summary_pb2 import Summary
    from torch.utils.tensorboard import SummaryWriter

    monkeypatch.setattr("hf_dist_recipes.logs.events.CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(2)
    files = []
    for part, steps in enumerate((range(0, 70000, 350), range(35000, 40000, 50))):
        w = SummaryWriter(str(tmp_path / "rank0"), filename_suffix=f".{part}")
        w.add_text("run", "host=node7")
        for s in steps:
            w.add_scalar("loss", float(rng.standard_normal()), s)
            w.add_scalar("t/" + "y" * 150, float(rng.standard_normal()), s)
            if s % 700 == 0:
                both = Summary(value=[Summary.Value(tag="pair/a", simple_value=1.5), Summary.Value(tag="pair/b")])
                w._get_file_writer().add_summary(both, s)
        w.close()
        files = sorted(str(p) for p in (tmp_path / "rank0").iterdir())
    got = read_rank(0, files)
    expected = _reference(files)
    assert got.warnings == [] and got.host == "node7"
    assert sorted(got.scalars) == sorted(expected)
    for tag, by_step in expected.items():
        steps, values = got.scalars[tag]
        assert steps.tolist() == sorted(by_step)
        assert values.tolist() == [by_step[s] for s in sorted(by_step)]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_records_the_fast_framing_cannot_see_are_still_read(tmp_path, where):
    # An event without wall_time (protobuf leaves a 0.0 out, so its data does not begin with 0x09) is no candidate
    # for the at-once framing: the reader must walk instead, and at the end of a file must not call it truncated.
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    def scalar(step, value, wall_time):
        summary = Summary(value=[Summary.Value(tag="x", simple_value=value)])
        return event_writer.record(Event(wall_time=wall_time, step=step, summary=summary).SerializeToString())

    events = [(s, float(s), 1.0) for s in range(10)]
    odd = {"first": 0, "middle": 5, "last": 9}[where]
    events[odd] = (odd, float(odd), 0.0)
    (tmp_path / "rank0").mkdir()
    path = tmp_path / "rank0" / "events.out.tfevents.0.h"
    path.write_bytes(b"".join(scalar(*e) for e in events))
    got = read_rank(0, [str(path)])
    assert got.warnings == [] and got.records == 10
    assert got.scalars["x"][0].tolist() == list(range(10)) and got.scalars["x"][1].tolist() == [
        float(s) for s in range(10)
    ]
