"""The time limit's signal, played on a generated sbatch script: save, requeue, resume, the same weights.

Faked, as in test_launch_scripts_two_nodes.py: the allocation's one node is this machine, `sbatch` is
tests/support/slurm.py (`sbatch_start`: the batch shell in the background, so that the test can signal it as
`--signal=B:USR1@600` does), `srun` and `scontrol` the stand-ins of tests/support/slurm_standins/ (srun forwards the
signals it gets to its tasks' process groups; `scontrol requeue` records the request in a file instead of a queue,
so the test submits the script again, as Slurm starts the requeued job). Real: the generated script with its trap,
bash, `accelerate launch` and its shutdown wait, two CPU ranks training ZeRO-3, their agreement on a step, the
save, the exit code and the resume.

Four launches: the job signalled after step 2; the requeued job, whose rank 1 alone gets SIGUSR2 (the ranks stop,
and rank 0's stop record makes the script requeue the job); the job requeued again, run to the end; and an
uninterrupted reference.
"""

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_dist_recipes.checkpoint.manifest import MANIFEST_NAME, Manifest, check_checkpoint
from hf_dist_recipes.checkpoint.preemption import PREEMPTED_EXIT_CODE
from hf_dist_recipes.cli.main import main as cli
from hf_dist_recipes.planning.launch_scripts import SHUTDOWN_TIMEOUT_S
from tests.support.launch import LAUNCH_ENV, LAUNCH_TIMEOUT_S, accelerate_launch, check_launch, free_port
from tests.support.paths import REPO
from tests.support.slurm import sbatch, sbatch_start

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "survival_worker.py")
STEPS = 10
JOB_ID = 5151


