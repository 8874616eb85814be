"""Launch scripts (`planning/launch_scripts.py`, `planning/launch_script_check.py`): what a rendered script holds,
read back by `parse`, and every `config validate` finding on a script that drifted from its plan, with the fix it
names. No training is launched (tests/distributed/test_launch_scripts_two_nodes.py runs the scripts as a two-node
job)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from hf_dist_recipes.checkpoint.auto_resume import AUTO_RESUME_ENV
from hf_dist_recipes.cli.main import main as cli
from hf_dist_recipes.comm.nccl_defaults import NCCL_ENV_DEFAULTS
from hf_dist_recipes.planning.launch_script_args import launch_script
from hf_dist_recipes.planning.launch_script_check import check_launch_script
from hf_dist_recipes.planning.launch_scripts import (
    REQUEUE_S,
    SHUTDOWN_TIMEOUT_ENV,
    SHUTDOWN_TIMEOUT_S,
    SIGNAL_LEAD_S,
    LaunchScript,
    sbatch_options,
)
from hf_dist_recipes.planning.plan import ParallelPlan

GPU_PLAN = ParallelPlan(nodes=2, procs_per_node=8)


def _gpu_script(launcher="slurm", **kwargs) -> LaunchScript:
    return launch_script(
        GPU_PLAN,
        launcher,
        job_name="llama",
        config_file="/cfg/llama.yaml",
        deepspeed_file="/cfg/deepspeed/llama.json",
        main_process_port=29511,
        log_dir="/cfg/logs",
        **kwargs,
    )


def test_the_slurm_script_holds_the_plan_the_rendezvous_and_the_launch():
    text = _gpu_script(socket_ifname="ib0", ib_hca="=mlx5_0,mlx5_1").render("/cfg/llama.sbatch")
    assert text.startswith("#!/bin/bash\n")
    assert sbatch_options(text) == {
        "job-name": "llama",
        "nodes": "2",
        "ntasks-per-node": "1",
        "exclusive": "",
        "gpus-per-node": "8",
        # issue 32 section 5: all of each node's memory, a time limit (a day unless --time), SIGUSR1 to the batch
        # shell 10 minutes before it, requeue allowed
        "mem": "0",
        "time": "24:00:00",
        "signal": "B:USR1@600",
        "requeue": "",
        "output": "/cfg/logs/%x-%j.out",
        "error": "/cfg/logs/%x-%j.err",
    }
    for line in ("CONFIG_FILE=/cfg/llama.yaml", "NUM_MACHINES=2", "PROCS_PER_NODE=8", "NUM_PROCESSES=16"):
        assert f"\n{line}\n" in text
    assert "\nMAIN_PROCESS_PORT=29511\n" in text and "\nLOG_DIR=/cfg/logs\n" in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in text
    srun = text[text.index("\nsrun ") :]
    assert (
        '--nodes="$NUM_MACHINES" --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE"' in srun
        and '--output="$LOG_DIR/%x-%j-node%n.out"' in srun
    )
    launch = re.search(r"exec accelerate launch [^']*", srun)[0]
    for flag in ("--config_file", "--machine_rank", "--main_process_ip", "--main_process_port"):
        assert flag in launch
    assert '--machine_rank "$SLURM_NODEID"' in launch and '--num_processes "$NUM_PROCESSES"' in launch
    # the training command (sbatch SCRIPT train.py ARGS), srun in the background so that the shell's traps run
    assert next(x for x in srun.splitlines() if x.startswith("  bash -c")).endswith('node "$@" &')
    for name, value in {**NCCL_ENV_DEFAULTS, "NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "=mlx5_0,mlx5_1"}.items():
        assert f'\nexport {name}="{value}"\n' in text
    assert "CUDA_VISIBLE_DEVICES" not in text and "HF_DIST_RECIPES_USE_CPU" not in text  # a GPU plan
    assert "usage: sbatch /cfg/llama.sbatch TRAINING_SCRIPT" in text


def test_every_node_activates_the_environment_generate_ran_in_or_the_one_given(tmp_path):
    import shlex
    import subprocess
    import sys

    text = _gpu_script().render()
    lines = text.splitlines()
    setup = lines[lines.index(next(x for x in lines if x.startswith("# The Python environment"))) + 1]
    # This test runs in the project's venv: its activate script, which puts this interpreter first on PATH.
    assert setup == f"source {shlex.quote(str(Path(sys.prefix) / 'bin' / 'activate'))}"
    probe = subprocess.run(
        ["bash", "-c", f"set -euo pipefail; {setup}; command -v python"],
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert probe.returncode == 0 and Path(probe.stdout.strip()).parent == Path(sys.executable).parent, probe
    given = _gpu_script(env_setup="module load cuda/12.4 && conda activate train", time_limit="2-00:00:00")
    back = LaunchScript.parse(given.render())
    assert back.env_setup == "module load cuda/12.4 && conda activate train" and back.time_limit == "2-00:00:00"
    assert 'export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"' in text  # NCCL's warnings in the node logs on a GPU plan


@pytest.mark.parametrize(
    "flags, named",
    [(["--time", "tomorrow"], "--time 'tomorrow'"), (["--env-setup", " "], "--env-setup: one shell line")],
)
def test_a_time_or_environment_line_sbatch_cannot_take_is_one_line_exit_2(flags, named, tmp_path, capsys):
    argv = ["config", "generate", "--cpu", "--gpus-per-node", "2", "--output", str(tmp_path), "--launcher", "slurm"]
    assert cli([*argv, *flags]) == 2
    assert named in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_the_torchrun_form_uses_the_c10d_rendezvous_and_hands_deepspeed_over():
    text = _gpu_script("torchrun").render()
    launch = re.search(r"exec torchrun [^']*", text)[0]
    assert '--nnodes "$NUM_MACHINES" --nproc-per-node "$PROCS_PER_NODE" --rdzv-backend c10d' in launch
    assert '--rdzv-endpoint "$MAIN_PROCESS_IP:$MAIN_PROCESS_PORT" --rdzv-id "$SLURM_JOB_ID"' in launch
    assert '\nexport ACCELERATE_USE_DEEPSPEED="true"\n' in text
    assert '\nexport ACCELERATE_DEEPSPEED_CONFIG_FILE="/cfg/deepspeed/llama.json"\n' in text
    assert "accelerate launch" not in text


@pytest.mark.parametrize("launcher", ["slurm", "torchrun"])
def test_a_generated_job_resumes_by_itself_unless_its_environment_says_0(launcher):
    text = _gpu_script(launcher).render()
    assert f'\nexport {AUTO_RESUME_ENV}="${{{AUTO_RESUME_ENV}:-1}}"\n' in text


@pytest.mark.parametrize(("cores", "threads"), [(112, 12), (224, 26), (32, 2), (16, 1), (8, 1)])
def test_an_offload_plan_pins_exactly_and_gives_cpu_adam_the_nodes_cores(cores, threads, tmp_path):
    """Issue 40: DeepSpeed's exact pinning, and OpenMP threads per rank from the node's cores (cores / 8 ranks - 2,
    at least 1), evaluated by bash as the node would, `nproc` answering `cores`; a value the job sets wins."""
    import subprocess
    from dataclasses import replace

    from hf_dist_recipes.environment.alloc_defaults import adam_threads

    offload = replace(GPU_PLAN, offload_optimizer=True, offload_params=True)
    text = launch_script(
        offload, "slurm", job_name="v3", config_file="/c.yaml", deepspeed_file=None, main_process_port=1, log_dir="/l"
    ).render()
    assert '\nexport DS_PIN_MEMORY_BACKEND="${DS_PIN_MEMORY_BACKEND:-native}"\n' in text
    (line,) = re.findall(r"^export OMP_NUM_THREADS=.*$", text, flags=re.M)
    for given, expected in (("unset OMP_NUM_THREADS; ", threads), ("OMP_NUM_THREADS=5; ", 5)):
        script = f'nproc() {{ echo {cores}; }}; PROCS_PER_NODE=8; {given}{line}; echo "$OMP_NUM_THREADS"'
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
        assert out.strip() == str(expected)
    # The arguments' count (environment.alloc_defaults, applied in the ranks) is the script's, by the same table.
    assert adam_threads(cores, 8) == threads
    # Neither without offload: torch's pinning then pins nothing of size, and the ranks' 1 thread is torchrun's.
    plain = _gpu_script().render()
    assert "DS_PIN_MEMORY_BACKEND" not in plain and "OMP_NUM_THREADS" not in plain


def test_a_cpu_plan_asks_for_no_gpus_and_hides_them():
    plan = ParallelPlan(nodes=2, procs_per_node=1, device="cpu", precision="fp32")
    script = launch_script(
        plan, "slurm", job_name="c", config_file="/c.yaml", deepspeed_file=None, main_process_port=1234, log_dir="/logs"
    )
    text = script.render()
    assert "gpus-per-node" not in sbatch_options(text)
    assert '\nexport CUDA_VISIBLE_DEVICES=""\n' in text and '\nexport HF_DIST_RECIPES_USE_CPU="1"\n' in text


@pytest.mark.parametrize("launcher", ["slurm", "torchrun"])
def test_parse_reads_back_what_render_wrote(launcher):
    script = _gpu_script(
        launcher, socket_ifname="eth0", extra_env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    )
    parsed = LaunchScript.parse(script.render())
    assert parsed == LaunchScript(**{**script.__dict__, "header": ()})


def test_sbatch_options_short_and_spaced_forms_and_only_before_the_first_command():
    text = "#!/bin/bash\n#SBATCH -N 3\n#SBATCH --gpus-per-node h100:4 --job-name=x\n\necho hi\n#SBATCH --nodes=9\n"
    assert sbatch_options(text) == {"nodes": "3", "gpus-per-node": "h100:4", "job-name": "x"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A 2 x 8 GPU plan and a CPU plan written by config generate, each with both scripts."""
    root = tmp_path_factory.mktemp("cfg")
    for launcher in ("slurm", "torchrun"):
        assert (
            cli(
                [
                    "config",
                    "generate",
                    "--nodes",
                    "2",
                    "--gpus-per-node",
                    "8",
                    "--name",
                    "gpu",
                    "--output",
                    str(root),
                    "--launcher",
                    launcher,
                    "--main-process-ip",
                    "10.0.0.1",
                ]
            )
            == 0
        )
    return root


