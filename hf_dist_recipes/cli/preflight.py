"""`hf-dist-recipes preflight --config-file X.yaml`: about a minute with the real launch config, before the big job.

Launches the preflight's ranks through `accelerate launch` with your YAML (and its DeepSpeed JSON: the
same ZeRO stage, TP and EP degrees, precision, machines); on machine N of a multi-machine job run the same command
with --machine-rank N, as with accelerate launch. Seven checks, one progress line each:
  1 environment    the doctor on every rank; the ranks' environments agree (names the odd host/rank)
  2 backend        the live process group is the right one for the host (NCCL on GPUs)
  3 communication  a short commbench (all-reduce / all-gather at a few sizes), slow ranks or links flagged
  4 plan           the plan against the model (--model, the model recorded in the JSON, else the demo's tiny
                   DeepSeek-V3-style model) and its memory per rank against the device's
  5 training       N steps with the real plan: loss falls, clipping, the recipe's schedule, ranks agree
  6 failure_paths  a NaN on one rank is skipped everywhere; save at k + resume reproduces step k + 1
  7 logs           every rank's TensorBoard run was written and `logs summarize` reads it
A plan that cannot work (unreadable files, TP or EP not dividing the processes or the model) stops here, before
anything is launched. A check that did not finish is an error; warnings exit 0 unless --strict. A dead or hung
rank ends the preflight within --peer-timeout-s (60 s), naming it; --timeout-s bounds the whole launch. The ranks'
output goes to <output>/preflight_launch.log; the report to <output>/preflight_report.json.
"""

from __future__ import annotations

import argparse
import contextlib
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "preflight",
        help="prove a launch config on the machines it will run on: environment, backend, "
        "communication, plan, training, failure paths, logs",
        description=__doc__,
        epilog="Example: hf-dist-recipes preflight --config-file accelerate_configs/cpu_zero3_2proc.yaml",
    )
    parser.add_argument("--config-file", required=True, help="the accelerate YAML the job will be launched with")
    parser.add_argument(
        "--model",
        help="a template name (hf-dist-recipes config estimate --help lists them) or a "
        "local directory / config.json (default: the model the JSON records, else the demo's)",
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of the training check (default 20)")
    parser.add_argument("--seed", type=int, default=42, help="seed of the training checks (default 42)")
    parser.add_argument(
        "--output",
        "--output-dir",
        dest="output_dir",
        metavar="DIR",
        default="runs/preflight",
        help="where the report, the launch log and the training checks' runs go (default runs/preflight)",
    )
    parser.add_argument("--machine-rank", type=int, help="this machine's rank in a multi-machine launch")
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="hard bound on the whole launch in seconds (default 600: a first run builds DeepSpeed's ops)",
    )
    parser.add_argument(
        "--peer-timeout-s",
        type=float,
        default=60.0,
        help="a rank whose heartbeat stops this long "
        "(dead, stopped, host down) ends the preflight, named (default 60, at least 5)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON (progress goes to stderr)")
    parser.add_argument("--strict", action="store_true", help="exit 1 on a warning too (default: only errors fail)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hf_dist_recipes.preflight.launch import plan_preflight, run_preflight

    if args.timeout_s <= 0:
        raise ValueError(f"--timeout-s must be > 0 seconds, got {args.timeout_s:g}; e.g. --timeout-s 600")
    out = sys.stderr if args.json else sys.stdout
    # DeepSpeed's import (the lint) logs to stdout; under --json stdout is the report alone.
    with contextlib.redirect_stdout(out):
        plan = plan_preflight(
            args.config_file,
            model=args.model,
            steps=args.steps,
            seed=args.seed,
            output_dir=args.output_dir,
            machine_rank=args.machine_rank,
            peer_timeout_s=args.peer_timeout_s,
        )
    print(
        f"preflight: {plan.config_file}: {plan.world_size} process(es), plan checked against {plan.models.name}; "
        f"launching (log: {plan.output_dir}/preflight_launch.log)",
        file=out,
        flush=True,
    )
    report = run_preflight(plan, timeout_s=args.timeout_s, on_line=lambda line: print(line, file=out, flush=True))
    from hf_dist_recipes.core.findings import exit_code, render_json, strict_exit

    data = report.to_dict()
    data["exit_code"] = exit_code([report.status], strict_exit(args.strict))
    print(render_json(data) if args.json else render(data))
    return data["exit_code"]


def render(data: dict) -> str:
    """One table: each result's status, check and detail, with the fix under every warning and error."""
    from hf_dist_recipes.core.findings import count_statuses, render_table

    hosts = sorted(set(data["hosts"]))
    title = f"hf-dist-recipes preflight of {data['config_file']}: {data['world_size']} rank(s)" + (
        f" on {', '.join(hosts)}" if hosts else ""
    )
    counts = count_statuses(data["checks"].values())
    summary = (
        f"{counts['ok']} check(s) ok, {counts['warning']} with warnings, {counts['error']} with errors, in "
        f"{data['elapsed_s']:.0f} s; exit {data['exit_code']}"
    )
    return render_table(data["results"], title=title, summary=summary)
