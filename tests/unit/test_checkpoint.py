"""The HuggingFace export in one process: the shard writer, the group-by-group export against `save_pretrained`,
the per-rank counters a checkpoint carries, and the offline exporter's refusals. The multi-process layouts
(ZeRO-3, TP, EP) are in tests/distributed/test_checkpoint_lifecycle.py."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_dist_recipes.checkpoint.export import save_hf_checkpoint
from hf_dist_recipes.checkpoint.gather import group_key
from hf_dist_recipes.checkpoint.offline import export_checkpoint
from hf_dist_recipes.checkpoint.writer import (
    SAFE_WEIGHTS_INDEX_NAME,
    ShardedSafetensorsWriter,
    write_safetensors,
)
from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.monitoring.rank_metrics import RankMetrics


def _weights(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_writer_shards_at_the_limit_and_indexes_every_tensor(tmp_path):
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(5)}  # 1 KiB each
    writer = ShardedSafetensorsWriter(str(tmp_path), max_shard_bytes=2048)
    writer.add(dict(list(tensors.items())[:3]))
    writer.add(dict(list(tensors.items())[3:]))
    result = writer.close()
    assert result.files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]  # 2 + 2 + 1 KiB
    assert result.bytes == 5 * 1024 and result.parameters == 5 * 256
    index = json.loads((tmp_path / SAFE_WEIGHTS_INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 5 * 1024
    first, second, third = result.files
    assert {n: index["weight_map"][n] for n in tensors} == {
        "t0": first,
        "t1": first,
        "t2": second,
        "t3": second,
        "t4": third,
    }
    back = _weights(tmp_path)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_a_second_save_leaves_no_shard_of_the_first(tmp_path):
    writer = ShardedSafetensorsWriter(str(tmp_path), max_shard_bytes=1024)
    writer.add({f"t{i}": torch.zeros(256) for i in range(3)})
    writer.close()
    writer = ShardedSafetensorsWriter(str(tmp_path))
    writer.add({"only": torch.ones(4)})
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_writer_refuses_a_name_twice_and_a_zero_limit(tmp_path):
    writer = ShardedSafetensorsWriter(str(tmp_path), max_shard_bytes=8)
    writer.add({"a": torch.zeros(4)})
    writer.add({"b": torch.zeros(4)})  # over the limit: "a" goes to a shard file
    with pytest.raises(ValueError, match="written twice"):
        writer.add({"a": torch.zeros(4)})
    with pytest.raises(ValueError, match="max_shard_bytes"):
        ShardedSafetensorsWriter(str(tmp_path / "x"), max_shard_bytes=0)


def test_our_safetensors_files_read_back_with_the_safetensors_library(tmp_path):
    from safetensors import safe_open

    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f32": torch.randn(7),
        "i64": torch.arange(4),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "strided": torch.randn(4, 6).t(),
    }
    write_safetensors(str(tmp_path / "x.safetensors"), tensors, metadata={"format": "pt"})
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    assert all(back[k].dtype == t.dtype and torch.equal(back[k], t) for k, t in tensors.items())
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_a_group_larger_than_a_shard_is_written_at_once(tmp_path):
    """What bounds memory: the writer never keeps a full shard while the next group is gathered."""
    writer = ShardedSafetensorsWriter(str(tmp_path), max_shard_bytes=1024)
    writer.add({"layer0.a": torch.zeros(256), "layer0.b": torch.zeros(256)})  # 2 KiB
    assert len(list(tmp_path.glob(".partial-*"))) == 2 and writer._buffer_bytes == 0


def test_group_key_streams_one_decoder_layer_at_a_time():
    assert group_key("model.layers.12.mlp.experts.gate_up_proj") == "model.layers.12"
    assert group_key("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert group_key("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("model_name", ["tiny-deepseek-v3", "tiny-llama"])
def test_export_equals_save_pretrained_without_deepspeed(model_name, tmp_path):
    """The independent reference is transformers' own save_pretrained: same files' names and tensors (DeepSeek:
    one tensor per expert on disk, reverted from the fused in-memory experts)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(template_config(model_name))
    model.save_pretrained(tmp_path / "stock")
    result = save_hf_checkpoint(model, str(tmp_path / "ours"), max_shard_bytes=64 * 1024)
    ours, stock = _weights(tmp_path / "ours"), _weights(tmp_path / "stock")
    assert ours.keys() == stock.keys() and all(torch.equal(ours[k], stock[k]) for k in stock)
    assert len(result.files) > 1 and result.parameters == sum(t.numel() for t in stock.values())
    if model_name == "tiny-deepseek-v3":
        assert "model.layers.1.mlp.experts.7.gate_proj.weight" in ours
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    ids = torch.arange(16).view(2, 8) % model.config.vocab_size
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model.eval()(ids).logits)


def test_rank_metrics_round_trip_through_a_checkpoint(tmp_path):
    m = RankMetrics(tokens=4096, optimizer_steps=3, train_seconds=1.5, first_loss=5.0, last_loss=4.0)
    m.save(tmp_path, rank=1)
    back = RankMetrics()
    assert back.load(tmp_path, rank=1) and (back.tokens, back.optimizer_steps, back.first_loss) == (4096, 3, 5.0)
    assert not RankMetrics().load(tmp_path, rank=0)  # another rank's file is not this rank's


def test_offline_export_refuses_what_is_not_a_deepspeed_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        export_checkpoint(str(tmp_path / "missing"), str(tmp_path / "out"))
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match="no DeepSpeed zero_pp_rank"):
        export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out"))
