"""`config validate` on a launch script: the script `config generate --launcher` wrote (`launch_scripts`), edited
or not, against the plan of the accelerate YAML it names. Each finding names what to change; errors would start the
wrong job or none (nodes, processes, GPUs, tasks per node, machine ranks, the DeepSpeed JSON), warnings a job that
works but disagrees with its files (the port), fails at once (a missing log folder) or loses its last steps at the
time limit (no trap, requeue or shutdown timeout)."""

from __future__ import annotations

import re
from pathlib import Path

from hf_dist_recipes.core.findings import ERROR, WARNING, Finding
from hf_dist_recipes.core.jsonfile import read_text_file
from hf_dist_recipes.parallel.plan_record import recorded_plan
from hf_dist_recipes.planning.accelerate_config import DEFAULT_PORT
from hf_dist_recipes.planning.launch_config import load_launch_config
from hf_dist_recipes.planning.launch_plan import is_loopback
from hf_dist_recipes.planning.launch_scripts import (
    ENV_SETUP_COMMENT,
    REQUEUE_S,
    SHUTDOWN_TIMEOUT_ENV,
    LaunchScript,
    assignments,
    gpu_count,
    sbatch_options,
)

# (status, detail, fix) of one finding, before the script's path is added
Rows = list[tuple[str, str, str]]


def check_launch_script(path: str | Path) -> list[Finding]:
    """Findings for a launch script against the plan of the accelerate YAML it names (CONFIG_FILE): nodes,
    processes and GPUs per node, tasks per node, the port, the machine rank's source, the torchrun form's DeepSpeed
    JSON, the log folder. Each finding's `fix` says what to change. ValueError when the script cannot be read."""
    p = Path(path)
    text = read_text_file(p, "launch script", "pass a script written by config generate --launcher")
    script = LaunchScript.parse(text, str(p))
    options = sbatch_options(text)
    regenerate = "or regenerate the files with hf-dist-recipes config generate ... --launcher " + script.launcher
    try:
        cfg = load_launch_config(script.config_file, given_as="the script's CONFIG_FILE=")
    except ValueError as err:
        fix = f"set CONFIG_FILE= to the plan's accelerate YAML, {regenerate}"
        return [Finding(str(p), ERROR, f"CONFIG_FILE: {err}", fix)]
    name = Path(script.config_file).name
    found = _count_findings(script, options, assignments(text), cfg, name, regenerate)
    found += _port_findings(script, cfg, name, regenerate)
    found += _address_findings(text, script.launcher, cfg, name, regenerate)
    found += _job_findings(script, options, text, cfg, name, regenerate)
    return [Finding(str(p), *f) for f in found]


def _count_findings(script: LaunchScript, options: dict, values: dict, cfg, name: str, regenerate: str) -> Rows:
    """The counts against the YAML's plan: machines, tasks and processes per node, all processes, GPUs per node."""
    out: Rows = []

    def add(status, detail, fix):
        out.append((status, detail, fix))

    per_node, rest = divmod(cfg.num_processes, cfg.num_machines)
    if script.nodes != cfg.num_machines:
        add(
            ERROR,
            f"NUM_MACHINES={script.nodes} but {name} has num_machines {cfg.num_machines}",
            f"set NUM_MACHINES={cfg.num_machines}, {regenerate}",
        )
    if options.get("nodes") != str(cfg.num_machines):
        add(
            ERROR,
            f"#SBATCH --nodes={options.get('nodes')} but {name} has num_machines {cfg.num_machines}",
            f"set #SBATCH --nodes={cfg.num_machines}",
        )
    if options.get("ntasks-per-node") != "1":
        add(
            ERROR,
            f"#SBATCH --ntasks-per-node={options.get('ntasks-per-node')}: each node runs one launcher, "
            "which starts that node's processes",
            "set #SBATCH --ntasks-per-node=1",
        )
    if rest == 0 and script.procs_per_node != per_node:
        add(
            ERROR,
            f"PROCS_PER_NODE={script.procs_per_node} but {name} has {cfg.num_processes} processes on "
            f"{cfg.num_machines} machine(s), {per_node} per node",
            f"set PROCS_PER_NODE={per_node}, {regenerate}",
        )
    if values.get("NUM_PROCESSES") != str(cfg.num_processes):
        add(
            ERROR,
            f"NUM_PROCESSES={values.get('NUM_PROCESSES')} but {name} has num_processes {cfg.num_processes} "
            "(all machines)",
            f"set NUM_PROCESSES={cfg.num_processes}",
        )
    gpus = gpu_count(options.get("gpus-per-node", "0"))
    if not cfg.use_cpu and gpus != per_node:
        add(
            ERROR,
            f"#SBATCH --gpus-per-node={options.get('gpus-per-node', '(none)')} but the plan runs {per_node} "
            "GPU process(es) per node",
            f"set #SBATCH --gpus-per-node={per_node}",
        )
    elif cfg.use_cpu and gpus:
        add(
            WARNING,
            f"#SBATCH --gpus-per-node={gpus} for a CPU plan (use_cpu in {name}): GPUs held and unused",
            "remove the #SBATCH --gpus-per-node line",
        )
    return out


