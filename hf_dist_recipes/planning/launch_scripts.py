"""The script that starts a plan on the machines of a Slurm allocation: `config generate --launcher slurm|torchrun`.

Data first: a `LaunchScript` holds what the script decides (nodes, processes and GPUs per node, the accelerate
YAML, the rendezvous port, the log folder, the exported environment); `render` writes it as an `sbatch` script and
`parse` reads one back, so that `config validate` checks a script, edited or not, against the plan its YAML holds
(`launch_script_check`).

Both forms are sbatch scripts with one task per node (`--ntasks-per-node=1`: the launcher on each node starts that
node's processes) and the rendezvous on the allocation's first node (`scontrol show hostnames`). `slurm` runs
`accelerate launch` with every multi-machine value on its command line (`--machine_rank $SLURM_NODEID`, the
address, the port, the counts), so the YAML's `main_process_ip`, often the 127.0.0.1 of the machine the files were
generated on, never decides where the ranks meet. `torchrun` runs torchrun with the c10d rendezvous (node ranks
assigned by the rendezvous, `--rdzv-id $SLURM_JOB_ID`) and hands the DeepSpeed JSON to the Trainer through the
variables `accelerate launch` itself sets for a DeepSpeed launch (accelerate 1.16, utils/launch.py,
`prepare_deepspeed_cmd_env`: ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_CONFIG_FILE, ACCELERATE_MIXED_PRECISION;
transformers' TrainingArguments and accelerate's DeepSpeedPlugin read them), so any Trainer script runs unchanged.

Both run srun in the background under a trap: the time limit's SIGUSR1 (`SIGNAL`) or a SIGTERM reaching the batch
shell goes on to srun as SIGTERM, the ranks save and exit 75 (`checkpoint.preemption`), each launcher waiting
`SHUTDOWN_TIMEOUT_S` for them; after SIGUSR1 the shell requeues the job, which resumes (`auto_resume`).
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from hf_dist_recipes.comm.nccl_defaults import NCCL_ENV_DEFAULTS
from hf_dist_recipes.core.user_values import writable_dir
from hf_dist_recipes.parallel.plan import ParallelPlan

Launcher = Literal["slurm", "torchrun"]
LAUNCHERS: tuple[str, ...] = get_args(Launcher)
SUFFIXES: dict[str, str] = {"slurm": ".sbatch", "torchrun": ".torchrun.sbatch"}
SCRIPT_SUFFIX = ".sbatch"  # what `config validate` reads as a launch script
# What a user-given network filter may hold: NCCL's filter grammar (names, ^ = , : prefixes) and nothing the
# shell would expand inside the script's double quotes.
_FILTER = re.compile(r"^[A-Za-z0-9_.,:=^-]+$")
# The plan's values, in this order, as plain NAME=value lines: what `parse` and `config validate` read back.
# --time when not given: a day. A partition whose limit is lower refuses the job at submission, naming its limit.
DEFAULT_TIME = "24:00:00"
_TIME = re.compile(r"^(\d+-)?\d{1,3}(:\d{2}){0,2}$|^\d+-\d{1,2}$")  # sbatch's forms: M, M:S, H:M:S, D-H, D-H:M:S
# The line under this comment activates the Python environment on every node (config validate reads it back).
ENV_SETUP_COMMENT = "# The Python environment every node runs"
# Slurm sends SIGUSR1 to the batch shell 10 minutes before --time runs out (B: the shell, not the ranks); the shell
# hands it to the ranks as SIGTERM (they save and exit PREEMPTED_EXIT_CODE) and requeues the job (--requeue).
SIGNAL_LEAD_S = 600
SIGNAL = f"B:USR1@{SIGNAL_LEAD_S}"
# How long each node's launcher lets its ranks run after forwarding them the SIGTERM before it kills them (torch
# elastic's default: 30 s, often less than a save). A launcher returns as soon as its ranks exit, so a longer wait
# costs nothing; a shorter one kills a save midway. Hence the most the signal's lead leaves: a minute short of it,
# for srun to end and the requeue to run before Slurm kills the job at --time.
SHUTDOWN_TIMEOUT_S = SIGNAL_LEAD_S - 60
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # read by torch/distributed/launcher/api.py
# The lines that turn the signal into a save and a requeue; `config validate` warns about a script without them.
TRAP_USR1 = "trap 'forward USR1' USR1"
REQUEUE = 'scontrol requeue "$SLURM_JOB_ID"'
PLAN_VARIABLES = ("CONFIG_FILE", "NUM_MACHINES", "PROCS_PER_NODE", "NUM_PROCESSES", "MAIN_PROCESS_PORT", "LOG_DIR")
# Without pipefail inside: head exits after one line and scontrol, still writing a long node list, dies of SIGPIPE,
# which pipefail would turn into the job's end.
RENDEZVOUS = 'MAIN_PROCESS_IP=$(set +o pipefail; scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)'
# The per-node command; single-quoted in the script, its values come from the exported plan variables.
ACCELERATE_LINE = (
    'exec accelerate launch --config_file "$CONFIG_FILE" --machine_rank "$SLURM_NODEID" '
    '--main_process_ip "$MAIN_PROCESS_IP" --main_process_port "$MAIN_PROCESS_PORT" '
    '--num_machines "$NUM_MACHINES" --num_processes "$NUM_PROCESSES" "$@"'
)
TORCHRUN_LINE = (
    'exec torchrun --nnodes "$NUM_MACHINES" --nproc-per-node "$PROCS_PER_NODE" --rdzv-backend c10d '
    '--rdzv-endpoint "$MAIN_PROCESS_IP:$MAIN_PROCESS_PORT" --rdzv-id "$SLURM_JOB_ID" "$@"'
)


@dataclass(frozen=True)
class LaunchScript:
    """One sbatch script. `procs_per_node`: processes each node's launcher starts; `gpus_per_node`: GPUs asked of
    Slurm per node (0: a CPU plan, no GPU line); `config_file`: the accelerate YAML (absolute); `deepspeed_file`:
    the DeepSpeed JSON the torchrun form exports (absolute; None in the slurm form, whose YAML names it);
    `main_process_port`: the rendezvous port on the first node; `log_dir`: where the job's and each node's output
    go (absolute); `env`: exported before `srun`, in order (values may name the plan variables, e.g.
    "$LOG_DIR/..."); `header`: comment lines under the shebang."""

    launcher: Launcher
    job_name: str
    nodes: int
    procs_per_node: int
    gpus_per_node: int
    config_file: str
    main_process_port: int
    log_dir: str
    deepspeed_file: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    header: tuple[str, ...] = ()
    time_limit: str = DEFAULT_TIME
    env_setup: str = ""

    @property
    def num_processes(self) -> int:
        return self.nodes * self.procs_per_node

    def sbatch_options(self) -> dict[str, str]:
        """The #SBATCH options, in the order written."""
        # --exclusive: the job owns its nodes, every core included (the ranks' data loaders and CPU work need them).
        options = {"job-name": self.job_name, "nodes": str(self.nodes), "ntasks-per-node": "1", "exclusive": ""}
        if self.gpus_per_node:
            options["gpus-per-node"] = str(self.gpus_per_node)
        # --mem=0: all of each node's memory. Without it Slurm grants its default per CPU or node, often far below
        # what pinned optimizer states and a resume's loads need (issue 32: ~1.25 TiB per node for DeepSeek-V3).
        options["mem"] = "0"
        options["time"] = self.time_limit
        options["signal"] = SIGNAL
        options["requeue"] = ""
        options["output"] = f"{self.log_dir}/%x-%j.out"
        options["error"] = f"{self.log_dir}/%x-%j.err"
        return options

    def render(self, path: str | Path | None = None) -> str:
        """The script's text; `path` (where it will be written) goes into the usage line."""
        name = str(path) if path else f"{self.job_name}{SUFFIXES[self.launcher]}"
        values = {
            "CONFIG_FILE": self.config_file,
            "NUM_MACHINES": self.nodes,
            "PROCS_PER_NODE": self.procs_per_node,
            "NUM_PROCESSES": self.num_processes,
            "MAIN_PROCESS_PORT": self.main_process_port,
            "LOG_DIR": self.log_dir,
        }
        lines = ["#!/bin/bash", *(f"# {line}" if line else "#" for line in self.header)]
        lines += [f"#SBATCH --{key}" + (f"={value}" if value else "") for key, value in self.sbatch_options().items()]
        lines += [
            "# Add your cluster's #SBATCH --partition / --account lines above.",
            f"# Submit: sbatch {name} TRAINING_SCRIPT [ARGS...]",
            "set -euo pipefail",
            *(
                [f"{ENV_SETUP_COMMENT} (config generate --env-setup to change it):", self.env_setup]
                if self.env_setup
                else []
            ),
            'if [ "$#" -eq 0 ]; then',
            f'  echo "usage: sbatch {name} TRAINING_SCRIPT [ARGS...] (the training command each node launches)" >&2',
            "  exit 2",
            "fi",
            "",
            "# The plan (hf-dist-recipes config validate checks these against CONFIG_FILE).",
            *(f"{key}={shlex.quote(str(value))}" for key, value in values.items()),
            "export " + " ".join(PLAN_VARIABLES),
            'if [ "${SLURM_NNODES:-$NUM_MACHINES}" != "$NUM_MACHINES" ]; then',
            '  echo "this allocation has $SLURM_NNODES node(s), the plan $NUM_MACHINES: submit with '
            '--nodes=$NUM_MACHINES or regenerate the plan" >&2',
            "  exit 2",
            "fi",
            "",
            "# The rendezvous: the first node of the allocation.",
            RENDEZVOUS,
            'if [ -z "$MAIN_PROCESS_IP" ]; then',
            '  echo "no host in SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST:-}: submit this script with sbatch" >&2',
            "  exit 2",
            "fi",
            "export MAIN_PROCESS_IP",
            "",
            "# Every rank's environment: NCCL's hang-proof defaults and the flight recorder's buffer",
            "# (hf_dist_recipes/comm/nccl_defaults.py), the network filters, the plan's own settings.",
            *(
                []
                if "NCCL_SOCKET_IFNAME" in self.env
                else [
                    "# Interfaces not pinned: hf-dist-recipes doctor on a node says if they must be (--socket-ifname)."
                ]
            ),
            f"# {SHUTDOWN_TIMEOUT_ENV}: how long each launcher lets its ranks save after a SIGTERM before killing "
            "them,",
            "# torch's 30 s raised to a minute short of --signal's lead.",
            *(f'export {key}="{value}"' for key, value in self.env.items()),
            "",
            'echo "job ${SLURM_JOB_ID}: ${NUM_MACHINES} node(s) x ${PROCS_PER_NODE} process(es), rendezvous '
            "${MAIN_PROCESS_IP}:${MAIN_PROCESS_PORT}, node logs "
            '${LOG_DIR}/${SLURM_JOB_NAME}-${SLURM_JOB_ID}-node*.out"',
            "",
            "# --signal's SIGUSR1 reaches this shell alone; scancel and a preempting scheduler send it SIGTERM.",
            "# Either goes on to srun as SIGTERM, which srun forwards to every node's launcher (srun(1), SIGNALS",
            '# AND ESCAPE SEQUENCES: "Signals sent to the srun command are automatically forwarded to the tasks it',
            '# is controlling"), and the launcher to its ranks: they agree on a step, save it and exit 75',
            "# (hf_dist_recipes/checkpoint/preemption.py). srun runs in the background: bash runs no trap until a",
            "# foreground command ends.",
            "# Once: a second SIGTERM would cut the launchers' wait for the save short. The last signal decides the",
            "# requeue: a SIGTERM after the warning is scancel or the limit itself.",
            'caught=""',
            'forwarded=""',
            'interrupted=""',
            'srun_pid=""',
            "forward() {",
            '  caught="$1"',
            "  interrupted=1",
            '  if [ -n "$srun_pid" ] && [ -z "$forwarded" ]; then',
            "    forwarded=1",
            '    echo "job ${SLURM_JOB_ID}: SIG$1: SIGTERM to srun; the ranks save the step they agree on, exit 75"',
            '    kill -TERM "$srun_pid" 2>/dev/null || true',
            "  fi",
            "}",
            TRAP_USR1,
            "trap 'forward TERM' TERM",
            "# One task per node; its launcher starts that node's processes, so the task gets the node's CPUs (srun's",
            "# default is one CPU per task: every rank would share one core). srun exports this environment.",
            'srun --nodes="$NUM_MACHINES" --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" '
            "--kill-on-bad-exit=1 \\",
            '  --output="$LOG_DIR/%x-%j-node%n.out" \\',
            f"  bash -c '{ACCELERATE_LINE if self.launcher == 'slurm' else TORCHRUN_LINE}' node \"$@\" &",
            "srun_pid=$!",
            'if [ -n "$caught" ]; then forward "$caught"; fi  # a signal before srun started',
            "# bash's wait returns as soon as a trapped signal arrives: wait again until srun has ended (its status).",
            "while :; do",
            '  interrupted=""',
            "  status=0",
            '  wait "$srun_pid" || status=$?',
            '  [ -n "$interrupted" ] || break',
            "done",
            "# The time limit is near: the job runs again and resumes from its newest complete checkpoint",
            "# (HF_DIST_RECIPES_AUTO_RESUME). Not on SIGTERM: scancel means stop, and a scheduler that preempts with",
            "# requeue requeues the job itself.",
            'if [ "$caught" = USR1 ]; then',
            '  echo "job ${SLURM_JOB_ID}: requeueing (SIGUSR1: the time limit is near); it resumes from its newest '
            'complete checkpoint"',
            f'  {REQUEUE} || echo "job ${{SLURM_JOB_ID}}: scontrol requeue failed; submit this script again to '
            'resume from the newest complete checkpoint" >&2',
            "fi",
            'exit "$status"',
        ]
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str, name: str = "script") -> LaunchScript:
        """The LaunchScript a script's text describes: its #SBATCH options, plan variables and exports. ValueError
        naming `name` when a plan variable is missing (not a script `config generate --launcher` wrote)."""
        options = sbatch_options(text)
        values = assignments(text)
        missing = [v for v in PLAN_VARIABLES if v not in values]
        if missing:
            raise ValueError(
                f"{name}: no {', '.join(m + '=' for m in missing)} line; not a launch script config generate wrote: "
                "regenerate it with hf-dist-recipes config generate ... --launcher slurm"
            )
        env = dict(re.findall(r'^export ([A-Z_][A-Z0-9_]*)="([^"]*)"$', text, flags=re.M))
        ints = {}
        for key in ("NUM_MACHINES", "PROCS_PER_NODE", "MAIN_PROCESS_PORT"):
            if not values[key].isdigit():
                raise ValueError(f"{name}: {key}={values[key]} is not a whole number; e.g. {key}=2")
            ints[key] = int(values[key])
        lines = text.splitlines()
        setup = next((lines[i + 1] for i, line in enumerate(lines[:-1]) if line.startswith(ENV_SETUP_COMMENT)), "")
        return cls(
            launcher="torchrun" if "exec torchrun " in text else "slurm",
            time_limit=options.get("time", ""),
            env_setup=setup,
            job_name=options.get("job-name", ""),
            nodes=ints["NUM_MACHINES"],
            procs_per_node=ints["PROCS_PER_NODE"],
            gpus_per_node=gpu_count(options.get("gpus-per-node", "0")),
            config_file=values["CONFIG_FILE"],
            main_process_port=ints["MAIN_PROCESS_PORT"],
            log_dir=values["LOG_DIR"],
            deepspeed_file=env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"),
            env=env,
        )


