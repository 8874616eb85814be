"""What ends long jobs, each in a real `accelerate launch` on CPU (2 ranks, ZeRO-3, the shipped config, a tiny Llama):
a rank SIGKILLed at step 2, before the first checkpoint, under `--max_restarts 1` (issue 41: the restart has nothing
to resume from and must start the run again by itself), a SIGTERM at the launcher, and a newest checkpoint that is
damaged (rank 1's optimizer file truncated, or 64 KiB of it zeroed, its size kept) or incomplete (its manifest
missing), and a SIGTERM before any step ended
(nothing to save) followed by a relaunch. A rank killed after a checkpoint is
test_offload_autoep's job, in the layout the planner recommends at scale (AutoEP + ZeRO-3 + both offloads). Every
job runs with `auto_resume=True` and must end with final weights bitwise equal to those of an uninterrupted run of the
same job, which is the independent reference: the model is built from its config after the recipe's seeding, the data
order is the sampler's, so nothing but the interruption differs.

Four launches: (1) the early-killed run, then, in the same processes after the restart, the uninterrupted reference;
(2) the run given SIGTERM after step 2; (2b) the run given SIGTERM before any step ended, which dies in seconds; (3)
the run of (2) started again, the three damaged-checkpoint jobs (copies of the reference's output directory up to
checkpoint-9, which is damaged), then the run of (2b) started again.
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_dist_recipes.checkpoint.manifest import MANIFEST_NAME, Manifest, check_checkpoint
from hf_dist_recipes.checkpoint.preemption import PREEMPTED_EXIT_CODE, STOP_FILE_ENV
from tests.support.damage import zero_the_middle
from tests.support.launch import LAUNCH_TIMEOUT_S, accelerate_launch, accelerate_launch_command, check_launch
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "survival_worker.py")
CONFIG = REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml"
STEPS, SAVE_STEPS, KILL_AT = 10, 3, 2  # checkpoints 3, 6, 9; rank 1 dies after step 2, before checkpoint-3
SIGNAL_AFTER = 2  # the launcher gets SIGTERM once rank 0 ended this step (each step end then waits PAUSE_S)
PAUSE_S = 0.5


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    assert out, f"no weights in {folder}"
    return out


def assert_bitwise_equal(folder: Path, reference: Path) -> None:
    got, want = weights(folder), weights(reference)
    assert sorted(got) == sorted(want)
    different = [name for name in want if not torch.equal(got[name], want[name])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def _step(out: Path) -> int:
    text = (out / "progress" / "rank0").read_text() if (out / "progress" / "rank0").exists() else ""
    return int(text) if text.strip() else 0


def sigterm_at_the_launcher(out: Path, option: str, ready) -> tuple[subprocess.CompletedProcess, int]:
    """Launch the paused job (`option`: the worker's pause), send SIGTERM to `accelerate launch` once `ready(out)`;
    the launch as it ended, and the step rank 0 had ended when the signal went."""
    cmd, env = accelerate_launch_command(CONFIG, [WORKER, str(out), str(STEPS), "100", option])
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not ready(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    signalled_at = _step(out)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), signalled_at


def sigusr2_to_rank_1(out: Path, stop_file: Path) -> tuple[subprocess.CompletedProcess, int]:
    """Launch the paused job under `--max_restarts 1`, its ranks fresh (their parent is the launcher, as on a
    cluster; a warm rank's is its server), and send SIGUSR2 to rank 1 alone once rank 0 ended SIGNAL_AFTER; the
    launch as it ended, and the step rank 0 had ended when the signal went."""
    cmd, env = accelerate_launch_command(
        CONFIG,
        [WORKER, str(out), str(STEPS), "100", f"step-pause={PAUSE_S}"],
        env={"PYTHON_EXEC": None, STOP_FILE_ENV: str(stop_file)},
        launch_args=("--max_restarts", "1"),
    )
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file, deadline = out / "progress" / "pid-rank1", time.monotonic() + LAUNCH_TIMEOUT_S
    while not (_ended_signal_after(out) and pid_file.exists()) and proc.poll() is None:
        assert time.monotonic() < deadline, "no step ended in time"
        time.sleep(0.05)
    signalled_at = _step(out)
    os.kill(int(pid_file.read_text()), signal.SIGUSR2)
    stdout, stderr = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), signalled_at


def _ended_signal_after(out: Path) -> bool:
    return _step(out) >= SIGNAL_AFTER


def _both_began(out: Path) -> bool:
    return all((out / "progress" / f"began-rank{r}").exists() for r in (0, 1))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("job_dies")
    early, reference, stopped, unsaved = root / "early", root / "reference", root / "stopped", root / "unsaved"
    first = accelerate_launch(
        CONFIG,
        [WORKER, str(early), str(STEPS), str(SAVE_STEPS), f"kill-at={KILL_AT}"]
        + ["then", str(reference), str(STEPS), str(SAVE_STEPS)],
        launch_args=("--max_restarts", "1"),
    )
    check_launch(first)
    term, signalled_at = sigterm_at_the_launcher(stopped, f"step-pause={PAUSE_S}", _ended_signal_after)
    usr2, usr2_at = sigusr2_to_rank_1(root / "usr2", root / "usr2.stopped.json")
    # SIGTERM once both ranks began their first step (train() began, its TensorBoard runs written): nothing to save.
    unsaved_term, _ = sigterm_at_the_launcher(unsaved, "begin-pause=60", _both_began)
    unsaved_left = sorted(p.name for p in unsaved.glob("checkpoint-*"))
    # As the stopped job left them, before the launch that continues it writes its own.
    after_term = {
        "checkpoints": sorted(p.name for p in stopped.glob("checkpoint-*")),
        "progress": {r: (stopped / "progress" / f"rank{r}").read_text() for r in (0, 1)},
        "exits": {p.name: p.read_text() for p in (stopped / "exits").iterdir()},
        "final": (stopped / "final").exists(),
    }
    damaged = {"truncated": root / "truncated", "zeroed": root / "zeroed", "no_manifest": root / "no_manifest"}
    for folder in damaged.values():
        # As if the job had died during step 10: checkpoint-9 is its newest.
        shutil.copytree(
            reference, folder, ignore=shutil.ignore_patterns("final", "survival", "progress", "checkpoint-10")
        )
    (optim,) = (damaged["truncated"] / "checkpoint-9").glob("global_step9/*rank_1*optim_states.pt")
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])
    (optim,) = (damaged["zeroed"] / "checkpoint-9").glob("global_step9/*rank_1*optim_states.pt")
    zero_the_middle(optim)  # 64 KiB, its size kept (issue 41: the sizes alone let it through)
    (damaged["no_manifest"] / "checkpoint-9" / MANIFEST_NAME).unlink()
    again = accelerate_launch(
        CONFIG,
        [WORKER, str(stopped), str(STEPS), "100"]
        + ["then", str(damaged["truncated"]), str(STEPS), str(SAVE_STEPS)]
        + ["then", str(damaged["zeroed"]), str(STEPS), str(SAVE_STEPS)]
        + ["then", str(damaged["no_manifest"]), str(STEPS), str(SAVE_STEPS)]
        + ["then", str(unsaved), str(STEPS), str(SAVE_STEPS)],
    )
    check_launch(again)
    return {
        "early": early,
        "first": first,
        "unsaved": unsaved,
        "unsaved_term": unsaved_term,
        "unsaved_left": unsaved_left,
        "reference": reference,
        "stopped": stopped,
        "term": term,
        "usr2": usr2,
        "usr2_at": usr2_at,
        "signalled_at": signalled_at,
        "after_term": after_term,
        "again": again,
        **damaged,
    }


def test_a_rank_killed_before_the_first_checkpoint_starts_the_run_again_by_itself(jobs):
    early, text = jobs["early"], jobs["first"].stdout + jobs["first"].stderr
    assert "exitcode: -9" in text and "local_rank: 1" in text  # the launcher saw rank 1 die of SIGKILL
    # The restart had nothing to resume: it started the run again, said so once, and kept the dead attempt's
    # TensorBoard runs aside (it refused to start before: the folder held another launch's event files).
    said = [line for line in text.splitlines() if "no checkpoint to resume from: the run starts again" in line]
    assert len(said) == 1, text[-3000:]
    (kept,) = early.glob("tensorboard.attempt-*")
    assert sorted(p.name for p in kept.iterdir()) == ["rank0", "rank1"] and str(kept) in said[0]
    assert list((kept / "rank1").glob("events.out.tfevents.*"))
    records = sorted(p.name for p in (early / "survival").glob("*.json"))
    assert records == ["rank0-attempt1.json", "rank1-attempt1.json"]
    # The dead attempt's hang dumps went aside too, named once: `logs hang` of the run reads one attempt's.
    (dumps,) = early.glob("flight_recorder.attempt-*")
    assert text.count(f"hang dumps of an earlier attempt kept in {dumps}") == 1, text[-3000:]
    assert all(p.stat().st_size for p in dumps.iterdir()) and not list((early / "flight_recorder").glob("rank_*"))
    assert_bitwise_equal(early / "final", jobs["reference"] / "final")


def test_a_sigterm_before_any_step_ended_then_a_relaunch_starts_the_run_again(jobs):
    """Nothing to save yet: the signal takes its stock course (the ranks die), and the relaunch, finding no
    checkpoint, starts the run again (it refused before issue 41: the dead attempt's event files were there)."""
    assert jobs["unsaved_term"].returncode != 0 and jobs["unsaved_left"] == []
    text = jobs["again"].stdout + jobs["again"].stderr
    assert "no checkpoint to resume from: the run starts again" in text
    (kept,) = jobs["unsaved"].glob("tensorboard.attempt-*")
    assert list((kept / "rank0").glob("events.out.tfevents.*"))
    assert_bitwise_equal(jobs["unsaved"] / "final", jobs["reference"] / "final")


def test_sigterm_at_the_launcher_saves_the_next_step_on_every_rank_and_exits_75(jobs):
    left = jobs["after_term"]
    (name,) = left["checkpoints"]  # save_steps 100: only the preemption's save
    checkpoint = jobs["stopped"] / name
    manifest = Manifest.from_json((checkpoint / MANIFEST_NAME).read_text())
    # The next step boundary: the step rank 0 ended when the signal went, or the one after it, never later.
    assert jobs["signalled_at"] <= manifest.step <= jobs["signalled_at"] + 1 < STEPS
    assert check_checkpoint(checkpoint) == [] and manifest.layout.world_size == 2
    # Every rank stopped after that same step, and left train() with the documented code.
    assert left["progress"] == {0: str(manifest.step), 1: str(manifest.step)}
    assert left["exits"] == {"rank0": str(PREEMPTED_EXIT_CODE), "rank1": str(PREEMPTED_EXIT_CODE)}
    text = jobs["term"].stdout + jobs["term"].stderr
    assert text.count(f"every rank stops after step {manifest.step}") == 1, text[-3000:]  # rank 0 says it once
    assert not left["final"]  # what follows train() in the script did not run
    assert jobs["term"].returncode != 0


def test_sigusr2_to_one_rank_under_max_restarts_ends_the_launch_after_the_save(jobs):
    """Issue 41: the elastic agent restarted the ranks that exited 75, and they trained on to the end."""
    launch = jobs["usr2"]
    out = Path(launch.args[launch.args.index(WORKER) + 1])
    text = launch.stdout + launch.stderr
    (checkpoint,) = out.glob("checkpoint-*")
    step = Manifest.from_json((checkpoint / MANIFEST_NAME).read_text()).step
    assert jobs["usr2_at"] <= step <= jobs["usr2_at"] + 1 < STEPS and check_checkpoint(checkpoint) == []
    # No rank trained past the save, no attempt started again, nothing after train() ran.
    assert {r: (out / "progress" / f"rank{r}").read_text() for r in (0, 1)} == {0: str(step), 1: str(step)}
    assert {p.name: p.read_text() for p in (out / "exits").iterdir()} == {"rank0": "75", "rank1": "75"}
    assert not (out / "final").exists() and not (out / "survival").exists()
    # The launch ends non-zero: accelerate exits 128 + SIGTERM once its agent is ended by a signal.
    assert launch.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert text.count("ending the launcher") == 1 and "--max_restarts (1 left)" in text, text[-3000:]
    # What the generated sbatch reads to requeue the job: the stop, written once the checkpoint was complete.
    stop = json.loads((out.parent / "usr2.stopped.json").read_text())
    assert stop == {"signal": "SIGUSR2", "rank": 1, "step": step, "checkpoint": str(checkpoint)}


def test_the_stopped_job_started_again_resumes_and_ends_equal_to_an_uninterrupted_run(jobs):
    (name,) = jobs["after_term"]["checkpoints"]
    assert f"auto_resume: resuming from {jobs['stopped'] / name}" in jobs["again"].stdout + jobs["again"].stderr
    assert_bitwise_equal(jobs["stopped"] / "final", jobs["reference"] / "final")


@pytest.mark.parametrize("damage", ["truncated", "zeroed", "no_manifest"])
def test_a_damaged_newest_checkpoint_is_named_and_passed_over_for_the_one_before(jobs, damage):
    folder = jobs[damage]
    text = jobs["again"].stdout + jobs["again"].stderr
    assert f"auto_resume: resuming from {folder / 'checkpoint-6'}" in text
    named = [line for line in text.splitlines() if str(folder / "checkpoint-9") in line]
    assert named, text[-3000:]
    if damage == "no_manifest":
        assert "manifest" in named[0]
    else:  # named in one line: the file, and (zeroed) that its content is not what was saved
        assert "rank_1" in named[0] and "optim_states" in named[0]
        assert ("not what was saved" in named[0]) == (damage == "zeroed"), named[0]
    assert_bitwise_equal(folder / "final", jobs["reference"] / "final")
    assert os.path.getsize(next((folder / "checkpoint-9").glob("global_step9/*rank_1*optim_states.pt"))) > 0