def _findings(tmp_path, source: Path, old: str, new: str):
    text = source.read_text()
    assert old in text, old
    edited = tmp_path / source.name
    edited.write_text(text.replace(old, new))
    return check_launch_script(edited)


# (the edit, the status, a phrase of the fix) for a script that drifted from its plan.
DRIFTS = {
    "nodes": ("#SBATCH --nodes=2", "#SBATCH --nodes=3", "error", "set #SBATCH --nodes=2"),
    "nodes short form": ("#SBATCH --nodes=2", "#SBATCH -N 4", "error", "set #SBATCH --nodes=2"),
    "num machines": ("\nNUM_MACHINES=2", "\nNUM_MACHINES=3", "error", "set NUM_MACHINES=2"),
    "tasks per node": ("--ntasks-per-node=1\n", "--ntasks-per-node=8\n", "error", "set #SBATCH --ntasks-per-node=1"),
    "procs per node": ("\nPROCS_PER_NODE=8", "\nPROCS_PER_NODE=4", "error", "set PROCS_PER_NODE=8"),
    "num processes": ("\nNUM_PROCESSES=16", "\nNUM_PROCESSES=8", "error", "set NUM_PROCESSES=16"),
    "gpus": ("#SBATCH --gpus-per-node=8", "#SBATCH --gpus-per-node=4", "error", "set #SBATCH --gpus-per-node=8"),
    "no gpus": ("#SBATCH --gpus-per-node=8\n", "", "error", "set #SBATCH --gpus-per-node=8"),
    "port": ("\nMAIN_PROCESS_PORT=29500", "\nMAIN_PROCESS_PORT=29501", "warning", "set MAIN_PROCESS_PORT=29500"),
    "no port": ("\nMAIN_PROCESS_PORT=29500", "\nMAIN_PROCESS_PORT=70000", "error", "set a port in 1-65535"),
    "machine rank": ('--machine_rank "$SLURM_NODEID"', "--machine_rank 0", "error", '--machine_rank "$SLURM_NODEID"'),
    "one cpu": (' --cpus-per-task="$SLURM_CPUS_ON_NODE"', "", "warning", '--cpus-per-task="$SLURM_CPUS_ON_NODE"'),
    "log dir": ("\nLOG_DIR=", "\nLOG_DIR=/no/such/dir/", "warning", "mkdir -p /no/such/dir/"),
    "config file": ("\nCONFIG_FILE=", "\nCONFIG_FILE=/no/such/", "error", "set CONFIG_FILE= to the plan's"),
    "no memory": ("#SBATCH --mem=0\n", "", "warning", "add #SBATCH --mem=0"),
    "no environment": ("# The Python environment every node runs", "# ", "warning", "--env-setup"),
    "no trap": ("trap 'forward USR1' USR1\n", "", "warning", "restore the trap, requeue and"),
    "no requeue": ('  scontrol requeue "$SLURM_JOB_ID" ||', "  true ||", "warning", "restore the trap, requeue and"),
    "no time limit": ("#SBATCH --time=24:00:00\n", "", "warning", "add #SBATCH --time"),
    "no signal": (f"#SBATCH --signal=B:USR1@{SIGNAL_LEAD_S}\n", "", "warning", "add #SBATCH --signal"),
    "no shutdown timeout": (
        f'export {SHUTDOWN_TIMEOUT_ENV}="{SHUTDOWN_TIMEOUT_S}"\n',
        "",
        "warning",
        f"{SHUTDOWN_TIMEOUT_ENV} lines",
    ),
    "fixed address": (
        'MAIN_PROCESS_IP=$(set +o pipefail; scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        "MAIN_PROCESS_IP=10.0.0.2",
        "warning",
        "make them equal",
    ),
}


