"""Our TensorBoard event files (core/event_writer.py, core/crc32c.py) read back by tensorboard's own code, and our
fast reader (logs/record_scan.py) against protobuf's decoding of the same files. `RunWriter` (the per-rank runs)
against torch's SummaryWriter: the same points through TensorBoard's EventAccumulator and our readers, the same
fields record by record, both CRCs of every record, and nothing written before a flush."""

from __future__ import annotations

import io
import math
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from hf_dist_recipes.core import event_writer
from hf_dist_recipes.core.crc32c import crc32c, crc32c_rows, masked, masked_crc32c
from hf_dist_recipes.core.event_writer import RunWriter, write_scalar_run
from hf_dist_recipes.logs.events import iter_records, read_rank, read_run, read_scalars, read_texts
from hf_dist_recipes.monitoring.tensorboard import _after_existing_event_files

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


# --- RunWriter against torch's SummaryWriter --------------------------------------------------------------------------


def _first_run(w) -> None:
    """What a run logs before it dies: texts with and without a step, scalars at steps 0-9 (ints, a negative value,
    beyond float32's range, NaN), an evaluation's second write of step 5, a step of a 6-byte varint."""
    w.add_text("run", "host=node7 rank 0", 0)
    w.add_text("seed", "rank 0: seed 42, rng fingerprint ab12")
    for step in range(10):
        w.add_scalar("train/loss", 1.0 / (step + 1), step)
        w.add_scalar("train/tokens", 4096 * step, step)
        w.add_scalar("rank/step_time_s", -0.25 * step if step % 4 else 1e40, step)
        if step == 5:
            w.add_scalar("train/loss", float("nan"), step)
            w.add_text("train/nonfinite_event", "skipped step 5: loss is nan", step)
    w.add_scalar("far", 2.5, 2**40)


def _resumed_run(w) -> None:
    """The resume at step 6 (purge_step=6): steps 6-12 again, a text, a tag new to the run."""
    w.add_text("run", "host=node8 rank 0", 6)
    for step in range(6, 13):
        w.add_scalar("train/loss", 10.0 + step, step)
        w.add_scalar("late", float(step), step)


def _both_runs(tmp_path):
    """The same two launches written by torch's SummaryWriter into torch/rank0 and by RunWriter into ours/rank0."""
    from torch.utils.tensorboard import SummaryWriter

    runs = {"torch": tmp_path / "torch" / "rank0", "ours": tmp_path / "ours" / "rank0"}
    for make in (lambda d: SummaryWriter(str(d)), RunWriter):
        w = make(runs["torch" if make is not RunWriter else "ours"])
        _first_run(w)
        w.close()
    for name, run in runs.items():
        _after_existing_event_files(str(run))  # the resume's file sorts after the first, as the callback ensures
        w = SummaryWriter(str(run), purge_step=6) if name == "torch" else RunWriter(run, purge_step=6)
        _resumed_run(w)
        w.close()
    return runs


