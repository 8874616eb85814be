"""`hf-dist-recipes config estimate`: a plan's memory per rank, step time and traffic, or with --suggest the fastest
plan that fits. `run_estimate` builds the data (`Estimate`), then renders it as text or JSON; the exit status follows
the fit (`_estimate_exit`). The flags are registered with the other config commands (`cli/config.py`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from hf_dist_recipes.cli.plan_inputs import check_gpu_memory, deepspeed_logs_to_stderr, hardware_and_sources
from hf_dist_recipes.core.findings import ERROR, OK, WARNING, exit_code, strict_exit
from hf_dist_recipes.core.sizes import GIB
from hf_dist_recipes.planning.generate import memory_limits, model_from, plan_from
from hf_dist_recipes.planning.plan import ParallelPlan


def run_estimate(args: argparse.Namespace) -> int:
    check_gpu_memory(args.gpu_memory)
    plan = plan_from(args)
    hardware, rate_sources, profile_notes = hardware_and_sources(args, plan)
    limits = memory_limits(args)
    model = model_from(args.model, required=True)
    if args.suggest and not args.gpu_memory:
        raise ValueError("--suggest needs --gpu-memory (GiB per GPU), e.g. --gpu-memory 80")
    if not args.suggest and (args.global_batch is not None or args.global_batch_tokens is not None):
        raise ValueError(
            "--global-batch is the target --suggest searches within; for a given plan set --micro-batch and "
            "--grad-accum"
        )
    warnings = [] if args.suggest else plan.validate(model)  # --suggest tries its own plans
    deepspeed_logs_to_stderr()  # after every check: its import notice would make a refusal two lines
    from hf_dist_recipes.planning.suggest import (
        evaluate,
        offload_warning,
        suggest,
    )

    target = None
    limited = {k: v for k, v in asdict(limits).items() if k != "host_source"}  # suggest's and evaluate's keywords
    if args.suggest:
        from hf_dist_recipes.planning.suggest import target_sequences

        target = target_sequences(plan.seq_len, sequences=args.global_batch, tokens=args.global_batch_tokens)
        chosen, rows = suggest(plan, model, args.gpu_memory, hardware, target=target, **limited)
    else:
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        chosen, rows = None, [evaluate(plan, model, device_gib=args.gpu_memory, hardware=hardware, **limited)]
    shown = chosen if args.suggest else rows[0]  # the plan the offload warning is about
    offload_warnings = [w for w in [offload_warning(shown) if shown else None] if w] + profile_notes
    from hf_dist_recipes.planning.elements import plan_save_bytes

    save = plan_save_bytes(shown.plan, model) if shown else None  # bytes per checkpoint of that plan
    from hf_dist_recipes.planning.runners_up import runners_up

    close = runners_up(chosen, rows, rate_sources) if chosen else []
    found = Estimate(plan, model, hardware, rate_sources, limits, target, chosen, rows, close, save, offload_warnings)
    if args.json:
        print(json.dumps(_estimate_json(args, found), indent=2))
    else:
        _print_estimate(args, found)
    return _estimate_exit(args, chosen, rows, offload_warnings)


@dataclass
class Estimate:
    """What `config estimate` found, rendered as text or JSON: the plan asked about, the model, the hardware and
    its rates' sources, the memory limits, the --suggest batch target (sequences; None without --suggest), the
    pick (None without --suggest or when nothing fits), the plans evaluated, the runners-up, the checkpoint bytes
    of the plan shown, and the warnings."""

    plan: ParallelPlan
    model: object
    hardware: object
    rate_sources: dict
    limits: object
    target: int | None
    chosen: object
    rows: list
    close: list
    save: object
    warnings: list[str]


def _estimate_json(args: argparse.Namespace, e: Estimate) -> dict:
    from dataclasses import asdict

    from hf_dist_recipes.planning.runners_up import stated_error
    from hf_dist_recipes.planning.suggest import reasons

    return {
        "model": e.model.name,
        "total_params": e.model.total_params,
        "params_by_component": e.model.params_by_component,
        "target_global_batch": e.target,
        "memory_target": e.limits.device_target,
        "routing_imbalance": e.limits.routing_imbalance,
        "host_memory_gib": e.limits.host_gib,
        "chosen": e.chosen.as_dict() if e.chosen else None,
        # The plan asked about's, or the pick's: what each rank's activations hold of a sequence.
        "tokens_per_rank": (e.chosen.plan if e.chosen else e.plan).tokens_per_rank,
        "why": reasons(e.chosen, e.rows) if e.chosen else [],
        "rates": {f: asdict(src) for f, src in e.rate_sources.items()},
        "profile": args.profile,
        "runners_up": [r.as_dict() for r in e.close],
        "runners_up_error": stated_error(e.rate_sources) if args.suggest else None,
        "warnings": e.warnings,
        "checkpoint_bytes": e.save.as_dict() if e.save else None,
        "estimates": [r.as_dict() for r in e.rows],
    }


def _print_estimate(args: argparse.Namespace, e: Estimate) -> None:
    from hf_dist_recipes.parallel.checkpoint_bytes import DEFAULT_DDP_TIMEOUT, render_load
    from hf_dist_recipes.parallel.checkpoint_bytes import render as render_save_bytes
    from hf_dist_recipes.planning.runners_up import stated_error
    from hf_dist_recipes.planning.suggest import compact_rows, reasons, render_candidates

    plan, model, hardware, target, chosen, rows = e.plan, e.model, e.hardware, e.target, e.chosen, e.rows
    close, save, rate_sources, offload_warnings = e.close, e.save, e.rate_sources, e.warnings
    print(
        f"{model.name}: {model.total_params / 1e9:.2f}B parameters; {plan.nodes} x {plan.procs_per_node} "
        f"{plan.device}, seq {plan.seq_len}, "
        + (f"{plan.tokens_per_rank} tokens per rank (SP {plan.sp}), " if plan.sp > 1 else "")
        # the activations column depends on it as much as on the sequence length: say which was assumed
        + ("activation checkpointing, " if plan.activation_checkpointing else "no recomputation, ")
        + (f"loss in chunks of {plan.loss_chunk_tokens} tokens, " if plan.loss_chunk_tokens else "")
        + (f"MLPs in {plan.tiled_mlp_shards} slices, " if plan.tiled_mlp_shards else "")
        + ("" if args.suggest else f"micro batch {plan.micro_batch}, accumulation {plan.grad_accum}, ")
        + f"{plan.precision}, gradients reduced in {plan.grad_reduce_dtype}; GiB per rank, GB sent per rank per "
        f"step, step time on {hardware.name}"
    )
    if args.suggest:
        print(
            f"batch target: {target:,} sequences x {plan.seq_len} = {target * plan.seq_len / 1e6:.1f}M tokens per "
            "step" + ("" if args.global_batch or args.global_batch_tokens else " (default 4M tokens; --global-batch)")
        )
    print(render_candidates(rows if args.all or not args.suggest else compact_rows(rows, chosen), chosen=chosen))
    if args.suggest:
        print("suggested: " + (_describe(chosen.plan, plan) if chosen else _nothing_fits(rows)))
        for line in reasons(chosen, rows) if chosen else []:
            print(f"  {line}")
        if chosen:
            print(
                f"runners-up, {stated_error(rate_sources)}: "
                + ("none" if not close else f"{len(close)}, a measurement decides between them and the pick")
            )
            for r in close:
                print(f"  {r.line()}")
    else:
        from hf_dist_recipes.planning.comm import describe

        print(f"step: {describe(rows[0].step)}")
    if save:
        print(render_save_bytes(save))
        print(render_load(save, DEFAULT_DDP_TIMEOUT))
    from hf_dist_recipes.planning.calibration import render_sources

    print("rates (flag > --profile > --hardware preset):")
    for line in render_sources(rate_sources):
        print(f"  {line}")
    for warning in offload_warnings:
        print(f"warning: {warning}")


def _estimate_exit(args: argparse.Namespace, chosen, rows, warnings: list[str]) -> int:
    """1 when the plan does not fit --gpu-memory (or --suggest found none that does); a warning exits 1 only with
    --strict; else 0. Without --gpu-memory nothing is judged to fit or not."""
    if args.suggest:
        misfit = chosen is None
    else:
        misfit = rows[0].fits is False
    statuses = [ERROR if misfit else OK, WARNING if warnings else OK]
    return exit_code(statuses, strict_exit(args.strict))


def _nothing_fits(rows) -> str:
    from hf_dist_recipes.planning.suggest import host_bound_rows

    host_bound = [r.memory for r in host_bound_rows(rows)]
    if not host_bound:
        return "nothing fits; add nodes or GPU memory"
    least = min(m.host_resume_peak_per_node for m in host_bound) / GIB
    return (
        f"nothing fits; {len(host_bound)} plan(s) fit the GPU but need at least {least:,.0f} GiB of host memory per "
        f"node at a resume, more than {host_bound[0].host_bytes / GIB:,.0f}: add nodes (less offloaded per node) or "
        "GPU memory"
    )


def _describe(plan: ParallelPlan, asked: ParallelPlan) -> str:
    """The flags of the suggested `plan` (for config generate), then its tokens per rank; `asked`: the plan the
    command was given, whose --activation-checkpointing the SP search may have turned on."""
    off = [k for k, on in (("optimizer", plan.offload_optimizer), ("parameters", plan.offload_params)) if on]
    return (
        f"--zero {plan.zero_stage} --tp {plan.tp} --ep {plan.ep}"
        + (f" --sp {plan.sp}" if plan.sp > 1 else "")
        + f" --micro-batch {plan.micro_batch} --grad-accum {plan.grad_accum}"
        + "".join(f" --offload-{'optimizer' if k == 'optimizer' else 'params'}" for k in off)
        + (
            " --activation-checkpointing"
            if plan.activation_checkpointing and not asked.activation_checkpointing
            else ""
        )
        + f" ({plan.tokens_per_rank:,} tokens per rank)"
    )