def test_a_script_as_written_has_no_findings(written):
    assert check_launch_script(written / "gpu.sbatch") == []
    assert check_launch_script(written / "gpu.torchrun.sbatch") == []


@pytest.mark.parametrize("drift", list(DRIFTS))
def test_each_drift_is_one_finding_naming_the_fix(drift, written, tmp_path):
    old, new, status, fix = DRIFTS[drift]
    findings = _findings(tmp_path, written / "gpu.sbatch", old, new)
    assert [f.status for f in findings] == [status], findings
    assert fix in findings[0].fix and findings[0].name == str(tmp_path / "gpu.sbatch")


def test_a_script_passing_no_address_falls_back_to_a_loopback_yaml(written, tmp_path):
    import shutil

    for name in ("gpu.yaml", "deepspeed"):
        src = written / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    yaml = tmp_path / "gpu.yaml"
    yaml.write_text(yaml.read_text().replace("10.0.0.1", "127.0.0.1"))
    script = (written / "gpu.sbatch").read_text().replace(str(written / "gpu.yaml"), str(yaml))
    assert check_launch_script(_write(tmp_path / "ok.sbatch", script)) == []  # the script passes the first node's
    without = script.replace(' --main_process_ip "$MAIN_PROCESS_IP"', "")
    (f,) = check_launch_script(_write(tmp_path / "no.sbatch", without))
    assert f.status == "error" and "127.0.0.1" in f.detail and '--main_process_ip "$MAIN_PROCESS_IP"' in f.fix


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_torchrun_form_must_hand_over_the_plans_json(written, tmp_path):
    (f,) = _findings(
        tmp_path,
        written / "gpu.torchrun.sbatch",
        'ACCELERATE_DEEPSPEED_CONFIG_FILE="',
        'ACCELERATE_DEEPSPEED_CONFIG_FILE="/elsewhere',
    )
    assert f.status == "error" and f"export ACCELERATE_DEEPSPEED_CONFIG_FILE={written}/deepspeed/gpu.json" == f.fix


