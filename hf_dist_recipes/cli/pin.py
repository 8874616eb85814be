"""`hf-dist-recipes pin --output DIR [--torch X [--cuda Y]] [--json]`: a lock and a Dockerfile that reproduces it.

Writes DIR/requirements.lock (exact versions, with the torch build, its wheel index and NCCL in `# ` header lines)
and DIR/Dockerfile (a CUDA devel base image matching the torch build, or python:<version>-slim for a CPU build;
`pip install -r requirements.lock --extra-index-url <that build's index>`; the hang-proof NCCL defaults as ENV).
Without --torch: this environment's exact versions. With --torch X [--cuda Y]: this environment's versions with
torch X's build for CUDA Y (default: the release's PyPI build) and the NCCL that build pins. A pair with no such
build is refused as a usage error (exit 2); one a known-issues rule marks as an error is refused with the rule, its
symptom and its fix, as a problem found (exit 1), as `doctor` reports the same rule.
`hf-dist-recipes doctor --lock DIR/requirements.lock` later names every package that drifted from the lock.
"""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "pin",
        help="write requirements.lock and a Dockerfile reproducing this environment or a chosen torch build",
        description=__doc__,
        epilog="Example: hf-dist-recipes pin --output pinned --torch 2.13.0 --cuda 13.0 && docker build -t job pinned",
    )
    parser.add_argument(
        "--output",
        required=True,
        metavar="DIR",
        help="folder to write requirements.lock and Dockerfile into (created if missing)",
    )
    parser.add_argument("--torch", metavar="X", help="pin this torch release instead of the running one (e.g. 2.13.0)")
    parser.add_argument(
        "--cuda",
        metavar="Y",
        help="CUDA build of --torch: 13.0, 12.6 (or cu126), or cpu (default: the release's build on PyPI)",
    )
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from hf_dist_recipes.core.findings import EXIT_FOUND_PROBLEMS
    from hf_dist_recipes.doctor.pin import RefusedPair, pin

    try:
        result = pin(args.output, args.torch, args.cuda)
    except RefusedPair as refused:
        print(f"hf-dist-recipes pin: error: {refused}", file=sys.stderr)
        return EXIT_FOUND_PROBLEMS
    data = result.to_dict()
    print(json.dumps(data, indent=2) if args.json else render(data))
    return 0


def render(data: dict) -> str:
    lines = [
        f"torch {data['torch']} ({data['torch_build']}), CUDA {data['cuda'] or 'none'}, NCCL {data['nccl'] or 'none'}, "
        f"Python {data['python']}: {data['packages']} packages",
        f"wrote {data['lock']}",
        f"wrote {data['dockerfile']} (FROM {data['image']}; wheels from {data['index_url']})",
        *data["notes"],
    ]
    return "\n".join(lines)