def _accumulated(run_dir):
    """What TensorBoard shows of a run: tags, scalars as (step, value) (NaN as a string: comparable) and texts."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = {kind: sorted(acc.Tags()[kind]) for kind in ("scalars", "tensors")}
    scalars = {t: [(e.step, repr(e.value)) for e in acc.Scalars(t)] for t in tags["scalars"]}
    texts = {t: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(t)] for t in tags["tensors"]}
    plugins = {t: acc.SummaryMetadata(t).plugin_data.plugin_name for t in tags["tensors"]}
    return tags, scalars, texts, plugins


def test_run_writer_reads_back_as_summarywriters_runs(tmp_path):
    runs = _both_runs(tmp_path)
    tags, scalars, texts, plugins = _accumulated(runs["ours"])
    assert (tags, scalars, texts, plugins) == _accumulated(runs["torch"])
    # The cases are there: the purge hid the first launch's steps >= 6, texts kept (TensorBoard keeps them too).
    assert [s for s, _ in scalars["train/loss"]] == [0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10, 11, 12]
    assert scalars["train/loss"][6] == (5, "nan") and scalars["train/loss"][7] == (6, "16.0")
    assert scalars["rank/step_time_s"][0] == (0, "inf") and scalars["far"] == []  # 2**40 >= 6: purged
    assert texts["run/text_summary"] == [(0, "host=node7 rank 0"), (6, "host=node8 rank 0")]
    assert texts["seed/text_summary"] == [(0, "rank 0: seed 42, rng fingerprint ab12")]
    assert set(plugins.values()) == {"text"}
    # Our readers (the callback's callers use them) give the same for both writers, and TensorBoard's points.
    for run in runs.values():
        got = read_scalars(run)
        assert {t: [(s, repr(float(np.float32(v)))) for s, v in pts] for t, pts in got.items()} == scalars
        assert read_texts(run) == texts
        assert read_run(run).warnings == []  # read_run checks both CRCs of every record


def _records_checked(path):
    """Each record's data, after checking both its CRCs with tensorboard's own masked CRC-32C."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tb_masked_crc32c

    data, out, p = Path(path).read_bytes(), [], 0
    while p < len(data):
        (n,) = struct.unpack_from("<Q", data, p)
        assert struct.unpack_from("<I", data, p + 8)[0] == tb_masked_crc32c(data[p : p + 8])
        body = data[p + 12 : p + 12 + n]
        assert struct.unpack_from("<I", data, p + 12 + n)[0] == tb_masked_crc32c(body)
        out.append(body)
        p += 16 + n
    return out


def test_run_writer_records_are_summarywriters_field_for_field(tmp_path):
    from tensorboard.compat.proto.event_pb2 import Event

    runs = _both_runs(tmp_path)
    files = {name: sorted(run.glob("events.out.tfevents.*")) for name, run in runs.items()}
    assert len(files["ours"]) == len(files["torch"]) == 2
    for ours, theirs in zip(files["ours"], files["torch"], strict=True):
        name = ours.name.split(".")
        assert name[:3] == ["events", "out", "tfevents"] and name[4:6] == theirs.name.split(".")[4:6]  # host, pid
        assert _records_checked(ours) == list(iter_records(ours))  # our framing reader agrees
        mine = [Event.FromString(d) for d in _records_checked(ours)]
        want = [Event.FromString(d) for d in _records_checked(theirs)]
        assert len(mine) == len(want) > 3
        assert mine[0].source_metadata.writer == "hf_dist_recipes.core.event_writer"
        for a, b in zip(mine, want, strict=True):
            assert a.wall_time == pytest.approx(b.wall_time, abs=60)
            for e in (a, b):
                e.ClearField("wall_time")
                e.ClearField("source_metadata")  # the header names its writer
            assert a == b


def test_run_writer_writes_at_flush_and_close_only(tmp_path):
    w = RunWriter(tmp_path / "rank0", purge_step=3, filename_suffix=".x")
    path = Path(w.path)
    assert path.parent == tmp_path / "rank0" and path.name.endswith(".x")
    assert path.read_bytes() == b""  # the name is taken, nothing written
    w.add_scalar("loss", 1.5, 3)
    w.add_text("event", "spike", 3)
    assert path.read_bytes() == b""
    w.flush()
    assert read_scalars(path.parent) == {"loss": [(3, 1.5)]}
    assert read_texts(path.parent) == {"event/text_summary": [(3, "spike")]}
    flushed = path.read_bytes()
    w.add_scalar("loss", 0.75, 4)
    w.flush()
    w.flush()  # nothing new: nothing written twice
    assert path.read_bytes().startswith(flushed) and read_scalars(path.parent)["loss"] == [(3, 1.5), (4, 0.75)]
    w.add_scalar("loss", 0.5, 5)
    assert read_scalars(path.parent)["loss"][-1] == (4, 0.75)
    w.close()
    w.close()
    w.flush()  # after close: nothing to do
    assert read_scalars(path.parent)["loss"][-1] == (5, 0.5)
    with pytest.raises(ValueError, match="was closed; open a new RunWriter"):
        w.add_scalar("loss", 0.25, 6)


