"""`DeepSpeedView` held against DeepSpeed's own reading: every shipped JSON and the edge cases go through
`DeepSpeedConfig` (the object the engine keeps as `_config`) after the Trainer's fill of "auto", and the expected
facts are the engine's own methods on that object (`DeepSpeedEngine.zero_use_cpu_optimizer`, `autotp_size`,
`bfloat16_enabled`, ...; they read nothing but `self._config`), never the view's."""

import copy
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_dist_recipes.parallel.deepspeed_view import DeepSpeedView
from hf_dist_recipes.planning.shipped import manifest, packaged_dir

# What the Trainer puts where a JSON says "auto" (transformers' HfTrainerDeepSpeedConfig.trainer_config_process /
# trainer_config_finalize, for micro batch 2, accumulation 3, fp32, max_grad_norm 1.0, a small model).
TRAINER_FILL = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 3,
    "gradient_clipping": 1.0,
    "enabled": False,
    "reduce_bucket_size": 4096,
    "stage3_prefetch_bucket_size": 4096,
    "stage3_param_persistence_threshold": 640,
}

EDGE_CASES = {
    # The case: DeepSpeed reads no offload and AutoEP off.
    "no_enabled_device_none": {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}},
        "tensor_parallel": {"autotp_size": 2},
        "expert_parallel": {"autoep_size": 2},
    },
    "enabled_false": {"zero_optimization": {"stage": 3}, "expert_parallel": {"enabled": False, "autoep_size": 4}},
    "ep_on_nvme_params": {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu"},
            "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
        },
        "expert_parallel": {"enabled": True, "autoep_size": 4},
    },
    "autos": {
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "offload_optimizer": {"device": "nvme"}},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
    },
    "missing_sections": {},
    "numbers_given": {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "fp16": {"enabled": True}},
    "old_bfloat16_key": {"zero_optimization": {"stage": 1}, "bfloat16": {"enabled": True}},
    # DeepSpeed's deprecated spelling, which its parser maps to offload_optimizer {"device": "cpu"}
    "deprecated_cpu_offload": {"zero_optimization": {"stage": 2, "cpu_offload": True}},
    "autotp_zero": {"tensor_parallel": {"autotp_size": 0}},
}


def _shipped() -> dict[str, dict]:
    root = packaged_dir()
    names = [entry["name"] for entry in manifest(root)]
    assert len(names) >= 7  # the scan sees the shipped configs
    return {name: json.loads((root / "deepspeed" / f"{name}.json").read_text()) for name in names}


CASES = {**{f"shipped:{k}": v for k, v in _shipped().items()}, **EDGE_CASES}


def _fill(node, key=None):
    """`node` with every "auto" replaced as the Trainer would (TRAINER_FILL)."""
    if isinstance(node, dict):
        return {k: _fill(v, k) for k, v in node.items()}
    return TRAINER_FILL[key] if node == "auto" else node


