"""Save and stop on a signal (`checkpoint.preemption`), in one process: a real RecipeTrainer on the tiny DeepSeek model
sent SIGTERM (SIGUSR2) by itself mid-step, which saves that step's complete checkpoint and exits 75; the signals a
user may name; the grace after which a rank that never reaches a step end ends; a failing train() giving the signal
back. The multi-rank agreement (ranks signalled at different moments save the same step) and the launcher's SIGTERM:
tests/distributed/test_job_dies.py."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from transformers import TrainerCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.checkpoint.manifest import MANIFEST_NAME, Manifest, check_checkpoint
from hf_dist_recipes.checkpoint.preemption import (
    GRACE_MARGIN_S,
    PREEMPTED_EXIT_CODE,
    PreemptionCallback,
    grace_s,
    parse_signals,
)
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from tests.support.models import SMALL

STEPS = 6


class SignalAt(TrainerCallback):
    """Sends `signum` to this process in the middle of step `step` (at its begin: the step still has to run)."""

    def __init__(self, step: int, signum: int):
        self.step, self.signum = step, signum

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signum)


def _trainer(out: Path, callbacks=(), **overrides) -> RecipeTrainer:
    args = RecipeTrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2,
                                   learning_rate=3e-3, logging_steps=1, save_strategy="no", disable_tqdm=True,
                                   report_to="none", seed=7, use_cpu=True, **overrides)  # fmt: skip
    return RecipeTrainer(model=build_tiny_deepseek(**SMALL), args=args, callbacks=list(callbacks),
                         train_dataset=stdlib_dataset(seq_len=16, max_bytes=4_000))  # fmt: skip


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR2])
def test_a_signal_during_a_step_saves_that_step_and_exits_75(tmp_path, signum, caplog):
    before = signal.getsignal(signum)
    trainer = _trainer(tmp_path, [SignalAt(3, signum)])
    with pytest.raises(SystemExit) as stopped:
        trainer.train()
    assert stopped.value.code == PREEMPTED_EXIT_CODE
    # save_strategy "no": the one checkpoint is the signal's, of the step the signal came in, and it is complete.
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-3"]
    manifest = Manifest.from_json((tmp_path / "checkpoint-3" / MANIFEST_NAME).read_text())
    assert manifest.step == 3 and check_checkpoint(tmp_path / "checkpoint-3") == []
    assert trainer.state.global_step == 3
    assert trainer.recipe_callbacks.preemption.stop.signal_name == signal.Signals(signum).name
    assert signal.getsignal(signum) == before  # the handler is gone with the run


def test_the_stopped_run_resumed_ends_as_the_uninterrupted_one(tmp_path):
    full = _trainer(tmp_path / "full")
    full.train()
    stopped = _trainer(tmp_path / "stopped", [SignalAt(2, signal.SIGTERM)], auto_resume=True)
    with pytest.raises(SystemExit):
        stopped.train()
    resumed = _trainer(tmp_path / "stopped", auto_resume=True)
    resumed.train()
    want, got = full.model.state_dict(), resumed.model.state_dict()
    assert all(got[k].equal(want[k]) for k in want)


def test_preemption_signals_none_keeps_the_stock_behaviour(tmp_path):
    trainer = _trainer(tmp_path, preemption_signals="none")
    assert trainer.recipe_callbacks.preemption.signals == ()
    before = signal.getsignal(signal.SIGUSR2)
    trainer.train()  # no handler installed, nothing agreed: train() returns
    assert signal.getsignal(signal.SIGUSR2) == before
    assert trainer.recipe_callbacks.preemption._last_step_end is None  # its step end returned before any work
    assert not list(tmp_path.glob("checkpoint-*"))


def test_signals_a_user_may_name_and_those_refused_with_the_fix():
    assert parse_signals("SIGTERM,SIGUSR2") == (signal.SIGTERM, signal.SIGUSR2)
    assert parse_signals(" term , usr2,TERM") == (signal.SIGTERM, signal.SIGUSR2)
    assert parse_signals("none") == parse_signals("") == parse_signals(None) == ()
    with pytest.raises(ValueError, match="SIGUSR1 writes a rank's state"):
        parse_signals("SIGTERM,SIGUSR1")
    with pytest.raises(ValueError, match="SIGINT is Ctrl-C"):
        parse_signals("INT")
    with pytest.raises(ValueError, match="no signal 'SIGTERN'"):
        parse_signals("SIGTERN")
    with pytest.raises(ValueError, match="SIGUSR1"):
        RecipeTrainingArguments(output_dir="x", preemption_signals="SIGUSR1", report_to="none")


class _Args:
    device = "cpu"


def test_a_rank_that_never_reaches_a_step_end_ends_after_the_grace():
    expired = threading.Event()
    clock = iter([100.0, 104.0, 105.0])  # step ends 4 s then 1 s apart: the longest gap is 4 s
    callback = PreemptionCallback((signal.SIGTERM,), clock=lambda: next(clock))
    callback.on_expire = lambda signum: expired.set()
    assert callback.request(signal.SIGTERM) is None  # no step ended yet: nothing to save, end now
    for _ in range(3):
        callback.on_step_end(_Args(), _State(), _Control())
    assert grace_s(4.0) == 8.0 + GRACE_MARGIN_S
    assert callback.request(signal.SIGUSR2) is None  # not one of its signals
    grace = callback.request(signal.SIGTERM)
    assert grace == grace_s(4.0)
    callback._timer.cancel()  # the real grace is 38 s; run the same timer at once
    callback._timer = threading.Timer(0.01, callback.on_expire, (signal.SIGTERM,))
    callback._timer.start()
    assert expired.wait(5)


def test_a_failing_train_ends_a_rank_that_was_signalled_at_once():
    ended = []
    callback = PreemptionCallback((signal.SIGTERM,))
    callback.on_expire = ended.append
    callback.on_step_end(_Args(), _State(), _Control())  # one step ended: a signal now asks for a save
    assert callback.request(signal.SIGTERM) is not None
    callback.abandon()  # train() raised (a peer died): the launcher's SIGTERM is an end, not a save
    assert ended == [signal.SIGTERM]
    assert callback.request(signal.SIGTERM) is None


class _State:
    global_step = 1
    is_world_process_zero = True


class _Control:
    should_save = should_training_stop = False


def test_a_checkpoint_saved_into_again_reads_incomplete_until_its_new_manifest(tmp_path):
    """Issue 41: a run rolled back to checkpoint-2 (here: resumed from it by path) saves into checkpoint-4 again.
    While its files are being rewritten the folder must not read as complete under the old manifest: a kill then
    would leave two runs' files that a resume accepts. Seen from inside the save, through the trainer."""
    seen = []

    class Watched(RecipeTrainer):
        def save_model(self, output_dir=None, _internal_call=False):
            if _internal_call:  # the checkpoint's own weights, the first files _save_checkpoint writes
                seen.append((os.path.basename(output_dir), check_checkpoint(output_dir)))
            return super().save_model(output_dir, _internal_call)

    def run(resume=None):
        args = RecipeTrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                                       save_strategy="steps", save_steps=2, disable_tqdm=True, report_to="none",
                                       seed=7, use_cpu=True)  # fmt: skip
        Watched(model=build_tiny_deepseek(**SMALL), args=args,
                train_dataset=stdlib_dataset(seq_len=16, max_bytes=4_000)).train(resume)  # fmt: skip

    run()
    assert [name for name, _ in seen] == ["checkpoint-2", "checkpoint-4"] and check_checkpoint(
        tmp_path / "checkpoint-4"
    ) == []
    seen.clear()
    run(str(tmp_path / "checkpoint-2"))
    ((name, problems),) = seen
    assert name == "checkpoint-4" and problems == [f"no {MANIFEST_NAME} (its save did not finish)"]
    assert check_checkpoint(tmp_path / "checkpoint-4") == []  # complete again once its files are


