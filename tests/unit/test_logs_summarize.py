"""Offline aggregation of per-rank TensorBoard logs written by torch's own SummaryWriter (not by our callback)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from hf_dist_recipes.logs.aggregate import summarize_logs, write_aggregate_run
from hf_dist_recipes.logs.events import find_rank_files, iter_records

RANKS, STEPS = 4, 100
SLOW_RANK, SLOW_FROM = 2, 40  # step time x1.5 from this step on
LR_RANK, LR_FROM = 3, 60  # learning rate x1.5 from this step on


def _write_run(root: Path, lr_diverges: bool = True, slow: bool = True, loss_fn=None) -> dict[str, np.ndarray]:
    """Four ranks' runs; returns the values written, tag -> ranks x steps (float32, as TensorBoard stores them)."""
    from torch.utils.tensorboard import SummaryWriter

    rng = np.random.default_rng(0)
    steps = np.arange(1, STEPS + 1)
    step_time = 1.0 + 0.02 * rng.standard_normal((RANKS, STEPS))
    if slow:
        step_time[SLOW_RANK, steps >= SLOW_FROM] *= 1.5
    lr = np.tile(1e-3 * (1 - steps / (2 * STEPS)), (RANKS, 1))
    if lr_diverges:
        lr[LR_RANK, steps >= LR_FROM] *= 1.5
    loss = loss_fn(rng) if loss_fn else 5.0 - 0.01 * steps + 0.1 * rng.standard_normal((RANKS, STEPS))
    values = {"rank/step_time_s": step_time, "train/learning_rate": lr, "rank/loss": loss}
    for r in range(RANKS):
        w = SummaryWriter(str(root / f"rank{r}"))
        w.add_text("run", f"host=node{r // 2} rank={r}")
        for i, s in enumerate(steps):
            for tag, v in values.items():
                w.add_scalar(tag, float(v[r, i]), int(s))
        w.close()
    return {tag: v.astype(np.float32).astype(np.float64) for tag, v in values.items()}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("logs")
    return root, _write_run(root)


def test_finds_the_slow_rank_and_the_diverging_learning_rate(run_dir):
    root, _ = run_dir
    summary = summarize_logs(root, workers=2)
    assert [(s.rank, s.host, s.from_step) for s in summary.stragglers] == [(SLOW_RANK, "node1", SLOW_FROM)]
    # 1.5x the others' step time, whose median is ~1.0 with 2 % noise.
    assert summary.stragglers[0].slower_by == pytest.approx(0.5, abs=0.05)
    assert [(d.tag, d.ranks, d.first_step) for d in summary.divergences] == [
        ("train/learning_rate", [LR_RANK], LR_FROM)
    ]
    assert summary.hosts == {0: "node0", 1: "node0", 2: "node1", 3: "node1"}
    assert summary.warnings == []


def test_clean_run_has_no_findings(tmp_path):
    _write_run(tmp_path, lr_diverges=False, slow=False)
    summary = summarize_logs(tmp_path, workers=1)
    assert summary.stragglers == [] and summary.divergences == []


def test_rank0_diverging_is_named_not_the_others(tmp_path):
    # The first rank read is the comparison reference; when it is the odd one, the majority must still win.
    from torch.utils.tensorboard import SummaryWriter

    for r in range(3):
        w = SummaryWriter(str(tmp_path / f"rank{r}"))
        for s in range(10):
            w.add_scalar("train/learning_rate", 0.5 if (r == 0 and s >= 7) else 0.1, s)
        w.close()
    (d,) = summarize_logs(tmp_path, workers=1).divergences
    assert (d.ranks, d.first_step) == ([0], 7)


