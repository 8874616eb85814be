"""`hf-dist-recipes commbench`: measure all_reduce, all_gather and reduce_scatter on N local processes with the real
backend (NCCL on GPUs, Gloo on CPU), per message size, with the nccl-tests definitions of algbw and busbw; then each
ring link alone, flagging links and ranks far below the median.

`--backend gloo` on a GPU host runs Gloo AND NCCL and shows them side by side: what a training that fell back to
Gloo pays on each collective. Inside your own launch (other hosts too):
`torchrun ... -m hf_dist_recipes.comm.commbench`."""

from __future__ import annotations

import argparse
import json
import sys

from hf_dist_recipes.comm.commbench import (
    DEFAULT_FRACTION,
    DEFAULT_ITERS,
    DEFAULT_LINK_SIZE,
    DEFAULT_SIZES,
    DEFAULT_WARMUP,
    BenchSettings,
)
from hf_dist_recipes.core.sizes import parse_size, parse_sizes


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "commbench",
        help="measure collective bandwidth (all_reduce, all_gather, reduce_scatter) and ring links",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: hf-dist-recipes commbench --sizes 1M,64M,256M --iters 50\n"
        "On a GPU host: hf-dist-recipes commbench --backend gloo   (Gloo next to NCCL, with the ratio)",
    )
    parser.add_argument("--num-processes", type=int, help="local processes (default: one per visible GPU, else 2)")
    parser.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        help="default: NCCL with GPUs, Gloo without; gloo on a GPU host: both, side by side",
    )
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help="message sizes, comma-separated; 1K = 1KiB = 1024 bytes, 1KB = 1000, and so on (default: %(default)s)",
    )
    parser.add_argument(
        "--iters", type=int, default=DEFAULT_ITERS, help="timed iterations per op and size (default: %(default)s)"
    )
    parser.add_argument(
        "--warmup", type=int, default=DEFAULT_WARMUP, help="untimed iterations first (default: %(default)s)"
    )
    parser.add_argument(
        "--link-size", default=DEFAULT_LINK_SIZE, help="bytes per ring-link send (default: %(default)s)"
    )
    parser.add_argument(
        "--fraction",
        type=float,
        default=DEFAULT_FRACTION,
        help="flag a link or rank below this fraction of the median (default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hf_dist_recipes.comm.commbench_launch import plan_commbench, run_commbench
    from hf_dist_recipes.comm.commbench_render import render

    settings = BenchSettings(
        sizes=parse_sizes(args.sizes, "--sizes"),
        iters=args.iters,
        warmup=args.warmup,
        link_bytes=parse_size(args.link_size, "--link-size"),
        fraction=args.fraction,
    )
    plan = plan_commbench(settings, num_processes=args.num_processes, backend=args.backend)
    try:
        result = run_commbench(plan)
    except RuntimeError as err:
        print(f"hf-dist-recipes commbench: {err}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0
