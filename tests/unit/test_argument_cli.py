"""Our argument classes on a command line, as HuggingFace's example scripts use them (issue 19 part 4).

`HfArgumentParser` hands every help string to argparse, which %-formats it: one "20%" and `--help` dies
(`ValueError: unsupported format character`). The help is printed in full for every argument class the package
defines, found by walking the package; every field RecipeTrainingArguments adds is set from the command line to a
non-default value; and the tuple of tests/scripts/run_clm.py (run_clm's ModelArguments, DataTrainingArguments and our
class in place of TrainingArguments) parses.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import sys
import typing

import pytest
from transformers import HfArgumentParser, TrainingArguments

import hf_dist_recipes
from hf_dist_recipes import RecipeTrainingArguments
from hf_dist_recipes.core.sizes import parse_size

REPO_SCRIPTS = __import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"


def _argument_classes() -> list[type]:
    """Every dataclass defined in hf_dist_recipes that is a TrainingArguments or carries help texts (the mark of a
    class meant for HfArgumentParser)."""
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(hf_dist_recipes.__path__, "hf_dist_recipes."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if not (inspect.isclass(obj) and dataclasses.is_dataclass(obj)):
                continue
            if not obj.__module__.startswith("hf_dist_recipes"):
                continue
            if issubclass(obj, TrainingArguments) or any("help" in f.metadata for f in dataclasses.fields(obj)):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[name] for name in sorted(found)]


def _made_argument_classes() -> list[type]:
    """The arguments classes `recipe()` makes at run time for the Trainer classes the README names (Seq2Seq, trl's
    SFT and DPO): the walk above cannot see them, and their help mixes our texts with transformers' and trl's."""
    from transformers import Seq2SeqTrainingArguments
    from trl import DPOConfig, SFTConfig

    from hf_dist_recipes.argument_classes import recipe_arguments_class

    return [
        recipe_arguments_class(c, RecipeTrainingArguments) for c in (Seq2SeqTrainingArguments, SFTConfig, DPOConfig)
    ]


ARGUMENT_CLASSES = _argument_classes() + _made_argument_classes()


def _run_clm():
    sys.path.insert(0, str(REPO_SCRIPTS))
    try:
        return importlib.import_module("run_clm")
    finally:
        sys.path.remove(str(REPO_SCRIPTS))


def test_the_walk_finds_the_recipe_arguments():
    assert RecipeTrainingArguments in ARGUMENT_CLASSES


@pytest.mark.parametrize("cls", ARGUMENT_CLASSES, ids=lambda c: c.__qualname__)
def test_help_prints_in_full(cls, capsys):
    parser = HfArgumentParser(cls)
    with pytest.raises(SystemExit) as done:  # the --help a script's user runs; a ValueError on "(0.2: 20%)" before
        parser.parse_args(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert text == parser.format_help()
    for f in dataclasses.fields(cls):
        if f.init:
            assert f"--{f.name}" in text
    print(text)


def test_run_clm_tuple_prints_help_and_parses(tmp_path):
    run_clm = _run_clm()
    classes = (run_clm.ModelArguments, run_clm.DataTrainingArguments, RecipeTrainingArguments)
    parser = HfArgumentParser(classes)
    text = parser.format_help()
    for name in ("--model_name_or_path", "--block_size", "--learning_rate", "--seed_check", "--save_shard_size"):
        assert name in text
    model_args, data_args, args = parser.parse_args_into_dataclasses(
        args=[
            "--model_type", "llama", "--tokenizer_name", "tok", "--train_file", "t.txt", "--block_size", "64",
            "--output_dir", str(tmp_path), "--do_train", "--learning_rate", "3e-3", "--report_to", "tensorboard",
            "--seed_check", "warn", "--max_unpartitioned_model_size", "2GiB", "--no_per_rank_tensorboard",
        ],
        look_for_args_file=False,
    )  # fmt: skip
    assert (model_args.model_type, data_args.block_size, data_args.keep_linebreaks) == ("llama", 64, True)
    assert type(args) is RecipeTrainingArguments and args.do_train and args.learning_rate == 3e-3
    assert args.report_to == ["tensorboard"]  # a list field from one word
    assert (args.seed_check, args.per_rank_tensorboard) == ("warn", False)
    assert args.max_unpartitioned_model_bytes == 2 * 1024**3


def test_closed_sets_are_choices_and_match_the_validators():
    from hf_dist_recipes.reproducibility import rank_agreement
    from hf_dist_recipes.stability import nonfinite

    hints = typing.get_type_hints(RecipeTrainingArguments)
    assert typing.get_args(hints["seed_check"]) == rank_agreement.POLICIES
    assert typing.get_args(hints["nonfinite_policy"]) == nonfinite.POLICIES
    text = HfArgumentParser(RecipeTrainingArguments).format_help()
    assert "{error,warn,off}" in text and "{skip,halt,off}" in text


def test_parallel_plan_closed_sets_are_choices_of_its_parser():
    from hf_dist_recipes.planning import plan

    parser = HfArgumentParser(plan.ParallelPlan)
    choices = {action.dest: list(action.choices) for action in parser._actions if action.choices}
    # By hand, what ParallelPlan.validate and `config generate` accept.
    assert choices == {
        "device": ["cuda", "cpu"],
        "precision": ["bf16", "fp16", "fp32"],
        "engine": ["deepspeed", "fsdp2"],
        "grad_reduce_dtype": ["fp32", "bf16", "fp16"],
    }
    assert [list(plan.DEVICES), list(plan.PRECISIONS), list(plan.ENGINES), list(plan.GRAD_REDUCE_DTYPES)] == [
        choices[k] for k in ("device", "precision", "engine", "grad_reduce_dtype")
    ]
    words = ["--engine", "fsdp2", "--device", "cpu"]
    (parsed,) = parser.parse_args_into_dataclasses(args=words, look_for_args_file=False)
    assert (parsed.engine, parsed.device, parsed.precision) == ("fsdp2", "cpu", "bf16")


def test_recipe_arguments_closed_sets_are_parser_choices():
    choices = {a.dest: list(a.choices or ()) for a in HfArgumentParser(RecipeTrainingArguments)._actions}
    assert choices["seed_check"] == ["error", "warn", "off"]
    assert choices["nonfinite_policy"] == ["skip", "halt", "off"]


def test_fields_set_on_creation_are_not_command_line_options(tmp_path):
    derived = [f.name for f in dataclasses.fields(RecipeTrainingArguments) if not f.init]
    assert {"launch_plan", "save_shard_bytes", "max_unpartitioned_model_bytes", "tp_batch_note"} <= set(derived)
    # What creating them did to the process is the process's record, not theirs (comm.process_setup.current()).
    assert not {"seed_report", "env_applied", "nccl_env_applied", "process_setup"} & set(derived)
    text = HfArgumentParser(RecipeTrainingArguments).format_help()
    assert not [name for name in derived if f"--{name} " in text or f"--{name}\n" in text]
    args = RecipeTrainingArguments(output_dir=str(tmp_path))
    assert args.launch_plan == {} and args.save_shard_bytes == 5 * 10**9  # the default 5GB, by hand
    assert not set(derived) & set(args.to_dict())  # training_args.json holds what the user can give


def test_a_value_outside_a_closed_set_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as done:
        HfArgumentParser(RecipeTrainingArguments).parse_args_into_dataclasses(
            args=["--seed_check", "maybe"], look_for_args_file=False
        )
    assert done.value.code == 2 and "invalid choice: 'maybe'" in capsys.readouterr().err


ADDED = [
    f
    for f in dataclasses.fields(RecipeTrainingArguments)
    if f.init and f.name not in TrainingArguments.__dataclass_fields__
]


def _non_default(f: dataclasses.Field, hint) -> tuple[list[str], object]:
    """(command-line words, the value the field must hold) for a value other than `f`'s default, from its type."""
    default = f.default
    if typing.get_origin(hint) in (typing.Union, __import__("types").UnionType):  # X | None: the X
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if hint is bool:
        return ([f"--no_{f.name}"], False) if default is True else ([f"--{f.name}"], True)
    if typing.get_origin(hint) is typing.Literal:
        other = next(c for c in typing.get_args(hint) if c != default)
        return [f"--{f.name}", other], other
    if hint is int:
        value = 4096 if default is None else default + 1  # None: off (loss_chunk_tokens), a count turns it on
        return [f"--{f.name}", str(value)], value
    if hint is float:
        value = default * 2 if default else 0.5
        return [f"--{f.name}", str(value)], value
    if hint is str and default is None:  # a free text such as a folder
        return [f"--{f.name}", "some/where"], "some/where"
    if f.name == "preemption_signals":  # a list of signal names
        return [f"--{f.name}", "SIGTERM"], "SIGTERM"
    if hint is str and isinstance(default, str):
        parse_size(default)  # every other str field added so far is a size; a new kind needs its own case here
        return [f"--{f.name}", "3GiB"], "3GiB"
    if typing.get_origin(hint) is list:
        item = typing.get_args(hint)[0]
        return [f"--{f.name}", "1", "2"], [item("1"), item("2")]
    raise AssertionError(f"{f.name}: no command-line case for type {hint!r}; add one to this test")


