"""`hf-dist-recipes config`: plan ZeRO-3 + tensor + expert parallelism, and write, check and size the configs.

generate   write an accelerate YAML and its DeepSpeed JSON (or an FSDP2 + TP YAML) for a plan
validate   lint existing DeepSpeed JSON / accelerate YAML files against the known traps and upstream's own
           config classes
estimate   per-rank memory of a plan as a table; --suggest finds the smallest TP/EP/offload that fits
list       the configs shipped with the package; copy writes one into a directory, path prints a launchable one's
           path
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from hf_dist_recipes.cli.config_estimate import run_estimate
from hf_dist_recipes.cli.plan_inputs import (
    check_gpu_memory,
    deepspeed_logs_to_stderr,
    hardware_and_sources,
    hardware_flags,
    profile_flag,
)
from hf_dist_recipes.core.findings import EXIT_FOUND_PROBLEMS, OK, WARNING, exit_code, strict_exit
from hf_dist_recipes.planning.generate import (
    add_memory_limit_flags,
    add_output_flags,
    add_plan_flags,
    check_host_memory,
    generate_from_args,
    memory_limits,
    model_from,
    plan_from,
)
from hf_dist_recipes.planning.launch_script_args import add_launcher_flags, check_launcher_options, script_from_args
from hf_dist_recipes.planning.plan import ParallelPlan


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "config",
        help="plan, generate, validate and size ZeRO-3 + TP + EP configs",
        description=__doc__,
    )
    sub = parser.add_subparsers(dest="config_command", metavar="SUBCOMMAND", required=True)

    gen = sub.add_parser(
        "generate",
        help="write accelerate YAML + DeepSpeed JSON for a plan",
        description="Check a plan, then write NAME.yaml (accelerate) and deepspeed/NAME.json. The JSON "
        "never holds train_batch_size, and gives DeepSeek models explicit TP layer specs "
        "and an expert_parallel section. A plan that cannot be built (a TP that does not divide the model, an "
        "unknown model) exits 2 with the fix; a GPU plan that does not fit the GPU memory by our estimate "
        "(--gpu-memory or --hardware, one of them required then) writes nothing and exits 1, unless --force.",
        epilog="Example: hf-dist-recipes config generate --model deepseek-v3 --nodes 8 --gpus-per-node 8 --ep 16 "
        "--micro-batch 3 --grad-accum 5 --offload-optimizer --offload-params --activation-checkpointing "
        "--gpu-memory 80 --main-process-ip 10.0.0.1 --output my_configs",
    )
    add_plan_flags(gen)
    add_output_flags(gen)
    add_launcher_flags(gen)
    profile_flag(gen.add_argument_group("step estimate (with --model: the plan's step time on measured rates)"))
    gen.add_argument("--json", action="store_true", help="print what was written as JSON")
    gen.add_argument("--strict", action="store_true", help="exit 1 when the files were written with warnings")
    gen.set_defaults(run=run_generate)

    val = sub.add_parser(
        "validate",
        help="lint DeepSpeed JSON / accelerate YAML files",
        description="Lint files against the known traps, then parse them with accelerate's and "
        "DeepSpeed's own config classes. Exit 0: clean or warnings only; 1: errors (warnings too with --strict); "
        "2: a file is missing or unreadable.",
    )
    val.add_argument("files", nargs="+", metavar="FILE")
    val.add_argument(
        "--gpu-memory",
        type=float,
        help="GiB per GPU: a YAML whose plan does not fit it by our estimate is an error (exit 1); over 90%% of it, "
        "a warning",
    )
    val.add_argument(
        "--host-memory",
        type=float,
        metavar="GIB",
        help="GiB of host memory per node: a YAML whose plan needs more at the peak of a resume (offloaded states "
        "plus the optimizer files being loaded) is an error (exit 1)",
    )
    val.add_argument("--model", help="the model, for files without the plan config generate records")
    # The activation side of the --gpu-memory estimate: the files record it only when config generate wrote them.
    val.add_argument("--seq-len", type=int, help="with --gpu-memory: tokens per sequence (default: recorded, or 4096)")
    val.add_argument("--micro-batch", type=int, help="with --gpu-memory: sequences per GPU (default: the JSON's, or 1)")
    val.add_argument(
        "--sp",
        type=int,
        help="with --gpu-memory: the Ulysses sequence-parallel degree (default: the YAML's parallelism_config, or 1)",
    )
    val.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        help="with --gpu-memory: assume layers are (not) recomputed (default: recorded, or not)",
    )
    val.add_argument("--json", action="store_true", help="print the findings as JSON")
    val.add_argument("--strict", action="store_true", help="exit 1 on a warning too (default: only errors fail)")
    val.set_defaults(run=run_validate)

    est = sub.add_parser(
        "estimate",
        help="per-rank memory table for a plan (or --suggest one)",
        description="Per-rank GiB of parameters, gradients, optimizer states, the layer ZeRO-3 "
        "gathers and activations (model states exact, activations estimated), and whether it fits --gpu-memory; "
        "then the bytes each rank sends per step inside the node and across nodes, and an "
        "estimated step time on the given hardware (the traffic model is stated on the config page of the "
        "documentation). Exit 1 when the plan does not fit --gpu-memory, or --suggest finds none that does.",
        epilog="Example: hf-dist-recipes config estimate --model deepseek-v3 --nodes 8 "
        "--gpu-memory 80 --activation-checkpointing --suggest",
    )
    add_plan_flags(est)
    est.add_argument("--gpu-memory", type=float, help="memory of one GPU in GiB (needed for fits? and --suggest)")
    est.add_argument(
        "--suggest",
        action="store_true",
        help="try TP/EP/offload and pick the fastest plan that fits (by the stated traffic model)",
    )
    est.add_argument(
        "--all",
        action="store_true",
        help="with --suggest: show every candidate (each micro batch tried), not one row per layout and one or two "
        "EPs per TP",
    )
    batch = est.add_mutually_exclusive_group()
    batch.add_argument(
        "--global-batch",
        type=int,
        metavar="SEQUENCES",
        help="with --suggest: the most sequences per optimizer step; micro batch and accumulation are searched "
        "within it (default: 4M tokens, 4,194,304 / --seq-len: the Llama 3 report's initial batch; DeepSeek-V3's "
        "report ramps 3,072 -> 15,360 sequences of 4,096)",
    )
    batch.add_argument("--global-batch-tokens", type=int, metavar="TOKENS", help="the same target in tokens")
    est.add_argument("--json", action="store_true", help="print the estimates as JSON")
    est.add_argument("--strict", action="store_true", help="exit 1 on a warning too (an offload or profile warning)")
    add_memory_limit_flags(est.add_argument_group("memory limits (fits?, --suggest)"))
    hardware_flags(est)
    est.set_defaults(run=run_estimate)

    from hf_dist_recipes.cli import config_files

    config_files.register(sub)  # list, copy, path: the shipped configs


def run_generate(args: argparse.Namespace) -> int:
    argv = args.argv[args.argv.index("generate") + 1 :] if "generate" in args.argv else None
    plan = plan_from(args)
    if args.model and plan.device == "cuda" and plan.engine == "deepspeed" and not (args.gpu_memory or args.hardware):
        model_from(args.model, required=False)  # a model that cannot be read is named first
        # The fit check needs the GPU's memory; an assumed one (the largest GPU known) passed plans that do not fit
        # an 80 GiB card without a word.
        raise ValueError(
            f"a GPU plan for --model {args.model} is checked against the GPU's memory: pass --gpu-memory GIB (e.g. "
            "--gpu-memory 80 for an H100 80GB) or --hardware NAME (e.g. --hardware h100)"
        )
    # The launch script's options are checked with the plan's, before any file is written.
    check_launcher_options(
        plan,
        args.launcher,
        log_dir=args.log_dir,
        socket_ifname=args.socket_ifname,
        ib_hca=args.ib_hca,
        time_limit=args.time,
        env_setup=args.env_setup,
        signal_lead=args.signal_lead,
    )
    rates = hardware_and_sources(args, plan) if args.profile else None  # a bad profile stops before any file
    check_gpu_memory(args.gpu_memory)  # a bad value is a usage error (2), not a plan that does not fit
    problem = None if args.force else _fit_problem(args, plan)
    if problem:  # the command did its job, and found the plan does not fit: exit 1, not the usage error's 2
        if args.json:
            print(json.dumps({"written": False, "problem": problem}, indent=2))
        print(f"hf-dist-recipes config generate: {problem}; or pass --force to write the files anyway", file=sys.stderr)
        return EXIT_FOUND_PROBLEMS
    if args.launcher:  # the script names the files by absolute paths: sbatch runs it from a spool directory
        args.output = os.path.abspath(os.path.expanduser(args.output))
    # DeepSpeed is imported only once every input was checked (its import notice would make a refusal two lines);
    # its logger then binds stderr, keeping --json output clean.
    with contextlib.redirect_stdout(sys.stderr):
        result = generate_from_args(args, argv, address_from_launcher=args.launcher is not None)
    script = script_from_args(args, result, argv) if args.launcher else None
    step = _profile_step(args, plan, rates) if rates else None
    code = exit_code([WARNING if result.warnings else OK], strict_exit(args.strict))
    if args.json:
        extra = {"step_estimate": step} if rates else {}
        print(json.dumps({**result.as_dict(), "launch_script": str(script) if script else None, **extra}, indent=2))
        return code
    for w in result.warnings:
        print(f"warning: {w}")
    print(f"wrote {result.yaml_file}" + (f" and {result.deepspeed_file}" if result.deepspeed_file else ""))
    if script:
        print(f"wrote {script}; submit: sbatch {script} train.py [ARGS]")
    print(
        f"  world {result.plan.world_size}, data-parallel {result.plan.dp_size}, TP {result.plan.tp}, "
        f"EP {result.plan.ep}"
        + (f", SP {result.plan.sp} ({result.plan.tokens_per_rank} tokens per rank)" if result.plan.sp > 1 else "")
        + f"; launch: accelerate launch --config_file {result.yaml_file} train.py"
    )
    if step:
        print(f"step estimate on --profile {args.profile}'s rates: {step['describe']}")
        for line in step["rate_lines"] + [f"warning: {w}" for w in step["warnings"]]:
            print(f"  {line}")
    return code


def _fit_problem(args: argparse.Namespace, plan: ParallelPlan) -> str | None:
    """Why the plan does not fit its GPUs or hosts by our estimate (None: it fits, or nothing to check): the check
    generate refuses with, run first so that the refusal exits 1. A model or plan that cannot be built raises
    ValueError (exit 2) as before."""
    from hf_dist_recipes.planning.generate import fit_problem

    if not args.model:
        return None
    model = model_from(args.model, required=False)
    if model is None:
        return None
    plan.validate(model)
    return fit_problem(plan, model, args.model, args.gpu_memory, args.hardware, limits=memory_limits(args))


def _profile_step(args: argparse.Namespace, plan: ParallelPlan, rates) -> dict | None:
    """With --profile and --model (a DeepSpeed plan): the plan's step estimate on the profile's rates, its rate
    sources and the profile's warnings, as JSON-ready data; None without a model."""
    if not args.model or plan.engine != "deepspeed":
        return None
    from dataclasses import asdict

    from hf_dist_recipes.planning.calibration import render_sources
    from hf_dist_recipes.planning.comm import describe
    from hf_dist_recipes.planning.suggest import evaluate

    hardware, sources, warnings = rates
    c = evaluate(plan, model_from(args.model, required=True), device_gib=args.gpu_memory, hardware=hardware)
    return {
        **c.step.as_dict(),
        "describe": describe(c.step),
        "rates": {f: asdict(s) for f, s in sources.items()},
        "rate_lines": render_sources(sources),
        "warnings": warnings,
    }