def test_aggregate_equals_numpy_across_ranks(run_dir, tmp_path):
    root, values = run_dir
    summary = summarize_logs(root, workers=1)
    for tag, v in values.items():
        s = summary.stats[tag]
        assert s.steps.tolist() == list(range(1, STEPS + 1)) and (s.count == RANKS).all()
        np.testing.assert_allclose(s.mean, v.mean(axis=0), rtol=1e-12)
        np.testing.assert_array_equal(s.min, v.min(axis=0))
        np.testing.assert_array_equal(s.max, v.max(axis=0))
        np.testing.assert_allclose(s.std, v.std(axis=0), rtol=1e-9, atol=1e-15)

    # The aggregate run, read back by TensorBoard's own loader (not our reader).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_aggregate_run(summary, tmp_path / "aggregate")
    acc = EventAccumulator(str(tmp_path / "aggregate"), size_guidance={"scalars": 0})
    acc.Reload()
    v = values["rank/step_time_s"]
    for name, expected in (("mean", v.mean(0)), ("min", v.min(0)), ("max", v.max(0)), ("spread", v.max(0) - v.min(0))):
        got = acc.Scalars(f"rank/step_time_s/{name}")
        assert [e.step for e in got] == list(range(1, STEPS + 1))
        np.testing.assert_allclose([e.value for e in got], expected, rtol=1e-6)  # stored as float32

    # A second summarize over the same logs replaces the aggregate run: one file, every step once.
    first = set((tmp_path / "aggregate").iterdir())
    write_aggregate_run(summary, tmp_path / "aggregate")
    (after,) = list((tmp_path / "aggregate").iterdir())
    assert after not in first
    acc = EventAccumulator(str(tmp_path / "aggregate"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("rank/step_time_s/mean")] == list(range(1, STEPS + 1))


def test_truncated_file_is_named_and_the_rest_aggregated(run_dir, tmp_path):
    root, values = run_dir
    shutil.copytree(root, tmp_path / "logs")
    (bad,) = find_rank_files(tmp_path / "logs")[1]
    data = Path(bad).read_bytes()
    Path(bad).write_bytes(data[: len(data) - 30])  # cut inside the last record, as a killed rank leaves it
    summary = summarize_logs(tmp_path / "logs", workers=2)
    (warning,) = summary.warnings
    assert bad in warning and "truncated" in warning
    s = summary.stats["rank/loss"]
    # The loss is written last at each step, so rank 1 lost only the last step's loss.
    assert s.count[:-1].tolist() == [RANKS] * (STEPS - 1) and s.count[-1] == RANKS - 1
    others = values["rank/loss"][[0, 2, 3], -1]
    assert s.mean[-1] == pytest.approx(others.mean(), rel=1e-12)
    assert summary.stats["rank/step_time_s"].count.tolist() == [RANKS] * STEPS


def test_damaged_length_is_caught_by_its_checksum(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path / "rank0"))
    for s in range(5):
        w.add_scalar("x", s, s)
    w.close()
    (path,) = find_rank_files(tmp_path)[0]
    n_good = sum(1 for _ in iter_records(path))
    data = bytearray(Path(path).read_bytes())
    # Records: the file_version event, then one per scalar. Corrupt the length of the 4th record (step 2).
    pos = 0
    for _ in range(3):
        pos += 12 + int.from_bytes(data[pos : pos + 8], "little") + 4
    data[pos] ^= 0x01  # one byte longer: without the checksum the framing would slip silently
    Path(path).write_bytes(bytes(data))
    summary = summarize_logs(tmp_path, workers=1)
    assert n_good == 6 and "checksum" in summary.warnings[0] and path in summary.warnings[0]
    assert summary.stats["x"].steps.tolist() == [0, 1]


def test_loss_inside_a_tp_group(tmp_path):
    # TP size 2: ranks 0,1 and 2,3 see the same batch, so their loss must agree; rank 3 parts at step 70.
    def loss_fn(rng):
        base = 5.0 + 0.1 * rng.standard_normal((2, STEPS))
        loss = np.repeat(base, 2, axis=0)
        loss[3, 69:] += 0.25
        return loss

    _write_run(tmp_path, lr_diverges=False, slow=False, loss_fn=loss_fn)
    (d,) = summarize_logs(tmp_path, tp=2, workers=1).divergences
    # Two ranks that disagree: nothing says which one is wrong, so both are named.
    assert (d.tag, d.group, d.ranks, d.first_step) == ("rank/loss", [2, 3], [2, 3], 70)
    assert summarize_logs(tmp_path, workers=1).divergences == []  # without --tp the loss may differ per rank


def test_loss_inside_a_tp_group_with_a_rank_missing(tmp_path):
    # Rank 3's files are gone: the groups are those of the ranks found, [0, 1] and [2]; rank 1 parts at step 30.
    def loss_fn(rng):
        loss = np.repeat(5.0 + 0.1 * rng.standard_normal((2, STEPS)), 2, axis=0)
        loss[1, 29:] += 0.25
        return loss

    _write_run(tmp_path, lr_diverges=False, slow=False, loss_fn=loss_fn)
    shutil.rmtree(tmp_path / "rank3")
    summary = summarize_logs(tmp_path, tp=2, workers=1)
    (d,) = summary.divergences
    assert summary.ranks == [0, 1, 2] and (d.group, d.ranks, d.first_step) == ([0, 1], [0, 1], 30)