def test_restarts_left_counts_what_the_elastic_agent_would_still_start():
    from hf_dist_recipes.checkpoint.preemption import restarts_left

    assert restarts_left({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "1"}) == 2
    assert restarts_left({"TORCHELASTIC_MAX_RESTARTS": "1", "TORCHELASTIC_RESTART_COUNT": "1"}) == 0
    assert restarts_left({}) == 0  # not under an agent (srun python train.py, a notebook)


# Command lines as the launchers' processes have them: (how it is started, a launcher?). The modules and scripts are
# stand-ins that sleep, under the launchers' names, so /proc shows the same words.
COMMAND_LINES = {
    "torchrun": (["torchrun", "--nproc-per-node", "8"], True),
    "python -m torch.distributed.run": (["-m", "torch.distributed.run", "train.py"], True),
    "accelerate launch": (["accelerate", "launch", "train.py"], True),
    "python -m accelerate.commands.launch": (["-m", "accelerate.commands.launch", "train.py"], True),
    "a notebook's kernel": (["-m", "ipykernel_launcher", "-f", "k.json"], False),  # notebook_launcher's agent
    "accelerate config": (["accelerate", "config"], False),
}


@pytest.mark.parametrize("name", list(COMMAND_LINES))
def test_only_a_torchrun_or_accelerate_launch_parent_is_taken_for_the_agent(name, tmp_path):
    import subprocess
    import sys
    import time

    from hf_dist_recipes.checkpoint.preemption import is_launcher

    words, launcher = COMMAND_LINES[name]
    sleep = "import time; time.sleep(30)\n"
    for module in ("torch.distributed.run", "accelerate.commands.launch", "ipykernel_launcher"):
        path = tmp_path.joinpath("modules", *module.split("."))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".py").write_text(sleep)
    (tmp_path / "bin").mkdir()
    for script in ("torchrun", "accelerate"):
        (tmp_path / "bin" / script).write_text(sleep)
    python = str(Path(sys.prefix) / "bin" / "python")  # not sys.executable: in a warm session, its stand-in
    argv = [python, *words] if words[0] == "-m" else [python, str(tmp_path / "bin" / words[0]), *words[1:]]
    # Through bash's exec: a session with warm servers rewrites a launcher's command line given to Popen.
    proc = subprocess.Popen(
        ["bash", "-c", 'exec "$@"', "bash", *argv],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "modules")},
    )
    try:
        cmdline, deadline = Path(f"/proc/{proc.pid}/cmdline"), time.monotonic() + 10
        while cmdline.read_bytes().split(b"\0")[0] != python.encode():  # bash until it execs
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert is_launcher(proc.pid) is launcher, cmdline.read_bytes()
    finally:
        proc.kill()
        proc.wait()
    assert not is_launcher(os.getpid()) and not is_launcher(proc.pid)  # pytest; a process gone