def sbatch_options(text: str) -> dict[str, str]:
    """The #SBATCH options of a script, long names (`-N 2` read as nodes), as sbatch reads them: only the lines
    before the first command count."""
    short = {"N": "nodes", "J": "job-name", "o": "output", "e": "error", "G": "gpus"}
    options: dict[str, str] = {}
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break  # sbatch stops reading directives at the first command
        if not stripped.startswith("#SBATCH"):
            continue
        words = shlex.split(stripped[len("#SBATCH") :], comments=True)
        while words:
            word = words.pop(0)
            if word.startswith("--"):
                key, eq, value = word[2:].partition("=")
                options[key] = value if eq else (words.pop(0) if words and not words[0].startswith("-") else "")
            elif word.startswith("-") and len(word) >= 2:
                key, value = word[1], word[2:] or (words.pop(0) if words else "")
                options[short.get(key, key)] = value
    return options


def assignments(text: str) -> dict[str, str]:
    """NAME=value lines at the start of a line (the plan variables), the value unquoted as the shell would."""
    found = {}
    for key, raw in re.findall(r"^([A-Z_][A-Z0-9_]*)=(.*)$", text, flags=re.M):
        try:
            words = shlex.split(raw)
        except ValueError:
            words = [raw]
        found[key] = words[0] if len(words) == 1 else raw
    return found


