"""Write the accelerate YAML and DeepSpeed JSON of a plan: what `hf-dist-recipes config generate` writes, and what
`planning.shipped` writes for each entry of accelerate_configs/manifest.json.

The flags that describe a plan are defined here (`add_plan_flags`, `add_output_flags`), so that the command line and
the manifest's argument lists are read by one parser; `write_configs` takes the plan itself.
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from hf_dist_recipes.core.user_values import writable_dir
from hf_dist_recipes.planning.accelerate_config import (
    DEFAULT_PORT,
    DEFAULT_SP_ATTN_IMPLEMENTATION,
    SP_ATTN_IMPLEMENTATIONS,
    accelerate_config,
    render_yaml,
)
from hf_dist_recipes.planning.comm import HARDWARE
from hf_dist_recipes.planning.memory import DEFAULT_DEVICE_TARGET, DEFAULT_ROUTING_IMBALANCE
from hf_dist_recipes.planning.plan import ENGINES, GRAD_REDUCE_DTYPES, PRECISIONS, ParallelPlan
from hf_dist_recipes.planning.sequence_parallel import sp_header_lines, sp_words


def add_plan_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a ParallelPlan and its model (`config generate` and `config estimate`)."""
    parser.add_argument("--model", help="family template (e.g. deepseek-v3, llama-3.1-8b) or a config.json path/dir")
    parser.add_argument("--nodes", type=int, default=1, help="machines (%(default)s)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="processes per machine (%(default)s)")
    parser.add_argument("--cpu", action="store_true", help="CPU processes with Gloo instead of GPUs (tests)")
    parser.add_argument("--zero", type=int, default=3, help="ZeRO stage 0-3 (%(default)s)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (%(default)s)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree (%(default)s)")
    parser.add_argument(
        "--sp",
        type=int,
        default=1,
        help="Ulysses sequence-parallel degree (%(default)s): each rank holds seq-len / sp tokens of a sequence; "
        "DeepSpeed only, with --tp 1 and --ep 1",
    )
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per rank per micro step (%(default)s)")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps (%(default)s)")
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (%(default)s)")
    parser.add_argument("--precision", choices=PRECISIONS, help="bf16 on GPUs, fp32 on CPU by default")
    parser.add_argument(
        "--grad-reduce-dtype",
        choices=GRAD_REDUCE_DTYPES,
        default="fp32",
        help="dtype of the gradient reduce-scatter/all-reduce (DeepSpeed communication_data_type): fp32 "
        "(%(default)s, as torchtitan's FSDP and Megatron-LM reduce) or the compute dtype, half the bytes",
    )
    parser.add_argument("--offload-optimizer", action="store_true", help="ZeRO optimizer offload to CPU")
    parser.add_argument("--offload-params", action="store_true", help="ZeRO-3 parameter offload to CPU")
    parser.add_argument("--activation-checkpointing", action="store_true", help="recompute activations")
    parser.add_argument(
        "--loss-chunk-tokens",
        type=int,
        metavar="TOKENS",
        help="the loss computed this many tokens at a time (RecipeTrainingArguments.loss_chunk_tokens, recorded in "
        "the JSON): the estimate counts one chunk's logits, not all of them (default: the stock loss)",
    )
    parser.add_argument(
        "--tiled-mlp-shards",
        type=int,
        metavar="SLICES",
        help="every gated MLP computed this many slices of its tokens at a time (RecipeTrainingArguments."
        "tiled_mlp_shards, recorded in the JSON): the estimate counts one slice's MLP intermediates (default: whole)",
    )
    parser.add_argument(
        "--no-zero-init",
        dest="zero_init",
        action="store_false",
        help="the model is constructed directly, not under zero.Init / from_pretrained (estimate only)",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="deepspeed",
        help="deepspeed (default) or fsdp2: accelerate's FSDP2 + TP ParallelismConfig, GPUs only",
    )


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `config generate` beyond the plan: where and how the files are written."""
    parser.add_argument("--output", required=True, help="directory for NAME.yaml and deepspeed/NAME.json")
    parser.add_argument("--name", help="file name stem (default: from the plan)")
    parser.add_argument(
        "--auto",
        action="store_true",
        help='write "auto" for bf16/fp16 too, which the Trainer then fills from its bf16/fp16 arguments (without '
        "it: the plan's precision). Micro batch, accumulation and clipping are always \"auto\"; the plan's micro "
        "batch and accumulation are recorded in the JSON",
    )
    parser.add_argument(
        "--sp-attn-implementation",
        choices=SP_ATTN_IMPLEMENTATIONS,
        default=DEFAULT_SP_ATTN_IMPLEMENTATION,
        help="with --sp: the attention kernel Ulysses wraps (%(default)s); the model must be loaded with the same "
        "attn_implementation",
    )
    parser.add_argument("--main-process-ip", default="127.0.0.1", help="multi-node: rank-0 machine's address")
    parser.add_argument("--main-process-port", type=int, default=DEFAULT_PORT, help="multi-node: rendezvous port")
    fit = parser.add_argument_group("fit check (GPU plans with --model: refused when our estimate exceeds the GPU)")
    fit.add_argument(
        "--gpu-memory",
        type=float,
        help="GiB per GPU; a GPU plan with --model needs it or --hardware (default: --hardware's)",
    )
    fit.add_argument("--hardware", choices=sorted(HARDWARE), help="GPU type whose memory to check against")
    add_memory_limit_flags(fit)
    fit.add_argument("--force", action="store_true", help="write the files even when the plan does not fit")


def add_memory_limit_flags(group) -> None:
    """--host-memory and --memory-target, for `config generate` and `config estimate`."""
    group.add_argument(
        "--host-memory",
        type=float,
        metavar="GIB",
        help="host memory of one node in GiB, for the resume peak of offloaded states (default: --hardware's DGX "
        "figure when --hardware is given, else not checked; preflight reads the machine's)",
    )
    group.add_argument(
        "--routing-imbalance",
        type=float,
        default=DEFAULT_ROUTING_IMBALANCE,
        metavar="FACTOR",
        help="MoE under EP: the busiest EP rank's expert load over the mean that activations are sized for "
        "(%(default)s: the worst step measured, benchmarks/results/2026-12-06-expert-imbalance.md); 1 for even "
        "routing",
    )
    group.add_argument(
        "--stock-resume",
        action="store_true",
        help="size the host for DeepSpeed's stock resume (each rank loads its whole optimizer file: the stock "
        "Trainer), not RecipeTrainer's memory-mapped one",
    )
    group.add_argument(
        "--memory-target",
        type=float,
        default=DEFAULT_DEVICE_TARGET,
        metavar="FRACTION",
        help="the fraction of the GPU's memory a plan may fill by our estimate (%(default)s: headroom for what it "
        "cannot see, such as routing more uneven than assumed); 1.0 for the whole GPU",
    )


@dataclass(frozen=True)
class MemoryLimits:
    """What a plan is held to besides the GPU's size: `device_target`, the fraction of the GPU it may fill;
    `host_gib`, host memory per node (None: not checked), named by `host_source`; `routing_imbalance`, the busiest EP
    rank's expert load over the mean (`planning.memory`); `memory_mapped_resume`, RecipeTrainer's resume (False:
    DeepSpeed's stock load). The fields are `fit.check_fit`'s keywords of the same names."""

    device_target: float = DEFAULT_DEVICE_TARGET
    host_gib: float | None = None
    host_source: str = "--host-memory"
    routing_imbalance: float = DEFAULT_ROUTING_IMBALANCE
    memory_mapped_resume: bool = True


def check_host_memory(gib: float | None) -> None:
    """--host-memory, when given, is a positive number of GiB per node (ValueError naming the flag)."""
    if gib is not None and not gib > 0:
        raise ValueError(f"--host-memory is GiB per node, got {gib:g}; e.g. --host-memory 2048 for a DGX H100")


def memory_limits(args: argparse.Namespace) -> MemoryLimits:
    """The MemoryLimits of parsed `add_memory_limit_flags` flags: --host-memory, else the explicitly named
    --hardware's DGX figure."""
    host, target, imbalance = args.host_memory, args.memory_target, args.routing_imbalance
    mapped = not getattr(args, "stock_resume", False)
    if not imbalance >= 1:
        raise ValueError(f"--routing-imbalance is the busiest EP rank's load over the mean, >= 1; got {imbalance:g}")
    check_host_memory(host)
    if not 0 < target <= 1:
        raise ValueError(
            f"--memory-target is a fraction of the GPU in (0, 1], got {target:g}; e.g. --memory-target 0.9"
        )
    preset = HARDWARE[args.hardware].host_memory_gib if getattr(args, "hardware", None) else None
    if host is None and preset:
        return MemoryLimits(target, preset, f"a DGX {args.hardware.upper()} (--hardware)", imbalance, mapped)
    return MemoryLimits(target, host, routing_imbalance=imbalance, memory_mapped_resume=mapped)


def generate_parser() -> argparse.ArgumentParser:
    """A parser of `config generate`'s plan and output flags (the argument lists of the shipped manifest)."""
    parser = argparse.ArgumentParser(prog="hf-dist-recipes config generate", add_help=False)
    add_plan_flags(parser)
    add_output_flags(parser)
    return parser


def plan_from(args: argparse.Namespace) -> ParallelPlan:
    """The ParallelPlan of parsed `add_plan_flags` flags."""
    return ParallelPlan(
        nodes=args.nodes,
        procs_per_node=args.gpus_per_node,
        device="cpu" if args.cpu else "cuda",
        zero_stage=args.zero,
        offload_optimizer=args.offload_optimizer,
        offload_params=args.offload_params,
        tp=args.tp,
        ep=args.ep,
        sp=args.sp,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        seq_len=args.seq_len,
        precision=args.precision or ("fp32" if args.cpu else "bf16"),
        activation_checkpointing=args.activation_checkpointing,
        engine=args.engine,
        zero_init=args.zero_init,
        grad_reduce_dtype=args.grad_reduce_dtype,
        loss_chunk_tokens=args.loss_chunk_tokens,
        tiled_mlp_shards=args.tiled_mlp_shards,
    )


def model_from(model_ref: str | None, *, required: bool):
    """The ModelShape of `--model` (None when not given and not `required`), or ValueError naming the fix."""
    if not model_ref:
        if required:
            raise ValueError("--model is needed here (a family template such as deepseek-v3, or a config.json)")
        return None
    from hf_dist_recipes.planning.models import introspect

    return introspect(model_ref)


@dataclass(frozen=True)
class Generated:
    plan: ParallelPlan
    warnings: list[str]
    yaml_file: Path
    deepspeed_file: Path | None

    def as_dict(self) -> dict:
        return {
            "plan": self.plan.as_dict(),
            "warnings": self.warnings,
            "yaml_file": str(self.yaml_file),
            "deepspeed_file": str(self.deepspeed_file) if self.deepspeed_file else None,
            "global_batch": self.plan.global_batch,
        }


def default_name(plan: ParallelPlan, model_name: str | None) -> str:
    parts = [model_name] if model_name else []
    parts += [f"{plan.nodes}x{plan.procs_per_node}{plan.device}", f"z{plan.zero_stage}"]
    parts += [f"tp{plan.tp}"] if plan.tp > 1 else []
    parts += [f"ep{plan.ep}"] if plan.ep > 1 else []
    parts += [f"sp{plan.sp}"] if plan.sp > 1 else []
    parts += ["fsdp2"] if plan.engine == "fsdp2" else []
    return "_".join(parts).replace("-", "_").replace(".", "_")


def fit_problem(
    plan: ParallelPlan,
    model,
    model_ref: str,
    gpu_memory_gib: float | None = None,
    hardware: str | None = None,
    limits: MemoryLimits | None = None,
) -> str | None:
    """Why `plan` does not fit its GPUs (within `limits.device_target` of their memory) or, given `limits.host_gib`
    per node, its hosts at a resume, by our estimate (`fit.check_fit`); None when it fits or is not checked (CPU plans;
    FSDP2, which the estimate does not model). The GPU memory: `gpu_memory_gib`, else `hardware`'s (a key of
    `comm.HARDWARE`), else the largest GPU there, so that a plan that fits no GPU we know is caught without flags.

    Refused rather than warned about: generate was given every assumption of the estimate (sequence length, micro
    batch, recomputation: its own flags), and the files exist to be launched; the out-of-memory error would come
    only after the model has loaded on every rank of an allocation. `config validate --gpu-memory` only warns, as
    a file written elsewhere may not record what it was sized for."""
    if plan.device != "cuda" or plan.engine != "deepspeed":
        return None
    from hf_dist_recipes.planning.fit import FLAGS, SOURCES, check_fit

    if gpu_memory_gib is not None:
        gib, source, name = gpu_memory_gib, "--gpu-memory", hardware
    else:
        name = hardware or max(HARDWARE, key=lambda k: HARDWARE[k].memory_gib)
        gib = HARDWARE[name].memory_gib
        source = (
            f"--hardware {name}"
            if hardware
            else (f"the largest GPU we know ({name}; pass --gpu-memory or --hardware for yours)")
        )
    default = ParallelPlan()
    sources = {k: FLAGS[k] if getattr(plan, k) != getattr(default, k) else "default" for k in SOURCES}
    limits = asdict(limits or MemoryLimits())  # its fields are check_fit's keywords
    verdict = check_fit(plan, model, model_ref, gib, source, sources, hardware=name, **limits)
    if verdict.fits:
        return None
    return verdict.message(change="generate takes --seq-len, --micro-batch and --activation-checkpointing")


def generate_from_args(
    args: argparse.Namespace, argv: list[str] | None = None, *, address_from_launcher: bool = False
) -> Generated:
    """`write_configs` for parsed `generate_parser` flags; `argv` (those flags as given) goes into the header;
    `address_from_launcher` as in `write_configs`."""
    return write_configs(
        plan_from(args),
        args.output,
        model_ref=args.model,
        name=args.name,
        auto=args.auto,
        main_process_ip=args.main_process_ip,
        main_process_port=args.main_process_port,
        command_args=argv,
        gpu_memory_gib=args.gpu_memory,
        hardware=args.hardware,
        force=args.force,
        address_from_launcher=address_from_launcher,
        limits=memory_limits(args),
        sp_attn_implementation=args.sp_attn_implementation,
    )


def jit_built_ops(plan: ParallelPlan) -> list[str]:
    """The DeepSpeed ops a launch of `plan` JIT-builds on its nodes (`environment.extensions`): cpu_adam under
    optimizer offload, pin_memory under offload on GPUs (the exact pinning the script and the arguments ask for),
    deepspeed_shm_comm (DeepSpeed's CPU collectives) on CPU."""
    offload = plan.offload_optimizer or plan.offload_params
    used = {"cpu_adam": plan.offload_optimizer, "pin_memory": offload and plan.device == "cuda"}
    used["deepspeed_shm_comm"] = plan.device == "cpu"
    return [op for op, needed in used.items() if needed]


def launch_header_lines(ops: Sequence[str] = ()) -> list[str]:
    """Comment lines for a generated DeepSpeed launch config: where DeepSpeed's ops build and why
    (`environment.extensions`, what each rank sets). `ops`: the ops the launch JIT-builds, as its plan says
    (`jit_built_ops`); none named: "its ops"."""
    from hf_dist_recipes.environment.extensions import ENV

    what = f"its ops ({', '.join(ops)})" if ops else "its ops"
    return [
        f"DeepSpeed JIT-builds {what} once per node: unless {ENV} is set,",
        "RecipeTrainingArguments sets it to $TMPDIR (else /tmp)/torch_extensions-<user>/<python_cuda_torch>, not",
        "~/.cache, which all nodes share behind one lock file that a node killed mid-build leaves to hang the rest",
    ]


def batch_header_lines(plan: ParallelPlan, *, sized: bool) -> list[str]:
    """The YAML header's lines on the batch: the JSON's micro batch and accumulation are "auto", the plan's are
    recorded; `sized`: the plan was sized for a model (then rank 0 warns at a larger micro batch)."""
    planned = f"micro batch {plan.micro_batch} x accumulation {plan.grad_accum} = global batch {plan.global_batch}"
    lines = [
        f"Sized for {planned}" if sized else f"Planned for {planned} (sized for no model: no --model)",
        'The JSON says "auto" for both (the plan is recorded in it): the Trainer fills them from',
        "per_device_train_batch_size and gradient_accumulation_steps.",
    ]
    if sized:
        lines.append(
            "Rank 0 warns at start-up when the micro batch exceeds the plan's (more activation memory than estimated)."
        )
    return lines


def write_configs(
    plan: ParallelPlan,
    output: str | Path,
    *,
    model_ref: str | None = None,
    name: str | None = None,
    auto: bool = False,
    main_process_ip: str = "127.0.0.1",
    main_process_port: int = DEFAULT_PORT,
    command_args: list[str] | None = None,
    gpu_memory_gib: float | None = None,
    hardware: str | None = None,
    force: bool = False,
    address_from_launcher: bool = False,
    limits: MemoryLimits | None = None,
    sp_attn_implementation: str = DEFAULT_SP_ATTN_IMPLEMENTATION,
) -> Generated:
    """Validate the plan, then write `<output>/NAME.yaml` (and `<output>/deepspeed/NAME.json` for DeepSpeed).
    `command_args`: the `config generate` arguments recorded in the YAML's header. Every check runs before the
    first file is written: a refused plan or an unwritable `output` leaves nothing behind. A DeepSpeed GPU plan
    with a model is also checked against the GPU's memory (`gpu_memory_gib`, else `hardware`'s, else the largest
    GPU of `comm.HARDWARE`), within `limits.device_target` of it, and given `limits.host_gib` its resume peak
    against the host: a plan that does not fit by our estimate is refused (ValueError) unless `force`,
    which writes it with a warning (`fit_problem`). `address_from_launcher`: a launch script written beside the
    files (`--launcher`) passes the first node's address at launch, so a loopback `main_process_ip` is no problem.
    `sp_attn_implementation`: with `plan.sp` > 1, the attention kernel the YAML's SP block names."""
    writable_dir(output, "--output", "my_configs")
    if gpu_memory_gib is not None and not gpu_memory_gib > 0:
        raise ValueError(f"--gpu-memory must be a positive number of GiB, got {gpu_memory_gib:g}; e.g. --gpu-memory 80")
    warnings = plan.validate()  # the model-free rules first: a refused plan fails before any model is built
    model = model_from(model_ref, required=plan.engine == "deepspeed" and (plan.tp > 1 or plan.ep > 1))
    if model is not None:
        warnings = plan.validate(model)
        problem = fit_problem(
            plan,
            model,
            model_ref or model.name,
            gpu_memory_gib,
            hardware,
            limits=limits,
        )
        if problem and not force:
            raise ValueError(f"{problem}; or pass --force to write the files anyway")
        warnings = warnings + ([problem] if problem else [])
    # After the checks: this imports DeepSpeed, whose import prints a notice (a refusal stays one line).
    from hf_dist_recipes.planning.deepspeed_config import deepspeed_config

    if plan.nodes > 1 and main_process_ip.startswith("127.") and plan.device == "cuda" and not address_from_launcher:
        warnings = warnings + [
            f"main_process_ip is {main_process_ip}: the other machines cannot reach it; pass "
            "--main-process-ip <rank-0 address> here or --main_process_ip at launch"
        ]
    name = name or default_name(plan, model.name if model else None)
    out = Path(output)
    ds_file = None
    if plan.engine == "deepspeed":
        ds_file = out / "deepspeed" / f"{name}.json"
        ds_file.parent.mkdir(parents=True, exist_ok=True)
        ds_file.write_text(json.dumps(deepspeed_config(plan, model, auto=auto, model_ref=model_ref), indent=2) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    config = accelerate_config(
        plan,
        deepspeed_file=str(ds_file) if ds_file else None,
        main_process_ip=main_process_ip,
        main_process_port=main_process_port,
        sp_attn_implementation=sp_attn_implementation,
    )
    command = (
        "hf-dist-recipes config generate " + shlex.join(command_args)
        if command_args
        else "hf-dist-recipes config generate"
    )
    header = [
        f"Generated by: {command}",
        f"{plan.nodes} machine(s) x {plan.procs_per_node} {plan.device} process(es); ZeRO-{plan.zero_stage}, "
        f"TP {plan.tp}, EP {plan.ep}{sp_words(plan)}; data-parallel {plan.dp_size}; global batch micro x "
        f"accumulation x {plan.dp_size}",
        *(sp_header_lines(plan, sp_attn_implementation) if plan.sp > 1 else []),
        *(batch_header_lines(plan, sized=model is not None) if plan.engine == "deepspeed" else []),
        "Launch from the directory the DeepSpeed path is relative to:",
        f"  accelerate launch --config_file {out / (name + '.yaml')} train.py",
    ]
    if plan.nodes > 1:
        header.append("On machine N: add --machine_rank N (and --main_process_ip <rank-0 address> if not set here)")
    from hf_dist_recipes.planning.zero_buffers import recommended_env, zero_buffer_notes

    notes = zero_buffer_notes(plan, model) if plan.engine == "deepspeed" else []
    if notes:
        header += ["DeepSpeed settings sized to this plan:"] + [f"  {line}" for line in notes]
    env = recommended_env(plan, model)
    if env:
        # hf_dist_recipes.environment.alloc_defaults: the arguments set it in every rank, before CUDA initialises.
        header.append("RecipeTrainingArguments sets this where unset; with the stock Trainer, before launching:")
        header.append("  " + " ".join(f"export {k}={v}" for k, v in env.items()))
    if plan.engine == "deepspeed":
        header += launch_header_lines(jit_built_ops(plan))
    header += [f"Warning: {w}" for w in warnings]
    yaml_file = out / f"{name}.yaml"
    yaml_file.write_text(render_yaml(config, "\n".join(header)))
    return Generated(plan=plan, warnings=warnings, yaml_file=yaml_file, deepspeed_file=ds_file)
