"""`hf-dist-recipes logs summarize LOGDIR`: every rank's TensorBoard logs folded into one view.

Reads the event files of each `rank<N>` directory under LOGDIR (ours, or any SummaryWriter's), and writes to --out
(default LOGDIR/summary): `aggregate/`, a TensorBoard run with the mean, min, max and spread across ranks of every
tag at every step (`tensorboard --logdir OUT`), and `report.md` with its plots. Prints the stragglers (ranks slower
than the median step time) and the divergences (values that must agree across ranks and do not, with the first
step where they part). A truncated or damaged event file is reported by name; the rest is still summarized."""

from __future__ import annotations

import argparse
import json
import os
import sys

from hf_dist_recipes.core.user_values import writable_dir


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "logs",
        help="summarize every rank's TensorBoard logs: aggregate run, stragglers, divergence, report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    summarize = sub.add_parser(
        "summarize",
        help="aggregate the rank<N> runs under LOGDIR",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: hf-dist-recipes logs summarize runs/job/logs --tp 2 && tensorboard --logdir "
        "runs/job/logs/summary",
    )
    summarize.add_argument("logdir", help="the run's logging_dir, holding rank<N> directories of event files")
    summarize.add_argument("--out", help="where to write the aggregate run and the report (default: LOGDIR/summary)")
    summarize.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel size: the per-rank loss must agree inside each "
        "TP group of consecutive ranks (default: not checked)",
    )
    summarize.add_argument(
        "--threshold",
        type=float,
        default=0.2,
        help="a straggler is slower than the median step time by more than this fraction (default: %(default)s)",
    )
    summarize.add_argument("--workers", type=int, help="processes reading ranks in parallel (default: one per CPU)")
    summarize.add_argument("--no-report", action="store_true", help="skip report.md and its plots")
    summarize.add_argument("--json", action="store_true", help="print the result as JSON")
    summarize.set_defaults(run=run_summarize)


def run_summarize(args: argparse.Namespace) -> int:
    from hf_dist_recipes.logs.aggregate import summarize_logs, write_aggregate_run

    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    out = args.out or os.path.join(args.logdir, "summary")
    # Before the logs are read (seconds to minutes): a folder that cannot be written is one line at once.
    writable_dir(out, "--out", "runs/job/summary")
    summary = summarize_logs(args.logdir, tp=args.tp, workers=args.workers, straggler_threshold=args.threshold)
    data = summary.to_dict()
    data["aggregate_run"] = write_aggregate_run(summary, os.path.join(out, "aggregate"))
    if not args.no_report:
        from hf_dist_recipes.logs.report import write_report

        data["report"] = write_report(summary, out)
    for line in summary.warnings:
        print(f"warning: {line}", file=sys.stderr)
    print(json.dumps(data, indent=2) if args.json else render(data))
    return 0


def render(data: dict) -> str:
    lines = [
        f"{data['logdir']}: {data['ranks']} rank(s), {data['files']} file(s), {data['records']:,} records, "
        f"{len(data['tags'])} tag(s) in {data['seconds']:.2f} s"
    ]
    if data["stragglers"]:
        lines.append("stragglers (step time vs the median of all ranks):")
        for s in data["stragglers"]:
            host = f" on {s['host']}" if s["host"] else ""
            lines.append(f"  rank {s['rank']}{host}: {100 * s['slower_by']:.0f}% slower from step {s['from_step']}")
    else:
        lines.append("stragglers: none")
    if data["divergences"]:
        lines.append("divergence (values that must agree across ranks):")
        for d in data["divergences"]:
            vals = ", ".join(f"rank {r}: {v:.6g}" for r, v in d["values"].items())
            lines.append(
                f"  {d['tag']}: rank(s) {', '.join(map(str, d['ranks']))} part at step {d['first_step']} ({vals})"
            )
    else:
        lines.append("divergence: none")
    run = data["aggregate_run"]
    lines.append(f"aggregate run: {run}  (view it: tensorboard --logdir {os.path.dirname(run)})")
    if data.get("report"):
        lines.append(f"report: {data['report']}")
    return "\n".join(lines)
