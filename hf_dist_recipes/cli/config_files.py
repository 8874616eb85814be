"""`hf-dist-recipes config list|copy|path`: the configs shipped with the package, usable without the repository.

list   the shipped configs: name, plan, and the `config generate` command that makes the same files
copy   write NAME.yaml and deepspeed/NAME.json into --output DIR, the YAML naming the JSON by its absolute path
path   the absolute path of a launchable copy of NAME (kept in ~/.cache/hf-dist-recipes/configs/<version>, or
       $XDG_CACHE_HOME's): accelerate launch --config_file "$(hf-dist-recipes config path NAME)" train.py
"""

from __future__ import annotations

import argparse
import json


def register(sub) -> None:
    """Add list, copy and path to `config`'s subcommands (`sub`, from cli/config.py)."""
    lst = sub.add_parser(
        "list",
        help="list the configs shipped with the package",
        description="The shipped configs (generated from their manifest by `config generate`), each with its plan.",
    )
    lst.add_argument("--json", action="store_true", help="print the list as JSON")
    lst.set_defaults(run=run_list)

    cp = sub.add_parser(
        "copy",
        help="write a shipped config (YAML + DeepSpeed JSON) into a directory, launchable from anywhere",
        description="Write NAME.yaml and deepspeed/NAME.json into DIR (created if missing; files of that name are "
        "replaced). The YAML names the JSON by its absolute path, so `accelerate launch --config_file DIR/NAME.yaml` "
        "works from any directory; edit the copy freely.",
        epilog="Example: hf-dist-recipes config copy zero3_2nodes_8gpu --output my_configs",
    )
    cp.add_argument("name", metavar="NAME", help="a shipped config (hf-dist-recipes config list)")
    cp.add_argument("--output", required=True, metavar="DIR", help="directory to write the copy into")
    cp.add_argument("--json", action="store_true", help="print what was written as JSON")
    cp.set_defaults(run=run_copy)

    path = sub.add_parser(
        "path",
        help="print the absolute path of a launchable copy of a shipped config",
        description="Print the absolute path of a copy of NAME whose DeepSpeed path is absolute, written (or "
        "refreshed) in $XDG_CACHE_HOME (default ~/.cache)/hf-dist-recipes/configs/<version>/: made for "
        '`accelerate launch --config_file "$(hf-dist-recipes config path NAME)"` from any directory.',
        epilog='Example: accelerate launch --config_file "$(hf-dist-recipes config path cpu_zero3_2proc)" train.py',
    )
    path.add_argument("name", metavar="NAME", help="a shipped config (hf-dist-recipes config list)")
    path.add_argument("--json", action="store_true", help='print {"name": ..., "path": ...} as JSON')
    path.set_defaults(run=run_path)


def run_list(args: argparse.Namespace) -> int:
    from hf_dist_recipes.planning.shipped import shipped_configs

    data = [c.as_dict() for c in shipped_configs()]
    print(json.dumps(data, indent=2) if args.json else render_list(data))
    return 0


def render_list(data: list[dict]) -> str:
    width = max(len(c["name"]) for c in data)
    lines = [f"{c['name']:<{width}}  {c['summary']}" for c in data]
    lines.append("copy one: hf-dist-recipes config copy NAME --output DIR; launch one: accelerate launch --config_file")
    lines.append('  "$(hf-dist-recipes config path NAME)" train.py')
    return "\n".join(lines)


def run_copy(args: argparse.Namespace) -> int:
    from hf_dist_recipes.planning.shipped import copy_config

    copied = copy_config(args.name, args.output)
    data = copied.as_dict()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(f"wrote {data['yaml_file']}\nwrote {data['deepspeed_file']}")
        print(f"launch from any directory: accelerate launch --config_file {data['yaml_file']} train.py")
    return 0


def run_path(args: argparse.Namespace) -> int:
    from hf_dist_recipes.planning.shipped import config_path

    path = config_path(args.name)
    # The path alone: made for "$(...)".
    print(json.dumps({"name": args.name, "path": str(path)}, indent=2) if args.json else path)
    return 0