def _final_weights(output: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted((output / "final").glob("*.safetensors")):
        tensors.update(load_file(shard))
    assert tensors, f"no weights under {output / 'final'}"
    return tensors


def _wait_for_step(progress: Path, step: int, job, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if progress.is_file() and progress.read_text().strip().isdigit() and int(progress.read_text()) >= step:
            return
        if job.shell.poll() is not None:
            text = job.stdout_file.read_text()
            pytest.fail(f"the job ended (exit {job.shell.returncode}) before step {step}:\n{text}")
        time.sleep(0.2)
    pytest.fail(f"no step {step} in {progress} within {timeout_s} s")


def test_the_time_limits_signal_saves_requeues_and_the_requeued_job_resumes_to_the_same_weights(tmp_path):
    argv = ["config", "generate", "--cpu", "--nodes", "1", "--gpus-per-node", "2", "--auto", "--name", "job"]
    argv += ["--main-process-port", str(free_port()), "--output", str(tmp_path / "cfg"), "--launcher", "slurm"]
    argv += ["--socket-ifname", "lo"]
    assert cli(argv) == 0
    script, yaml_file = tmp_path / "cfg" / "job.sbatch", tmp_path / "cfg" / "job.yaml"
    assert f'export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="{SHUTDOWN_TIMEOUT_S}"' in script.read_text()
    out, requeues = tmp_path / "run", tmp_path / "requeues"
    env = {**LAUNCH_ENV, "SCONTROL_STANDIN_LOG": str(requeues)}
    node_log = tmp_path / "cfg" / "logs" / f"job-{JOB_ID}-node0.out"
    submit = {"nodelist": "127.0.0.1", "job_id": JOB_ID, "cwd": tmp_path, "env": env}
    worker = [WORKER, str(out), str(STEPS), "100", "step-pause=0.5"]  # no save of its own before the end

    started = time.monotonic()
    running = sbatch_start(script, worker, **submit)
    _wait_for_step(out / "progress" / "rank0", 2, running, LAUNCH_TIMEOUT_S)
    running.shell.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1: the batch shell, nothing else
    first = running.wait(LAUNCH_TIMEOUT_S)
    first_s = time.monotonic() - started
    assert not first.result.timed_out, first.result.describe()
    job_out, ranks_out = first.stdout_file.read_text(), node_log.read_text()  # the requeued job writes them anew

    assert f"job {JOB_ID}: SIGUSR1: SIGTERM to srun" in job_out, job_out
    assert f"job {JOB_ID}: requeueing (SIGUSR1: the time limit is near)" in job_out, job_out
    assert requeues.read_text() == f"requeue {JOB_ID}\n"
    (stop,) = re.findall(r"rank (\d+) received SIGTERM: every rank stops after step (\d+)", ranks_out)
    step = int(stop[1])
    assert step >= 2 and [int((out / "progress" / f"rank{r}").read_text()) for r in (0, 1)] == [step, step]
    (checkpoint,) = out.glob("checkpoint-*")
    assert checkpoint.name == f"checkpoint-{step}" and check_checkpoint(checkpoint) == []
    assert Manifest.from_json((checkpoint / MANIFEST_NAME).read_text()).step == step
    # Both ranks exited with the preemption's code. Not from the launcher's failure report: an agent that got the
    # SIGTERM itself re-raises it after its workers end and reports none of their codes.
    assert [(out / "exits" / f"rank{r}").read_text() for r in (0, 1)] == [str(PREEMPTED_EXIT_CODE)] * 2
    assert f"exiting with code {PREEMPTED_EXIT_CODE}" in ranks_out
    assert not (out / "final").exists()

    # The requeued job: SIGUSR2 to rank 1 alone, nothing to the shell. The launcher's status is 1 (no launcher
    # passes the ranks' 75 through); rank 0's stop record makes the shell requeue the job.
    running = sbatch_start(script, worker, **submit)
    _wait_for_step(out / "progress" / "rank0", step + 2, running, LAUNCH_TIMEOUT_S)
    os.kill(int((out / "progress" / "pid-rank1").read_text()), signal.SIGUSR2)
    second = running.wait(LAUNCH_TIMEOUT_S)
    second_out, resumed_log = second.stdout_file.read_text(), node_log.read_text()
    assert f"auto_resume: resuming from {checkpoint}" in resumed_log
    (stopped,) = re.findall(r"rank 1 received SIGUSR2: every rank stops after step (\d+)", resumed_log)
    assert f"job {JOB_ID}: requeueing (the ranks stopped on a signal: " in second_out, second_out
    assert '"signal": "SIGUSR2"' in second_out and f'"step": {stopped}' in second_out
    assert requeues.read_text() == f"requeue {JOB_ID}\n" * 2
    assert [int((out / "progress" / f"rank{r}").read_text()) for r in (0, 1)] == [int(stopped)] * 2

    third = sbatch(script, worker, **submit, timeout_s=LAUNCH_TIMEOUT_S)
    resumed_log = node_log.read_text()
    assert third.result.ok, f"{third.result.describe()}\n{third.stderr_file.read_text()}\n{resumed_log[-4000:]}"
    assert f"auto_resume: resuming from {out / f'checkpoint-{stopped}'}" in resumed_log
    # The record of the attempt before was cleared at the start: a job that ends on its own is not requeued.
    assert "requeue" not in third.stdout_file.read_text() and requeues.read_text() == f"requeue {JOB_ID}\n" * 2

    reference = tmp_path / "reference"
    started = time.monotonic()
    check_launch(accelerate_launch(yaml_file, [WORKER, str(reference), str(STEPS), "100"], cwd=tmp_path))
    reference_s = time.monotonic() - started
    resumed, uninterrupted = _final_weights(out), _final_weights(reference)
    assert resumed.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(resumed[name].view(torch.uint8), tensor.view(torch.uint8)), name
    print(
        f"signalled after step {step} (job {first_s:.0f} s, exit {first.result.returncode}); SIGUSR2 after step "
        f"{stopped} ({second.result.seconds:.0f} s); the job run to its end {third.result.seconds:.0f} s; "
        f"uninterrupted reference {reference_s:.0f} s"
    )
