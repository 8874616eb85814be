"""From `config generate`'s command line to a written launch script: the --launcher flags (`add_launcher_flags`) and
their checks before anything is written (`check_launcher_options`), the `LaunchScript` of a plan and its files
(`launch_script`), the Python environment every node activates (`this_environment`), and the script written beside
the YAML (`script_from_args`, `write_launch_script`). What a script holds, how it reads and writes, is
`launch_scripts`."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

from hf_dist_recipes.comm.nccl_defaults import NCCL_ENV_DEFAULTS
from hf_dist_recipes.core.user_values import writable_dir
from hf_dist_recipes.environment.alloc_defaults import PIN_BACKEND_ENV
from hf_dist_recipes.planning.launch_scripts import (
    DEFAULT_TIME,
    LAUNCHERS,
    REQUEUE_S,
    SHUTDOWN_TIMEOUT_ENV,
    SIGNAL_LEAD_S,
    SUFFIXES,
    Launcher,
    LaunchScript,
    planned_signal_lead,
)
from hf_dist_recipes.planning.plan import ParallelPlan

# What a user-given network filter may hold: NCCL's filter grammar (names, ^ = , : prefixes) and nothing the
# shell would expand inside the script's double quotes.
_FILTER = re.compile(r"^[A-Za-z0-9_.,:=^-]+$")
_TIME = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$|^\d+-\d{1,2}$")  # sbatch's forms: M, M:S, H:M:S, D-H, D-H:M:S


# Threads per rank for CPU Adam, evaluated on the node as `environment.alloc_defaults.adam_threads` counts them:
# cores / ranks - 2, at least 1 (a value the job sets wins).
OMP_THREADS_EXPR = "${OMP_NUM_THREADS:-$(( $(nproc) / PROCS_PER_NODE > 3 ? $(nproc) / PROCS_PER_NODE - 2 : 1 ))}"


def add_launcher_flags(parser: argparse.ArgumentParser) -> None:
    """`config generate`'s flags for the launch script."""
    group = parser.add_argument_group("launch script (--launcher: an sbatch script beside the YAML)")
    group.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        help="also write NAME.sbatch (slurm: srun + accelerate launch) or NAME.torchrun.sbatch (srun + torchrun, "
        "c10d rendezvous); submit with: sbatch FILE train.py [ARGS]",
    )
    group.add_argument("--log-dir", help="with --launcher: the job's and each node's logs (default: OUTPUT/logs)")
    group.add_argument("--socket-ifname", help="with --launcher: NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME (e.g. ib0)")
    group.add_argument("--ib-hca", help="with --launcher: NCCL_IB_HCA, the InfiniBand ports (e.g. =mlx5_0,mlx5_1)")
    group.add_argument(
        "--time",
        help=f"with --launcher: the job's time limit, as sbatch takes it (default {DEFAULT_TIME}; e.g. 2-00:00:00)",
    )
    group.add_argument(
        "--signal-lead",
        type=int,
        metavar="SECONDS",
        help="with --launcher: how long before --time Slurm signals the job to save and requeue (default: a step "
        f"and one save of the plan's checkpoint at 100 MiB/s per rank, plus {REQUEUE_S} s; at least "
        f"{SIGNAL_LEAD_S}); config validate checks a script's against the same sum",
    )
    group.add_argument(
        "--env-setup",
        help="with --launcher: the shell line that activates the Python environment on every node (default: the "
        "environment config generate runs in, e.g. 'source /shared/venv/bin/activate'; e.g. 'module load cuda/12.4 "
        "&& conda activate train')",
    )


