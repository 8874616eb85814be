"""`hf-dist-recipes calibrate`: measure the step model's rates on this host and write a profile that `config estimate`,
`--suggest` and `config generate` read with `--profile FILE` (`planning.rate_measurements` measures,
`planning.calibration` is the profile). Builds the profile first, then renders it as text or --json."""

from __future__ import annotations

import argparse
import json
import sys
import time

DESCRIPTION = """Measure, on a machine the job will use, the rates the step-time estimate otherwise assumes, and write
them to a profile (JSON) for `config estimate / generate --profile FILE`:

  CPU Adam       DeepSpeed's DeepSpeedCPUAdam stepping an fp32 partition in --processes processes at once
                 (parameters per second per node); the partition and processes of the plan with --model
  collectives    commbench's ranks on this host (NCCL on GPUs, Gloo on CPU): bus bandwidth inside the node;
                 --commbench FILE reads a commbench --json result instead (one run across nodes: the network)
  GPU only       pinned host <-> device copy bandwidth; bf16 matmul TFLOP/s of one layer of --model

What this host cannot measure (no GPU: copies and matmuls; one host: the network) is written as assumed, and the
estimate keeps the --hardware preset's value for it."""


def register(subparsers) -> None:
    from hf_dist_recipes.planning.generate import add_plan_flags
    from hf_dist_recipes.planning.rate_measurements import DEFAULT_PARTITION_PARAMS, DEFAULT_STEPS

    parser = subparsers.add_parser(
        "calibrate",
        help="measure CPU Adam, collective, copy and matmul rates here; write a profile for config --profile",
        description=DESCRIPTION,
        epilog="Example: hf-dist-recipes calibrate --output profile.json && hf-dist-recipes config estimate "
        "--model deepseek-v3 --nodes 8 --gpu-memory 80 --suggest --profile profile.json",
    )
    parser.add_argument("--output", required=True, metavar="FILE", help="the profile to write (JSON)")
    parser.add_argument(
        "--partition-params",
        type=int,
        help=f"fp32 parameters each CPU Adam process steps (default: the plan's optimizer partition with --model, "
        f"else {DEFAULT_PARTITION_PARAMS:,})",
    )
    parser.add_argument(
        "--processes",
        type=int,
        help="CPU Adam processes stepping at once, one per rank of a node (default: --gpus-per-node with --model, "
        "else this host's GPUs, else 1)",
    )
    parser.add_argument(
        "--threads-per-process",
        type=int,
        help="OpenMP threads per CPU Adam process (default: OMP_NUM_THREADS, else 1: what accelerate launch gives "
        "each GPU rank)",
    )
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="timed CPU Adam steps (%(default)s)")
    parser.add_argument(
        "--commbench",
        metavar="FILE",
        help="a `commbench --json` result to read instead of launching ranks here (run across nodes: the network)",
    )
    parser.add_argument(
        "--no-collectives", action="store_true", help="measure no collectives (intra-node bandwidth stays assumed)"
    )
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")
    add_plan_flags(
        parser.add_argument_group("plan (optional, with --model: sizes the CPU Adam partition and processes)")
    )
    parser.set_defaults(run=run)


def settings_from(args: argparse.Namespace):
    """The CalibrationSettings of the parsed flags (ValueError naming the flag to fix)."""
    from hf_dist_recipes.comm.backend import cuda_device_count
    from hf_dist_recipes.planning.rate_measurements import (
        DEFAULT_PARTITION_PARAMS,
        MAX_MEASURED_PARAMS,
        CalibrationSettings,
        check_settings,
        default_threads,
    )

    context: dict = {}
    plan_partition = model = None
    tokens, ep = 4096, 1
    processes = args.processes
    if args.model:
        from hf_dist_recipes.planning.elements import rank_elements
        from hf_dist_recipes.planning.generate import model_from, plan_from

        plan = plan_from(args)
        model = model_from(args.model, required=True)
        plan.validate(model)
        plan_partition = rank_elements(plan, model).optimizer
        processes = plan.procs_per_node if processes is None else processes
        tokens, ep = plan.micro_batch * plan.seq_len, plan.ep
        context = {"model": model.name, "plan": plan.as_dict()}
    if processes is None:
        processes = cuda_device_count() or 1
    partition = args.partition_params
    if partition is None:
        partition = min(plan_partition, MAX_MEASURED_PARAMS) if plan_partition else DEFAULT_PARTITION_PARAMS
    settings = CalibrationSettings(
        partition_params=partition,
        processes=processes,
        threads=args.threads_per_process if args.threads_per_process is not None else default_threads(),
        steps=args.steps,
        plan_partition_params=plan_partition,
        commbench_file=args.commbench,
        skip_collectives=args.no_collectives,
        model=model,
        tokens=tokens,
        ep=ep,
        context=context,
    )
    return check_settings(settings)


def render(profile, path: str, wall_s: float) -> str:
    """The profile as a table of rates, then where it was written and how to use it."""
    rows = []
    for key, rate in profile.rates.items():
        value = "assumed" if rate.assumed else f"{rate.value:.4g} {rate.unit}"
        rows.append(f"  {key:<22} {value:<26} {rate.how}")
    lines = [f"calibration of {profile.host} ({profile.device}), {profile.created}, {wall_s:.0f} s", *rows]
    lines += [f"note: {n}" for n in profile.notes]
    lines.append(
        f"wrote {path}; measured: {', '.join(profile.measured()) or 'nothing'}; assumed (the --hardware preset's "
        f"value stays): {', '.join(profile.assumed()) or 'nothing'}"
    )
    lines.append(f"use it: hf-dist-recipes config estimate --model MODEL ... --profile {path}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from hf_dist_recipes.planning.calibration import check_output, write_profile
    from hf_dist_recipes.planning.rate_measurements import calibrate

    check_output(args.output)
    settings = settings_from(args)
    if args.commbench:  # a bad file is named before minutes of measuring
        from hf_dist_recipes.core.jsonfile import read_json_object

        read_json_object(args.commbench, "commbench result", "write one with hf-dist-recipes commbench --json")
    start = time.perf_counter()

    def progress(line: str) -> None:
        print(f"calibrate [{time.perf_counter() - start:5.1f} s]: {line}", file=sys.stderr, flush=True)

    try:
        profile = calibrate(settings, progress)
    except RuntimeError as err:
        print(f"hf-dist-recipes calibrate: {err}", file=sys.stderr)
        return 1
    path = write_profile(profile, args.output)
    wall = time.perf_counter() - start
    print(json.dumps(profile.as_dict(), indent=2) if args.json else render(profile, str(path), wall))
    return 0
