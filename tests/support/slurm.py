"""Playing Slurm on one machine, for the generated launch scripts: `sbatch` here, `srun` and `scontrol` as stand-in
executables (tests/support/slurm_standins/) on PATH.

`sbatch(script, args, nodelist=...)` does what sbatch and slurmd do for a batch job that matters to the script: it
reads the #SBATCH options (sbatch's own parser in the package, `launch_scripts.sbatch_options`, would prove
nothing about itself, so the options are read here with a regular expression), sets the variables a job sees
(SLURM_JOB_ID, SLURM_JOB_NAME, SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_CPUS_ON_NODE, ...), runs the script with bash
in the submission directory and writes its stdout and stderr where --output and --error say (%x, %j expanded).
`sbatch_start` starts the same job and returns at once, for a test that signals the batch shell as Slurm does
(`--signal=B:USR1@...`, scancel's SIGTERM). The hardware is faked: every "node" of the nodelist is this machine; say
so in the tests that use it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hf_dist_recipes.core.launch import LaunchResult, kill_tree, run_process
from tests.support.paths import REPO

STANDINS = Path(__file__).parent / "slurm_standins"


@dataclass(frozen=True)
class BatchJob:
    """A finished stand-in batch job: how it ended, its #SBATCH options, where its output went."""

    result: LaunchResult
    options: dict[str, str]
    stdout_file: Path
    stderr_file: Path
    env: dict[str, str]


def directives(text: str) -> dict[str, str]:
    """`--key=value` of each `#SBATCH` line before the first command."""
    options = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            break
        match = re.match(r"#SBATCH\s+--([\w-]+)=(\S+)", line)
        if match:
            options[match[1]] = match[2]
    return options


def _batch_job(script: Path, *, nodelist: str, job_id: int, cwd: Path, env: dict[str, str] | None):
    """The #SBATCH options, the job's full environment and its stdout / stderr files."""
    options = directives(script.read_text())
    hosts = [h for h in nodelist.split(",") if h]
    nodes = int(options.get("nodes", "1"))
    assert nodes <= len(hosts), f"the script asks for {nodes} nodes, the stand-in allocation has {len(hosts)}"
    name = options.get("job-name", script.name)
    job = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_JOB_NAME": name,
        "SLURM_JOB_NODELIST": ",".join(hosts[:nodes]),
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_SUBMIT_DIR": str(cwd),
        "SLURM_NTASKS_PER_NODE": options.get("ntasks-per-node", "1"),
        "SLURM_CPUS_ON_NODE": str(os.cpu_count()),
    }
    # PATH: the stand-ins first, then this venv's executables (accelerate, torchrun), as an activated environment.
    path = os.pathsep.join([str(STANDINS), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    full_env = {**os.environ, **job, "PATH": path, "PYTHONPATH": str(REPO), **(env or {})}

    def expand(pattern: str) -> Path:
        return Path(pattern.replace("%x", name).replace("%j", str(job_id)))

    stdout_file = expand(options.get("output", str(cwd / "slurm-%j.out")))
    stderr_file = expand(options.get("error", str(stdout_file)))
    return options, full_env, stdout_file, stderr_file


def sbatch(
    script: Path,
    args: list[str],
    *,
    nodelist: str,
    job_id: int,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout_s: float,
) -> BatchJob:
    """Run `script` with `args` as a batch job on the nodes of `nodelist` (a comma list; `--nodes` of the script
    must not exceed it) and wait, ending the job's whole process tree after `timeout_s` seconds."""
    options, full_env, stdout_file, stderr_file = _batch_job(script, nodelist=nodelist, job_id=job_id, cwd=cwd, env=env)
    result = run_process(["bash", str(script), *args], env=full_env, cwd=cwd, timeout_s=timeout_s, output="capture")
    stdout_file.write_text(result.stdout)
    with open(stderr_file, "a" if stderr_file == stdout_file else "w") as err:
        err.write(result.stderr)
    return BatchJob(result=result, options=options, stdout_file=stdout_file, stderr_file=stderr_file, env=full_env)


@dataclass
class RunningJob:
    """A stand-in batch job started by `sbatch_start`: `shell` is the batch shell, the one process Slurm's
    `--signal=B:...` signals; its output goes to the job's files as it is written, as slurmd writes it."""

    shell: subprocess.Popen
    argv: list[str]
    options: dict[str, str]
    stdout_file: Path
    stderr_file: Path
    env: dict[str, str]
    started: float

    def wait(self, timeout_s: float) -> BatchJob:
        """Wait for the batch shell; after `timeout_s` seconds (from the start) end the job's whole process tree."""
        timed_out = False
        try:
            self.shell.wait(timeout=max(0.0, self.started + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_tree(self.shell)
        result = LaunchResult(
            argv=self.argv,
            returncode=self.shell.returncode,
            stdout=self.stdout_file.read_text(),
            stderr=self.stderr_file.read_text(),
            timed_out=timed_out,
            seconds=time.monotonic() - self.started,
            timeout_s=timeout_s,
        )
        return BatchJob(result, self.options, self.stdout_file, self.stderr_file, self.env)


def sbatch_start(
    script: Path, args: list[str], *, nodelist: str, job_id: int, cwd: Path, env: dict[str, str] | None = None
) -> RunningJob:
    """`sbatch` without the wait: start the batch shell (in a session of its own, as slurmd starts it) and return."""
    options, full_env, stdout_file, stderr_file = _batch_job(script, nodelist=nodelist, job_id=job_id, cwd=cwd, env=env)
    argv = ["bash", str(script), *args]
    with open(stdout_file, "w") as out, open(stderr_file, "a" if stderr_file == stdout_file else "w") as err:
        shell = subprocess.Popen(argv, env=full_env, cwd=cwd, stdout=out, stderr=err, start_new_session=True)
    return RunningJob(shell, argv, options, stdout_file, stderr_file, full_env, time.monotonic())
