"""Entry point of `hf-dist-recipes`. User errors (ValueError) print one line and exit with status 2 (the table of
exit statuses: cli/conventions.py).

Each subcommand's module (hf_dist_recipes/cli/<name>.py) is imported only when it runs: `hf-dist-recipes logs
summarize` does not pay for importing `config`'s YAML and plan machinery or `demo`'s launcher (~0.2 s together).
`--help`, no command, or a command that does not exist builds the whole parser, so the listing and argparse's
"invalid choice" message stay as they were.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib import import_module

from hf_dist_recipes.core.findings import EXIT_USAGE

# Command name -> its module under hf_dist_recipes.cli, in the order `--help` lists them. Each module's
# register(subparsers) adds the command of this name (tests/cli/test_main_lazy.py checks they agree).
SUBCOMMANDS = ("demo", "config", "checkpoint", "logs", "doctor", "pin", "commbench", "calibrate", "preflight")
USAGE_ERROR = EXIT_USAGE  # the command could not do its job: a usage error, an input it cannot read
BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer that `| head` closed
# Reading a DeepSpeed JSON imports DeepSpeed, which logs this to stdout on hosts without a GPU: a refusal's second line
logging.getLogger("DeepSpeed").addFilter(lambda rec: not rec.getMessage().startswith("Setting accelerator to CPU"))


def _version() -> str:
    from hf_dist_recipes import __version__

    return __version__


class _VersionAction(argparse.Action):
    """`--version`, with the version looked up only when asked (importlib.metadata costs ~0.08 s)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {_version()}")
        parser.exit()


def build_parser(commands: tuple[str, ...] = SUBCOMMANDS) -> argparse.ArgumentParser:
    """The parser with `commands` registered (default: all of them)."""
    parser = argparse.ArgumentParser(
        prog="hf-dist-recipes",
        description="Distributed training of DeepSeek-style models with transformers, accelerate and DeepSpeed, "
        "with the seven practices as checked defaults.",
    )
    parser.add_argument("--version", action=_VersionAction, help="show program's version number and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in commands:
        import_module(f"hf_dist_recipes.cli.{name}").register(subparsers)
    from hf_dist_recipes.cli import conventions

    return conventions.apply(parser)  # accelerate's spellings, --output, the exit-status table: every command alike


def _command_of(argv: list[str]) -> str | None:
    """The subcommand `argv` starts with, when it is one of SUBCOMMANDS (the only options before a command,
    --help and --version, exit before any command runs)."""
    return argv[0] if argv and argv[0] in SUBCOMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = _command_of(argv)
    parser = build_parser((command,) if command else SUBCOMMANDS)
    args = parser.parse_args(argv)
    args.argv = argv  # generate records its own command line in the files it writes
    if args.command is None:
        parser.print_help()
        return USAGE_ERROR
    try:
        code = args.run(args)
        sys.stdout.flush()  # a reader that went away (`| head`) raises here, inside the handler, not at exit
        return code
    except ValueError as err:
        print(f"hf-dist-recipes {args.command}: error: {err}", file=sys.stderr)
        return USAGE_ERROR
    except BrokenPipeError:
        # Stop quietly as other Unix tools do; stdout goes to devnull so the interpreter's own flush at exit
        # does not raise again (Python's documentation, "Note on SIGPIPE").
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
