"""`hf-dist-recipes commbench`: the subcommand of `comm.commbench.commbench_command_parser` (its flags and
description), launched by `comm.commbench_launch` and rendered by `comm.commbench_render`. Links or ranks flagged
slow are warnings: exit 0, or 1 with --strict; ranks that failed exit 1."""

from __future__ import annotations

import argparse
import json
import sys

from hf_dist_recipes.comm.commbench import commbench_command_parser, settings_of
from hf_dist_recipes.core.findings import OK, WARNING, exit_code, strict_exit


def register(subparsers) -> None:
    parser = commbench_command_parser(subparsers)
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a link or rank is flagged slow (default: a warning, 0)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hf_dist_recipes.comm.commbench_launch import plan_commbench, run_commbench
    from hf_dist_recipes.comm.commbench_render import render

    plan = plan_commbench(settings_of(args), num_processes=args.num_processes, backend=args.backend)
    try:
        result = run_commbench(plan)
    except RuntimeError as err:
        print(f"hf-dist-recipes commbench: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else render(result))
    # A warning when any run (one, or the NCCL/Gloo side by side) flagged a link or rank.
    runs = result.get("runs", [result])
    flagged = any(r.get("flagged", {}).get("links") or r.get("flagged", {}).get("ranks") for r in runs)
    return exit_code([WARNING if flagged else OK], strict_exit(args.strict))
