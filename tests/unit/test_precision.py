"""bf16 by default where the GPUs support it; fp32 only as a choice; gradients accumulate in fp32."""

import json

import pytest
import torch
from deepspeed.runtime.config import DeepSpeedConfig

from hf_dist_recipes import RecipeTrainingArguments
from hf_dist_recipes.environment.precision import resolve_bf16
from hf_dist_recipes.planning.deepspeed_config import deepspeed_config
from hf_dist_recipes.planning.plan import ParallelPlan


@pytest.mark.parametrize(
    "requested, fp16, gpus, supported, expected",
    [
        (None, False, 8, True, True),  # the recipe default on A100/H100/H200
        (None, False, 8, False, False),  # V100/T4: no bf16, the stock default stays
        (None, False, 0, False, False),  # CPU host
        (None, True, 8, True, False),  # fp16 chosen
        (False, False, 8, True, False),  # fp32 chosen explicitly
        (True, False, 0, False, True),  # an explicit True is the user's (the stock check judges the hardware)
    ],
)
def test_resolve_bf16(requested, fp16, gpus, supported, expected):
    assert resolve_bf16(requested, fp16=fp16, cuda_devices=gpus, bf16_supported=supported) is expected


def test_arguments_on_this_host_choose_its_precision_and_backend(tmp_path):
    """Per host: a CPU host trains in fp32 with the launcher's Gloo; a GPU host with NCCL, bf16 where every GPU has
    it (torch's own capability numbers, >= 8.0)."""
    args = RecipeTrainingArguments(output_dir=str(tmp_path))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        assert args.bf16 is False and args.use_cpu is True and args.ddp_backend is None
    else:
        ampere = all(torch.cuda.get_device_capability(i)[0] >= 8 for i in range(gpus))
        assert args.bf16 is ampere and args.use_cpu is False and args.ddp_backend == "nccl"


def test_an_explicit_cpu_request_trains_in_fp32_on_any_host(tmp_path):
    args = RecipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    assert args.bf16 is False and args.use_cpu is True and args.ddp_backend is None


def test_arguments_turn_bf16_on_on_a_faked_bf16_gpu_host(tmp_path, monkeypatch):
    # Fake: this host has no GPU. The facts read about the hardware are replaced (device count, bf16 support), and
    # the stock TrainingArguments.__post_init__, which would set up NCCL on the missing GPUs, is skipped: what is
    # tested is the recipe's own decision, made before it.
    from transformers import TrainingArguments

    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "0")  # a rank a launcher started: NCCL is chosen only there
    monkeypatch.setattr("hf_dist_recipes.environment.precision.cuda_bf16_supported", lambda: True)
    monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: None)
    args = RecipeTrainingArguments(output_dir=str(tmp_path))
    assert args.bf16 is True and args.ddp_backend == "nccl" and args.use_cpu is False
    assert RecipeTrainingArguments(output_dir=str(tmp_path), bf16=False).bf16 is False
    assert RecipeTrainingArguments(output_dir=str(tmp_path), fp16=True).bf16 is False
    monkeypatch.setattr("hf_dist_recipes.environment.precision.cuda_bf16_supported", lambda: False)  # V100s
    assert RecipeTrainingArguments(output_dir=str(tmp_path)).bf16 is False


def test_generated_deepspeed_json_accumulates_gradients_in_fp32_and_deepspeed_reads_it():
    for precision in ("bf16", "fp32"):
        config = deepspeed_config(ParallelPlan(procs_per_node=2, precision=precision))
        assert config["data_types"] == {"grad_accum_dtype": "fp32"}
        assert config["bf16"] == {"enabled": precision == "bf16"}
        # The Trainer fills the "auto" micro batch, accumulation and clipping before DeepSpeed reads the file.
        filled = {**config, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
        parsed = DeepSpeedConfig(json.loads(json.dumps({**filled, "gradient_clipping": 1.0})))
        assert parsed.grad_accum_dtype == "fp32" and parsed.bfloat16_config.enabled is (precision == "bf16")


def test_auto_json_takes_bf16_from_the_arguments(tmp_path):
    # The "auto" value is filled from args.bf16 by transformers: with the default arguments on a bf16 GPU host the
    # JSON agrees (enabled true); here, on a CPU host, both say fp32.
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    config = deepspeed_config(ParallelPlan(procs_per_node=2), auto=True)
    args = RecipeTrainingArguments(output_dir=str(tmp_path))
    hf = HfTrainerDeepSpeedConfig(config)
    hf.trainer_config_process(args)
    assert hf.config["bf16"]["enabled"] is args.bf16 is False


def test_a_process_no_launcher_started_gets_no_nccl_on_a_gpu_host(tmp_path, monkeypatch):
    # Fake: 8 GPUs, as above; no launcher variables. `python train.py` on one GPU must not ask for a process group
    # that nothing creates (the stock post-init would fail on NCCL with "Default process group has not been
    # initialized"): the backend stays unset, as in transformers, and precision is still chosen for the GPU.
    from transformers import TrainingArguments

    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 8)
    monkeypatch.setattr("hf_dist_recipes.environment.precision.cuda_bf16_supported", lambda: True)
    monkeypatch.setattr(TrainingArguments, "__post_init__", lambda self: None)
    for name in ("LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    args = RecipeTrainingArguments(output_dir=str(tmp_path))
    assert args.ddp_backend is None and args.bf16 is True and args.use_cpu is False