def test_a_cpu_plan_with_gpus_is_a_warning(tmp_path):
    assert (
        cli(
            [
                "config",
                "generate",
                "--cpu",
                "--nodes",
                "2",
                "--gpus-per-node",
                "1",
                "--name",
                "cpu",
                "--output",
                str(tmp_path),
                "--launcher",
                "slurm",
            ]
        )
        == 0
    )
    text = (
        (tmp_path / "cpu.sbatch").read_text().replace("#SBATCH --ntasks", "#SBATCH --gpus-per-node=8\n#SBATCH --ntasks")
    )
    (tmp_path / "cpu.sbatch").write_text(text)
    (f,) = check_launch_script(tmp_path / "cpu.sbatch")
    assert f.status == "warning" and "remove the #SBATCH --gpus-per-node line" in f.fix


def test_config_validate_prints_the_findings_and_exits_1(written, tmp_path, capsys):
    _findings(tmp_path, written / "gpu.sbatch", "#SBATCH --nodes=2", "#SBATCH --nodes=3")
    assert cli(["config", "validate", str(tmp_path / "gpu.sbatch"), "--json"]) == 1
    (finding,) = json.loads(capsys.readouterr().out)
    assert finding["level"] == "error" and finding["message"].endswith("; set #SBATCH --nodes=2")


