import json

import pytest
from transformers import TrainingArguments

from hf_dist_recipes import RecipeTrainingArguments
from hf_dist_recipes._compat import accelerate as compat_accelerate
from hf_dist_recipes._compat import transformers as compat_transformers
from hf_dist_recipes.comm import backend


def test_recipe_defaults(tmp_path):
    args = RecipeTrainingArguments(output_dir=str(tmp_path))
    assert args.max_grad_norm == 1.0
    assert args.lr_scheduler_type == "cosine_with_restarts"
    assert args.lr_scheduler_kwargs == {"num_cycles": 3}
    assert args.warmup_steps == 0.05 and args.get_warmup_steps(200) == 10
    assert args.logging_nan_inf_filter is False
    assert args.logging_dir == str(tmp_path / "tensorboard")
    assert args.per_rank_tensorboard is True
    # Per host: without CUDA use_cpu=True avoids the world-size trap of use_cpu=False; with GPUs they are used.
    assert args.use_cpu is (backend.cuda_device_count() == 0)


def test_tensorboard_logging_dir_from_the_environment_is_honoured(tmp_path, monkeypatch):
    """Issue 42: transformers 5's TensorBoardCallback takes its folder from TENSORBOARD_LOGGING_DIR (its
    TrainingArguments have no logging_dir); the recipe's per-rank runs go there too, under rank<N>."""
    from transformers.integrations import TensorBoardCallback

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    assert TensorBoardCallback().logging_dir == str(tmp_path / "tb")  # upstream's reading, which ours follows
    assert RecipeTrainingArguments(output_dir=str(tmp_path)).logging_dir == str(tmp_path / "tb")
    given = RecipeTrainingArguments(output_dir=str(tmp_path), logging_dir=str(tmp_path / "mine"))
    assert given.logging_dir == str(tmp_path / "mine")  # a value given wins, as for every field


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


def test_upgrade_keeps_the_launch_plans_activation_checkpointing(tmp_path, monkeypatch):
    """Issue 18 part 2: a plain TrainingArguments, upgraded by RecipeTrainer, lost the plan's recomputation."""
    from pathlib import Path

    generated = Path(__file__).resolve().parents[2] / "accelerate_configs" / "deepspeed"
    # The generated DeepSeek-V2-Lite JSON (its recorded plan assumed activation checkpointing) as the launcher's.
    monkeypatch.setenv(compat_accelerate.ACCELERATE_USE_DEEPSPEED, "true")
    monkeypatch.setenv(
        compat_accelerate.ACCELERATE_DEEPSPEED_CONFIG_FILE,
        str(generated / "deepseek_v2_lite_zero3_ep2_1node_8gpu.json"),
    )
    assert RecipeTrainingArguments(output_dir=str(tmp_path), use_cpu=True).activation_checkpointing is True
    plain = TrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    # transformers' post-init turned the declared None into False (fails when upstream changes: see _compat).
    assert TrainingArguments.__dataclass_fields__["activation_checkpointing"].default is None
    assert {
        name: getattr(plain, name) for name in compat_transformers.STOCK_POST_INIT_DEFAULTS
    } == compat_transformers.STOCK_POST_INIT_DEFAULTS
    up = RecipeTrainingArguments.from_training_arguments(plain)
    assert up.activation_checkpointing is True and up.gradient_checkpointing is True
    assert up.activation_checkpointing_from_plan is True


def test_upgrade_keeps_a_plain_request_for_recomputation(tmp_path):
    # No launch config: the plan says nothing, the user's True (under either name) stands.
    for request in ({"activation_checkpointing": True}, {"gradient_checkpointing": True}):
        up = RecipeTrainingArguments.from_training_arguments(TrainingArguments(output_dir=str(tmp_path), **request))
        assert up.activation_checkpointing is True and up.activation_checkpointing_from_plan is False
    plain = TrainingArguments(output_dir=str(tmp_path))
    assert RecipeTrainingArguments.from_training_arguments(plain).activation_checkpointing is False


def test_disabled_clipping_needs_opt_out(tmp_path):
    with pytest.raises(ValueError, match="allow_unclipped_gradients"):
        RecipeTrainingArguments(output_dir=str(tmp_path), max_grad_norm=0.0)
    args = RecipeTrainingArguments(output_dir=str(tmp_path), max_grad_norm=0.0, allow_unclipped_gradients=True)
    assert args.max_grad_norm == 0.0


def test_gloo_on_faked_cuda_host(tmp_path, monkeypatch):
    # Fake: this host has no GPU; only the device count the policy reads is replaced.
    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 8)
    with pytest.raises(ValueError, match="Gloo was requested on a host with 8 CUDA GPU"):
        RecipeTrainingArguments(output_dir=str(tmp_path), ddp_backend="gloo")


def test_tp_batch_trap_fixed_in_a_deepspeed_file(tmp_path, monkeypatch):
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3},
                "tensor_parallel": {"autotp_size": 2},
                "train_batch_size": "auto",
                "train_micro_batch_size_per_gpu": "auto",
            }
        )
    )
    monkeypatch.setenv("WORLD_SIZE", "4")
    # Only the config handling is exercised; no process group is created here.
    args = RecipeTrainingArguments.__new__(RecipeTrainingArguments)
    args.deepspeed, args.per_device_train_batch_size, args.gradient_accumulation_steps = str(ds), 4, 2
    assert "4 x 2 x DP 2 = 16" in args._fix_deepspeed_batch()
    assert "train_batch_size" not in args.deepspeed


