"""MkDocs hook: the CLI reference page (cli.md), generated at build time from the real argparse parsers.

Generated rather than committed so that it cannot drift from the parsers: every command and subcommand of
`hf_dist_recipes.cli.main.build_parser()` gets a heading and its `--help` text, formatted at a fixed width of 100
columns so the page does not depend on the terminal that builds it. tests/unit/test_docs.py renders it too.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

PAGE = "cli.md"
WIDTH = "100"  # argparse reads $COLUMNS for its line width

INTRO = """# CLI reference

Generated from the parsers of `hf-dist-recipes` when this site is built (`docs/hooks/cli_reference.py`), so it
always matches the installed command: each section is that command's `--help`. The pages under *Commands* explain
what the commands do; user errors are one line on stderr ([Troubleshooting](troubleshooting.md)).

## Conventions

Every command takes `--output` for where it writes (`--out` and `--output-dir` stay as aliases), and every flag that
shares its name with an `accelerate launch` flag in both spellings: `--config-file` or `--config_file`,
`--machine-rank` or `--machine_rank`, `--num-processes` or `--num_processes`, `--main-process-ip`,
`--main-process-port`; `--nodes` is also `--num-machines` / `--num_machines`.

## Exit status

One meaning per code, in every command (each command's `--help` ends with this table):

| exit | meaning |
|---|---|
{rows}
"""


def intro() -> str:
    """INTRO with the exit-status table of the parsers' epilogs (`hf_dist_recipes.cli.conventions.EXIT_MEANINGS`)."""
    from hf_dist_recipes.cli.conventions import EXIT_MEANINGS

    return INTRO.format(rows="\n".join(f"| {code} | {meaning} |" for code, meaning in EXIT_MEANINGS.items()))


def _subcommands(
    parser: argparse.ArgumentParser, path: list[str]
) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield path + [name], sub
                yield from _subcommands(sub, path + [name])


def commands() -> list[tuple[list[str], argparse.ArgumentParser]]:
    """Every (command path, parser) pair, the top-level parser first."""
    from hf_dist_recipes.cli.main import build_parser

    parser = build_parser()
    return [([], parser), *_subcommands(parser, [])]


def render() -> str:
    """The whole page as Markdown."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        parts = [intro()]
        for path, parser in commands():
            title = " ".join(["hf-dist-recipes", *path])
            parts.append(f"## `{title}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
        return "\n".join(parts)
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def on_files(files, config):
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files
