"""Launching real multi-process runs with the venv's accelerate: free ports, the CPU-only environment, one
`accelerate launch` run to completion, one machine of a multi-machine config, and the YAML/configs they take."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml

from hf_dist_recipes.core.launch import free_port  # the tests' launches pick ports as the product's do
from tests.support.launch_count import LAUNCHER_MODULE
from tests.support.paths import REPO

LAUNCH_TIMEOUT_S = 420  # one run; the first also JIT-builds DeepSpeed's shm op (about 60 s on 2 cores)


def cpu_only_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a genuine CPU run on any host, GPU hosts included. CUDA_VISIBLE_DEVICES="" hides the GPUs from
    torch and so from DeepSpeed (its accelerator detection falls back to "cpu"); HF_DIST_RECIPES_USE_CPU=1 is the
    explicit CPU request that lets RecipeTrainingArguments train on the CPU of a machine with GPUs instead of
    stopping (environment.cuda_host.cpu_request). Not ACCELERATE_USE_CPU: accelerate's DeepSpeed launcher does
    not pass use_cpu on, and that variable would turn DeepSpeed off in the ranks' AcceleratorState. On a CPU host
    both change nothing."""
    return dict(env, CUDA_VISIBLE_DEVICES="", HF_DIST_RECIPES_USE_CPU="1")


# The ranks' environment: the repository importable (workers import `tests.support`), nothing downloaded.
LAUNCH_ENV = {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _launch_env() -> dict[str, str]:
    return dict(os.environ, **LAUNCH_ENV)


def launched_ranks_env(env: dict[str, str]) -> dict[str, str]:
    """What a CPU launch's ranks see of `env` at their start: the environment the warm rank servers import in."""
    return cpu_only_env(dict(env, **LAUNCH_ENV))


def python_for(env: Mapping[str, str]) -> list[str]:
    """The interpreter for a process a test starts by hand (a one-process worker, a rank of its own launch) in `env`:
    in a session with warm rank servers, `warm_python.py`, which forks it from a server that already imported the
    stack (about 4 s of one core saved per process; signals forwarded, exit code or signal mirrored) or starts it
    fresh by the same rules as a launched rank's; else this interpreter. Give it `launched_ranks_env(...)`, the
    servers' own import-time environment, or it starts fresh."""
    return [env["PYTHON_EXEC"], "-u"] if env.get("PYTHON_EXEC") else [sys.executable]


def fresh_env(env: dict[str, str]) -> dict[str, str]:
    """`env` without the warm rank servers: torchrun starts each rank as a new interpreter (tests.support.warm_ranks),
    for a test about what happens before or during the imports."""
    return {k: v for k, v in env.items() if k != "PYTHON_EXEC"}


def accelerate_launch_command(
    config_file: Path,
    script_and_args: list[str],
    *,
    num_processes: int | None = None,
    env: Mapping[str, str | None] | None = None,
    launch_args: tuple[str, ...] = (),
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of `accelerate launch --config_file config_file [launch_args] ...`: a free
    rendezvous port, and `env`'s variables set for the launch and its ranks (None: unset it).

    In a session with warm rank servers (`PYTHON_EXEC` set, tests.support.warm_ranks) the launcher starts as its
    ranks do: the real `accelerate launch`, forked from a server that already imported torch, accelerate and
    DeepSpeed (which accelerate's DeepSpeed launcher imports), instead of a new interpreter importing them: about
    3 s of one core per launch. The same rules start it fresh instead (warm_python.py). Not for a test that looks
    for the launch's processes in its process tree: `fresh_env` starts launcher and ranks fresh. Signals sent to the
    warm launcher's stand-in reach the real one (warm_python.py forwards them)."""
    overrides, full = env or {}, _launch_env()
    full = {k: v for k, v in {**full, **overrides}.items() if v is not None}
    if (yaml.safe_load(Path(config_file).read_text()) or {}).get("use_cpu"):
        full = cpu_only_env(full)
    cmd = [
        *python_for(full),
        "-m",
        LAUNCHER_MODULE,
        "--config_file",
        str(config_file),
        "--main_process_port",
        str(free_port()),
    ]
    cmd += list(launch_args)
    if num_processes:
        cmd += ["--num_processes", str(num_processes)]
    return cmd + script_and_args, full


def accelerate_launch(
    config_file: Path,
    script_and_args: list[str],
    *,
    cwd: Path = REPO,
    timeout: int = LAUNCH_TIMEOUT_S,
    num_processes: int | None = None,
    env: Mapping[str, str | None] | None = None,
    launch_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run `accelerate launch --config_file config_file ...` (`accelerate_launch_command`) and return it with output
    captured. `launch_args`: accelerate's own flags (e.g. --max_restarts 1)."""
    cmd, full = accelerate_launch_command(
        config_file, script_and_args, num_processes=num_processes, env=env, launch_args=launch_args
    )
    return subprocess.run(cmd, cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)


def check_launch(proc: subprocess.CompletedProcess) -> None:
    """Fail with the ranks' last output when a launch did not succeed."""
    if proc.returncode != 0:
        pytest.fail(f"launch failed with exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def write_cpu_deepspeed_yaml(path: Path, ds_json: Path, num_processes: int = 2) -> Path:
    """An accelerate YAML like accelerate_configs/cpu_zero3_2proc.yaml pointing at `ds_json`."""
    text = (REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml").read_text()
    text = text.replace("accelerate_configs/deepspeed/cpu_zero3_2proc.json", str(ds_json))
    text = text.replace("num_processes: 2", f"num_processes: {num_processes}")
    path.write_text(text)
    return path


def two_machine_config(out_dir: Path, name: str = "two") -> tuple[Path, int]:
    """A generated 2-machine CPU config (one process per machine, ZeRO-3, `--auto`) on 127.0.0.1 with a free port:
    two `accelerate launch` processes with machine_rank 0 and 1 then act as two machines. Returns (YAML, port)."""
    from hf_dist_recipes.cli.main import main

    port = free_port()
    argv = ["config", "generate", "--cpu", "--nodes", "2", "--gpus-per-node", "1", "--auto", "--name", name]
    argv += ["--main-process-ip", "127.0.0.1", "--main-process-port", str(port), "--output", str(out_dir)]
    assert main(argv) == 0
    return out_dir / f"{name}.yaml", port


def launch_machine(
    config: Path, machine_rank: int, script_and_args: list[str], *, cwd: Path, **popen
) -> subprocess.Popen:
    """Start machine `machine_rank` of a multi-machine `config` (`accelerate launch --machine_rank N ...`) as a CPU
    run on any host (`cpu_only_env`), output merged into one text pipe; `popen` adds Popen arguments."""
    env = cpu_only_env(_launch_env())
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    cmd += ["--machine_rank", str(machine_rank), *script_and_args]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
