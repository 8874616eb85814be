"""Preemption and time limits: a signal that reaches any rank makes every rank save the same step, then exit.

A scheduler ends a job with a signal: Slurm at `--time` (the generated sbatch turns its `--signal=B:USR1@600` into a
SIGTERM to the launchers, `planning.launch_scripts`), a preempting scheduler, `scancel`, torchrun forwarding the
SIGTERM it got to every worker. Stock, the process dies on it and the steps since the last checkpoint are lost.

`PreemptionCallback` (on by default: `RecipeTrainingArguments.preemption_signals`, SIGTERM and SIGUSR2) records the
signal in its handler and does nothing else there. At each step end the ranks agree on it: one all-reduce (MAX) of
two integers over the default group, so ranks that got the signal at different moments, or not at all, stop after
the same step. Then every rank saves that step's checkpoint (complete, with its manifest: `checkpoint.manifest`) and
`train()` ends; `RecipeTrainerMixin.train` then exits with `PREEMPTED_EXIT_CODE` (75, EX_TEMPFAIL: "try again"), and
a job started again with `auto_resume` continues from that checkpoint. The agreement's cost per step is measured by
benchmarks/preemption_check.py (benchmarks/results/).

Not SIGUSR1: it writes a rank's state for `logs hang` (`comm.flight_recorder.DUMP_SIGNAL`), which must not also stop
the job. A signal before the first step of this `train()` ended finds nothing new to save: the process ends as it
would have without the recipe. A rank that does not reach the next step end within `grace_s` (twice the longest
time between two step ends so far, plus `GRACE_MARGIN_S`: a step with its save or evaluation) is stuck, not busy:
it ends then, as the signal's previous course would have ended it (with the flight recorder's state dump, where
the watchdog runs one: `HangWatchdogCallback` hands this callback its `SignalDump`). Once the ranks agreed, the
save is bounded by the collective timeout of a save instead.

torchrun gives its workers 30 s after forwarding a SIGTERM, then kills them (`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`); the
generated launch scripts raise it to 540 s, a minute short of the time limit's signal lead
(`planning.launch_scripts.SHUTDOWN_TIMEOUT_S`).

The launch ends too (`end_launch`, after the save, every rank). The elastic agent of `accelerate launch` and torchrun
reads any non-zero exit as a failure: with `--max_restarts` left it starts the ranks again, which resume and train on
through the scheduler's grace (issue 41). So once every rank is past the save, the first rank of each node ends its
agent with SIGTERM (the agent's own death signal: it stops its workers and exits; no restart) and every rank waits
for that, then exits 75. No launcher lets 75 through: a rank's 75 is a `ChildFailedError`, status 1, and an agent
ended by a signal exits 128 + 15 under `accelerate launch` (its `_run_torchrun`) and 1 under torchrun (the uncaught
`SignalException`). So rank 0 also writes the stop (JSON: the signal, the rank it reached, the step, the checkpoint)
to `$HF_DIST_RECIPES_STOP_FILE` when set: the generated sbatch sets it and requeues the job when it appears.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transformers import TrainerCallback

from hf_dist_recipes.core.files import write_atomically

logger = logging.getLogger(__name__)

PREEMPTED_EXIT_CODE = 75  # os.EX_TEMPFAIL: the run stopped on a signal, saved, and continues when started again
STOP_FILE_ENV = "HF_DIST_RECIPES_STOP_FILE"  # where rank 0 writes the agreed stop once its checkpoint is complete
AGENT_WAIT_S = 30.0  # how long a rank waits for its agent to end it after the agent was signalled, then exits itself
DEFAULT_PREEMPTION_SIGNALS = "SIGTERM,SIGUSR2"
GRACE_MARGIN_S = 30.0
# Signals that must keep their meaning: the state dump, the interrupt a person types, and those no handler can catch.
_RESERVED = {"SIGUSR1": "writes a rank's state for `logs hang`", "SIGINT": "is Ctrl-C", "SIGKILL": "cannot be caught"}
_RESERVED["SIGSTOP"] = _RESERVED["SIGKILL"]


def parse_signals(value: str | Sequence[str] | None) -> tuple[signal.Signals, ...]:
    """The signals of a `preemption_signals` value: names separated by commas ("SIGTERM,SIGUSR2"), a sequence of
    names, or "none" / "" / None for none. ValueError naming the fix for an unknown or reserved name."""
    if value is None:
        return ()
    names = [n.strip().upper() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()]
    if names in ([], ["NONE"], ["OFF"]):
        return ()
    found = []
    for name in names:
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full in _RESERVED:
            raise ValueError(
                f"preemption_signals: {full} {_RESERVED[full]}; use SIGTERM and/or SIGUSR2 (default "
                f"{DEFAULT_PREEMPTION_SIGNALS}), or 'none'"
            )
        number = getattr(signal, full, None)
        if not isinstance(number, signal.Signals):
            raise ValueError(f"preemption_signals: no signal {name!r}; e.g. preemption_signals='SIGTERM,SIGUSR2'")
        if number not in found:
            found.append(number)
    return tuple(found)


def grace_s(longest_gap_s: float) -> float:
    """Seconds a rank has, after the signal, to reach the next step end: twice the longest time between two step
    ends so far (a step with a save or an evaluation) plus GRACE_MARGIN_S."""
    return 2 * longest_gap_s + GRACE_MARGIN_S


@dataclass(frozen=True)
class Stop:
    """What the ranks agreed: `signal_name` reached rank `first_rank` (the lowest rank that had it), and every rank
    stopped after `step`, saving checkpoint-`step`."""

    signal_name: str
    first_rank: int
    step: int


class PreemptionCallback(TrainerCallback):
    """Save and stop on `signals` (module docstring). `stop` is set once the ranks agreed; `received` holds the
    signal this rank got (None: none yet). `on_expire(signum)` ends a rank that did not reach a step end within
    the grace (default: exit with 128 + signum, as a death by that signal reads in a shell)."""

    def __init__(self, signals: Sequence[signal.Signals], *, clock: Callable[[], float] = time.monotonic):
        self.signals = tuple(signals)
        self.clock = clock
        self.on_expire: Callable[[int], None] = _exit_for
        self.received: int | None = None
        self.stop: Stop | None = None
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None
        self._last_step_end: float | None = None
        self._longest_gap = 0.0
        self._lock = threading.Lock()

    def request(self, signum: int) -> float | None:
        """Record `signum` (the first one counts) and return the grace in seconds, after which `on_expire` ends the
        process unless train() has ended by then; None when no step of this train() has ended yet (nothing new to
        save: the caller ends the process now). Safe from a signal handler and from another thread."""
        if signum not in self.signals or self._last_step_end is None:
            return None
        grace = grace_s(self._longest_gap)
        with self._lock:
            if self.received is None:
                self.received = signum
                self._timer = threading.Timer(grace, self.on_expire, (signum,))
                self._timer.daemon = True
                self._timer.start()
        return grace

    def abandon(self) -> None:
        """train() is failing: a signal now (the launcher ending the ranks after another one died) takes its
        previous course at once, and one already received ends the process now instead of after the grace."""
        with self._lock:
            self._last_step_end = None
            if self._timer is not None:
                self._timer.cancel()
        if self.received is not None and self.stop is None:
            self.on_expire(self.received)

    def _handler(self, signum, frame):
        if self.request(signum) is not None:
            return
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        else:  # its default action: the process ends as it would have without the recipe
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def on_train_begin(self, args, state, control, **kwargs):
        self.received, self.stop, self._last_step_end, self._longest_gap = None, None, None, 0.0
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be installed from the main thread; a trainer driven from another goes without
        for signum in self.signals:
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._handler)

    def on_step_end(self, args, state, control, **kwargs):
        if not self.signals:
            return  # preemption_signals="none": no handler, no collective
        now = self.clock()
        if self._last_step_end is not None:
            self._longest_gap = max(self._longest_gap, now - self._last_step_end)
        self._last_step_end = now
        signum, first_rank = agree(self.received, args)
        if not signum:
            return
        if self._timer is not None:
            self._timer.cancel()  # it reached the step end, so it is not stuck; the save has its own timeout
        name = signal.Signals(signum).name
        self.stop = Stop(name, first_rank, state.global_step)
        control.should_save = control.should_training_stop = True
        if state.is_world_process_zero:
            logger.warning(
                "rank %d received %s: every rank stops after step %d, saves checkpoint-%d and exits with code %d "
                "(resume: auto_resume, which the generated launch scripts turn on)",
                first_rank,
                name,
                state.global_step,
                state.global_step,
                PREEMPTED_EXIT_CODE,
            )

    def on_train_end(self, args, state, control, **kwargs):
        if self._timer is not None:
            self._timer.cancel()  # also a signal that came too late to stop training: train() ended on its own
        if threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                # Only where ours is still there: a callback that installed before us and ends before us (the
                # TensorBoard flush, the state dump) has put back what was there before both of us.
                if signal.getsignal(signum) == self._handler:
                    signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            self._previous = {}


def agree(received: int | None, args) -> tuple[int, int]:
    """(the highest signal number any rank received, the lowest rank that received one); (0, 0) when none did. One
    all-reduce of two integers over the default group (on the GPU under NCCL); no collective in one process."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return (received or 0, 0)
    world, rank = dist.get_world_size(), dist.get_rank()
    device = args.device if "nccl" in str(dist.get_backend()) else "cpu"
    flags = torch.tensor([received or 0, world - rank if received else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    signum, lowest = (int(v) for v in flags.tolist())
    return (signum, world - lowest) if signum else (0, 0)


def _exit_for(signum: int) -> None:
    name = signal.Signals(signum).name
    print(
        f"[hf_dist_recipes] {name}: this rank did not reach a step end within the grace after the signal; ending it",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + signum)


def restarts_left(environ=os.environ) -> int:
    """How many more times the elastic agent that started this process would start the ranks again (0: none, or not
    under an agent): TORCHELASTIC_MAX_RESTARTS less TORCHELASTIC_RESTART_COUNT, both set by the agent."""
    try:
        return max(0, int(environ["TORCHELASTIC_MAX_RESTARTS"]) - int(environ["TORCHELASTIC_RESTART_COUNT"]))
    except (KeyError, ValueError):
        return 0


# How an elastic agent's command line begins: `torchrun`, `python -m torch.distributed.run`, `accelerate launch`,
# `python -m accelerate.commands.launch` (each word's last path component).
_LAUNCHERS = ("torchrun", "torch.distributed.run", "accelerate launch", "accelerate.commands.launch")


def is_launcher(pid: int) -> bool:
    """Whether process `pid` runs torchrun or `accelerate launch` (Linux /proc; False where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = [os.path.basename(w.decode(errors="replace")) for w in f.read().split(b"\0")[:4]]
    except OSError:
        return False
    pairs = words + [f"{a} {b}" for a, b in zip(words, words[1:], strict=False)]
    return any(name in pairs for name in _LAUNCHERS)


def end_launch(stop: Stop, checkpoint: str, *, rank: int, local_rank: int, environ=os.environ) -> None:
    """On every rank after the agreed save, before the exit with PREEMPTED_EXIT_CODE (module docstring): wait until
    the checkpoint is complete on every rank, write the stop record (rank 0, `STOP_FILE_ENV`), and where the agent has
    restarts left, end it and wait for it to end this rank (SystemExit(75) from its SIGTERM, or after AGENT_WAIT_S)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # rank 0's manifest is written: the checkpoint is complete
    if rank == 0 and environ.get(STOP_FILE_ENV):
        record = {"signal": stop.signal_name, "rank": stop.first_rank, "step": stop.step, "checkpoint": checkpoint}
        try:
            write_atomically(environ[STOP_FILE_ENV], json.dumps(record) + "\n", durable=True)
        except OSError as error:  # the checkpoint is complete: a missing record must not turn the exit into a crash
            said = (STOP_FILE_ENV, environ[STOP_FILE_ENV], error)
            logger.warning("%s=%s: the stop was not recorded (%s); a script that requeues on it will not", *said)
    left, agent = restarts_left(environ), os.getppid()
    if not left:
        return
    if not is_launcher(agent):  # e.g. notebook_launcher's agent is the notebook's kernel: never signalled
        if rank == 0:
            logger.warning("the elastic agent may start the ranks again (%d restarts left): it is not this rank's "
                           "parent process, a torchrun or accelerate launch, which this would end", left)  # fmt: skip
        return
    if rank == 0:
        logger.warning(
            "ending the launcher (pid %d) with SIGTERM: its --max_restarts (%d left) would start the ranks again, and "
            "they stopped on %s to be started again from checkpoint-%d; the launch exits non-zero",
            agent, left, stop.signal_name, stop.step,
        )  # fmt: skip

    def ended(signum, frame):
        raise SystemExit(PREEMPTED_EXIT_CODE)

    signal.signal(signal.SIGTERM, ended)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # the handler is in place on every rank before any agent stops its workers
    if local_rank == 0:
        os.kill(agent, signal.SIGTERM)
    deadline = time.monotonic() + AGENT_WAIT_S
    while os.getppid() == agent and time.monotonic() < deadline:
        time.sleep(0.05)
