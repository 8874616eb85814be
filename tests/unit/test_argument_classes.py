"""Issue 19, sections 1 and 3 in one process: argument subclasses keep their class, fields and methods when the
recipe upgrades them, and `recipe(trainer_cls)` applies the recipe to other Trainer classes."""

import copy
import dataclasses
import inspect
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from hf_dist_recipes import RecipeTrainer, RecipeTrainerMixin, RecipeTrainingArguments, recipe
from hf_dist_recipes._compat import transformers as compat_transformers
from hf_dist_recipes.argument_classes import recipe_arguments_class
from hf_dist_recipes.comm import process_setup
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from tests.support.models import SMALL

HERE = Path(__file__).resolve().parent


@dataclass
class UserArguments(TrainingArguments):
    """What a user's script defines: an extra field, a method, a stock default of its own, a post-init."""

    teacher_temperature: float = field(default=2.0, metadata={"help": "Softmax temperature of the teacher."})
    learning_rate: float = field(default=1e-3, metadata={"help": "This script's own default."})

    def __post_init__(self):
        self.post_init_ran = True
        super().__post_init__()

    def scaled(self, x: float) -> float:
        return x / self.teacher_temperature


def _tiny_trainer(trainer_cls, args):
    return trainer_cls(
        model_init=lambda: build_tiny_deepseek(**SMALL),
        args=args,
        train_dataset=stdlib_dataset(seq_len=16, max_bytes=10_000),
    )


def test_seq2seq_arguments_keep_their_class_and_fields_through_recipetrainer(tmp_path):
    user = Seq2SeqTrainingArguments(output_dir=str(tmp_path), predict_with_generate=True, generation_max_length=7)
    trainer = _tiny_trainer(RecipeTrainer, user)
    args = trainer.args
    assert isinstance(args, Seq2SeqTrainingArguments) and isinstance(args, RecipeTrainingArguments)
    assert type(args).__name__ == "RecipeSeq2SeqTrainingArguments"
    assert (args.predict_with_generate, args.generation_max_length) == (True, 7)
    # Left at the stock defaults: the recipe's (stock: linear, 0 warm-up, NaN filter on).
    assert args.lr_scheduler_type == "cosine_with_restarts" and args.lr_scheduler_kwargs == {"num_cycles": 3}
    assert (args.warmup_steps, args.logging_nan_inf_filter) == (0.05, False)
    assert args.logging_dir == os.path.join(str(tmp_path), "tensorboard")


def test_user_subclass_keeps_fields_methods_defaults_and_post_init(tmp_path):
    user = UserArguments(output_dir=str(tmp_path), teacher_temperature=4.0, warmup_steps=3)
    trainer = _tiny_trainer(RecipeTrainer, user)
    args = trainer.args
    assert isinstance(args, UserArguments) and isinstance(args, RecipeTrainingArguments)
    assert args.teacher_temperature == 4.0 and args.scaled(8.0) == 2.0  # 8 / 4
    assert args.learning_rate == 1e-3  # the subclass's own default, not the stock 5e-5
    assert args.warmup_steps == 3  # the user's choice beats the recipe's 0.05
    assert args.post_init_ran and process_setup.current().seed_report.seed == args.seed  # both post-inits ran
    # A field the subclass declares keeps its help for HfArgumentParser.
    fields = {f.name: f for f in dataclasses.fields(args)}
    assert fields["teacher_temperature"].metadata["help"] == "Softmax temperature of the teacher."


def test_made_class_is_cached_and_its_mro_puts_the_recipe_first():
    made = recipe_arguments_class(Seq2SeqTrainingArguments, RecipeTrainingArguments)
    assert recipe_arguments_class(Seq2SeqTrainingArguments, RecipeTrainingArguments) is made
    assert made.__mro__[1:3] == (RecipeTrainingArguments, Seq2SeqTrainingArguments)
    assert recipe_arguments_class(TrainingArguments, RecipeTrainingArguments) is RecipeTrainingArguments
    assert recipe_arguments_class(made, RecipeTrainingArguments) is made
    with pytest.raises(ValueError, match="TrainingArguments subclass"):
        recipe_arguments_class(dict, RecipeTrainingArguments)


def test_trl_config_keeps_trl_defaults_and_takes_the_recipes(tmp_path):
    # trl declares learning_rate=2e-5, logging_steps=10, gradient_checkpointing=True; the recipe declares neither.
    up = RecipeTrainingArguments.from_training_arguments(SFTConfig(output_dir=str(tmp_path), bf16=False))
    assert type(up).__name__ == "RecipeSFTConfig" and isinstance(up, SFTConfig)
    assert (up.learning_rate, up.logging_steps, up.gradient_checkpointing) == (2e-5, 10, True)
    assert up.lr_scheduler_type == "cosine_with_restarts" and up.max_length == 1024
    # trl's gradient_checkpointing=True turns into activation_checkpointing=True in transformers' post-init; the
    # upgrade counts that as a default, not a user's request (fails when upstream changes).
    assert SFTConfig(output_dir=str(tmp_path), bf16=False).activation_checkpointing is True
    assert up.activation_checkpointing_from_plan is False