def test_a_script_config_generate_did_not_write_is_one_line_exit_2(tmp_path, capsys):
    other = tmp_path / "other.sbatch"
    other.write_text("#!/bin/bash\n#SBATCH --nodes=2\nsrun python train.py\n")
    assert cli(["config", "validate", str(other)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "CONFIG_FILE=" in err and "--launcher slurm" in err


def test_the_script_stops_without_a_training_command_or_in_the_wrong_allocation(written, tmp_path):
    import subprocess

    script = str(written / "gpu.sbatch")
    env = dict(os.environ, SLURM_JOB_ID="1", SLURM_JOB_NAME="gpu", SLURM_JOB_NODELIST="a,b")
    proc = subprocess.run(
        ["bash", script], env=dict(env, SLURM_NNODES="2"), capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 2 and "usage: sbatch" in proc.stderr and "TRAINING_SCRIPT" in proc.stderr
    proc = subprocess.run(
        ["bash", script, "train.py"], env=dict(env, SLURM_NNODES="3"), capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 2 and "submit with --nodes=2" in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--launcher", "torchrun", "--engine", "fsdp2"], "--launcher slurm"),
        (["--log-dir", "logs"], "add --launcher slurm"),
        (["--socket-ifname", "lo"], "add --launcher slurm"),
        (["--launcher", "slurm", "--socket-ifname", "eth0;rm -rf x"], "--socket-ifname ib0"),
        (["--launcher", "slurm", "--ib-hca", "$(mlx5)"], "--ib-hca =mlx5_0,mlx5_1"),
        (["--launcher", "slurm", "--signal-lead", "60"], "--signal-lead 600"),
        (["--signal-lead", "900"], "add --launcher slurm"),
    ],
)
def test_launcher_flags_that_cannot_make_a_script_are_one_line_exit_2(flags, named, tmp_path, capsys):
    out = tmp_path / "cfg"
    code = cli(["config", "generate", "--nodes", "2", "--gpus-per-node", "8", "--output", str(out), *flags])
    stdout, err = capsys.readouterr()
    assert code == 2 and stdout == "" and err.count("\n") == 1 and named in err and "Traceback" not in err, err
    assert not out.exists()


def test_generate_json_names_the_script_and_relative_paths_become_absolute(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = ["config", "generate", "--cpu", "--nodes", "2", "--gpus-per-node", "1", "--name", "c", "--output", "cfg"]
    assert cli([*argv, "--launcher", "torchrun", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    script = Path(result["launch_script"])
    assert script == tmp_path / "cfg" / "c.torchrun.sbatch" and os.access(script, os.X_OK)
    parsed = LaunchScript.parse(script.read_text())
    assert parsed.config_file == str(tmp_path / "cfg" / "c.yaml") == result["yaml_file"]
    assert parsed.deepspeed_file == str(tmp_path / "cfg" / "deepspeed" / "c.json") == result["deepspeed_file"]
    assert parsed.log_dir == str(tmp_path / "cfg" / "logs") and (tmp_path / "cfg" / "logs").is_dir()
    assert check_launch_script(script) == []


@pytest.mark.parametrize("launcher", [None, "slurm"])
def test_the_loopback_address_warning_only_where_no_script_passes_the_first_nodes_address(launcher, tmp_path, capsys):
    # A 2-node GPU plan left at 127.0.0.1 cannot rendezvous when launched by hand; the script passes the first
    # node of the allocation as --main_process_ip, so warning there would send the user after a non-problem.
    argv = ["config", "generate", "--nodes", "2", "--gpus-per-node", "8", "--output", str(tmp_path / "cfg")]
    assert cli(argv + (["--launcher", launcher] if launcher else [])) == 0
    warned = "main_process_ip is 127.0.0.1" in capsys.readouterr().out
    assert warned is (launcher is None)


# A stand-in srun for the trap alone: it records the signals it gets, and ends 143 a second after a SIGTERM (as a
# launcher whose ranks saved and exited does) or with the status EXIT_WITH after SLEEP seconds.
FAKE_SRUN = """#!/bin/bash
trap 'echo TERM >> "$SRUN_RECORD"; sleep 1; kill "$pid"; exit 143' TERM
trap 'echo USR1 >> "$SRUN_RECORD"' USR1
sleep "${SLEEP:-30}" &
pid=$!
echo started >> "$SRUN_RECORD"
wait "$pid" || wait "$pid" || true
exit "${EXIT_WITH:-0}"
"""


@pytest.mark.parametrize(
    "sent, requeued", [(None, False), ("USR1", True), ("TERM", False), ("USR1,TERM", False), ("TERM,USR1", True)]
)
def test_the_batch_shell_hands_a_signal_to_srun_waits_for_it_and_requeues_on_the_time_limit(
    sent, requeued, written, tmp_path
):
    import signal
    import subprocess
    import sys
    import time

    from tests.support.slurm import STANDINS

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(FAKE_SRUN)
    (fake / "srun").chmod(0o755)
    (fake / "scontrol").symlink_to(STANDINS / "scontrol")
    record, requeues = tmp_path / "srun.record", tmp_path / "requeues"
    env = dict(
        os.environ,
        PATH=f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        SLURM_JOB_ID="77",
        SLURM_JOB_NAME="gpu",
        SLURM_JOB_NODELIST="a,b",
        SLURM_NNODES="2",
        SLURM_CPUS_ON_NODE="2",
        SRUN_RECORD=str(record),
        SCONTROL_STANDIN_LOG=str(requeues),
        SLEEP="30" if sent else "0.2",
        EXIT_WITH="3",
    )
    shell = subprocess.Popen(
        ["bash", str(written / "gpu.sbatch"), "train.py"], env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    if sent:
        deadline = time.monotonic() + 20
        while not (record.is_file() and "started" in record.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for name in sent.split(","):
            shell.send_signal(getattr(signal, f"SIG{name}"))
            while "TERM" not in record.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)  # srun got its SIGTERM; the next signal comes while the ranks would save
    out, _ = shell.communicate(timeout=20)
    # srun's status is the job's: 3 when it ended by itself, 143 when the forwarded SIGTERM ended it.
    assert shell.returncode == (143 if sent else 3), out
    assert record.read_text().split() == (["started", "TERM"] if sent else ["started"])  # SIGTERM, whatever came
    assert out.count("SIGTERM to srun") == (1 if sent else 0)  # once, whatever came after
    assert not sent or f"job 77: SIG{sent.split(',')[0]}: SIGTERM to srun" in out
    assert ("job 77: requeueing" in out) == requeued
    assert (requeues.read_text() if requeues.exists() else "") == ("requeue 77\n" if requeued else "")


def test_the_launchers_wait_for_the_save_less_than_the_signals_lead():
    text = _gpu_script().render()
    assert f'\nexport {SHUTDOWN_TIMEOUT_ENV}="{SHUTDOWN_TIMEOUT_S}"\n' in text
    assert 30 < SHUTDOWN_TIMEOUT_S < SIGNAL_LEAD_S  # above torch's default, below the signal's lead
    assert f"#SBATCH --signal=B:USR1@{SIGNAL_LEAD_S}\n" in text


def test_the_signal_comes_early_enough_for_the_plans_save_and_validate_holds_a_script_to_it(tmp_path, capsys):
    """Issue 40: DeepSeek-V3 on 8 x 8 GPUs (EP 16, optimizer offload) saves 12 bytes per partitioned element, of the
    published 671e9 parameters over 64 ranks: about 126 GB per rank, 1,200 s at the assumed 100 MiB/s. The default
    10 minutes cut that save off; the generated lead covers it, the running step and the requeue."""
    plan = ["--model", "deepseek-v3", "--nodes", "8", "--ep", "16", "--offload-optimizer", "--micro-batch", "2"]
    plan += ["--grad-accum", "8", "--activation-checkpointing", "--gpu-memory", "80", "--name", "v3"]
    assert cli(["config", "generate", *plan, "--output", str(tmp_path), "--launcher", "slurm"]) == 0
    text = (tmp_path / "v3.sbatch").read_text()
    lead = LaunchScript.parse(text).signal_lead_s
    save_s = 12 * 671e9 / 64 / (100 * 2**20)
    assert save_s + REQUEUE_S < lead < save_s + REQUEUE_S + 600 and lead % 60 == 0, (lead, save_s)
    assert f'export {SHUTDOWN_TIMEOUT_ENV}="{lead - REQUEUE_S}"' in text  # the launchers wait for the save
    assert f"The time limit's signal comes {lead} s: a step" in text
    assert check_launch_script(tmp_path / "v3.sbatch") == []
    # The default lead edited back in: an error naming the lead the plan needs.
    short = _write(tmp_path / "short.sbatch", text.replace(f"B:USR1@{lead}", f"B:USR1@{SIGNAL_LEAD_S}"))
    (finding,) = check_launch_script(short)
    assert finding.status == "error" and f"--signal=B:USR1@{lead}" in finding.fix, finding
    # --signal-lead: what the user's file system needs instead, written as given (validate holds it to the plan).
    out = tmp_path / "given"
    assert cli(["config", "generate", *plan, "--output", str(out), "--launcher", "slurm", "--signal-lead", "3600"]) == 0
    assert LaunchScript.parse((out / "v3.sbatch").read_text()).signal_lead_s == 3600
    assert check_launch_script(out / "v3.sbatch") == []
    capsys.readouterr()


def test_the_script_names_the_stop_record_the_ranks_write_and_its_help_names_the_signals(written):
    """The sbatch requeues on rank 0's stop record (`checkpoint.preemption.end_launch`): the variable it exports is
    the one the ranks read, and is cleared before srun, so that an earlier attempt's record cannot requeue this one."""
    import subprocess

    from hf_dist_recipes.checkpoint.preemption import STOP_FILE_ENV

    text = (written / "gpu.sbatch").read_text()
    lines = text.splitlines()
    export, clear = lines.index(f"export {STOP_FILE_ENV}"), lines.index(f'rm -f "${STOP_FILE_ENV}"')
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert export < clear < srun
    assert f'elif [ -z "$caught" ] && [ -f "${STOP_FILE_ENV}" ]; then' in lines[srun:]
    helped = subprocess.run(["bash", str(written / "gpu.sbatch"), "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "SIGUSR2 to a rank" in helped.stdout and "SIGUSR1 to a rank" in helped.stdout
    bare = subprocess.run(["bash", str(written / "gpu.sbatch")], capture_output=True, text=True)
    assert bare.returncode == 2 and bare.stderr.startswith("usage: sbatch")