@pytest.mark.parametrize("f", ADDED, ids=lambda f: f.name)
def test_every_added_field_is_set_from_the_command_line(f, tmp_path):
    words, expected = _non_default(f, typing.get_type_hints(RecipeTrainingArguments)[f.name])
    assert expected != f.default
    (args,) = HfArgumentParser(RecipeTrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), *words], look_for_args_file=False
    )
    assert getattr(args, f.name) == expected
    if f.name.endswith("_size"):  # sizes also land in bytes, 3 x 2^30
        assert getattr(args, f.name.removesuffix("_size") + "_bytes") == 3 * 1024**3


def test_the_walk_covers_several_added_kinds():
    # The per-field test above must see booleans, closed sets, sizes and numbers (else a kind went untested).
    hints = typing.get_type_hints(RecipeTrainingArguments)
    kinds = {f.name: _non_default(f, hints[f.name])[0] for f in ADDED}
    assert kinds["allow_no_recompute"] == ["--allow_no_recompute"]
    assert kinds["per_rank_tensorboard"] == ["--no_per_rank_tensorboard"]
    assert kinds["nonfinite_policy"] == ["--nonfinite_policy", "halt"]
    assert kinds["max_unpartitioned_model_size"] == ["--max_unpartitioned_model_size", "3GiB"]
    assert kinds["loss_chunk_tokens"] == ["--loss_chunk_tokens", "4096"]
    assert kinds["preemption_signals"] == ["--preemption_signals", "SIGTERM"]
    assert len(ADDED) >= 20


def test_none_turns_the_model_size_check_off_from_the_command_line(tmp_path):
    (args,) = HfArgumentParser(RecipeTrainingArguments).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), "--max_unpartitioned_model_size", "none"], look_for_args_file=False
    )
    assert args.max_unpartitioned_model_size is None and args.max_unpartitioned_model_bytes is None


def test_the_run_clm_script_prints_its_help(tmp_path):
    """The user's view: `python run_clm.py --help` with our class in the tuple exits 0 and lists our arguments."""
    import os
    import subprocess

    from tests.support.launch import launched_ranks_env, python_for

    env = dict(launched_ranks_env(os.environ), COLUMNS="120")  # forked warm in a session that launches
    proc = subprocess.run(
        [*python_for(env), str(REPO_SCRIPTS / "run_clm.py"), "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for shown in ("--model_type", "--train_file", "--straggler_threshold", "--seed_check {error,warn,off}"):
        assert shown in proc.stdout
    assert "--no_per_rank_tensorboard" in proc.stdout and "--max_unpartitioned_model_size" in proc.stdout