def _port_findings(script: LaunchScript, cfg, name: str, regenerate: str) -> Rows:
    """The rendezvous port: a TCP port, and the YAML's (the script's wins at launch)."""
    out: Rows = []

    def add(status, detail, fix):
        out.append((status, detail, fix))

    yaml_port = cfg.raw.get("main_process_port", DEFAULT_PORT)
    if not 0 < script.main_process_port < 65536:
        add(ERROR, f"MAIN_PROCESS_PORT={script.main_process_port} is no TCP port", "set a port in 1-65535, e.g. 29500")
    elif script.main_process_port != yaml_port:
        add(
            WARNING,
            f"MAIN_PROCESS_PORT={script.main_process_port} but {name} has main_process_port {yaml_port}; "
            "the script's wins at launch",
            f"make them equal: set MAIN_PROCESS_PORT={yaml_port}, {regenerate}",
        )
    return out


def _job_findings(script: LaunchScript, options: dict, text: str, cfg, name: str, regenerate: str) -> Rows:
    """What the job needs around the launch: an environment, memory, CPUs for srun, the time limit's trap and
    requeue, the machine rank, the torchrun form's DeepSpeed JSON, the log folder."""
    out: Rows = []

    def add(status, detail, fix):
        out.append((status, detail, fix))

    if not script.env_setup:
        add(
            WARNING,
            "the script activates no Python environment: each node runs the python first on the batch shell's PATH, "
            "which may not hold torch or this package",
            f"add a line under '{ENV_SETUP_COMMENT}:', {regenerate} (--env-setup to name another environment)",
        )
    if "mem" not in options:
        add(
            WARNING,
            "no #SBATCH --mem: Slurm grants its default memory, often far below what pinned optimizer states and a "
            "resume's checkpoint loads need",
            f"add #SBATCH --mem=0 (all of each node's memory), {regenerate}",
        )
    srun = text[text.find("\nsrun ") :]
    if "--cpus-per-task" not in srun and "--exclusive" not in srun:
        add(
            WARNING,
            "srun gives each task one CPU unless told; the node's launcher and all its ranks would share one core",
            'pass --cpus-per-task="$SLURM_CPUS_ON_NODE" to srun',
        )
    missing = [
        what
        for what, found in (
            ("no SIGUSR1 trap", re.search(r"^\s*trap .*\bUSR1\b", text, re.M)),
            ("no scontrol requeue", re.search(r'^[^#\n]*\bscontrol requeue "?\$\{?SLURM_JOB_ID\b', text, re.M)),
            (f"no {SHUTDOWN_TIMEOUT_ENV}", re.search(rf"^\s*export {SHUTDOWN_TIMEOUT_ENV}=", text, re.M)),
        )
        if not found
    ]
    if missing:
        add(
            WARNING,
            f"{', '.join(missing)}: at --time the ranks are killed without saving their last steps, and the job "
            "does not run again",
            f"restore the trap, requeue and {SHUTDOWN_TIMEOUT_ENV} lines, {regenerate}",
        )
    for option, why in (("time", "the partition's default limit ends the job"), ("signal", "no save before --time")):
        if option not in options:
            add(WARNING, f"no #SBATCH --{option}: {why}", f"add #SBATCH --{option}, {regenerate}")
    needed, lead = recorded_plan(cfg.deepspeed).get("signal_lead_s"), script.signal_lead_s
    if lead and needed and lead < needed:
        add(
            ERROR,
            f"#SBATCH --signal comes {lead} s before --time; the plan's step and one save need {needed} s: the save "
            "is cut off at the limit, and the job resumes from the save before",
            f"#SBATCH --signal=B:USR1@{needed} and export {SHUTDOWN_TIMEOUT_ENV}={needed - REQUEUE_S}, {regenerate}",
        )
    # With one task per node SLURM_PROCID equals SLURM_NODEID; either numbers the machines.
    if script.launcher == "slurm" and not re.search(r'--machine_rank "?\$\{?SLURM_(NODEID|PROCID)\b', text):
        add(
            ERROR,
            "accelerate launch takes no --machine_rank from the scheduler ($SLURM_NODEID): every node would start "
            "as machine 0",
            'pass --machine_rank "$SLURM_NODEID" in the srun command',
        )
    if script.launcher == "torchrun" and script.deepspeed_file != (
        str(cfg.deepspeed_file) if cfg.deepspeed_file else None
    ):
        add(
            ERROR,
            f"ACCELERATE_DEEPSPEED_CONFIG_FILE={script.deepspeed_file} but {name} names {cfg.deepspeed_file}",
            f"export ACCELERATE_DEEPSPEED_CONFIG_FILE={cfg.deepspeed_file}",
        )
    if not Path(script.log_dir).is_dir():
        add(
            WARNING,
            f"LOG_DIR {script.log_dir} does not exist; Slurm does not create the folder of --output and the "
            "job fails at once",
            f"mkdir -p {script.log_dir}",
        )
    return out