def run_validate(args: argparse.Namespace) -> int:
    check_gpu_memory(args.gpu_memory)
    check_host_memory(args.host_memory)
    for flag, value in (("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch), ("--sp", args.sp)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value}; e.g. {flag} 1")
    model_from(args.model, required=False)  # an unknown --model is a usage error even when no file needs it
    from dataclasses import asdict

    from hf_dist_recipes.core.findings import count_statuses, exit_code, render_json, render_table, strict_exit
    from hf_dist_recipes.planning.lint import check_readable, lint_files

    for path in args.files:  # a file that cannot be read: exit 2 in one line; findings in files read: exit 1
        check_readable(path)
    deepspeed_logs_to_stderr()

    assume = {"seq_len": args.seq_len, "micro_batch": args.micro_batch, "sp": args.sp}
    assume["activation_checkpointing"] = args.activation_checkpointing
    findings = lint_files(
        args.files, gpu_memory_gib=args.gpu_memory, model=args.model, assume=assume, host_memory_gib=args.host_memory
    )
    if args.json:
        print(render_json([f.as_dict() for f in findings]))
    else:
        counts = count_statuses(f.status for f in findings)
        summary = f"{len(args.files)} file(s) checked: {counts['error']} error(s), {counts['warning']} warning(s)"
        print(render_table([asdict(f) for f in findings], title=None, summary=summary))
    return exit_code((f.status for f in findings), strict_exit(args.strict))
