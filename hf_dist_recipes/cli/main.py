"""Entry point of `hf-dist-recipes`. User errors (ValueError) print one line and exit with status 2."""

from __future__ import annotations

import argparse
import sys

from hf_dist_recipes import __version__
from hf_dist_recipes.cli import checkpoint, commbench, config, demo, doctor, logs, pin, preflight

SUBCOMMANDS = (demo, config, checkpoint, logs, doctor, pin, commbench, preflight)
USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-dist-recipes",
        description="Distributed training of DeepSeek-style models with transformers, accelerate and DeepSpeed, "
        "with the seven practices as checked defaults.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.argv = argv  # generate records its own command line in the files it writes
    if args.command is None:
        parser.print_help()
        return USAGE_ERROR
    try:
        return args.run(args)
    except ValueError as err:
        print(f"hf-dist-recipes {args.command}: error: {err}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
