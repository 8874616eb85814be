"""The conventions every command shares (cli/conventions.py): both flag spellings, `--output`, one exit-status
table in every `--help`, help texts written for users, `--strict`, and defaults that follow the flags they depend on.

Every list here is built from the parsers themselves, so a command or flag added later is checked without an edit."""

from __future__ import annotations

import argparse
import functools
import json
import re

import pytest

from hf_dist_recipes.cli import conventions
from hf_dist_recipes.cli.main import build_parser, main
from hf_dist_recipes.core.findings import EXIT_FOUND_PROBLEMS, EXIT_OK, EXIT_USAGE

COMMANDS = [(" ".join(path), parser) for path, parser in conventions.commands(build_parser()) if path]


def _leaves():
    return [(name, p) for name, p in COMMANDS if not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)]


@functools.cache
def _accelerate_flags() -> frozenset[str]:
    """Every option string of `accelerate launch`, from accelerate's own parser."""
    from accelerate.commands.launch import launch_command_parser

    return frozenset(s for a in launch_command_parser()._actions for s in a.option_strings)


def _required_argv(parser: argparse.ArgumentParser, skip: argparse.Action) -> list[str]:
    """Placeholder values for the parser's required arguments (positionals and required flags) but `skip`."""
    argv: list[str] = []
    for a in parser._actions:
        if a is skip or a.dest == "help":
            continue
        if not a.option_strings:
            argv.append("X")
        elif a.required:
            argv += [a.option_strings[0], "X"]
    return argv


def _value(action: argparse.Action) -> list[str]:
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(list(action.choices)[-1])]
    return ["3"] if action.type in (int, float) else ["some-value"]


# Every long flag of every command with two or more words, in each spelling it is written in (help's and aliases).
FLAGS = [
    (name, parser, action, option)
    for name, parser in _leaves()
    for action in parser._actions
    for option in action.option_strings
    if conventions.other_spelling(option)
]


def test_the_flags_accelerate_shares_are_among_them():
    names = {option for _, _, _, option in FLAGS}
    assert {"--config-file", "--machine-rank", "--num-processes"} <= names, names
    assert {"--main-process-ip", "--main-process-port", "--max-steps", "--output-dir"} <= names, names
    shared = {o for o in names if conventions.other_spelling(o) in _accelerate_flags()}
    assert {"--config-file", "--num-processes", "--main-process-port"} <= shared, shared


@pytest.mark.parametrize("case", range(len(FLAGS)), ids=[f"{c[0]} {c[3]}" for c in FLAGS])
def test_every_flag_takes_both_spellings_with_the_same_value(case):
    """As accelerate launch and HfArgumentParser: `--max-steps 3` and `--max_steps 3` (issue 42)."""
    name, parser, action, option = FLAGS[case]
    other = conventions.other_spelling(option)
    base = _required_argv(parser, action)
    written = parser.parse_args(base + [option, *_value(action)])
    spelled = parser.parse_args(base + [other, *_value(action)])
    assert getattr(written, action.dest) == getattr(spelled, action.dest) != action.default, f"{name} {other}"


