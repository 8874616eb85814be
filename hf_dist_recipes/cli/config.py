"""`hf-dist-recipes config`: plan ZeRO-3 + tensor + expert parallelism, and write, check and size the configs.

  generate   write an accelerate YAML and its DeepSpeed JSON (or an FSDP2 + TP YAML) for a plan
  validate   lint existing DeepSpeed JSON / accelerate YAML files against the known traps and upstream's own
             config classes (exit 1 when any error is found)
  estimate   per-rank memory of a plan as a table; --suggest finds the smallest TP/EP/offload that fits
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from hf_dist_recipes.parallel.accelerate_config import DEFAULT_PORT, accelerate_config, render_yaml
from hf_dist_recipes.parallel.plan import ENGINES, PRECISIONS, ParallelPlan


def register(subparsers) -> None:
    parser = subparsers.add_parser("config", help="plan, generate, validate and size ZeRO-3 + TP + EP configs",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="config_command", metavar="SUBCOMMAND", required=True)

    gen = sub.add_parser("generate", help="write accelerate YAML + DeepSpeed JSON for a plan",
                         description="Check a plan, then write NAME.yaml (accelerate) and deepspeed/NAME.json. The JSON "
                                     "never holds train_batch_size, and gives DeepSeek models explicit TP layer specs "
                                     "and an expert_parallel section. Bad plans exit 2 with the fix.",
                         epilog="Example: hf-dist-recipes config generate --model deepseek-v3 --nodes 2 "
                                "--gpus-per-node 8 --zero 3 --tp 2 --ep 8 --output my_configs")
    _plan_flags(gen)
    gen.add_argument("--output", required=True, help="directory for NAME.yaml and deepspeed/NAME.json")
    gen.add_argument("--name", help="file name stem (default: from the plan)")
    gen.add_argument("--auto", action="store_true",
                     help='write "auto" where the Trainer fills values from its arguments (micro batch, '
                          'accumulation, clipping, bf16/fp16): one config for jobs of any batch size')
    gen.add_argument("--main-process-ip", default="127.0.0.1", help="multi-node: rank-0 machine's address")
    gen.add_argument("--main-process-port", type=int, default=DEFAULT_PORT, help="multi-node: rendezvous port")
    gen.add_argument("--json", action="store_true", help="print what was written as JSON")
    gen.set_defaults(run=run_generate)

    val = sub.add_parser("validate", help="lint DeepSpeed JSON / accelerate YAML files",
                         description="Lint files against the known traps, then parse them with accelerate's and "
                                     "DeepSpeed's own config classes. Exit 0: clean or warnings only; 1: errors; "
                                     "2: a file is missing or unreadable.")
    val.add_argument("files", nargs="+", metavar="FILE")
    val.add_argument("--gpu-memory", type=float,
                     help="GiB per GPU: also warn when a YAML's plan does not fit it by our estimate")
    val.add_argument("--model", help="the model, for files without the plan config generate records")
    val.add_argument("--json", action="store_true", help="print the findings as JSON")
    val.set_defaults(run=run_validate)

    est = sub.add_parser("estimate", help="per-rank memory table for a plan (or --suggest one)",
                         description="Per-rank GiB of parameters, gradients, optimizer states, the layer ZeRO-3 "
                                     "gathers and activations (model states exact, activations estimated; see "
                                     "hf_dist_recipes/parallel/memory.py), and whether it fits --gpu-memory; then "
                                     "the bytes each rank sends per step inside the node and across nodes, and an "
                                     "estimated step time on the given hardware (hf_dist_recipes/parallel/comm.py "
                                     "states the model).",
                         epilog="Example: hf-dist-recipes config estimate --model deepseek-v3 --nodes 8 "
                                "--gpu-memory 80 --activation-checkpointing --suggest")
    _plan_flags(est)
    est.add_argument("--gpu-memory", type=float, help="memory of one GPU in GiB (needed for fits? and --suggest)")
    est.add_argument("--suggest", action="store_true",
                     help="try TP/EP/offload and pick the fastest plan that fits (by the stated traffic model)")
    est.add_argument("--all", action="store_true", help="with --suggest: show every candidate, not one or two EPs per TP")
    est.add_argument("--json", action="store_true", help="print the estimates as JSON")
    _hardware_flags(est)
    est.set_defaults(run=run_estimate)


def _deepspeed_logs_to_stderr() -> None:
    """Import DeepSpeed with stdout pointed at stderr: its logger binds the stream it sees at import time and
    prints an accelerator notice, which would otherwise corrupt --json output."""
    import contextlib

    if "deepspeed" not in sys.modules:
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401


def _plan_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="family template (e.g. deepseek-v3, llama-3.1-8b) or a config.json path/dir")
    parser.add_argument("--nodes", type=int, default=1, help="machines (%(default)s)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="processes per machine (%(default)s)")
    parser.add_argument("--cpu", action="store_true", help="CPU processes with Gloo instead of GPUs (tests)")
    parser.add_argument("--zero", type=int, default=3, help="ZeRO stage 0-3 (%(default)s)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (%(default)s)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree (%(default)s)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per micro step (%(default)s)")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (%(default)s)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (%(default)s)")
    parser.add_argument("--precision", choices=PRECISIONS, help="bf16 on GPUs, fp32 on CPU by default")
    parser.add_argument("--offload-optimizer", action="store_true", help="ZeRO optimizer offload to CPU")
    parser.add_argument("--offload-params", action="store_true", help="ZeRO-3 parameter offload to CPU")
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute activations")
    parser.add_argument("--no-zero-init", dest="zero_init", action="store_false",
                        help="the model is constructed directly, not under zero.Init / from_pretrained (estimate only)")
    parser.add_argument("--engine", choices=ENGINES, default="deepspeed",
                        help="deepspeed (default) or fsdp2: accelerate's FSDP2 + TP ParallelismConfig, GPUs only")


def _hardware_flags(parser: argparse.ArgumentParser) -> None:
    from hf_dist_recipes.parallel.comm import HARDWARE

    group = parser.add_argument_group("hardware (step-time model; defaults from --hardware)")
    group.add_argument("--hardware", choices=sorted(HARDWARE), default="h100",
                       help="GPU type whose defaults to use (%(default)s): H100/H200 SXM, A100 SXM; one NIC per GPU")
    group.add_argument("--intra-node-gbps", type=float, help="NCCL bus bandwidth inside a node, GB/s per GPU")
    group.add_argument("--inter-node-gbps", type=float, help="network bandwidth per GPU across nodes, GB/s")
    group.add_argument("--gpu-tflops", type=float, help="dense bf16 peak of one GPU, TFLOP/s")
    group.add_argument("--compute-efficiency", type=float, help="fraction of the peak the matmuls reach (0-1]")
    group.add_argument("--pcie-gbps", type=float, help="host <-> GPU bandwidth for offload, GB/s")
    group.add_argument("--cpu-adam-rate", type=float,
                       help="parameters per second one node's CPUs update with CPU Adam (offload)")


def hardware_from(args: argparse.Namespace):
    """The Hardware of --hardware with the flags given on top."""
    from dataclasses import replace

    from hf_dist_recipes.parallel.comm import HARDWARE

    changes = {field: getattr(args, flag) for field, flag in (
        ("intra_node_gbps", "intra_node_gbps"), ("inter_node_gbps", "inter_node_gbps"), ("gpu_tflops", "gpu_tflops"),
        ("compute_efficiency", "compute_efficiency"), ("pcie_gbps", "pcie_gbps"),
        ("cpu_adam_params_per_s", "cpu_adam_rate")) if getattr(args, flag) is not None}
    return replace(HARDWARE[args.hardware], **changes)


def plan_from(args: argparse.Namespace) -> ParallelPlan:
    return ParallelPlan(
        nodes=args.nodes, procs_per_node=args.gpus_per_node, device="cpu" if args.cpu else "cuda",
        zero_stage=args.zero, offload_optimizer=args.offload_optimizer, offload_params=args.offload_params,
        tp=args.tp, ep=args.ep, micro_batch=args.micro_batch, grad_accum=args.grad_accum, seq_len=args.seq_len,
        precision=args.precision or ("fp32" if args.cpu else "bf16"),
        activation_checkpointing=args.activation_checkpointing, engine=args.engine, zero_init=args.zero_init,
    )


def _model(args: argparse.Namespace, *, required: bool):
    if not args.model:
        if required:
            raise ValueError("--model is needed here (a family template such as deepseek-v3, or a config.json)")
        return None
    from hf_dist_recipes.parallel.models import introspect

    return introspect(args.model)


@dataclass(frozen=True)
class Generated:
    plan: ParallelPlan
    warnings: list[str]
    yaml_file: Path
    deepspeed_file: Path | None

    def as_dict(self) -> dict:
        return {"plan": self.plan.as_dict(), "warnings": self.warnings, "yaml_file": str(self.yaml_file),
                "deepspeed_file": str(self.deepspeed_file) if self.deepspeed_file else None,
                "global_batch": self.plan.global_batch}


def default_name(plan: ParallelPlan, model_name: str | None) -> str:
    parts = [model_name] if model_name else []
    parts += [f"{plan.nodes}x{plan.procs_per_node}{plan.device}", f"z{plan.zero_stage}"]
    parts += [f"tp{plan.tp}"] if plan.tp > 1 else []
    parts += [f"ep{plan.ep}"] if plan.ep > 1 else []
    parts += ["fsdp2"] if plan.engine == "fsdp2" else []
    return "_".join(parts).replace("-", "_").replace(".", "_")


def generate(args: argparse.Namespace, argv: list[str] | None = None) -> Generated:
    """Validate the plan, then write the files. Data only; `run_generate` renders it."""
    from hf_dist_recipes.parallel.deepspeed_config import deepspeed_config

    plan = plan_from(args)
    warnings = plan.validate()  # the model-free rules first: a refused plan fails before any model is built
    model = _model(args, required=plan.engine == "deepspeed" and (plan.tp > 1 or plan.ep > 1))
    if model is not None:
        warnings = plan.validate(model)
    if plan.nodes > 1 and args.main_process_ip.startswith("127.") and plan.device == "cuda":
        warnings = warnings + [f"main_process_ip is {args.main_process_ip}: the other machines cannot reach it; pass "
                               "--main-process-ip <rank-0 address> here or --main_process_ip at launch"]
    name = args.name or default_name(plan, model.name if model else None)
    out = Path(args.output)
    ds_file = None
    if plan.engine == "deepspeed":
        ds_file = out / "deepspeed" / f"{name}.json"
        ds_file.parent.mkdir(parents=True, exist_ok=True)
        ds_file.write_text(json.dumps(deepspeed_config(plan, model, auto=args.auto, model_ref=args.model), indent=2) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    config = accelerate_config(plan, deepspeed_file=str(ds_file) if ds_file else None,
                               main_process_ip=args.main_process_ip, main_process_port=args.main_process_port)
    command = "hf-dist-recipes config generate " + shlex.join(argv) if argv else "hf-dist-recipes config generate"
    header = [f"Generated by: {command}",
              f"{plan.nodes} machine(s) x {plan.procs_per_node} {plan.device} process(es); ZeRO-{plan.zero_stage}, "
              f"TP {plan.tp}, EP {plan.ep}; data-parallel {plan.dp_size}; global batch "
              + ("micro x accumulation x " + str(plan.dp_size) if args.auto else str(plan.global_batch)),
              "Launch from the directory the DeepSpeed path is relative to:",
              f"  accelerate launch --config_file {out / (name + '.yaml')} train.py"]
    if plan.nodes > 1:
        header.append("On machine N: add --machine_rank N (and --main_process_ip <rank-0 address> if not set here)")
    from hf_dist_recipes.extensions import launch_header_lines
    from hf_dist_recipes.parallel.zero_buffers import recommended_env, zero_buffer_notes

    notes = zero_buffer_notes(plan, model) if plan.engine == "deepspeed" else []
    if notes:
        header += ["DeepSpeed settings sized to this plan:"] + [f"  {line}" for line in notes]
    env = recommended_env(plan, model)
    if env:
        header.append("Before launching: " + " ".join(f"export {k}={v}" for k, v in env.items()))
    header += launch_header_lines(plan)
    header += [f"Warning: {w}" for w in warnings]
    yaml_file = out / f"{name}.yaml"
    yaml_file.write_text(render_yaml(config, "\n".join(header)))
    return Generated(plan=plan, warnings=warnings, yaml_file=yaml_file, deepspeed_file=ds_file)


def run_generate(args: argparse.Namespace) -> int:
    _deepspeed_logs_to_stderr()
    argv = args.argv[args.argv.index("generate") + 1:] if "generate" in args.argv else None
    result = generate(args, argv)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        return 0
    for w in result.warnings:
        print(f"warning: {w}")
    print(f"wrote {result.yaml_file}" + (f" and {result.deepspeed_file}" if result.deepspeed_file else ""))
    print(f"  world {result.plan.world_size}, data-parallel {result.plan.dp_size}, TP {result.plan.tp}, "
          f"EP {result.plan.ep}; launch: accelerate launch --config_file {result.yaml_file} train.py")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    _deepspeed_logs_to_stderr()
    from hf_dist_recipes.parallel.lint import ERROR, lint_file

    if args.gpu_memory is not None and args.gpu_memory <= 0:
        raise ValueError(f"--gpu-memory must be a positive number of GiB, got {args.gpu_memory:g}")
    findings = [f for path in args.files for f in lint_file(path, gpu_memory_gib=args.gpu_memory, model=args.model)]
    if args.json:
        print(json.dumps([f.as_dict() for f in findings], indent=2))
    else:
        for f in findings:
            print(f"{f.path}: {f.level}: {f.message}")
        errors = sum(f.level == ERROR for f in findings)
        print(f"{len(args.files)} file(s) checked: {errors} error(s), {len(findings) - errors} warning(s)")
    return 1 if any(f.level == ERROR for f in findings) else 0


def run_estimate(args: argparse.Namespace) -> int:
    _deepspeed_logs_to_stderr()
    from hf_dist_recipes.parallel.suggest import compact_rows, evaluate, reasons, render_candidates, suggest

    plan = plan_from(args)
    hardware = hardware_from(args)
    model = _model(args, required=True)
    if args.suggest:
        if not args.gpu_memory:
            raise ValueError("--suggest needs --gpu-memory (GiB per GPU), e.g. --gpu-memory 80")
        chosen, rows = suggest(plan, model, args.gpu_memory, hardware)
    else:
        warnings = plan.validate(model)
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        chosen, rows = None, [evaluate(plan, model, device_gib=args.gpu_memory, hardware=hardware)]
    if args.json:
        print(json.dumps({"model": model.name, "total_params": model.total_params,
                          "params_by_component": model.params_by_component,
                          "chosen": chosen.as_dict() if chosen else None,
                          "why": reasons(chosen, rows) if chosen else [],
                          "estimates": [r.as_dict() for r in rows]}, indent=2))
        return 0
    print(f"{model.name}: {model.total_params / 1e9:.2f}B parameters; {plan.nodes} x {plan.procs_per_node} "
          f"{plan.device}, seq {plan.seq_len}, micro batch {plan.micro_batch}, accumulation {plan.grad_accum}, "
          f"{plan.precision}; GiB per rank, GB sent per rank per step, step time on {hardware.name}")
    print(render_candidates(rows if args.all or not args.suggest else compact_rows(rows, chosen), chosen=chosen))
    if args.suggest:
        print("suggested: " + (_describe(chosen.plan) if chosen else "nothing fits; add nodes or GPU memory"))
        for line in reasons(chosen, rows) if chosen else []:
            print(f"  {line}")
    else:
        from hf_dist_recipes.parallel.comm import describe

        print(f"step: {describe(rows[0].step)}")
    return 0


def _describe(plan: ParallelPlan) -> str:
    off = [k for k, on in (("optimizer", plan.offload_optimizer), ("parameters", plan.offload_params)) if on]
    return (f"--zero {plan.zero_stage} --tp {plan.tp} --ep {plan.ep}"
            + "".join(f" --offload-{'optimizer' if k == 'optimizer' else 'params'}" for k in off))
