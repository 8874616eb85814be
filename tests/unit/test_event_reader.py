"""One reader: `logs.events.read_scalars` / `read_texts` read with the package's own reader
(`logs.events.read_run`) and give what TensorBoard's `EventAccumulator` gives, on the shapes a run produces: duplicate
steps (an evaluation log at a training step), a resume's purge (`purge_step`: a `SessionLog.START`), several files,
several values in one event, text and tensor summaries, large steps, and files without a version header (where
TensorBoard purges by out-of-order steps instead)."""

from __future__ import annotations

import struct
import time

import pytest

from hf_dist_recipes.core.crc32c import masked_crc32c
from hf_dist_recipes.logs.events import read_run, read_scalars, read_texts


def accumulator(run_dir, kind):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={kind: 0})
    acc.Reload()
    if kind == "scalars":
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    return {
        tag: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
        for tag in acc.Tags()["tensors"]
    }


def write_event_file(path, events):
    with open(path, "wb") as f:
        for event in events:
            data = event.SerializeToString()
            head = struct.pack("<Q", len(data))
            f.write(head + struct.pack("<I", masked_crc32c(head)) + data + struct.pack("<I", masked_crc32c(data)))


def test_a_resumed_run_with_duplicates_and_texts_reads_as_tensorboard_reads_it(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "rank0"
    w = SummaryWriter(run, filename_suffix=".a")
    w.add_text("run", "host=a rank 0", 0)
    for step in range(1, 30):
        w.add_scalar("train/loss", 1.0 / step, step)
        w.add_scalar("train/big_step", step * 0.5, step + 2**40)  # a 6-byte step varint
        if step % 5 == 0:
            w.add_scalar("train/loss", -1.0 * step, step)  # a second write of one step: both kept
            w.add_scalars("pair", {"a": step, "b": -step}, step)
        if step == 7:
            w.add_scalar("only_early", 3.0, step)  # purged entirely later: the tag stays, empty
        if step % 10 == 0:
            w.add_text("train/event", f"at {step}", step)
    w.close()
    # The file name holds the second it was made, then a per-process counter: in one second "...8.a" would sort
    # after "...11.b". A resume comes later than its run's first file; so here.
    time.sleep(1.1)
    # A resume at step 6 (purge_step): what was logged at 6 or later is purged; texts are not
    # (TensorBoard keeps them too).
    w = SummaryWriter(run, purge_step=6, filename_suffix=".b")
    for step in range(6, 20):
        w.add_scalar("train/loss", 2.0 * step, step)
        w.add_scalar("late", float(step), step)
    w.add_text("train/event", "resumed", 6)
    w.close()
    files = sorted(p.name for p in run.iterdir())
    assert len(files) >= 2 and files[0].endswith(".a")  # written in that order and read in that order
    expected = accumulator(run, "scalars")
    assert expected["only_early"] == [] and len(expected["train/loss"]) > 14  # the cases are there
    got = read_scalars(run)
    assert got == expected
    assert list(got) == list(expected)  # tag order too
    assert read_texts(run) == accumulator(run, "tensors")


def test_files_without_a_version_header_purge_by_out_of_order_steps(tmp_path):
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    def scalar(step, tag, value):
        return Event(wall_time=1.0, step=step, summary=Summary(value=[Summary.Value(tag=tag, simple_value=value)]))

    write_event_file(
        tmp_path / "events.out.tfevents.1.h",
        [scalar(s, "x", s) for s in range(10)] + [scalar(s, "y", s) for s in range(10)] + [scalar(4, "x", -4.0)],
    )
    assert read_scalars(tmp_path) == accumulator(tmp_path, "scalars")
    assert [s for s, _ in read_scalars(tmp_path)["x"]] == [0, 1, 2, 3, 4]


def test_tensor_scalars_are_tensors_there_and_not_scalars_here(tmp_path):
    """tf.summary's scalars (rank-0 float tensors) are in EventAccumulator's tensors, not its scalars: read_scalars
    leaves them out too (`logs summarize`'s read_rank takes them as scalars)."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.compat.proto.tensor_pb2 import TensorProto

    events = [Event(wall_time=1.0, file_version="brain.Event:2")]
    value = Summary.Value(tag="t", tensor=TensorProto(dtype=1, float_val=[2.5]))
    events.append(Event(wall_time=2.0, step=3, summary=Summary(value=[value])))
    events.append(Event(wall_time=3.0, step=3, summary=Summary(value=[Summary.Value(tag="s", simple_value=1.5)])))
    write_event_file(tmp_path / "events.out.tfevents.1.h", events)
    assert read_scalars(tmp_path) == accumulator(tmp_path, "scalars") == {"s": [(3, 1.5)]}
    assert list(read_run(tmp_path, tensors=True).tensors) == ["t"]


@pytest.mark.parametrize("cut", [3, 20])
def test_a_file_cut_short_keeps_what_came_before(tmp_path, cut):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(tmp_path)
    for step in range(50):
        w.add_scalar("x", float(step), step)
    w.close()
    (path,) = tmp_path.iterdir()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - cut])
    assert read_scalars(tmp_path) == accumulator(tmp_path, "scalars")
    assert len(read_run(tmp_path).warnings) == 1
    assert read_scalars(path) == accumulator(path, "scalars")  # a file's own path: that file


def test_a_record_whose_data_fails_its_checksum_ends_its_file_as_in_tensorboard(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(tmp_path)
    for step in range(50):
        w.add_scalar("x", float(step), step)
    w.close()
    (path,) = tmp_path.iterdir()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside some record's data (or its CRC): no length is touched
    path.write_bytes(bytes(data))
    expected = accumulator(tmp_path, "scalars")
    assert 0 < len(expected["x"]) < 50
    assert read_scalars(tmp_path) == expected
