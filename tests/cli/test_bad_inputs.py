"""Every bad input to `demo` and `config` stops before anything runs: exit 2, one line on stderr naming the flag or
file (and, for a flag, a value that is accepted), no traceback, nothing launched or written. The arguments refuse
the same values with the same rule."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hf_dist_recipes.arguments import RecipeTrainingArguments
from hf_dist_recipes.cli.main import main
from tests.support.paths import REPO

# (bad flags, the flag the error must name). Each value here fails inside the ranks, or trains nothing, if launched.
BAD_DEMO_FLAGS = [
    (["--max-steps", "0"], "--max-steps"),
    (["--max-steps", "-3"], "--max-steps"),
    (["--micro-batch", "0"], "--micro-batch"),
    (["--seq-len", "1"], "--seq-len"),  # one byte: no next-token target, the loss is NaN (test below)
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**32)], "--seed"),
    (["--warmup-steps", "50", "--max-steps", "10"], "--warmup-steps"),
    (["--warmup-steps", "-1"], "--warmup-steps"),
    (["--learning-rate", "0"], "--learning-rate"),
    (["--logging-steps", "0"], "--logging-steps"),
    (["--max-bytes", "100"], "--max-bytes"),  # fewer bytes than one step's blocks: no step at all
    (["--num-processes", "0"], "--num-processes"),  # used to fall back silently to the YAML's count
]


@pytest.fixture
def no_launch(monkeypatch):
    """What was launched, to be asserted empty: the checks must stop the demo before its launcher (`run_demo`) is
    reached and before any `accelerate launch` or rank starts (either is refused and recorded, so a caller that
    swallowed the error would still fail the test). Other processes (nvidia-smi on a GPU host) still run."""
    launched: list = []

    def run_demo(*args, **kwargs):
        launched.append(("run_demo", args))
        raise AssertionError("run_demo was called")

    class NoLaunchPopen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            words = args if isinstance(args, (list, tuple)) else [args]
            if any("accelerate" in str(a) or "demo.train" in str(a) for a in words):
                launched.append(("Popen", args))
                raise AssertionError(f"a launch was started: {args}")
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr("hf_dist_recipes.cli.demo.run_demo", run_demo)
    monkeypatch.setattr(subprocess, "Popen", NoLaunchPopen)
    return launched


def _run(capsys, argv):
    start = time.perf_counter()
    code = main(argv)
    seconds = time.perf_counter() - start
    captured = capsys.readouterr()
    return code, captured.out, captured.err, seconds


def _one_line_naming(err: str, name: str) -> str:
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert name in err, err
    return err.strip()


@pytest.mark.parametrize("flags, flag", BAD_DEMO_FLAGS, ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_bad_demo_flag_stops_before_launch(flags, flag, capsys, tmp_path, no_launch):
    out_dir = tmp_path / "run"
    # No --dry-run: a value that got through would reach run_demo, whose launch fails the test (no_launch).
    code, out, err, seconds = _run(capsys, ["demo", *flags, "--output-dir", str(out_dir)])
    line = _one_line_naming(err, flag)
    assert code == 2 and out == "" and not out_dir.exists() and no_launch == []
    print(f"{flags} refused in {seconds:.2f} s")
    # The value the message offers is accepted: the same flags with it pass the checks.
    example = re.search(rf"e\.g\. {re.escape(flag)} (\S+)$", line)
    assert example, line
    fixed = list(flags)
    fixed[fixed.index(flag) + 1] = example.group(1)
    code, out, err, _ = _run(capsys, ["demo", *fixed, "--output-dir", str(out_dir), "--dry-run"])
    assert code == 0 and err == "" and "launch" in out and not out_dir.exists(), err


def test_unwritable_output_dir_is_refused_without_creating_anything(capsys, tmp_path, no_launch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    # A file where a parent directory should be: unwritable for every user, root included.
    code, out, err, seconds = _run(capsys, ["demo", "--output-dir", str(blocker / "run")])  # the old name still works
    line = _one_line_naming(err, "--output")
    assert code == 2 and out == "" and "is a file, not a directory" in line and no_launch == []
    print(f"refused in {seconds:.2f} s")


def test_missing_data_file_is_refused_before_launch(capsys, tmp_path, no_launch):
    code, out, err, seconds = _run(
        capsys, ["demo", "--data-files", str(tmp_path / "none.txt"), "--output-dir", str(tmp_path / "run")]
    )
    line = _one_line_naming(err, "--data-files")
    assert code == 2 and str(tmp_path / "none.txt") in line and no_launch == []
    assert not (tmp_path / "run").exists()
    print(f"refused in {seconds:.2f} s")


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, "is a directory"),
        ("", "is empty"),
        ("   \n", "is empty"),
        ("num_processes: [2\n", "not valid YAML at line"),
        ("- 1\n- 2\n", "must be a YAML mapping"),
        (b"\xff\xfe\x00", "is not UTF-8 text"),
    ],
)
def test_bad_config_yaml_names_the_file(content, problem, capsys, tmp_path, no_launch):
    path = tmp_path / "acc.yaml"
    if content is None:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    for argv in (["demo", "--config-file", str(path)], ["config", "validate", str(path)]):
        code, out, err, _ = _run(capsys, argv)
        line = _one_line_naming(err, str(path))
        assert code == 2 and problem in line, line


def _config_cases(tmp_path):
    """(argv, what the line must name, path that must not be created) for each bad `config` input."""
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    empty_json = tmp_path / "empty.json"
    empty_json.write_text("")
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{bad")
    no_config = tmp_path / "model_dir"
    no_config.mkdir()
    out = tmp_path / "out"
    yaml = str(REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml")
    return [
        (["config", "generate", "--cpu", "--gpus-per-node", "2", "--output", str(blocker / "cfg")], "--output", None),
        (["config", "generate", "--model", "no-such-model", "--tp", "2", "--output", str(out)], "no-such-model", out),
        (
            ["config", "generate", "--model", str(tmp_path / "gone.json"), "--tp", "2", "--output", str(out)],
            "gone.json",
            out,
        ),
        (["config", "generate", "--model", str(no_config), "--tp", "2", "--output", str(out)], "no config.json", out),
        (["config", "generate", "--model", str(bad_json), "--tp", "2", "--output", str(out)], "bad.json", out),
        (["config", "estimate", "--model", "deepseek-v3", "--gpu-memory", "-1"], "--gpu-memory", None),
        (["config", "estimate", "--model", "deepseek-v3", "--gpu-memory", "0"], "--gpu-memory", None),
        (["config", "estimate", "--model", "no-such-model"], "no-such-model", None),
        (["config", "validate", yaml, "--gpu-memory", "0"], "--gpu-memory", None),
        (["config", "validate", yaml, "--model", "no-such-model"], "no-such-model", None),
        (["config", "validate", str(tmp_path / "gone.json")], "gone.json", None),
        (["config", "validate", str(empty_json)], "empty.json", None),
        (["config", "validate", str(bad_json)], "bad.json", None),
        (["config", "validate", str(tmp_path / "notes.txt")], "notes.txt", None),
    ]


CONFIG_CASE_IDS = [
    "output-under-a-file",
    "unknown-model",
    "missing-model-file",
    "model-dir-without-config",
    "malformed-model-json",
    "estimate-negative-memory",
    "estimate-zero-memory",
    "estimate-unknown-model",
    "validate-zero-memory",
    "validate-unknown-model",
    "validate-missing",
    "validate-empty-json",
    "validate-malformed-json",
    "validate-other-suffix",
]


@pytest.mark.parametrize("index", range(len(CONFIG_CASE_IDS)), ids=CONFIG_CASE_IDS)
def test_bad_config_input_is_one_line_exit_2(index, capsys, tmp_path):
    argv, name, not_created = _config_cases(tmp_path)[index]
    code, out, err, _ = _run(capsys, argv)
    _one_line_naming(err, name)
    assert code == 2 and out == ""
    assert not_created is None or not not_created.exists()


def test_validate_keeps_exit_1_for_findings_and_2_when_a_file_cannot_be_read(capsys, tmp_path):
    finding = tmp_path / "tp.json"  # TP 2 with an explicit train_batch_size: trap 1, an error finding
    finding.write_text(
        '{"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}, "train_batch_size": 8}'
    )
    code, out, _, _ = _run(capsys, ["config", "validate", str(finding)])
    assert code == 1 and "1 error(s)" in out
    code, out, err, _ = _run(capsys, ["config", "validate", str(finding), str(tmp_path / "gone.yaml")])
    assert code == 2 and out == "" and "gone.yaml" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, name",
    [
        (["demo", "--seed", "-1", "--dry-run"], "--seed"),
        (["config", "validate", "EMPTY"], "empty.yaml"),
        # The two examples: a traceback of 98 and 39 lines before the directory was probed.
        (["demo", "--output", "/proc/x/run"], "--output"),
        (["config", "generate", "--output", "/proc/x/cfg"], "--output"),
    ],
)
def test_console_script_prints_one_line_and_no_traceback(argv, name, tmp_path):
    """Through the installed console script (pyproject's [project.scripts]) in a fresh process: nothing imported
    earlier (DeepSpeed's import notice, logging set up by other tests) hides a second line."""
    script = Path(sys.executable).with_name("hf-dist-recipes")
    assert script.is_file(), f"{script} missing: install the package (make install / pip install -e .)"
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    argv = [str(empty) if a == "EMPTY" else a for a in argv]
    proc = subprocess.run([str(script), *argv], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    _one_line_naming(proc.stderr, name)


# (RecipeTrainingArguments fields, the same value as demo flags, {argument name: flag name})
SAME_RULE = [
    (dict(seed=-1), ["--seed", "-1"], {"seed": "--seed"}),
    (dict(per_device_train_batch_size=0), ["--micro-batch", "0"], {"per_device_train_batch_size": "--micro-batch"}),
    (dict(learning_rate=-1.0), ["--learning-rate", "-1"], {"learning_rate": "--learning-rate"}),
    (
        dict(warmup_steps=50, max_steps=10),
        ["--warmup-steps", "50", "--max-steps", "10"],
        {"warmup_steps": "--warmup-steps", "max_steps": "--max-steps"},
    ),
]


@pytest.mark.parametrize("fields, flags, names", SAME_RULE, ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_arguments_refuse_the_same_value_with_the_same_rule(fields, flags, names, capsys, tmp_path, no_launch):
    with pytest.raises(ValueError) as refused:
        RecipeTrainingArguments(output_dir=str(tmp_path / "args"), **fields)
    code, _, err, _ = _run(capsys, ["demo", *flags, "--output-dir", str(tmp_path / "run")])
    assert code == 2
    # Spelled as flags ("seed=42" -> "--seed 42"), the arguments' message is the demo's, word for word.
    as_flags = str(refused.value)
    for arg_name, flag in names.items():
        as_flags = re.sub(rf"\b{arg_name}=", f"{flag} ", as_flags)
        as_flags = re.sub(rf"(?<![-\w]){arg_name}\b", flag, as_flags)
    assert err.strip() == f"hf-dist-recipes demo: error: {as_flags}"


def test_warmup_ratio_and_epoch_runs_stay_accepted(tmp_path):
    """The warm-up rule applies to steps against max_steps only: a ratio, or a run sized by epochs, is not refused."""
    RecipeTrainingArguments(output_dir=str(tmp_path), warmup_steps=0.5, max_steps=10)
    RecipeTrainingArguments(output_dir=str(tmp_path), warmup_steps=50)  # max_steps -1: length from the epochs


def test_seq_len_minimum_is_what_the_model_needs():
    """Why --seq-len must be >= 2: the demo model's loss on one-token blocks has no target and is NaN; on two
    tokens it is finite. Independent of our validator: the real model and transformers' own loss."""
    import torch

    from hf_dist_recipes.demo.data import MIN_SEQ_LEN
    from hf_dist_recipes.demo.model import build_tiny_deepseek

    torch.manual_seed(0)
    model = build_tiny_deepseek()
    losses = {}
    for length in (MIN_SEQ_LEN - 1, MIN_SEQ_LEN):
        ids = torch.randint(0, 256, (2, length))
        losses[length] = model(input_ids=ids, labels=ids).loss.item()
    assert torch.isnan(torch.tensor(losses[MIN_SEQ_LEN - 1]))
    assert torch.isfinite(torch.tensor(losses[MIN_SEQ_LEN]))


# Every command that writes, with the flag naming where: (argv before the path, flag, argv after the path).
WRITING_COMMANDS = {
    "demo": (["demo", "--output"], "--output", []),
    "config generate": (["config", "generate", "--cpu", "--gpus-per-node", "2", "--output"], "--output", []),
    "config generate --log-dir": (
        ["config", "generate", "--cpu", "--gpus-per-node", "2", "--output", "OUT", "--launcher", "slurm", "--log-dir"],
        "--log-dir",
        [],
    ),
    "config copy": (["config", "copy", "cpu_zero3_2proc", "--output"], "--output", []),
    "pin": (["pin", "--output"], "--output", []),
    "calibrate": (["calibrate", "--output"], "--output", []),
    "checkpoint export": (["checkpoint", "export", "CKPT", "--output"], "--output", []),
    "checkpoint dequantize": (["checkpoint", "dequantize", "CKPT", "--output"], "--output", []),
    "logs summarize": (["logs", "summarize", "LOGDIR", "--output"], "--output", []),
    "preflight": (
        ["preflight", "--config-file", str(REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml"), "--output"],
        "--output",
        [],
    ),
}
OUTPUT_FLAGS = {"--output", "--output-dir", "--out", "--log-dir"}


def _output_options(parser, path=()):
    """(command words, flag) for every option of the CLI that names where something is written."""
    import argparse

    for action in parser._actions:  # argparse has no public walk over subparsers
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _output_options(sub, (*path, name))
        else:
            # The first spelling is the documented one (--output; --out and --output-dir are its aliases).
            if set(action.option_strings) & OUTPUT_FLAGS:
                yield " ".join(path), action.option_strings[0]


def test_every_writing_command_is_covered_below():
    from hf_dist_recipes.cli.main import build_parser

    covered = {(cmd.split(" --")[0], flag) for cmd, (_, flag, _) in WRITING_COMMANDS.items()}
    assert set(_output_options(build_parser())) == covered


def _unwritable(kind, tmp_path) -> Path:
    if kind == "proc":  # the example: root passes os.access on /proc, but nothing can be created there
        if not Path("/proc/self").is_dir():
            pytest.skip("no /proc on this system")
        return Path("/proc/no_such_dir/run")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    return blocker / "run"


@pytest.mark.parametrize("kind", ["proc", "under-a-file"])
@pytest.mark.parametrize("command", list(WRITING_COMMANDS))
def test_unwritable_output_is_one_line_exit_2_for_every_writing_command(command, kind, capsys, tmp_path, no_launch):
    before, flag, after = WRITING_COMMANDS[command]
    bad = _unwritable(kind, tmp_path)
    (tmp_path / "logs").mkdir()
    words = {"CKPT": str(tmp_path / "checkpoint-1"), "LOGDIR": str(tmp_path / "logs"), "OUT": str(tmp_path / "cfg")}
    argv = [words.get(a, a) for a in before] + [str(bad)] + after
    code, out, err, seconds = _run(capsys, argv)
    line = _one_line_naming(err, flag)
    assert code == 2 and out == "" and str(bad) in line and no_launch == [], (argv, err)
    print(f"{command} refused in {seconds:.2f} s")
    assert not bad.exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["logs"] + (["a_file"] if kind != "proc" else [])
    )


def test_config_path_with_an_unwritable_cache_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/no_such_dir")
    code, out, err, _ = _run(capsys, ["config", "path", "cpu_zero3_2proc"])
    line = _one_line_naming(err, "XDG_CACHE_HOME")
    assert code == 2 and out == "" and "/proc" in line


@pytest.mark.parametrize("argv", [["config", "copy", "no_such_config", "--output", "OUT"], ["config", "path", "nope"]])
def test_unknown_shipped_config_names_the_choices(argv, capsys, tmp_path):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    code, out, err, _ = _run(capsys, argv)
    line = _one_line_naming(err, "cpu_zero3_2proc")  # the list of names to choose from
    assert code == 2 and out == "" and "hf-dist-recipes config list" in line and not (tmp_path / "out").exists()