def passes_rank0_address(path: str | Path) -> Path | None:
    """The accelerate YAML (resolved) of the launch script at `path` when the script passes the rank-0 address at
    launch (`MAIN_PROCESS_IP`, the allocation's first node, as config generate writes it), so that the YAML's own
    `main_process_ip` is not used; None when it does not or cannot be read."""
    try:
        text = read_text_file(Path(path), "launch script", "pass a script written by config generate --launcher")
        script = LaunchScript.parse(text, str(path))
    except ValueError:
        return None
    return Path(script.config_file).resolve() if _passes_address(text, script.launcher) else None


def _passes_address(text: str, launcher: str):
    return (
        re.search(r'--main_process_ip "?\$\{?MAIN_PROCESS_IP\b', text)
        if launcher == "slurm"
        else re.search(r'--rdzv-endpoint "?\$\{?MAIN_PROCESS_IP\b', text)
    )


def _address_findings(text: str, launcher: str, cfg, name: str, regenerate: str) -> Rows:
    """The rank-0 address the script launches with against the YAML's `main_process_ip`: (status, detail, fix).
    The generated script passes the allocation's first node at launch (its value wins over the YAML's); a script
    that does not, on several machines, falls back to the YAML, where a loopback address reaches no other node."""
    yaml_ip = str(cfg.raw.get("main_process_ip") or "")
    if not _passes_address(text, launcher):
        if cfg.num_machines > 1 and (not yaml_ip or is_loopback(yaml_ip)):
            return [
                (
                    ERROR,
                    f"the script passes no rank-0 address at launch and {name} has main_process_ip "
                    f"{yaml_ip or '(none)'}: the other {cfg.num_machines - 1} machine(s) cannot reach it",
                    f'pass --main_process_ip "$MAIN_PROCESS_IP" (the first node of the allocation), {regenerate}',
                )
            ]
        return []
    fixed = re.search(r"^\s*MAIN_PROCESS_IP=([0-9A-Za-z.:_-]+)\s*$", text, re.M)
    if fixed and yaml_ip and not is_loopback(yaml_ip) and fixed.group(1) != yaml_ip:
        return [
            (
                WARNING,
                f"MAIN_PROCESS_IP={fixed.group(1)} but {name} has main_process_ip {yaml_ip}; the script's wins at "
                "launch",
                f"make them equal, or leave MAIN_PROCESS_IP to the allocation's first node, {regenerate}",
            )
        ]
    return []