def test_straggler_step_in_a_long_run_is_block_resolved(tmp_path):
    # 2,000 steps: blocks of 8 steps (256 blocks at most); the start is the first step of the block it falls in.
    from torch.utils.tensorboard import SummaryWriter

    for r in range(3):
        w = SummaryWriter(str(tmp_path / f"rank{r}"))
        for s in range(2000):
            w.add_scalar("rank/step_time_s", 2.0 if (r == 1 and s >= 1005) else 1.0, s)
        w.close()
    summary = summarize_logs(tmp_path, workers=1)
    assert summary.block_width == 8
    (s,) = summary.stragglers
    assert (s.rank, s.from_step) == (1, 1000) and s.slower_by == pytest.approx(1.0)


def test_bad_logdirs(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        summarize_logs(tmp_path / "missing")
    with pytest.raises(ValueError, match="no event files in rank<N>"):
        summarize_logs(tmp_path)
    with pytest.raises(ValueError, match="--tp must be >= 1"):
        summarize_logs(tmp_path, tp=0)


def test_tensor_scalars_as_tf_summary_writes_them(tmp_path):
    # tf.summary.scalar (TensorFlow 2) stores a rank-0 float tensor tagged with the scalars plugin, not
    # simple_value; TensorFlow is not installed, so the same Event is built from tensorboard's protos.
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="scalars"))
    for r, scale in ((0, 1.0), (1, 3.0)):
        w = EventFileWriter(str(tmp_path / f"rank{r}"))
        for s in range(3):
            value = Summary.Value(tag="loss", metadata=meta, tensor=TensorProto(dtype=1, float_val=[scale * s]))
            w.add_event(Event(step=s, summary=Summary(value=[value])))
        w.close()
    s = summarize_logs(tmp_path, workers=1).stats["loss"]
    assert s.mean.tolist() == [0.0, 2.0, 4.0] and s.spread.tolist() == [0.0, 2.0, 4.0]


def test_records_split_across_read_chunks(run_dir, monkeypatch):
    # Reads of 50 bytes: most records straddle two or more chunks; the result must not change.
    root, values = run_dir
    monkeypatch.setattr("hf_dist_recipes.logs.events.CHUNK_BYTES", 50)
    summary = summarize_logs(root, workers=1)
    assert summary.warnings == []
    np.testing.assert_allclose(summary.stats["rank/loss"].mean, values["rank/loss"].mean(axis=0), rtol=1e-12)


def test_a_rank_without_the_tag_does_not_vote(tmp_path):
    # rank 2 logs no learning rate: ranks 0 and 1 disagree and nothing breaks the tie, so both are named.
    from torch.utils.tensorboard import SummaryWriter

    for r in range(3):
        w = SummaryWriter(str(tmp_path / f"rank{r}"))
        for s in range(5):
            if r < 2:
                w.add_scalar("train/learning_rate", 0.2 if (r == 1 and s >= 3) else 0.1, s)
            w.add_scalar("rank/step_time_s", 1.0, s)
        w.close()
    (d,) = summarize_logs(tmp_path, workers=1).divergences
    assert (d.ranks, d.first_step) == ([0, 1], 3)


def test_busy_time_of_the_live_check_finds_the_straggler_that_equal_step_times_hide(tmp_path):
    # In synchronous training every rank's step time is the slow rank's (the others wait for it in collectives):
    # written here as equal step times. The live check's per-rank busy time (step time minus wait), logged every 10
    # steps, is what differs: rank 1 busy 1.5x the others' from step 50.
    from torch.utils.tensorboard import SummaryWriter

    for r in range(RANKS):
        w = SummaryWriter(str(tmp_path / f"rank{r}"))
        for s in range(1, STEPS + 1):
            w.add_scalar("rank/step_time_s", 1.0, s)
            if s % 10 == 0:
                w.add_scalar("train/straggler/busy_s", 0.6 * (1.5 if r == 1 and s >= 50 else 1.0), s)
        w.close()
    summary = summarize_logs(tmp_path, workers=1)
    assert [(s.rank, s.from_step) for s in summary.stragglers] == [(1, 50)]
    assert summary.stragglers[0].slower_by == pytest.approx(0.5, abs=0.01)