def test_the_stop_record_is_written_once_complete_and_a_path_it_cannot_write_is_named_not_fatal(tmp_path, caplog):
    import json
    import logging

    from hf_dist_recipes.checkpoint.preemption import STOP_FILE_ENV, Stop, end_launch

    stop, record = Stop("SIGUSR2", 1, 4), tmp_path / "job-7.stopped.json"
    end_launch(stop, "runs/x/checkpoint-4", rank=0, local_rank=0, environ={STOP_FILE_ENV: str(record)})
    assert json.loads(record.read_text()) == {
        "signal": "SIGUSR2",
        "rank": 1,
        "step": 4,
        "checkpoint": "runs/x/checkpoint-4",
    }
    end_launch(stop, "c", rank=1, local_rank=1, environ={STOP_FILE_ENV: str(tmp_path / "other.json")})
    assert not (tmp_path / "other.json").exists()  # rank 0 alone writes it
    missing = tmp_path / "no-such-folder" / "job.stopped.json"
    with caplog.at_level(logging.WARNING, logger="hf_dist_recipes.checkpoint.preemption"):
        end_launch(stop, "c", rank=0, local_rank=0, environ={STOP_FILE_ENV: str(missing)})
    assert f"{STOP_FILE_ENV}={missing}: the stop was not recorded" in caplog.text
