import json

import pytest
from transformers import TrainingArguments

from hf_dist_recipes import RecipeTrainingArguments, _compat


def test_recipe_defaults(tmp_path):
    args = RecipeTrainingArguments(output_dir=str(tmp_path))
    assert args.max_grad_norm == 1.0
    assert args.lr_scheduler_type == "cosine_with_restarts"
    assert args.lr_scheduler_kwargs == {"num_cycles": 3}
    assert args.warmup_steps == 0.05 and args.get_warmup_steps(200) == 10
    assert args.logging_nan_inf_filter is False
    assert args.logging_dir == str(tmp_path / "tensorboard")
    assert args.per_rank_tensorboard is True
    assert args.use_cpu is True  # no CUDA on this host: the world-size trap of use_cpu=False is avoided


def test_new_fields_come_after_every_trainingarguments_field():
    import dataclasses

    stock = [f.name for f in dataclasses.fields(TrainingArguments)]
    ours = [f.name for f in dataclasses.fields(RecipeTrainingArguments)]
    assert ours[: len(stock)] == stock


def test_upgrade_keeps_user_choices_and_fills_recipe_defaults(tmp_path):
    plain = TrainingArguments(output_dir=str(tmp_path), learning_rate=1e-3, warmup_steps=7, seed=5)
    up = RecipeTrainingArguments.from_training_arguments(plain)
    assert isinstance(up, RecipeTrainingArguments)
    assert (up.learning_rate, up.warmup_steps, up.seed) == (1e-3, 7, 5)
    assert up.lr_scheduler_type == "cosine_with_restarts"  # left at the stock "linear": recipe default
    assert up.logging_nan_inf_filter is False


def test_upgrade_keeps_an_explicit_scheduler(tmp_path):
    plain = TrainingArguments(output_dir=str(tmp_path), lr_scheduler_type="constant")
    assert RecipeTrainingArguments.from_training_arguments(plain).lr_scheduler_type == "constant"


def test_disabled_clipping_needs_opt_out(tmp_path):
    with pytest.raises(ValueError, match="allow_unclipped_gradients"):
        RecipeTrainingArguments(output_dir=str(tmp_path), max_grad_norm=0.0)
    args = RecipeTrainingArguments(output_dir=str(tmp_path), max_grad_norm=0.0, allow_unclipped_gradients=True)
    assert args.max_grad_norm == 0.0


def test_gloo_on_faked_cuda_host(tmp_path, monkeypatch):
    # Fake: this host has no GPU; only the device count the policy reads is replaced.
    monkeypatch.setattr("hf_dist_recipes.backend.cuda_device_count", lambda: 8)
    with pytest.raises(ValueError, match="Gloo was requested on a host with 8 CUDA GPU"):
        RecipeTrainingArguments(output_dir=str(tmp_path), ddp_backend="gloo")


def test_tp_batch_trap_fixed_in_a_deepspeed_file(tmp_path, monkeypatch):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2},
                              "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}))
    monkeypatch.setenv("WORLD_SIZE", "4")
    # Only the config handling is exercised; no process group is created here.
    args = RecipeTrainingArguments.__new__(RecipeTrainingArguments)
    args.deepspeed, args.per_device_train_batch_size, args.gradient_accumulation_steps = str(ds), 4, 2
    assert "4 x 2 x DP 2 = 16" in args._fix_deepspeed_batch()
    assert "train_batch_size" not in args.deepspeed


def test_launcher_config_is_read_from_accelerate_env(tmp_path, monkeypatch):
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3}}')
    monkeypatch.setenv(_compat.ACCELERATE_USE_DEEPSPEED, "true")
    monkeypatch.setenv(_compat.ACCELERATE_DEEPSPEED_CONFIG_FILE, str(ds))
    assert _compat.launcher_deepspeed_config() == {"zero_optimization": {"stage": 3}}
    monkeypatch.setenv(_compat.ACCELERATE_USE_DEEPSPEED, "false")
    assert _compat.launcher_deepspeed_config() is None


def test_min_lr_ratio_is_checked_when_the_arguments_are_made(tmp_path):
    with pytest.raises(ValueError, match=r"min_lr_ratio must be in \[0, 1\), got 1.5"):
        RecipeTrainingArguments(output_dir=str(tmp_path), min_lr_ratio=1.5)


def test_the_cpu_opt_out_flag_named_in_the_error_parses(tmp_path):
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(RecipeTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--allow_cpu_with_gpus"])
    assert args.allow_cpu_with_gpus is True
    assert RecipeTrainingArguments(output_dir=str(tmp_path)).allow_cpu_with_gpus is False