def test_the_other_spelling_stays_out_of_help_which_says_so_once(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    assert "--max-steps MAX_STEPS" in text and "--max_steps MAX_STEPS" not in text
    assert text.count(conventions.SPELLINGS) == 1
    out = str(tmp_path / "x")
    assert main(["demo", "--output_dir", out, "--max_steps", "10", "--dry-run", "--json"]) == EXIT_OK
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert (settings["output_dir"], settings["max_steps"]) == (out, 10)


def test_nodes_is_also_accelerates_num_machines():
    parser = dict(COMMANDS)["config estimate"]
    values = {flag: parser.parse_args(["--model", "m", flag, "4"]).nodes for flag in conventions.SYNONYMS["--nodes"]}
    assert values == {"--num-machines": 4, "--num_machines": 4}


OUTPUT_COMMANDS = [
    (name, action)
    for name, parser in _leaves()
    for action in parser._actions
    if {"--output", *conventions.OUTPUT_ALIASES} & set(action.option_strings)
]


def test_every_command_with_an_output_location_takes_output():
    names = {name for name, _ in OUTPUT_COMMANDS}
    assert {"demo", "preflight", "logs summarize", "config generate", "calibrate", "pin", "checkpoint export"} <= names
    for name, action in OUTPUT_COMMANDS:
        assert action.option_strings[0] == "--output", f"{name}: --output is the documented name"


@pytest.mark.parametrize("alias", conventions.OUTPUT_ALIASES)
def test_the_old_output_names_stay_aliases(alias):
    for _name, parser in _leaves():
        action = next((a for a in parser._actions if alias in a.option_strings), None)
        if action is None:
            continue
        base = _required_argv(parser, action)
        assert getattr(parser.parse_args(base + [alias, "D"]), action.dest) == "D"
        assert getattr(parser.parse_args(base + ["--output", "D"]), action.dest) == "D"


def test_out_is_no_ambiguous_abbreviation(capsys, tmp_path):
    # `demo --out DIR` abbreviated --output-dir before --output existed; both names now match it.
    assert main(["demo", "--out", str(tmp_path / "run"), "--dry-run", "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["settings"]["output_dir"] == str(tmp_path / "run")


def test_every_command_page_links_the_exit_status_table():
    from tests.support.paths import REPO

    pages = sorted((REPO / "docs" / "commands").glob("*.md"))
    assert pages
    for page in pages:
        assert "../cli.md#exit-status" in page.read_text(), f"{page.name} does not link the exit-status table"


@pytest.mark.parametrize("name", [n for n, _ in COMMANDS])
def test_every_help_ends_with_the_exit_status_table(name):
    text = dict(COMMANDS)[name].format_help()
    assert conventions.EXIT_STATUS.splitlines()[0] in text
    for code in (EXIT_OK, EXIT_FOUND_PROBLEMS, EXIT_USAGE):
        assert re.search(rf"^  {code}  ", text, re.M), f"{name}: exit {code} missing from --help"


# Module paths (`core.findings.HANG_EXIT`) and our source files (`doctor/probe.py`) mean nothing to a user; a command
# users run (`python -m hf_dist_recipes.comm.commbench`, inside their own launch) is not a source path.
SOURCE_PATH = re.compile(r"\b[\w/]+/\w+\.py\b|\bhf_dist_recipes\.\w+|\b(core|comm|doctor|planning|parallel)\.\w+")


@pytest.mark.parametrize("name", [n for n, _ in COMMANDS])
def test_help_names_no_module_or_source_path(name):
    text = re.sub(r"-m hf_dist_recipes[\w.]+", "", dict(COMMANDS)[name].format_help())
    found = SOURCE_PATH.search(text)
    assert found is None, f"{name} --help names {found.group(0)!r}"


def test_logs_summarize_and_hang_describe_themselves():
    summarize = dict(COMMANDS)["logs summarize"].description
    hang = dict(COMMANDS)["logs hang"].description
    assert summarize != hang
    assert "TensorBoard" in summarize and "flight-recorder" not in summarize
    assert "flight-recorder" in hang and "TensorBoard" not in hang


# Commands that report warnings: each takes --strict (a warning exits 1 with it, 0 without).
WARNING_COMMANDS = ["doctor", "preflight", "config validate", "config generate", "config estimate", "logs summarize"]


@pytest.mark.parametrize("name", [*WARNING_COMMANDS, "commbench"])
def test_commands_that_warn_take_strict(name):
    assert any("--strict" in a.option_strings for a in dict(COMMANDS)[name]._actions)


def test_every_command_with_json_output_takes_json():
    # config path was the one command without it.
    lacking = [n for n, p in _leaves() if not any("--json" in a.option_strings for a in p._actions)]
    assert lacking == [], lacking


def test_config_path_json(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["config", "path", "cpu_zero3_2proc", "--json"]) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["name"] == "cpu_zero3_2proc" and data["path"].endswith(".yaml") and str(tmp_path) in data["path"]
    assert main(["config", "path", "cpu_zero3_2proc"]) == EXIT_OK
    assert capsys.readouterr().out.strip() == data["path"]  # without --json: the path alone, for "$(...)"


# ---- defaults that follow the flags they depend on ------------------------------------------------------------


def _demo_settings(argv: list[str]):
    from hf_dist_recipes.demo.settings import add_training_flags, settings_from

    parser = argparse.ArgumentParser()
    add_training_flags(parser)
    return settings_from(parser.parse_args(argv))


def test_demo_warmup_and_logging_follow_max_steps():
    """`demo --max-steps 10` used to stop on a --warmup-steps 20 the user never set. No training is launched."""
    from hf_dist_recipes.demo.settings import check_settings

    short = _demo_settings(["--max-steps", "10"])
    assert (short.warmup_steps, short.logging_steps) == (1, 1)
    check_settings(short, processes=2)  # valid: no ValueError
    default = _demo_settings([])
    assert (default.max_steps, default.warmup_steps, default.logging_steps) == (200, 20, 20)  # as before
    long = _demo_settings(["--max-steps", "1000"])
    assert (long.warmup_steps, long.logging_steps) == (100, 20)
    one = _demo_settings(["--max-steps", "1"])
    assert (one.warmup_steps, one.logging_steps) == (0, 1)
    check_settings(one, processes=2)
    given = _demo_settings(["--max-steps", "10", "--warmup-steps", "5", "--logging-steps", "2"])
    assert (given.warmup_steps, given.logging_steps) == (5, 2)  # what the user gives is kept
    with pytest.raises(ValueError, match="--warmup-steps"):  # and still checked against --max-steps
        check_settings(_demo_settings(["--max-steps", "10", "--warmup-steps", "50"]), processes=2)


def test_demo_max_bytes_follows_the_step_size():
    """A micro batch whose step needs more than the 2,000,000 bytes of the default no longer stops on --max-bytes."""
    from hf_dist_recipes.demo.settings import DEFAULT_MAX_BYTES, check_settings, max_bytes_for

    big = _demo_settings(["--micro-batch", "4096", "--seq-len", "1024"])
    check_settings(big, processes=2)  # valid: no ValueError
    assert max_bytes_for(big, 2) == 4096 * 1024 * 2
    assert max_bytes_for(_demo_settings([]), 2) == DEFAULT_MAX_BYTES  # as before
    given = _demo_settings(["--micro-batch", "4096", "--seq-len", "1024", "--max-bytes", "3000000"])
    with pytest.raises(ValueError, match="--max-bytes"):  # what the user gives is still checked
        check_settings(given, processes=2)


def test_demo_max_steps_10_dry_run_exits_0(capsys, tmp_path):
    assert main(["demo", "--max-steps", "10", "--dry-run", "--output", str(tmp_path / "run")]) == EXIT_OK
    assert "10 steps" in capsys.readouterr().out


# ---- exit codes, command by command (the ones other test files do not cover) ----------------------------------


def test_doctor_usage_error_exits_2(capsys, tmp_path):
    assert main(["doctor", "--lock", str(tmp_path / "none.lock")]) == EXIT_USAGE


def test_config_validate_strict(capsys, tmp_path):
    warned = tmp_path / "ds.json"  # a scheduler section overrides the recipe's schedule: a warning, not an error
    warned.write_text('{"zero_optimization": {"stage": 3}, "scheduler": {"type": "WarmupLR"}}')
    code = main(["config", "validate", str(warned), "--json"])
    assert {f["level"] for f in json.loads(capsys.readouterr().out)} == {"warning"}
    assert code == EXIT_OK
    assert main(["config", "validate", str(warned), "--strict"]) == EXIT_FOUND_PROBLEMS
    assert main(["config", "validate", str(tmp_path / "none.json")]) == EXIT_USAGE


def test_config_generate_exit_codes(capsys, tmp_path):
    fits = ["config", "generate", "--cpu", "--gpus-per-node", "2", "--output", str(tmp_path / "a")]
    assert main(fits) == EXIT_OK
    too_big = ["config", "generate", "--model", "deepseek-v3", "--tp", "2", "--ep", "8", "--gpu-memory", "80"]
    assert main([*too_big, "--output", str(tmp_path / "b")]) == EXIT_FOUND_PROBLEMS
    assert not (tmp_path / "b").exists()  # nothing written
    assert main(["config", "generate", "--zero", "0", "--output", str(tmp_path / "c")]) == EXIT_USAGE


def test_config_estimate_exit_codes(capsys):
    plan = ["config", "estimate", "--model", "deepseek-v3", "--nodes", "8", "--tp", "2", "--ep", "8"]
    assert main([*plan, "--gpu-memory", "4000"]) == EXIT_OK
    assert main([*plan, "--gpu-memory", "80"]) == EXIT_FOUND_PROBLEMS  # does not fit
    assert main([*plan]) == EXIT_OK  # without --gpu-memory nothing is judged to fit or not
    assert main([*plan, "--gpu-memory", "-1"]) == EXIT_USAGE


def test_logs_summarize_exit_code_of_its_findings():
    from hf_dist_recipes.cli.logs import summarize_exit_code

    clean = {"divergences": [], "stragglers": [], "warnings": []}
    assert summarize_exit_code(clean, strict=True) == EXIT_OK
    slow = {**clean, "stragglers": [{"rank": 1}]}
    assert summarize_exit_code(slow, strict=False) == EXIT_OK
    assert summarize_exit_code(slow, strict=True) == EXIT_FOUND_PROBLEMS
    parted = {**clean, "divergences": [{"tag": "train/loss"}]}
    assert summarize_exit_code(parted, strict=False) == EXIT_FOUND_PROBLEMS


def test_logs_summarize_of_a_missing_folder_exits_2(capsys, tmp_path):
    assert main(["logs", "summarize", str(tmp_path / "none"), "--output", str(tmp_path / "out")]) == EXIT_USAGE


def test_demo_exit_codes(capsys, monkeypatch, tmp_path):
    class Failed:
        returncode = 1

        def as_dict(self):
            return {"returncode": 1}

    monkeypatch.setattr("hf_dist_recipes.cli.demo.run_demo", lambda plan, quiet: Failed())
    assert main(["demo", "--json", "--output", str(tmp_path / "run")]) == EXIT_FOUND_PROBLEMS
    assert main(["demo", "--max-steps", "0", "--dry-run"]) == EXIT_USAGE


def test_commbench_exit_codes(capsys, monkeypatch):
    import hf_dist_recipes.comm.commbench_launch as launch

    result = {"flagged": {"links": [[0, 1]], "ranks": []}}
    monkeypatch.setattr(launch, "run_commbench", lambda plan: result)
    monkeypatch.setattr("hf_dist_recipes.comm.commbench_render.render", lambda r: "table")
    assert main(["commbench", "--num-processes", "2", "--backend", "gloo"]) == EXIT_OK  # flagged: a warning
    assert main(["commbench", "--num-processes", "2", "--backend", "gloo", "--strict"]) == EXIT_FOUND_PROBLEMS

    def fails(plan):
        raise RuntimeError("ranks exited 1")

    monkeypatch.setattr(launch, "run_commbench", fails)
    assert main(["commbench", "--num-processes", "2", "--backend", "gloo"]) == EXIT_FOUND_PROBLEMS
    assert main(["commbench", "--sizes", "lots"]) == EXIT_USAGE


def test_preflight_exit_codes(capsys, monkeypatch, tmp_path):
    import hf_dist_recipes.preflight.launch as launch
    from hf_dist_recipes.preflight.result import CheckResult, PreflightReport

    class Plan:
        config_file, world_size, output_dir = "acc.yaml", 2, str(tmp_path)
        models = type("M", (), {"name": "tiny"})

    def report(status):
        fix = "" if status == "ok" else "the fix"
        return PreflightReport("acc.yaml", 2, ["h", "h"], [CheckResult("backend", status, "d", fix)])

    monkeypatch.setattr(launch, "plan_preflight", lambda *a, **k: Plan())
    # (worst status, exit, exit with --strict)
    for status, code, strict in (("ok", 0, 0), ("warning", 0, 1), ("error", 1, 1)):
        monkeypatch.setattr(launch, "run_preflight", lambda plan, timeout_s, on_line, s=status: report(s))
        assert main(["preflight", "--config-file", "acc.yaml", "--json"]) == code
        assert json.loads(capsys.readouterr().out)["exit_code"] == code
        assert main(["preflight", "--config-file", "acc.yaml", "--strict"]) == strict
        capsys.readouterr()
    monkeypatch.undo()
    assert main(["preflight", "--config-file", str(tmp_path / "none.yaml")]) == EXIT_USAGE