def gpu_count(value: str) -> int:
    """GPUs of a --gpus-per-node value: "8" or "h100:8"; 0 when not a count."""
    tail = value.rpartition(":")[2]
    return int(tail) if tail.isdigit() else 0


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
) -> None:
    """Raise ValueError naming the fix for launcher options that cannot make a script, before any file is written.
    `log_dir` must be creatable (it is created by `write_launch_script`: Slurm does not create an --output
    folder)."""
    if launcher is None:
        flags = (("--log-dir", log_dir), ("--socket-ifname", socket_ifname), ("--ib-hca", ib_hca))
        flags += (("--time", time_limit), ("--env-setup", env_setup))
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
    env[SHUTDOWN_TIMEOUT_ENV] = str(SHUTDOWN_TIMEOUT_S)
    # A launch given --max_restarts (torchrun's c10d form: across machines) then gives each round its own store
    # instead of the first attempt's, whose keys a restarted rank would read (pytorch/pytorch#135712,
    # hf_dist_recipes.comm.restarts).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
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
    from hf_dist_recipes.parallel.zero_buffers import recommended_env
    from hf_dist_recipes.planning.generate import model_from

    plan = generated.plan
    model = model_from(args.model, required=False)
    yaml_file = Path(generated.yaml_file)
    command = "hf-dist-recipes config generate" + (" " + shlex.join(argv) if argv else "")
    header = (
        f"Generated by: {command}",
        f"{plan.nodes} node(s) x {plan.procs_per_node} {plan.device} process(es), {plan.world_size} in all; "
        f"ZeRO-{plan.zero_stage}, TP {plan.tp}, EP {plan.ep}; the plan: {yaml_file.name}",
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