def test_run_writer_takes_the_next_name_when_one_is_taken(tmp_path, monkeypatch):
    # tensorboard's writer numbers its files with a counter of its own: the same name in the same second is possible.
    taken = tmp_path / "events.out.tfevents.1.h.1.0"
    taken.write_bytes(b"theirs")
    names = iter([str(taken), str(tmp_path / "events.out.tfevents.1.h.1.1")])
    monkeypatch.setattr(event_writer, "event_file_name", lambda run_dir, suffix="": next(names))
    with RunWriter(tmp_path) as w:
        w.add_scalar("x", math.pi, 1)
    assert taken.read_bytes() == b"theirs" and w.path.endswith(".1.1")
    assert read_scalars(tmp_path)["x"] == [(1, float(np.float32(math.pi)))]


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_signal_handler_flushing_inside_a_flush_writes_each_record_once(tmp_path, monkeypatch, when):
    # The callback's SIGTERM handler flushes, at whatever point of a flush (or an add) the signal arrives: here just
    # before and just after the flush's write. Whatever both write, each record is in the file once, in order.
    w = RunWriter(tmp_path)
    w.add_scalar("x", 1.0, 1)
    w.flush()
    w.add_scalar("x", 2.0, 2)
    real, caught = event_writer._pwrite, []

    def signalled(fd, data, offset):
        first = not caught  # the handler's own flush comes here too: one signal
        if first and when == "before":
            os.kill(os.getpid(), signal.SIGUSR1)  # Python runs the handler at the next bytecode: here
        n = real(fd, data, offset)
        if first and when == "after":
            os.kill(os.getpid(), signal.SIGUSR1)
        return n

    def handler(signum, frame):
        caught.append(signum)
        w.flush()

    monkeypatch.setattr(event_writer, "_pwrite", signalled)
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        w.flush()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    monkeypatch.setattr(event_writer, "_pwrite", real)
    w.close()
    assert caught and read_run(tmp_path).warnings == []
    assert read_scalars(tmp_path) == {"x": [(1, 1.0), (2, 2.0)]}
    assert len(list(iter_records(w.path))) == 3  # the header and the two scalars, nothing twice


def test_tensorboards_own_writer_hangs_when_the_sigterm_flush_lands_inside_a_write(tmp_path):
    """Issue 42, why RunWriter stays (its writing saves ~0.07% of a run: no reason by itself). The per-rank
    TensorBoard callback flushes from its SIGTERM handler, so a preempted rank's last logs reach the disk; the signal
    comes whenever the scheduler sends it. RunWriter takes that at any point of a flush or an add (the test above).
    torch's SummaryWriter does not: its async writer's `write` holds a `threading.Lock` that `flush` takes again,
    so a handler's flush landing inside a write waits on itself forever, and the rank spends its grace period hung
    (tensorboard 2.21 event_file_writer.py `_AsyncWriter`). Shown in a child process stopped after 10 s: the first
    flush returns, the add whose write the signal interrupts never does."""
    child = textwrap.dedent(
        """
        import os, signal, sys
        from tensorboard.summary.writer import event_file_writer
        from torch.utils.tensorboard import SummaryWriter

        w = SummaryWriter(sys.argv[1])
        w.add_scalar("x", 1.0, 1)
        w.flush()
        print("flushed", flush=True)
        inside = event_file_writer._AsyncWriter._check_worker_status  # called with write's lock held
        sent = []

        def check(self):
            if not sent:  # the signal arrives here, once: Python runs the handler at the next bytecode
                sent.append(1)
                os.kill(os.getpid(), signal.SIGUSR1)
            return inside(self)

        event_file_writer._AsyncWriter._check_worker_status = check
        signal.signal(signal.SIGUSR1, lambda signum, frame: w.flush())  # what the callback's handler does
        w.add_scalar("x", 2.0, 2)
        print("returned", flush=True)
        """
    )
    with pytest.raises(subprocess.TimeoutExpired) as hung:
        subprocess.run([sys.executable, "-c", child, str(tmp_path)], capture_output=True, timeout=10)
    out = hung.value.stdout or b""
    assert b"flushed" in out and b"returned" not in out, out
