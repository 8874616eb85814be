"""The script that starts a plan on the machines of a Slurm allocation: `config generate --launcher slurm|torchrun`.

Data first: a `LaunchScript` holds what the script decides (nodes, processes and GPUs per node, the accelerate
YAML, the rendezvous port, the log folder, the exported environment); `render` writes it as an `sbatch` script and
`parse` reads one back, so that `config validate` checks a script, edited or not, against the plan its YAML holds
(`launch_script_check`). From `config generate`'s flags to a script on disk: `launch_script_args`.

Both forms are sbatch scripts with one task per node (`--ntasks-per-node=1`: the launcher on each node starts that
node's processes) and the rendezvous on the allocation's first node (`scontrol show hostnames`). `slurm` runs
`accelerate launch` with every multi-machine value on its command line (`--machine_rank $SLURM_NODEID`, the
address, the port, the counts), so the YAML's `main_process_ip`, often the 127.0.0.1 of the machine the files were
generated on, never decides where the ranks meet. `torchrun` runs torchrun with the c10d rendezvous (node ranks
assigned by the rendezvous, `--rdzv-id $SLURM_JOB_ID`) and hands the DeepSpeed JSON to the Trainer through the
variables `accelerate launch` itself sets for a DeepSpeed launch (accelerate 1.16, utils/launch.py,
`prepare_deepspeed_cmd_env`: ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_CONFIG_FILE, ACCELERATE_MIXED_PRECISION;
transformers' TrainingArguments and accelerate's DeepSpeedPlugin read them), so any Trainer script runs unchanged.

Both run srun in the background under a trap: the time limit's SIGUSR1 (`--signal`) or a SIGTERM reaching the batch
shell goes on to srun as SIGTERM, the ranks save and exit 75 (`checkpoint.preemption`), each launcher waiting
`SHUTDOWN_TIMEOUT_S` for them; after SIGUSR1 the shell requeues the job, which resumes (`auto_resume`). So it does
when no signal reached the shell and the ranks stopped on their own (SIGUSR2 to a rank): rank 0's stop record
(`STOP_FILE_ENV`) says so, since no launcher passes the ranks' 75 through.
"""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

Launcher = Literal["slurm", "torchrun"]
LAUNCHERS: tuple[str, ...] = get_args(Launcher)
SUFFIXES: dict[str, str] = {"slurm": ".sbatch", "torchrun": ".torchrun.sbatch"}
SCRIPT_SUFFIX = ".sbatch"  # what `config validate` reads as a launch script
# --time when not given: a day. A partition whose limit is lower refuses the job at submission, naming its limit.
DEFAULT_TIME = "24:00:00"
# The line under this comment activates the Python environment on every node (config validate reads it back).
ENV_SETUP_COMMENT = "# The Python environment every node runs"
# Slurm sends SIGUSR1 to the batch shell (B:, not the ranks) `signal_lead_s` before --time, at least this; the shell
# hands it to the ranks as SIGTERM (they save, exit PREEMPTED_EXIT_CODE) and requeues the job. `planned_signal_lead`.
SIGNAL_LEAD_S = 600
# For srun to end and the requeue to run once the ranks have saved, before Slurm kills the job at --time.
REQUEUE_S = 60
# How long each node's launcher lets its ranks run after forwarding them the SIGTERM before it kills them (torch
# elastic's default: 30 s, often less than a save). A launcher returns as soon as its ranks exit, so a longer wait
# costs nothing; a shorter one kills a save midway. Hence the most the signal's lead leaves: REQUEUE_S short of it.
SHUTDOWN_TIMEOUT_S = SIGNAL_LEAD_S - REQUEUE_S
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # read by torch/distributed/launcher/api.py
# The lines that turn the signal into a save and a requeue; `config validate` warns about a script without them.
TRAP_USR1 = "trap 'forward USR1' USR1"
# Where rank 0 writes the stop the ranks agreed on (checkpoint.preemption.STOP_FILE_ENV; held equal by a test).
STOP_FILE_ENV = "HF_DIST_RECIPES_STOP_FILE"
REQUEUE = 'scontrol requeue "$SLURM_JOB_ID"'
# A signal that reaches the ranks without the batch shell stops them too; the shell learns of it from this file.
STOP_FILE_LINES = (
    "# A signal that reaches the ranks without this shell (SIGUSR2 to a rank, a preemption sent to the",
    "# tasks) stops them too: rank 0 writes the stop here once the checkpoint is complete (a launcher's",
    "# status is never the ranks' 75), and the job is requeued.",
    f'{STOP_FILE_ENV}="$LOG_DIR/${{SLURM_JOB_NAME:-job}}-${{SLURM_JOB_ID}}.stopped.json"',
    f"export {STOP_FILE_ENV}",
    f'rm -f "${STOP_FILE_ENV}"',
)
# The plan's values, in this order, as plain NAME=value lines: what `parse` and `config validate` read back.
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