def test_every_route_names_the_defaults_the_recipe_replaced_and_a_recipe_arguments_class_keeps_what_it_is_given(
    tmp_path,
):
    """Issue 31 section 6, issue 42: the line is read from the values, so the upgrade of a plain SFTConfig and
    recipe_arguments(SFTConfig) name the same five replaced defaults, the schedule's one cycle under trl, the seeding
    and the seed check."""
    from hf_dist_recipes import recipe_arguments
    from hf_dist_recipes.argument_classes import describe_recipe_defaults, recipe_defaults_in_effect

    def shown(rows):
        return [(n, str(getattr(a, "value", a)), str(getattr(b, "value", b))) for n, a, b in rows]

    # trl's SFTConfig keeps transformers' defaults for these five (the recipe's are in docs/practices/); bf16 and the
    # learning rate are the user's here, so they are not replaced.
    up = RecipeTrainingArguments.from_training_arguments(
        SFTConfig(output_dir=str(tmp_path), bf16=False, learning_rate=1e-4)
    )
    made = recipe_arguments(SFTConfig)(output_dir=str(tmp_path), bf16=False, learning_rate=1e-4)
    five = [
        ("ddp_timeout", "1800", "7200"),
        ("log_level_replica", "warning", "error"),
        ("logging_nan_inf_filter", "True", "False"),
        ("lr_scheduler_type", "linear", "cosine_with_restarts"),
        ("warmup_steps", "0", "0.05"),
    ]
    for args in (up, made):
        assert shown(recipe_defaults_in_effect(args, RecipeTrainingArguments)) == five
        assert args.lr_scheduler_kwargs == {"num_cycles": 1}  # trl's trainers fine-tune: one cosine, no restarts
        line = describe_recipe_defaults(args, "RecipeSFTTrainer", RecipeTrainingArguments)
        assert "recipe_arguments(SFTConfig)(..., ddp_timeout=1800, log_level_replica='warning', " in line, line
        assert "'cosine_with_restarts' (num_cycles=1)" in line and "seed=42" in line and "seed_check='error'" in line
    # A pre-training run's arguments keep the three hard restarts and are told the same way.
    plain = RecipeTrainingArguments(output_dir=str(tmp_path))
    assert plain.lr_scheduler_kwargs == {"num_cycles": 3}
    line = describe_recipe_defaults(plain, "RecipeTrainer", RecipeTrainingArguments)
    assert "in place of TrainingArguments':" in line and "(num_cycles=3)" in line, line
    assert "give them: RecipeTrainingArguments(..., ddp_timeout=1800," in line, line
    # Following the line keeps trl's values: nothing replaced; the seeding is still said.
    kept = recipe_arguments(SFTConfig)(
        output_dir=str(tmp_path),
        bf16=False,
        ddp_timeout=1800,
        log_level_replica="warning",
        logging_nan_inf_filter=True,
        lr_scheduler_type="linear",
        warmup_steps=0,
    )
    assert RecipeTrainingArguments.from_training_arguments(kept, SFTConfig) is kept
    assert (kept.ddp_timeout, kept.logging_nan_inf_filter, kept.lr_scheduler_type, kept.warmup_steps) == (
        1800,
        True,
        "linear",
        0,
    )
    line = describe_recipe_defaults(kept, "RecipeSFTTrainer", RecipeTrainingArguments)
    assert line == (
        "RecipeSFTTrainer: every rank seeded with seed=42 when the recipe's arguments were made, and "
        "seed_check='error' stops a job whose ranks disagree on seeds, data order or weights."
    )
    # Arguments the user gave in full replace nothing; a value given equal to the recipe's is named all the same
    # (the line reads values: which value is in effect is what it says).
    given = SFTConfig(
        output_dir=str(tmp_path),
        bf16=False,
        ddp_timeout=600,
        log_level_replica="info",
        logging_nan_inf_filter=False,
        lr_scheduler_type="constant",
        warmup_steps=3,
    )
    upgraded = RecipeTrainingArguments.from_training_arguments(given)
    assert shown(recipe_defaults_in_effect(upgraded, RecipeTrainingArguments)) == [
        ("logging_nan_inf_filter", "True", "False")
    ]


def test_plain_arguments_for_a_trl_trainer_become_its_config_as_trl_would(tmp_path):
    plain = TrainingArguments(output_dir=str(tmp_path), seed=11)
    up = RecipeTrainingArguments.from_training_arguments(plain, SFTConfig)
    assert isinstance(up, SFTConfig) and up.seed == 11
    # SFTTrainer's own rebuild (SFTConfig(**args.to_dict())) carries the stock values over trl's defaults.
    assert (up.learning_rate, up.logging_steps, up.gradient_checkpointing) == (5e-5, 500, False)
    with pytest.raises(ValueError, match="pass a SFTConfig"):
        RecipeTrainingArguments.from_training_arguments(Seq2SeqTrainingArguments(output_dir=str(tmp_path)), SFTConfig)


