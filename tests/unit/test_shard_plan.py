"""Shared writing in one process: the shard plan made from metadata equals the single writer's choices, and N
writers sharing the stream write the single writer's files byte for byte (sha256). The multi-rank save and the
multi-process export: tests/distributed/test_checkpoint_lifecycle.py."""

import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_dist_recipes.checkpoint.export import to_disk_names
from hf_dist_recipes.checkpoint.gather import iter_module_groups
from hf_dist_recipes.checkpoint.shard_plan import PlannedShardWriter, plan_shards, write_index
from hf_dist_recipes.checkpoint.writer import WRITERS_RECORD, ShardedSafetensorsWriter
from hf_dist_recipes.core.model_templates import template_config


def _hashes(folder) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.name != WRITERS_RECORD
    }


def _meta(group):
    return {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in group.items()}


def test_plan_follows_the_single_writers_boundaries():
    # By hand, limit 2 KiB: t0 t1 (1 KiB each) fill shard 1; t2 starts shard 2, t3 (1.5 KiB) would take it to
    # 2.5 KiB -> shard 3; the group ends with shard 3 at 1.5 KiB (< 2 KiB) so t4 (0.5 KiB) joins it: 2 KiB, closed.
    kib = 256  # float32 elements per KiB
    groups = [
        {"t0": torch.zeros(kib), "t1": torch.zeros(kib)},
        {"t2": torch.zeros(kib), "t3": torch.zeros(kib * 3 // 2)},
        {"t4": torch.zeros(kib // 2)},
    ]
    plan = plan_shards([_meta(g) for g in groups], 2048)
    assert plan.shards == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert plan.files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [plan.owner(k, 2) for k in range(3)] == [0, 0, 1]  # contiguous: k * 2 // 3
    assert plan.bytes == 5 * 1024 and plan.parameters == 5 * kib


def test_plan_refuses_a_name_twice():
    with pytest.raises(ValueError, match="written twice"):
        plan_shards([{"a": torch.zeros(1)}, {"a": torch.zeros(1)}], 1024)


@pytest.mark.parametrize("writers", [1, 2, 3, 4])
def test_shared_writers_write_the_single_writers_files_bit_for_bit(writers, tmp_path):
    """DeepSeek-V3-style groups (fused experts reverted to one tensor per expert) in 64 KiB shards: the meta pass
    (no data) plans the same shards, and `writers` writers each taking the whole stream but writing only their
    shards produce the same files and index as one ShardedSafetensorsWriter."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(template_config("tiny-deepseek-v3"))
    groups = [to_disk_names(model, g) for g in iter_module_groups(model)]
    meta_groups = [to_disk_names(model, g) for g in iter_module_groups(model, meta=True)]
    assert [[(n, t.shape, t.dtype) for n, t in g.items()] for g in meta_groups] == [
        [(n, t.shape, t.dtype) for n, t in g.items()] for g in groups
    ]
    assert all(t.device.type == "meta" for g in meta_groups for t in g.values())
    single = ShardedSafetensorsWriter(str(tmp_path / "single"), max_shard_bytes=64 * 1024)
    for g in groups:
        single.add(g)
    expected = single.close()
    plan = plan_shards(meta_groups, 64 * 1024)
    assert plan.files == expected.files and len(plan.files) > 4
    shared = tmp_path / "shared"
    written = {}
    for w in range(writers):
        writer = PlannedShardWriter(str(shared), plan, w, writers)
        for g in groups:
            if writer.wants(g):
                writer.add(g)
        written[w] = writer.close()
    result = write_index(str(shared), plan, written)
    assert _hashes(shared) == _hashes(tmp_path / "single")
    assert (result.files, result.bytes, result.parameters) == (expected.files, expected.bytes, expected.parameters)
    record = json.loads((shared / WRITERS_RECORD).read_text())
    assert sorted(f for files in record.values() for f in files) == sorted(expected.files)
    # contiguous blocks, sizes differing by at most one, in order: writer 0 the first files
    n = len(expected.files)
    blocks = [expected.files[-(-w * n // writers) : -(-(w + 1) * n // writers)] for w in range(writers)]
    assert record == {str(w): b for w, b in enumerate(blocks)}
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_a_writer_with_a_shard_left_incomplete_says_so(tmp_path):
    plan = plan_shards([{"a": torch.zeros(4), "b": torch.zeros(4)}], 1024)
    writer = PlannedShardWriter(str(tmp_path), plan, 0, 1)
    writer.add({"a": torch.zeros(4)})
    with pytest.raises(ValueError, match="incomplete"):
        writer.close()
    with pytest.raises(ValueError, match="not in the shard plan"):
        writer.add({"zzz": torch.zeros(1)})
