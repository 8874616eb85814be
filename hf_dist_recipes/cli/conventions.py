"""The conventions every `hf-dist-recipes` command shares, applied once to the built parser (`apply`), so that a
command added later follows them without a line of its own:

- both spellings: every flag is accepted as written in help (`--max-steps`) and with underscores (`--max_steps`), or
  the other way round, as `accelerate launch` and transformers' `HfArgumentParser` accept theirs: users paste one
  command line into another. The other spelling stays out of help, which says so once (SPELLINGS);
- one output flag: `--output` names where a command writes; the older `--out` and `--output-dir` stay as aliases;
- one exit-status table (EXIT_STATUS), in every command's `--help` and on the CLI reference page.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Iterator

from hf_dist_recipes._compat.stdlib import add_option_string, parser_actions, subcommand_parsers
from hf_dist_recipes.core.findings import EXIT_FOUND_PROBLEMS, EXIT_OK, EXIT_USAGE

# Our flags named differently from accelerate's flag of the same meaning: accelerate's name in both spellings.
SYNONYMS = {"--nodes": ("--num-machines", "--num_machines")}

OUTPUT = "--output"
OUTPUT_ALIASES = ("--out", "--output-dir")  # what commands called it before --output was the one name

# One meaning per exit status, for every command. EXIT_STATUS is the text of `--help` and of the CLI reference.
EXIT_MEANINGS = {
    EXIT_OK: "done, nothing wrong found; warnings too, unless --strict",
    EXIT_FOUND_PROBLEMS: "the command ran and found problems: a plan that does not fit, errors in a config, a hang, "
    "preflight or doctor errors, a launched run that failed; warnings too with --strict",
    EXIT_USAGE: "the command could not do its job: a usage error, an input it cannot read (one line on stderr "
    "names the fix)",
}
SPELLINGS = "Every flag also takes its other spelling: --max_steps for --max-steps, --output_dir for --output-dir."
EXIT_STATUS = "Exit status:\n" + "\n".join(
    textwrap.fill(meaning, 100, initial_indent=f"  {code}  ", subsequent_indent="     ")
    for code, meaning in EXIT_MEANINGS.items()
)
WRAP = 100  # the width a one-paragraph description is wrapped at once --help prints text as written


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Yield (command path, parser) for `parser` and every subcommand under it, depth first."""
    yield path, parser
    for name, sub in subcommand_parsers(parser):
        yield from commands(sub, (*path, name))


def other_spelling(option: str) -> str | None:
    """`--max_steps` for `--max-steps`, `--max-steps` for `--max_steps`; None for a one-word or a short flag."""
    if not option.startswith("--"):
        return None
    name = option[2:]
    other = name.replace("-", "_") if "-" in name else name.replace("_", "-")
    return None if other == name else f"--{other}"


def apply(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The conventions above on `parser` and every subcommand; returns `parser`."""
    for path, command in commands(parser):
        for action in parser_actions(command):
            for option in list(action.option_strings):
                for synonym in SYNONYMS.get(option, ()):
                    add_option_string(command, action, synonym)
                if option in OUTPUT_ALIASES:
                    if action.metavar is None:
                        action.metavar = "DIR"  # not OUTPUT_DIR / OUT, the dest of the old name
                    add_option_string(command, action, OUTPUT, first=True)
                    for other in OUTPUT_ALIASES:  # `--out` was an abbreviation of --output-dir: now it is exact
                        add_option_string(command, action, other)
            for action in parser_actions(command):  # every spelling above, in the other spelling too
                for option in list(action.option_strings):
                    if other := other_spelling(option):
                        add_option_string(command, action, other, hidden=True)  # a flag the command has wins
        if path:
            _exit_epilog(command)
    return parser


def _exit_epilog(parser: argparse.ArgumentParser) -> None:
    """EXIT_STATUS under the command's own epilog. Help is then printed as written (the table's layout): a
    description with line breaks of its own (a module docstring) keeps them, with its epilog; a description or
    epilog written as one paragraph is wrapped here."""
    if "\n" not in (parser.description or "") and not issubclass(
        parser.formatter_class, argparse.RawDescriptionHelpFormatter
    ):
        parser.description = _wrap(parser.description)
        parser.epilog = _wrap(parser.epilog)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "\n\n".join(p for p in (parser.epilog, SPELLINGS, EXIT_STATUS) if p)


def _wrap(text: str | None) -> str | None:
    if text is None:
        return None
    # Flags such as --gpus-per-node stay whole: no break at their hyphens.
    return "\n".join(textwrap.fill(p, WRAP, break_on_hyphens=False, break_long_words=False) for p in text.split("\n"))
