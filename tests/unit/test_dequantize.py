"""`checkpoint dequantize` (issue 32 section 3) on a tiny DeepSeek-V3 that the test writes in DeepSeek's FP8 format:
float8_e4m3fn weights (a CPU dtype in torch) with a float32 `<name>_scale_inv` per block, `quantization_config` in
config.json. Blocks of 16 x 24 so that most weights end in partial blocks, as V3's 576-row `kv_a_proj_with_mqa`
does with blocks of 128 (here it has 24 rows = 16 + 8 and 64 columns = 24 + 24 + 16). The scales sit in the next
shard file, not beside their weight, so the converter must find them through the index.

The reference is computed here block by block with loops, independently of the converter's vectorised code, and
written as a plain bf16 checkpoint; both load with `from_pretrained` and must give the same logits."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hf_dist_recipes.checkpoint.dequantize import dequantize_checkpoint
from hf_dist_recipes.cli.main import main
from hf_dist_recipes.core.model_templates import template_config
from hf_dist_recipes.environment.precision import check_not_fp8

BLOCK = (16, 24)
FP8_MAX = 448.0  # the largest float8_e4m3fn value
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}


def _blocks(shape, block=BLOCK):
    rows, cols = shape
    for i in range(math.ceil(rows / block[0])):
        for j in range(math.ceil(cols / block[1])):
            yield i, j, slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])


def _quantize(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1]))
    for i, j, r, c in _blocks(w.shape, block):
        s = w[r, c].float().abs().max().clamp(min=1e-12) / FP8_MAX
        q[r, c] = (w[r, c].float() / s).to(torch.float8_e4m3fn)
        scale[i, j] = s
    return q, scale


def _by_hand(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i, j, r, c in _blocks(q.shape):
        out[r, c] = q[r, c].float() * scale[i, j]
    return out.to(torch.bfloat16)


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


def write_fp8_checkpoint(root, block=BLOCK):
    """A tiny DeepSeek-V3 in the published FP8 format under `root`: (FP8 folder, bf16 reference folder, names of the
    quantized weights). The scales of a file's weights go into the next file, as in DeepSeek's shards."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(template_config("tiny-deepseek-v3"))
    plain = root / "plain"
    model.save_pretrained(plain, max_shard_size="60KB")  # several shards, the on-disk (per-expert) layout
    index = json.loads((plain / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    src, ref = root / "src", root / "ref"
    src.mkdir(), ref.mkdir()
    scales_for: dict[str, dict[str, torch.Tensor]] = {f: {} for f in files}
    quantized = []
    for n, name in enumerate(files):
        with safe_open(str(plain / name), framework="pt") as st:
            tensors = {k: st.get_tensor(k) for k in st.keys()}
        fp8_tensors, ref_tensors = {}, {}
        for key, t in tensors.items():
            if (
                key.endswith(("proj.weight", "proj_with_mqa.weight")) and t.dim() == 2
            ):  # as DeepSeek: not embeddings, norms, router
                q, s = _quantize(t, block)
                fp8_tensors[key], ref_tensors[key] = q, _by_hand(q, s)
                scales_for[files[(n + 1) % len(files)]][key + "_scale_inv"] = s
                index["weight_map"][key + "_scale_inv"] = files[(n + 1) % len(files)]
                quantized.append(key)
            else:
                fp8_tensors[key], ref_tensors[key] = t, t  # kept as they are on both sides
        save_file(fp8_tensors, str(src / name), {"format": "pt"})
        save_file(ref_tensors, str(ref / name), {"format": "pt"})
    for name, scales in scales_for.items():  # scales go into the next file, beside its own tensors
        merged = {**_tensors_of(src / name), **scales}
        save_file(merged, str(src / name), {"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    ref_index = {k: v for k, v in index["weight_map"].items() if not k.endswith("_scale_inv")}
    (ref / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": ref_index}))
    config = json.loads((plain / "config.json").read_text())
    (ref / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    quant = {**QUANT, "weight_block_size": list(block)}
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    (src / "generation_config.json").write_text((plain / "generation_config.json").read_text())
    return src, ref, sorted(quantized)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    """(FP8 folder, bf16 reference folder, names of the quantized weights), with partial blocks."""
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8"))


def _tensors_of(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as st:
        return {k: st.get_tensor(k) for k in st.keys()}


def _logits(folder) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    tokens = torch.arange(32).reshape(2, 16) % model.config.vocab_size
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_the_fixture_has_partial_blocks_that_a_grid_derived_block_misreads(fp8):
    src, _, quantized = fp8
    key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert key in quantized
    q, scale = _tensors_of(src / _file_of(src, key))[key], _tensors(src)[key + "_scale_inv"]
    assert q.shape == (24, 64) and scale.shape == (2, 3)  # 16 + 8 rows, 24 + 24 + 16 columns
    # transformers 5.24/5.25's reading: rows // scale rows = 12-row blocks, 64 // 3 does not divide (it refuses).
    grid = scale.repeat_interleave(12, 0)
    assert not torch.equal(grid[:, :1], scale.repeat_interleave(16, 0)[:24, :1])


def _file_of(folder, key) -> str:
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][key]


def test_dequantized_checkpoint_loads_and_gives_the_bf16_models_logits(fp8, tmp_path):
    src, ref, quantized = fp8
    result = dequantize_checkpoint(str(src), str(tmp_path / "out"))
    assert result.dequantized == len(quantized) and result.block == BLOCK
    out = tmp_path / "out"
    written, expected = _tensors(out), _tensors(ref)
    assert sorted(written) == sorted(expected)  # the same names, no scale left
    for key in quantized:
        assert written[key].dtype == torch.bfloat16 and torch.equal(written[key], expected[key]), key
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and (out / "generation_config.json").is_file()
    assert torch.equal(_logits(out), _logits(ref))


def test_workers_write_the_same_files(fp8, tmp_path):
    src, _, _ = fp8
    one = dequantize_checkpoint(str(src), str(tmp_path / "one"))
    two = dequantize_checkpoint(str(src), str(tmp_path / "two"), workers=2)
    assert set(two.written_by.values()) == {0, 1} and len(one.files) > 2
    for name in one.files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


def test_the_cli_says_what_it_wrote(fp8, tmp_path, capsys):
    src, _, quantized = fp8
    assert main(["checkpoint", "dequantize", str(src), "--output", str(tmp_path / "cli"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dequantized"] == len(quantized) and data["block"] == list(BLOCK)


def test_what_is_not_fp8_or_lacks_a_scale_is_one_line(fp8, tmp_path, capsys):
    src, ref, _ = fp8
    with pytest.raises(ValueError, match="no FP8 quantization_config"):
        dequantize_checkpoint(str(ref), str(tmp_path / "a"))
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in src.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    missing = next(k for k in index["weight_map"] if k.endswith("_scale_inv"))
    del index["weight_map"][missing]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"has no {missing}"):
        dequantize_checkpoint(str(broken), str(tmp_path / "b"))
    assert main(["checkpoint", "dequantize", str(ref), "--output", str(tmp_path / "c")]) == 2
    assert "no FP8 quantization_config" in capsys.readouterr().err


def test_a_model_from_an_fp8_checkpoint_stops_before_training_naming_the_command(tmp_path):
    """Through the trainer: transformers keeps the FP8 quantization_config on a model it loaded (and, on a CPU
    host, dequantized) from such a checkpoint; the config object stands for that here."""
    from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments

    model = AutoModelForCausalLM.from_config(template_config("tiny-deepseek-v3"))
    check_not_fp8(model)  # a plain model passes
    model.config.quantization_config = dict(QUANT)
    args = RecipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    with pytest.raises(ValueError, match="hf-dist-recipes checkpoint dequantize SRC --output DST"):
        RecipeTrainer(model=model, args=args)


def test_a_model_transformers_dequantized_on_load_is_stopped_too(tmp_path):
    """transformers 5.25 on a host without a GPU dequantizes an FP8 checkpoint while loading it and drops
    `quantization_config` from the model's config (so does `dequantize=True` anywhere): the guard reads the config.json
    of the folder the model came from. Blocks that divide every weight, so that transformers loads it at all (it
    refuses the partial blocks of the `fp8` fixture)."""
    from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments

    src, _, _ = write_fp8_checkpoint(tmp_path, block=(16, 16))
    model = AutoModelForCausalLM.from_pretrained(src)  # as a user's script loads it, on this CPU host
    assert getattr(model.config, "quantization_config", None) is None  # what hid it from the config-only guard
    args = RecipeTrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", max_steps=1)
    with pytest.raises(ValueError, match=f"{src}.*hf-dist-recipes checkpoint dequantize SRC --output DST"):
        RecipeTrainer(model=model, args=args)