def _deepspeeds_reading(config: dict):
    """DeepSpeed's own `DeepSpeedConfig` of `config` after the Trainer's fill, as an engine's `self` (outside a
    process group DeepSpeed counts one rank; a micro batch stands in where the JSON gives none, as the Trainer's)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    filled = _fill(copy.deepcopy(config))
    filled.pop("train_batch_size", None)
    filled.setdefault("train_micro_batch_size_per_gpu", TRAINER_FILL["train_micro_batch_size_per_gpu"])
    return SimpleNamespace(_config=DeepSpeedConfig(filled))


def _auto(config: dict, *path: str) -> bool:
    for key in path:
        config = config.get(key) if isinstance(config, dict) else None
    return config == "auto"


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_view_reads_what_deepspeed_reads(name):
    from deepspeed.runtime.engine import DeepSpeedEngine as Engine

    config = CASES[name]
    view = DeepSpeedView.read(config)
    engine = _deepspeeds_reading(config)
    ds = engine._config
    assert view.stage == Engine.zero_optimization_stage(engine)
    optimizer = "cpu" if Engine.zero_cpu_offload(engine) else "nvme" if Engine.zero_use_cpu_optimizer(engine) else None
    assert view.offload_optimizer == optimizer
    param = Engine.zero_offload_param(engine)
    assert view.offload_param == (param.device if param is not None and param.device != "none" else None)
    assert view.tp == max(Engine.autotp_size(engine), 1)
    # engine._configure_expert_parallel: `if autoep_config is None or not autoep_config.enabled: return`
    assert view.ep_enabled == bool(ds.expert_parallel_config.enabled)
    assert view.ep == (ds.expert_parallel_config.autoep_size if view.ep_enabled else 1)
    given = {k: config.get(k) for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")}
    micro, accum = given.values()
    assert view.micro_batch == (None if micro in (None, "auto") else Engine.train_micro_batch_size_per_gpu(engine))
    assert view.grad_accum == (None if accum in (None, "auto") else Engine.gradient_accumulation_steps(engine))
    assert view.bf16 == (None if _auto(config, "bf16", "enabled") else Engine.bfloat16_enabled(engine))
    assert view.fp16 == (None if _auto(config, "fp16", "enabled") else Engine.fp16_enabled(engine))


def test_the_edge_cases_read_as_deepspeed_reads_them():
    """The facts themselves, so that the comparison above cannot pass on a view and a DeepSpeed that both read
    nothing: the issue's JSON is no offload and AutoEP off, with TP 2."""
    edge = DeepSpeedView.read(EDGE_CASES["no_enabled_device_none"])
    assert (edge.stage, edge.offload_optimizer, edge.tp, edge.ep_enabled, edge.ep) == (3, None, 2, False, 1)
    offload = DeepSpeedView.read(EDGE_CASES["ep_on_nvme_params"])
    assert (offload.offload_optimizer, offload.offload_param, offload.ep_enabled, offload.ep) == (
        "cpu",
        "nvme",
        True,
        4,
    )
    autos = DeepSpeedView.read(EDGE_CASES["autos"])
    assert (autos.micro_batch, autos.grad_accum, autos.bf16, autos.fp16, autos.precision) == (None,) * 5
    assert autos.zero.reduce_bucket_size == DeepSpeedView.read({}).zero.reduce_bucket_size  # DeepSpeed's default
    assert DeepSpeedView.read(EDGE_CASES["deprecated_cpu_offload"]).offload_optimizer == "cpu"
    given = DeepSpeedView.read(EDGE_CASES["numbers_given"])
    assert (given.micro_batch, given.grad_accum, given.precision) == (4, 2, "fp16")
    assert DeepSpeedView.read({"zero_optimization": {"stage": "auto"}}).stage is None


def test_an_expert_parallel_section_without_enabled_is_named_as_ignored():
    (message,) = DeepSpeedView.read(EDGE_CASES["no_enabled_device_none"]).ignored
    assert "expert_parallel without enabled: true is ignored by DeepSpeed" in message and '"enabled": true' in message
    assert DeepSpeedView.read(EDGE_CASES["enabled_false"]).ignored == ()  # switched off on purpose
    assert DeepSpeedView.read(EDGE_CASES["ep_on_nvme_params"]).ignored == ()


@pytest.mark.parametrize(
    "config, match",
    [
        ({"tensor_parallel": {"autotp_size": -2}}, "autotp_size must be a positive integer, got -2"),
        ({"tensor_parallel": {"autotp_size": "two"}}, "refuses the config: tensor_parallel: 1 validation error"),
        ({"tensor_parallel": {"autotp_size": 1.5}}, "autotp_size Input should be a valid integer"),
        ({"zero_optimization": {"stage": 7}}, "DeepSpeed refuses the config: zero_optimization: 1 validation error"),
        ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}, "offload_optimizer.device Input should be"),
        ({"train_micro_batch_size_per_gpu": 0}, 'train_micro_batch_size_per_gpu must be a positive integer or "auto"'),
        ({"gradient_accumulation_steps": True}, "gradient_accumulation_steps must be a positive integer"),
        ({"expert_parallel": {"enabled": True, "autoep_size": "two"}}, "autoep_size must be a positive integer"),
    ],
)
def test_values_deepspeed_refuses_raise_naming_them(config, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        DeepSpeedView.read(config)


def test_the_shipped_configs_are_all_read():
    assert {Path(p).stem for p in (packaged_dir() / "deepspeed").glob("*.json")} == set(_shipped())