def test_launcher_config_is_read_from_accelerate_env(tmp_path, monkeypatch):
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 3}}')
    monkeypatch.setenv(compat_accelerate.ACCELERATE_USE_DEEPSPEED, "true")
    monkeypatch.setenv(compat_accelerate.ACCELERATE_DEEPSPEED_CONFIG_FILE, str(ds))
    assert compat_accelerate.launcher_deepspeed_config() == {"zero_optimization": {"stage": 3}}
    monkeypatch.setenv(compat_accelerate.ACCELERATE_USE_DEEPSPEED, "false")
    assert compat_accelerate.launcher_deepspeed_config() is None


def test_min_lr_ratio_is_checked_when_the_arguments_are_made(tmp_path):
    with pytest.raises(ValueError, match=r"min_lr_ratio must be in \[0, 1\), got 1.5"):
        RecipeTrainingArguments(output_dir=str(tmp_path), min_lr_ratio=1.5)


def test_the_cpu_opt_out_flag_named_in_the_error_parses(tmp_path):
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(RecipeTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--allow_cpu_with_gpus"]
    )
    assert args.allow_cpu_with_gpus is True
    assert RecipeTrainingArguments(output_dir=str(tmp_path)).allow_cpu_with_gpus is False


# --- schedule: lr_scheduler_kwargs and the schedule fields ---


def test_upgrade_honours_schedule_kwargs_of_a_plain_trainingarguments(tmp_path):
    plain = TrainingArguments(
        output_dir=str(tmp_path),
        lr_scheduler_type="cosine_with_restarts",
        lr_scheduler_kwargs={"num_cycles": 2, "min_lr_ratio": 0.1, "restart_warmup_steps": 4},
    )
    up = RecipeTrainingArguments.from_training_arguments(plain)
    assert (up.min_lr_ratio, up.restart_warmup_steps) == (0.1, 4)
    # Only the key transformers' own cosine_with_restarts accepts stays: the stock create_scheduler passes them on.
    assert up.lr_scheduler_kwargs == {"num_cycles": 2}


def test_schedule_kwargs_as_a_command_line_json_string(tmp_path):
    args = RecipeTrainingArguments(output_dir=str(tmp_path), lr_scheduler_kwargs='{"min_lr_ratio": 0.2}')
    assert args.min_lr_ratio == 0.2 and args.restart_warmup_steps == 0
    assert args.lr_scheduler_kwargs == {"num_cycles": 3}  # the recipe's cycle count, as without kwargs


def test_schedule_value_given_twice(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"min_lr_ratio is given twice: min_lr_ratio=0.2 and lr_scheduler_kwargs="
        r"\{'min_lr_ratio': 0.1\}; give it once",
    ):
        RecipeTrainingArguments(output_dir=str(tmp_path), min_lr_ratio=0.2, lr_scheduler_kwargs={"min_lr_ratio": 0.1})
    same = RecipeTrainingArguments(
        output_dir=str(tmp_path), restart_warmup_steps=5, lr_scheduler_kwargs={"restart_warmup_steps": 5}
    )
    assert same.restart_warmup_steps == 5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"min_lr": 0.1},
            r"'min_lr', which cosine_with_restarts does not take; accepted keys: num_cycles, min_lr_ratio",
        ),
        ({"num_cycles": 0}, "num_cycles must be a positive integer"),
        ({"restart_warmup_steps": 2.5}, "restart_warmup_steps must be a whole number"),
        ({"min_lr_ratio": 1.0}, r"min_lr_ratio must be in \[0, 1\)"),
    ],
)
def test_bad_schedule_kwargs_name_the_fix(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        RecipeTrainingArguments(output_dir=str(tmp_path), lr_scheduler_kwargs=kwargs)


def test_schedule_options_with_another_scheduler_are_an_error(tmp_path):
    # The stock schedules would raise a TypeError only when training starts, or ignore the field silently.
    with pytest.raises(ValueError, match="only apply to lr_scheduler_type='cosine_with_restarts', not 'cosine'"):
        RecipeTrainingArguments(
            output_dir=str(tmp_path), lr_scheduler_type="cosine", lr_scheduler_kwargs={"min_lr_ratio": 0.1}
        )
    with pytest.raises(ValueError, match="restart_warmup_steps=3 only apply"):
        RecipeTrainingArguments(output_dir=str(tmp_path), lr_scheduler_type="linear", restart_warmup_steps=3)


def test_wrong_explicit_train_batch_size_is_refused_by_the_constructor(tmp_path, monkeypatch):
    """Through RecipeTrainingArguments(...) itself, not only parallel/batch.py's helper. One process is enough:
    the check reads the world size from WORLD_SIZE and runs before super().__post_init__ creates any process group.
    Hand count: micro 4 x accumulation 2 x data-parallel (world 4 / TP 2 = 2) = 16; 32 is the world-size value
    (4 x 2 x 4) the stock Trainer would have filled in."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    ds = {"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}, "train_batch_size": 32}
    with pytest.raises(ValueError, match=r"train_batch_size=32 .* = 16\. Remove \"train_batch_size\""):
        RecipeTrainingArguments(
            output_dir=str(tmp_path), deepspeed=ds, per_device_train_batch_size=4, gradient_accumulation_steps=2
        )
    # The same through a JSON file (the accepted value is not built here: with WORLD_SIZE=4 the arguments would
    # then wait for three peers; tests/distributed/test_tensor_parallel_batch.py trains it).
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    with pytest.raises(ValueError, match="set it to 16"):
        RecipeTrainingArguments(
            output_dir=str(tmp_path), deepspeed=str(path), per_device_train_batch_size=4, gradient_accumulation_steps=2
        )