def check_launcher_options(
    plan: ParallelPlan,
    launcher: str | None,
    *,
    log_dir: str | Path | None = None,
    socket_ifname: str | None = None,
    ib_hca: str | None = None,
    time_limit: str | None = None,
    env_setup: str | None = None,
    signal_lead: int | None = None,
) -> None:
    """Raise ValueError naming the fix for launcher options that cannot make a script, before any file is written.
    `log_dir` must be creatable (it is created by `write_launch_script`: Slurm does not create an --output
    folder)."""
    if launcher is None:
        flags = (("--log-dir", log_dir), ("--socket-ifname", socket_ifname), ("--ib-hca", ib_hca))
        flags += (("--time", time_limit), ("--env-setup", env_setup), ("--signal-lead", signal_lead))
        given = [f for f, v in flags if v]
        if given:
            raise ValueError(f"{given[0]} is a setting of the launch script; add --launcher slurm (or torchrun)")
        return
    if launcher not in LAUNCHERS:
        raise ValueError(f"--launcher {launcher}: expected one of {', '.join(LAUNCHERS)}; e.g. --launcher slurm")
    if launcher == "torchrun" and plan.engine != "deepspeed":
        raise ValueError(
            "--launcher torchrun hands the Trainer a DeepSpeed JSON; an FSDP2 plan's settings live in the accelerate "
            "YAML: use --launcher slurm (srun + accelerate launch)"
        )
    for flag, value, example in (("--socket-ifname", socket_ifname, "ib0"), ("--ib-hca", ib_hca, "=mlx5_0,mlx5_1")):
        if value is not None and not _FILTER.match(value):
            raise ValueError(f"{flag} {value!r}: interface names and NCCL's ^ = , : only; e.g. {flag} {example}")
    if time_limit is not None and not _TIME.match(time_limit):
        raise ValueError(f"--time {time_limit!r}: sbatch's forms are MINUTES, H:M:S or D-H:M:S; e.g. --time 2-00:00:00")
    if signal_lead is not None and signal_lead <= REQUEUE_S:
        raise ValueError(
            f"--signal-lead {signal_lead}: the save needs time after the signal, and the requeue {REQUEUE_S} s; "
            f"e.g. --signal-lead {SIGNAL_LEAD_S}"
        )
    if env_setup is not None and ("\n" in env_setup or not env_setup.strip()):
        raise ValueError("--env-setup: one shell line; e.g. --env-setup 'source /shared/venv/bin/activate'")
    if log_dir is not None:
        writable_dir(log_dir, "--log-dir", "runs/logs")


def launch_script(
    plan: ParallelPlan,
    launcher: Launcher,
    *,
    job_name: str,
    config_file: str | Path,
    deepspeed_file: str | Path | None,
    main_process_port: int,
    log_dir: str | Path,
    socket_ifname: str | None = None,
    ib_hca: str | None = None,
    extra_env: dict[str, str] | None = None,
    header: tuple[str, ...] = (),
    time_limit: str | None = None,
    env_setup: str | None = None,
    signal_lead_s: int = SIGNAL_LEAD_S,
) -> LaunchScript:
    """The LaunchScript of `plan` (paths made absolute). Its environment: NCCL_ENV_DEFAULTS (hang-proof NCCL, the
    flight recorder's buffer); the network filters given; `extra_env` (e.g. the plan's
    allocator setting); a CPU plan's explicit CPU request; the torchrun form's DeepSpeed hand-over."""
    # Not the recorder's dump prefix: RecipeTrainingArguments points it at <output_dir>/flight_recorder/, beside the
    # dumps and stacks every rank writes there on a hang, where `hf-dist-recipes logs hang` reads them.
    env = dict(NCCL_ENV_DEFAULTS)
    if plan.device == "cuda":
        # NCCL's own warnings (a transport that fell back, a failed connection) in the node logs, unless the job's
        # environment asks for more or less.
        env["NCCL_DEBUG"] = "${NCCL_DEBUG:-WARN}"
    if socket_ifname:
        env["NCCL_SOCKET_IFNAME"] = env["GLOO_SOCKET_IFNAME"] = socket_ifname
    if ib_hca:
        env["NCCL_IB_HCA"] = ib_hca
    env.update(extra_env or {})
    # A requeued or restarted job resumes from its newest complete checkpoint (RecipeTrainingArguments.auto_resume),
    # unless the job's environment says 0.
    env["HF_DIST_RECIPES_AUTO_RESUME"] = "${HF_DIST_RECIPES_AUTO_RESUME:-1}"
    env[SHUTDOWN_TIMEOUT_ENV] = str(signal_lead_s - REQUEUE_S)
    # A launch given --max_restarts (torchrun's c10d form: across machines) then gives each round its own store
    # instead of the first attempt's, whose keys a restarted rank would read (pytorch/pytorch#135712,
    # hf_dist_recipes.comm.restarts).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if plan.device == "cuda" and (plan.offload_optimizer or plan.offload_params):
        # Offloaded states pinned at their size by DeepSpeed's own page-locked allocator: torch's pinning, DeepSpeed's
        # default, rounds each block up to a power of two (planning.host_memory counts the exact bytes).
        env[PIN_BACKEND_ENV] = f"${{{PIN_BACKEND_ENV}:-native}}"
    if plan.device == "cuda" and plan.offload_optimizer:
        # CPU Adam runs on OpenMP threads: the node's cores shared by its ranks, 2 each left for the data loader and
        # the host side of the step; torchrun and accelerate otherwise hand every rank 1 (issue 40: 8 of ~112 cores).
        env["OMP_NUM_THREADS"] = OMP_THREADS_EXPR
    if plan.device == "cpu":
        # DeepSpeed picks its accelerator from what torch sees, and the recipe stops a CPU run on a GPU host unless
        # asked for explicitly (environment.cuda_host): a CPU plan is that request.
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["HF_DIST_RECIPES_USE_CPU"] = "1"
    ds = str(Path(deepspeed_file).resolve()) if deepspeed_file else None
    if launcher == "torchrun":
        if ds is None:
            raise ValueError("--launcher torchrun needs the plan's DeepSpeed JSON; use --launcher slurm")
        env.update(
            ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_CONFIG_FILE=ds, ACCELERATE_MIXED_PRECISION="no"
        )
    return LaunchScript(
        launcher=launcher,
        job_name=job_name,
        nodes=plan.nodes,
        procs_per_node=plan.procs_per_node,
        gpus_per_node=plan.procs_per_node if plan.device == "cuda" else 0,
        config_file=str(Path(config_file).resolve()),
        main_process_port=main_process_port,
        log_dir=str(Path(log_dir).resolve()),
        deepspeed_file=ds if launcher == "torchrun" else None,  # the slurm form's YAML names it
        env=env,
        header=header,
        time_limit=time_limit or DEFAULT_TIME,
        env_setup=env_setup if env_setup is not None else this_environment(),
        signal_lead_s=signal_lead_s,
    )


