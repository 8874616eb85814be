"""`hf-dist-recipes commbench`: the subcommand of `comm.commbench.commbench_command_parser` (its flags and
description), launched by `comm.commbench_launch` and rendered by `comm.commbench_render`."""

from __future__ import annotations

import argparse
import json
import sys

from hf_dist_recipes.comm.commbench import commbench_command_parser, settings_of


def register(subparsers) -> None:
    commbench_command_parser(subparsers).set_defaults(run=run)


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
    return 0
