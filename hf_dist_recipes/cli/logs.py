"""`hf-dist-recipes logs summarize` and `logs hang`: every rank's logs read back into one view (SUMMARIZE, HANG: the
descriptions each command's --help prints)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from hf_dist_recipes.core.user_values import writable_dir

SUMMARIZE = """Every rank's TensorBoard logs folded into one view.

Reads the event files of each rank<N> directory under LOGDIR (ours, or any SummaryWriter's), and writes to --output
(default LOGDIR/summary): aggregate/, a TensorBoard run with the mean, min, max and spread across ranks of every tag
at every step (tensorboard --logdir OUTPUT), and report.md with its plots. Prints the stragglers (ranks slower than
the median step time) and the divergences (values that must agree across ranks and do not, with the first step where
they part). A truncated or damaged event file is reported by name; the rest is still summarized.

A divergence is a problem found (exit 1); stragglers and unreadable files are warnings (exit 1 with --strict)."""

HANG = """Why a job hung.

Reads the flight-recorder dumps and stacks every rank wrote into <output_dir>/flight_recorder/ (when the watchdog
named a lost rank, when a collective timed out, or on SIGUSR1) and prints where the ranks part: the collective
(group, sequence id, op, sizes), which rank called what from which line, the ranks that never arrived, and each
rank's stack top. Exit 0 when the dumps agree, 1 when ranks are named (a desync, a rank lost), 2 when DIR holds no
dumps. --json prints the same as JSON."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "logs",
        help="every rank's logs: summarize (aggregate run, stragglers, divergence, report), hang (why a job hung)",
        description=__doc__,
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    summarize = sub.add_parser(
        "summarize",
        help="aggregate the rank<N> runs under LOGDIR",
        description=SUMMARIZE,
        epilog="Example: hf-dist-recipes logs summarize runs/job/logs --tp 2 && tensorboard --logdir "
        "runs/job/logs/summary",
    )
    summarize.add_argument("logdir", help="the run's logging_dir, holding rank<N> directories of event files")
    summarize.add_argument(
        "--output",
        "--out",
        dest="out",
        metavar="DIR",
        help="where to write the aggregate run and the report (default: LOGDIR/summary)",
    )
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
    summarize.add_argument(
        "--strict", action="store_true", help="exit 1 on a warning too: a straggler, a file that could not be read"
    )
    summarize.set_defaults(run=run_summarize)
    hang = sub.add_parser(
        "hang",
        help="why a job hung: which rank, which collective, which line (from the ranks' hang dumps)",
        description=HANG,
        epilog="Example: hf-dist-recipes logs hang runs/job  (the output_dir; the logging dir works too)",
    )
    hang.add_argument("dir", help="the job's output_dir or logging_dir, or its flight_recorder/ folder")
    hang.add_argument(
        "--world-size",
        type=int,
        help="the job's number of ranks, when the dumps may not show it (default: read from the dumps)",
    )
    hang.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    hang.set_defaults(run=run_hang)


def run_summarize(args: argparse.Namespace) -> int:
    from hf_dist_recipes.logs.aggregate import summarize_logs, write_aggregate_run

    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    out = args.out or os.path.join(args.logdir, "summary")
    # Before the logs are read (seconds to minutes): a folder that cannot be written is one line at once.
    writable_dir(out, "--output", "runs/job/summary")
    summary = summarize_logs(args.logdir, tp=args.tp, workers=args.workers, straggler_threshold=args.threshold)
    data = summary.to_dict()
    data["aggregate_run"] = write_aggregate_run(summary, os.path.join(out, "aggregate"))
    if not args.no_report:
        from hf_dist_recipes.logs.report import plots_unavailable, write_report

        data["report"] = write_report(summary, out)
        data["report_plots_missing"] = plots_unavailable()
        if data["report_plots_missing"]:
            data["warnings"].append(f"report.md has {data['report_plots_missing']}")
    for line in data["warnings"]:
        print(f"warning: {line}", file=sys.stderr)
    print(json.dumps(data, indent=2) if args.json else render(data))
    return summarize_exit_code(data, strict=args.strict)


def summarize_exit_code(data: dict, *, strict: bool) -> int:
    """1 when values that must agree across ranks diverge; stragglers and damaged files are warnings (1 under
    --strict); else 0."""
    from hf_dist_recipes.core.findings import ERROR, OK, WARNING, exit_code, strict_exit

    statuses = [ERROR if data["divergences"] else OK, WARNING if data["stragglers"] or data["warnings"] else OK]
    return exit_code(statuses, strict_exit(strict))


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


def run_hang(args: argparse.Namespace) -> int:
    from hf_dist_recipes.comm.hang_report import diagnose

    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    diagnosis = diagnose(args.dir, world_size=args.world_size)
    data = diagnosis.to_dict()
    print(json.dumps(data, indent=2) if args.json else render_hang(data))
    return data["exit_code"]


def _at(frame: dict | None) -> str:
    return f"{frame['file']}:{frame['line']} in {frame['function']}" if frame else "?"


def _code(frame: dict | None, pad: str) -> list[str]:
    return [f"{pad}{frame['code']}"] if frame and frame.get("code") else []


def _frames(frame: dict | None, user: dict | None, head: str, user_head: str) -> list[str]:
    """`frame` (the innermost line that is not torch's) with its code, then the user's own frame when it differs."""
    pad = " " * (len(head) - len(head.lstrip()) + 2)
    lines = [f"{head}{_at(frame or user)}", *_code(frame or user, pad)]
    if frame and user and user != frame:
        lines += [f"{user_head}{_at(user)}", *_code(user, pad)]
    return lines


def _call_line(call: dict) -> str:
    return f"{call['op']} #{call['seq']} of group {call['group']} in={call['input_sizes']} out={call['output_sizes']}"


def render_hang(data: dict) -> str:
    """The text form of a `HangDiagnosis.to_dict()`: the verdict, the first divergence rank by rank, then each rank."""
    import time

    mark = "ERROR" if data["status"] == "error" else "ok"
    lines = [f"{data['source']}: {data['world_size']} rank(s)", f"{mark}  {data['summary']}"]
    first = data["first_divergence"]
    if first:
        lines.append(f"first divergence: collective #{first['seq']} of group {first['group']} ({first['kind']})")
        for call in first["calls"]:
            lines.append(f"  rank {call['rank']}: {_call_line(call)}")
            lines += _frames(call["call_site"], call["user_frame"], "      called at ", "      from your code ")
        last = {r["rank"]: r["last_call"] for r in data["ranks"]}
        for rank in first["not_arrived"]:
            call = last.get(rank)
            state = next(r for r in data["ranks"] if r["rank"] == rank)
            if call is None and state["reason"] == "fatal_signal":
                frame = state["user_frame"] or state["stack_top"]
                lines.append(f"  rank {rank}: died ({state['message']}) at {_at(frame)}")
                lines += _code(frame, "        ")
            elif call is None:
                lines.append(f"  rank {rank}: never arrived (no flight-recorder dump)")
            else:
                frame = call["call_site"] or call["user_frame"]
                lines.append(
                    f"  rank {rank}: never arrived; its last collective: #{call['seq']} {call['op']} at {_at(frame)}"
                )
        if first["detail"]:
            lines.append(f"  {first['detail']}")
        if first["waited_s"] is not None:
            lines.append(f"  from the first rank's call to the last dump: {first['waited_s']:.1f} s")
    for other in data["divergences"][1:]:
        lines.append(f"also: collective #{other['seq']} of group {other['group']} ({other['kind']}): {other['detail']}")
    lines.append("ranks:")
    for r in data["ranks"]:
        if not r["has_recorder"] and not r["has_stack"]:
            lines.append(f"  rank {r['rank']}: wrote nothing (lost, killed or frozen before it could dump)")
            continue
        when = time.strftime(" at %H:%M:%S", time.localtime(r["time"])) if r["time"] else ""
        head = f"  rank {r['rank']}" + (f" on {r['host']}" if r["host"] else "")
        said = f": {r['message']}" if r["message"] else ""
        lines.append(f"{head}: {r['reason'] or 'no stack file'}{when}{said}")
        if r["last_call"]:
            frame = r["last_call"]["call_site"] or r["last_call"]["user_frame"]
            lines.append(f"    last collective: {_call_line(r['last_call'])} at {_at(frame)}")
        elif not r["has_recorder"]:
            lines.append("    no flight-recorder dump")
        if r["stack_top"]:
            top = f"    stack top ({r['thread'] or 'main'} thread): "
            lines += _frames(r["stack_top"], r["user_frame"], top, "    your code: ")
    lines += [f"note: {n}" for n in data["notes"]]
    lines.append(f"next: {data['advice']}")
    return "\n".join(lines)