def this_environment() -> str:
    """The shell line that activates the Python environment this process runs in: a venv's activate script, a
    conda environment, else this interpreter's folder first on PATH."""
    import os
    import sys

    if sys.prefix != sys.base_prefix and os.path.isfile(os.path.join(sys.prefix, "bin", "activate")):
        return f"source {shlex.quote(os.path.join(sys.prefix, 'bin', 'activate'))}"
    conda = os.environ.get("CONDA_PREFIX")
    if conda and os.path.realpath(conda) == os.path.realpath(sys.prefix):
        return f'eval "$(conda shell.bash hook)" && conda activate {shlex.quote(conda)}'
    return f'export PATH={shlex.quote(os.path.dirname(sys.executable))}:"$PATH"'


def script_from_args(args: argparse.Namespace, generated, argv: list[str] | None = None) -> Path:
    """Write the launch script of `config generate`'s parsed flags beside `generated` (a `generate.Generated`):
    its name and port are the YAML's, the log folder `--log-dir` or OUTPUT/logs. `argv`: the flags as given, for
    the header. Returns the script's path."""
    from hf_dist_recipes.planning.generate import model_from
    from hf_dist_recipes.planning.zero_buffers import recommended_env

    plan = generated.plan
    model = model_from(args.model, required=False)
    yaml_file = Path(generated.yaml_file)
    command = "hf-dist-recipes config generate" + (" " + shlex.join(argv) if argv else "")
    lead, why = planned_signal_lead(plan, model, args.hardware or "h100")
    if args.signal_lead is not None:
        lead, why = args.signal_lead, f"{args.signal_lead} s, as --signal-lead asked (the plan's: {why})"
    header = (
        f"Generated by: {command}",
        f"{plan.nodes} node(s) x {plan.procs_per_node} {plan.device} process(es), {plan.world_size} in all; "
        f"ZeRO-{plan.zero_stage}, TP {plan.tp}, EP {plan.ep}; the plan: {yaml_file.name}",
        f"The time limit's signal comes {why}.",
    )
    script = launch_script(
        plan,
        args.launcher,
        job_name=yaml_file.stem,
        config_file=yaml_file,
        deepspeed_file=generated.deepspeed_file,
        main_process_port=args.main_process_port,
        log_dir=args.log_dir or yaml_file.parent / "logs",
        socket_ifname=args.socket_ifname,
        ib_hca=args.ib_hca,
        extra_env=recommended_env(plan, model),
        header=header,
        time_limit=args.time,
        env_setup=args.env_setup,
        signal_lead_s=lead,
    )
    return write_launch_script(script, yaml_file.parent)


def write_launch_script(script: LaunchScript, output: str | Path) -> Path:
    """Write `script` into `output` as JOB_NAME.sbatch (slurm) or JOB_NAME.torchrun.sbatch, executable, and create
    its log folder. Returns the script's path."""
    path = Path(output) / f"{script.job_name}{SUFFIXES[script.launcher]}"
    Path(script.log_dir).mkdir(parents=True, exist_ok=True)
    path.write_text(script.render(path))
    path.chmod(0o755)
    return path