def test_upgraded_arguments_deepcopy_and_load_from_training_args_bin_in_a_fresh_process(tmp_path):
    user = RecipeTrainingArguments.from_training_arguments(
        UserArguments(output_dir=str(tmp_path), teacher_temperature=4.0)
    )
    assert copy.deepcopy(user).teacher_temperature == 4.0 and type(copy.deepcopy(user)) is type(user)
    seq = RecipeTrainingArguments.from_training_arguments(
        Seq2SeqTrainingArguments(output_dir=str(tmp_path), predict_with_generate=True, generation_max_length=7)
    )
    torch.save(user, tmp_path / "user.bin")
    torch.save(seq, tmp_path / "seq.bin")
    code = (
        "import torch\n"
        f"u = torch.load({str(tmp_path / 'user.bin')!r}, weights_only=False)\n"
        f"s = torch.load({str(tmp_path / 'seq.bin')!r}, weights_only=False)\n"
        "print(type(u).__name__, u.teacher_temperature, u.scaled(8.0), u.lr_scheduler_type.value)\n"
        "print(type(s).__name__, s.predict_with_generate, s.generation_max_length)\n"
    )
    from tests.support.launch import launched_ranks_env, python_for

    # A new process that imported nothing of ours (forked warm, from a server that imported only upstream's stack,
    # in a session that launches): the unpickling imports the classes by itself. Without the hash seed the
    # arguments above exported, which a fresh interpreter would take and a warm fork cannot.
    env = launched_ranks_env({k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"})
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parents[1])])
    (tmp_path / "load.py").write_text(code)
    argv = [*python_for(env), str(tmp_path / "load.py")]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == [
        "RecipeUserArguments 4.0 2.0 cosine_with_restarts",
        "RecipeSeq2SeqTrainingArguments True 7",
    ]


def test_recipe_factory_classes():
    assert recipe(Trainer) is RecipeTrainer
    made = recipe(SFTTrainer)
    assert (
        made is recipe(SFTTrainer) is recipe(SFTTrainer, arguments_class=None) and made.__name__ == "RecipeSFTTrainer"
    )
    # The mixin's own base holds its overrides of private Trainer methods (_compat), before the Trainer.
    assert made.__mro__[1:4] == (RecipeTrainerMixin, compat_transformers.TrainerPrivateOverrides, SFTTrainer)
    assert recipe(made) is made
    assert made.recipe_arguments_base is SFTConfig  # from `args: SFTConfig | TrainingArguments | None`
    assert recipe(DPOTrainer).recipe_arguments_base is DPOConfig
    assert recipe(Seq2SeqTrainer).recipe_arguments_base is TrainingArguments  # its annotation names no subclass
    # The constructor shows the Trainer's parameters, in its order (DPOTrainer: `args` third).
    assert list(inspect.signature(made.__init__).parameters) == list(inspect.signature(SFTTrainer.__init__).parameters)
    assert list(inspect.signature(recipe(DPOTrainer).__init__).parameters)[1:4] == ["model", "ref_model", "args"]
    with pytest.raises(ValueError, match="Trainer subclass"):
        recipe(TrainingArguments)


class ForwardingTrainer(Trainer):
    """A user's Trainer whose constructor only forwards: the mixin finds `args` in Trainer's signature."""

    def __init__(self, *args, **kwargs):
        self.forwarded = True
        super().__init__(*args, **kwargs)


def test_recipe_of_a_forwarding_user_trainer_upgrades_positional_args(tmp_path):
    user = UserArguments(output_dir=str(tmp_path), teacher_temperature=3.0)
    model = build_tiny_deepseek(**SMALL)
    trainer = recipe(ForwardingTrainer)(model, user, train_dataset=stdlib_dataset(seq_len=16, max_bytes=10_000))
    assert trainer.forwarded and isinstance(trainer.args, UserArguments)
    assert isinstance(trainer.args, RecipeTrainingArguments) and trainer.args.teacher_temperature == 3.0
    assert trainer.rank_agreement is not None  # the recipe's constructor ran after the user's


def test_recipe_seq2seq_trainer_keeps_seq2seq_arguments(tmp_path):
    user = Seq2SeqTrainingArguments(output_dir=str(tmp_path), predict_with_generate=True, generation_max_length=5)
    trainer = _tiny_trainer(recipe(Seq2SeqTrainer), user)
    assert isinstance(trainer, Seq2SeqTrainer) and isinstance(trainer, RecipeTrainerMixin)
    assert isinstance(trainer.args, Seq2SeqTrainingArguments) and trainer.args.generation_max_length == 5