def planned_signal_lead(plan, model, hardware: str = "h100") -> tuple[int, str]:
    """(seconds, why): how long before --time Slurm must signal a job of `plan` for its save to end in time: one
    estimated step on `hardware` (the running one ends first), then the busiest rank's checkpoint bytes at the
    assumed write rate, then REQUEUE_S; SIGNAL_LEAD_S at the least, and without a model (`model` None) or a GPU."""
    if model is None or plan.device != "cuda" or plan.engine != "deepspeed":
        return SIGNAL_LEAD_S, f"{SIGNAL_LEAD_S} s, the default (no model to size a save for)"
    from hf_dist_recipes.parallel.checkpoint_bytes import ASSUMED_WRITE_BYTES_PER_S as RATE
    from hf_dist_recipes.planning.comm import step_estimate
    from hf_dist_recipes.planning.elements import plan_save_bytes

    step = step_estimate(plan, model, hardware).step_time_s
    per_rank = plan_save_bytes(plan, model).engine_per_rank
    lead = max(SIGNAL_LEAD_S, 60 * math.ceil((step + per_rank / RATE + REQUEUE_S) / 60))
    return lead, (
        f"{lead} s: a step ({step:,.0f} s estimated on {hardware}), one save ({per_rank / 1e9:,.1f} GB per rank at "
        f"an assumed {RATE / 2**20:.0f} MiB/s, {per_rank / RATE:,.0f} s), {REQUEUE_S} s to requeue, in whole minutes"
    )


@dataclass(frozen=True)
class LaunchScript:
    """One sbatch script. `procs_per_node`: processes each node's launcher starts; `gpus_per_node`: GPUs asked of
    Slurm per node (0: a CPU plan, no GPU line); `config_file`: the accelerate YAML (absolute); `deepspeed_file`:
    the DeepSpeed JSON the torchrun form exports (absolute; None in the slurm form, whose YAML names it);
    `main_process_port`: the rendezvous port on the first node; `log_dir`: where the job's and each node's output
    go (absolute); `env`: exported before `srun`, in order (values may name the plan variables, e.g.
    "$LOG_DIR/..."); `header`: comment lines under the shebang; `signal_lead_s`: seconds before --time that Slurm
    signals the job to save."""

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
    signal_lead_s: int = SIGNAL_LEAD_S

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
        options["signal"] = f"B:USR1@{self.signal_lead_s}"
        options["requeue"] = ""
        options["output"] = f"{self.log_dir}/%x-%j.out"
        options["error"] = f"{self.log_dir}/%x-%j.err"
        return options

    def usage(self, name: str) -> list[str]:
        """The script's `usage` function: the command, and what each signal does (`--help` prints it)."""
        return [
            "usage() {",
            f'  echo "usage: sbatch {name} TRAINING_SCRIPT [ARGS...] (the training command each node launches)"',
            '  echo "Signals: SIGUSR2 to a rank (kill -USR2 PID on a node): every rank saves the same step and"',
            '  echo "  stops, and the job is requeued; it resumes from that checkpoint. SIGUSR1 to a rank: it writes"',
            '  echo "  its state for hf-dist-recipes logs hang, trains on. scancel: every rank saves; the job ends."',
            f'  echo "  {self.signal_lead_s} s before --time, Slurm signals this script: every rank saves; the job"',
            '  echo "  is requeued."',
            "}",
        ]

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
            *self.usage(name),
            'if [ "$#" -eq 0 ]; then usage >&2; exit 2; fi',
            'if [ "$1" = -h ] || [ "$1" = --help ]; then usage; exit 0; fi',
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
            *STOP_FILE_LINES,
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
            f'elif [ -z "$caught" ] && [ -f "${STOP_FILE_ENV}" ]; then',
            f'  echo "job ${{SLURM_JOB_ID}}: requeueing (the ranks stopped on a signal: $(cat "${STOP_FILE_ENV}"))"',
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
            # sbatch's [B:|R:]SIG[@SECONDS], 60 s when not given; 0: no --signal
            signal_lead_s=int(lead) if (lead := options.get("signal", "@0").partition("@")[2]).isdigit() else 60,
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
