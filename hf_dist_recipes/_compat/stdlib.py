"""The standard library's details that are not public API: argparse's."""

from __future__ import annotations

# argparse has no public walk over a parser's arguments and subcommands, nor a way to give a defined flag another
# spelling; `hf-dist-recipes`' shared conventions (cli/conventions.py: both flag spellings, --output) need
# both. Read in CPython 3.10 to 3.13's argparse.py: `_actions` (every argument, in order), `_SubParsersAction`
# (`choices`: name -> parser), `_option_string_actions` (spelling -> action, shared with the argument groups).
# tests/cli/test_conventions.py parses both spellings of every aliased flag. Goes when argparse offers both publicly.


def parser_actions(parser) -> list:
    """Every argparse action of `parser`, in the order added (subcommand actions included)."""
    return list(parser._actions)


def subcommand_parsers(parser) -> list:
    """(name, parser) of every subcommand `parser` has, in the order added."""
    import argparse

    return [
        (name, sub)
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
    ]


def add_option_string(parser, action, option: str, *, first: bool = False, hidden: bool = False) -> bool:
    """Make `option` another spelling of `action` of `parser` (first in its help when `first`; parsed but not in
    its help when `hidden`); False, changing nothing, when `parser` already has that spelling."""
    if option in parser._option_string_actions:
        return False
    import argparse

    if hidden and isinstance(action, argparse.BooleanOptionalAction):
        # It sets its value only for a spelling in its option_strings, and reads "--no-" off the spelling: a hidden
        # one gets an action of its own that stores what its visible twin would.
        value = not option.startswith(("--no-", "--no_"))
        action = argparse._StoreConstAction(
            [option], action.dest, const=value, default=action.default, help=action.help
        )
    if first:
        action.option_strings.insert(0, option)
    elif not hidden:
        action.option_strings.append(option)
    parser._option_string_actions[option] = action
    return True
