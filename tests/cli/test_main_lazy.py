"""cli/main.py imports only the subcommand that runs: its table of names must match what each module registers."""

from __future__ import annotations

import argparse

import pytest

from hf_dist_recipes.cli.main import SUBCOMMANDS, build_parser, main


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # argparse has no public walk
    return list(sub.choices)


def test_every_module_registers_the_command_of_its_name():
    assert _commands(build_parser()) == list(SUBCOMMANDS)
    for name in SUBCOMMANDS:
        assert _commands(build_parser((name,))) == [name]


def test_help_and_unknown_commands_still_see_every_command(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and all(f"    {name}" in out for name in SUBCOMMANDS)
    with pytest.raises(SystemExit) as done:
        main(["lgos"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "invalid choice: 'lgos'" in err and "'logs'" in err


def test_version_is_looked_up_when_asked(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"hf-dist-recipes {version('hf-dist-recipes')}\n"
