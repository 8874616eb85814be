"""accelerate_configs/ is generated: regenerate it from the manifest and fail on any difference; every file loads
with accelerate's own loader and DeepSpeed's own config class, and lints clean."""

import shutil

import pytest

from hf_dist_recipes.planning.lint import ERROR, lint_file
from hf_dist_recipes.planning.shipped import manifest, regenerate
from tests.support.paths import REPO

CONFIGS = REPO / "accelerate_configs"


def _files(root):
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def test_regenerating_gives_the_committed_files(tmp_path, monkeypatch):
    fresh = tmp_path / "accelerate_configs"
    fresh.mkdir()
    shutil.copy(CONFIGS / "manifest.json", fresh / "manifest.json")
    monkeypatch.chdir(tmp_path)  # the YAMLs hold paths relative to the repository root
    regenerate("accelerate_configs")
    assert _files(fresh) == _files(CONFIGS)
    for rel in _files(CONFIGS):
        assert (fresh / rel).read_text() == (CONFIGS / rel).read_text(), f"{rel} differs: run make configs"


def test_the_issue_list_is_shipped():
    names = {e["name"] for e in manifest(CONFIGS)}
    assert names == {
        "zero3_1node_8gpu",
        "zero3_tp2_llama_1node_8gpu",
        "deepseek_v3_zero3_ep16_offload_8nodes_8gpu",
        "deepseek_v2_lite_zero3_ep2_1node_8gpu",
        "zero3_2nodes_8gpu",
        "cpu_zero3_2proc",
        "cpu_zero3_tp2_ep2_4proc",
    }


def _gpu_configs_with_a_model() -> list:
    """Shipped GPU configs whose DeepSpeed JSON records the model it was planned for (the others have no memory
    to check: CPU configs, and model-agnostic ZeRO-3 files)."""
    import json

    import yaml

    out = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        ds = json.loads((REPO / data["deepspeed_config"]["deepspeed_config_file"]).read_text())
        if not data.get("use_cpu") and ds.get("hf_dist_recipes", {}).get("generated_for", {}).get("model"):
            out.append(path)
    return out


def test_the_models_planned_for_are_the_expected_ones():
    assert {p.stem for p in _gpu_configs_with_a_model()} == {
        "zero3_tp2_llama_1node_8gpu",
        "deepseek_v3_zero3_ep16_offload_8nodes_8gpu",
        "deepseek_v2_lite_zero3_ep2_1node_8gpu",
    }


@pytest.mark.parametrize("yaml_file", _gpu_configs_with_a_model(), ids=lambda p: p.name)
def test_every_shipped_gpu_plan_fits_80_gib_by_our_own_estimate(yaml_file, monkeypatch):
    # The same check `config validate --gpu-memory 80` makes; the removed deepseek_v3_zero3_tp2_ep8_1node_8gpu
    # needed about 1,300 GiB per GPU by it.
    monkeypatch.chdir(REPO)
    findings = lint_file(yaml_file, root=REPO, gpu_memory_gib=80)
    assert not [f for f in findings if "GiB per GPU" in f.message], [f.message for f in findings]
    # and the check can fail: the same plan on 40 GiB GPUs does not fit (DeepSeek-V3: 45 GiB; V2-Lite: 33 GiB)
    small = lint_file(yaml_file, root=REPO, gpu_memory_gib=20)
    assert [f for f in small if "GiB per GPU" in f.message]


@pytest.mark.parametrize("yaml_file", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_file_loads_upstream_and_lints_clean(yaml_file, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from deepspeed.runtime.config import DeepSpeedConfig

    monkeypatch.chdir(REPO)
    cluster = load_config_from_file(str(yaml_file))
    ds_path = REPO / cluster.deepspeed_config["deepspeed_config_file"]
    import json

    raw = json.loads(ds_path.read_text())
    filled = {
        **raw,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }
    parsed = DeepSpeedConfig(filled)
    # Gradients are reduced in fp32 by DeepSpeed's own reading of the file (its default would be the compute dtype).
    import torch

    assert parsed.communication_data_type == torch.float32
    assert [f for f in lint_file(yaml_file, root=REPO) if f.level == ERROR] == []


def test_grad_reduce_dtype_bf16_is_written_and_read_by_deepspeed(tmp_path):
    import json

    import torch
    from deepspeed.runtime.config import DeepSpeedConfig

    from hf_dist_recipes.planning.deepspeed_config import deepspeed_config
    from hf_dist_recipes.planning.plan import ParallelPlan

    config = deepspeed_config(ParallelPlan(grad_reduce_dtype="bf16"))
    assert config["communication_data_type"] == "bf16"
    # The Trainer fills the "auto" micro batch, accumulation and clipping before DeepSpeed reads the file.
    filled = {**config, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0}
    assert DeepSpeedConfig(json.loads(json.dumps(filled))).communication_data_type == torch.bfloat16
