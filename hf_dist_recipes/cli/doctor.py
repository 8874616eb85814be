"""`hf-dist-recipes doctor [--json] [--strict] [--lock FILE]`: is this environment sound for distributed training?
(DESCRIPTION: what --help says.) The probe is doctor/probe.py, the checks doctor/doctor_checks.py and the
known-bad combinations doctor/rules.py; --json follows doctor/doctor.py REPORT_SCHEMA."""

from __future__ import annotations

import argparse
import os

NAME_WIDTH = 20
DESCRIPTION = """Is this environment sound for distributed training?

Probes the environment (versions, torch's CUDA and NCCL, the NCCL installed, driver, GPUs, peer access and NVLink,
InfiniBand ports, /dev/shm, NCCL_/TORCH_/CUDA_ variables) and prints one line per check, ok / warning / error, with
the fix under each finding: the doctor's checks and every known-bad combination (with its source) that matches.
--lock FILE adds an error for each package whose installed version differs from a lock written by
`hf-dist-recipes pin`. --report prints the same as a block to paste into a GitHub issue.

An error exits 1; a warning exits 0, or 1 with --strict. --json prints {"facts": ..., "checks": [...],
"exit_code": N} (its JSON schema is on the doctor page of the documentation). Imports no DeepSpeed (its version
comes from the package metadata): answers in a few seconds."""
NOTICE = "notice"
RULE_PREFIX = "rule "  # the doctor's name for a known-bad combination's row (doctor/doctor.py)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check this environment for distributed training: versions, driver, NCCL, GPUs, links, "
        "known-bad combinations",
        description=DESCRIPTION,
        epilog="Example: hf-dist-recipes doctor --strict --lock pinned/requirements.lock",
    )
    parser.add_argument("--json", action="store_true", help="print facts, checks and exit code as JSON")
    parser.add_argument(
        "--report",
        action="store_true",
        help="print a block to paste into a GitHub issue (as `accelerate env`): versions, GPUs, the known issues "
        "that apply and the checks that did not pass",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 on a warning too (default: only errors fail)")
    parser.add_argument(
        "--lock",
        metavar="FILE",
        help="a lock written by `hf-dist-recipes pin`: every package whose installed version differs is an error",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Imported here so that `hf-dist-recipes --help` and the other subcommands do not pay for them.
    from hf_dist_recipes.doctor import doctor
    from hf_dist_recipes.doctor import probe as probe_module

    lock = None
    if args.lock:
        if not os.path.isfile(args.lock):
            raise ValueError(f"--lock {args.lock}: no such file; write one with hf-dist-recipes pin --output DIR")
        from hf_dist_recipes.doctor.lock import read_lock

        lock = read_lock(args.lock)
    from hf_dist_recipes.core.findings import render_json

    report = doctor.run_checks(probe_module.probe(), lock)
    data = report.to_dict(strict=args.strict)
    if args.report:
        from hf_dist_recipes.doctor.report import render_report

        print(render_report(data))
    else:
        print(render_json(data) if args.json else render(data))
    return data["exit_code"]


def render(data: dict) -> str:
    """The table: status, check, detail, and the fix (with its source) under every finding."""
    from hf_dist_recipes.core.findings import count_statuses, render_table

    facts, checks = data["facts"], data["checks"]
    title = (
        f"hf-dist-recipes doctor on {facts['host']} ({facts['arch']}, Python {facts['python']}"
        + (", in a container" if facts["in_container"] else "")
        + ")"
    )
    # A known issue that applies at "info" severity passes (status ok) but is not a check that found nothing: it
    # shows as a notice, with its advice.
    rows = [dict(c, mark=NOTICE) if c["name"].startswith(RULE_PREFIX) and c["status"] == "ok" else c for c in checks]
    notices = sum(r.get("mark") == NOTICE for r in rows)
    counts = count_statuses(c["status"] for c in checks)
    summary = (
        f"{counts['ok'] - notices} ok, {notices} notice(s), {counts['warning']} warning(s), {counts['error']} "
        f"error(s); exit {data['exit_code']}"
    )
    # A long rule id overflows its own row rather than widen every row.
    return render_table(rows, title=title, summary=summary, max_name_width=NAME_WIDTH)
