"""No silent hangs: when a rank dies or stops, every other rank ends within a bound, naming it and its last step.

Measured on this project's 2-core CPU machine (torch 2.13, Gloo, two `accelerate launch` machines on 127.0.0.1),
machine 1's rank killed with SIGKILL at step 5: under plain DDP, machine 0's next all_gather raised "Connection closed
by peer" about 1 s later (the kernel closed the dead process's sockets), exit 1, naming neither rank nor step; under
DeepSpeed ZeRO-3 (shared/reference/verified-on-cpu.md), machine 0 still waited more than 200 s later. A rank alive but
stuck, or a host gone without closing its sockets, is the same: the survivors wait for the collective timeout.

Two bounds, one per failure:
- a peer that is gone (process killed, host down, store unreachable): every `interval_s` each rank's daemon thread
  writes a heartbeat `(seq, step, host, state)` under `hf_dist_recipes/heartbeat/<rank>` in the default group's store
  and reads its peers'. A peer whose `seq` stays the same for `peer_timeout` seconds of this rank's monotonic clock
  (no clocks compared across hosts) is lost: the thread prints its rank, host and last step and ends this process with
  exit code 3 (`LOST_PEER_EXIT_CODE`), as no Python exception reaches a main thread blocked in a C++ collective;
- a peer alive but stuck in Python or CUDA (its heartbeat thread still beats): the collective timeout, `ddp_timeout`
  at start-up (2 hours in the recipe, 30 minutes stock: it must cover rank 0 reading a large checkpoint alone under
  ZeRO-3), `RecipeTrainingArguments.step_timeout` once the first optimizer step finished.

A save is not a hang: `RecipeTrainer.save_model` tells the recipe callbacks the bytes the busiest rank writes
(`on_save_begin`); `HangWatchdogCallback.begin_save` raises (never lowers) the collective timeout to `save_bound` of
them (by default `parallel.checkpoint_bytes.save_timeout_s`, handed over by `recipe_callbacks`: step timeout + bytes at
an assumed 100 MiB/s per rank) until the checkpoint is complete (`on_save`, after the engine's files) or `save_model`
returns (a final save). The heartbeat beats on meanwhile, so the peer bound needs nothing.

What each rank was doing: before a rank ends for a lost peer, and when a collective of `train()` fails or times out,
it writes its flight recorder and threads' stacks to `<output_dir>/flight_recorder/` (once per process, the first
failure's), as does SIGUSR1 sent to a rank's process while training runs; a rank Gloo aborts (a collective mismatch)
leaves its stacks in `fatal_rank_<N>.txt` there. Both messages name `hf-dist-recipes logs hang <output_dir>`
(`hang_report_hint`): the collective where the ranks part, the rank that never arrived, each rank's line of code.

Why one file of about 430 lines: the heartbeat, the bounds it enforces (peer, step, start-up, save) and the callback
that switches between them share one state machine per rank, whose order at train begin, each step, a save and a
failure is the correctness argument; the dumps and the sentence pointing at them live in `comm.flight_recorder`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from hf_dist_recipes._compat import torch as compat_torch
from hf_dist_recipes.comm.flight_recorder import (
    AutomaticDump,
    FatalStacks,
    SignalDump,
    hang_report_hint,
    set_aside_dumps,
)
from hf_dist_recipes.comm.flight_recorder import is_collective_error as looks_like_lost_peer
from hf_dist_recipes.runtime import RecipeCallback

logger = logging.getLogger(__name__)

HEARTBEAT_PREFIX = "hf_dist_recipes/heartbeat/"
LOST_KEY = "hf_dist_recipes/lost"  # the first rank that finds a lost peer writes its message here for all others
WATCH_FANOUT = 8  # peers each rank reads: the store serves world_size * 8 reads per interval, not world_size ** 2
LOST_PEER_EXIT_CODE = 3
RUNNING, DONE = "running", "done"


def heartbeat_interval(peer_timeout: float) -> float:
    """Seconds between beats: a tenth of the bound, within [0.5, 10] s, so a lost peer is found within about
    `peer_timeout + interval` and a healthy one has beaten several times before it could look stale."""
    return min(10.0, max(0.5, peer_timeout / 10))


def watched_peers(rank: int, world_size: int, fanout: int = WATCH_FANOUT) -> list[int]:
    """The ranks `rank` watches: the next `fanout` ranks, cyclically. Every rank is watched by `fanout` others, so
    a lost rank is found as soon as by watching all, and the finder tells everyone through `LOST_KEY`."""
    return [(rank + i) % world_size for i in range(1, min(fanout, world_size - 1) + 1)]


def validate_hang_settings(peer_timeout: float, step_timeout: float) -> None:
    """ValueError naming the fix for a bound that cannot work."""
    if peer_timeout != 0 and peer_timeout < 5:
        raise ValueError(
            f"peer_timeout={peer_timeout}: use at least 5 seconds (a loaded machine can pause a "
            "heartbeat for a few seconds), or 0 to turn the heartbeat off"
        )
    if step_timeout < 0:
        raise ValueError(f"step_timeout={step_timeout}: use seconds > 0, or 0 to keep ddp_timeout for the whole run")


@dataclass(frozen=True)
class Beat:
    """One heartbeat: `seq` counts up with every beat; `step` is the last finished optimizer step."""

    seq: int
    step: int
    host: str
    state: str = RUNNING

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Beat:
        return cls(**json.loads(raw))


class PeerWatch:
    """Which peers have gone silent, from beats observed at times of this rank's own monotonic clock.

    A peer counts as alive from `start` until it first beats, so a rank that starts late has `timeout_s` to do so.
    A peer whose last beat says `done` finished normally and is never stale."""

    def __init__(self, peers: list[int], timeout_s: float, start: float):
        self.timeout_s = timeout_s
        self.last_beat: dict[int, Beat | None] = {p: None for p in peers}
        self.last_change: dict[int, float] = {p: start for p in peers}

    def observe(self, peer: int, beat: Beat | None, now: float) -> None:
        previous = self.last_beat[peer]
        if beat is not None and (previous is None or beat.seq != previous.seq or beat.state != previous.state):
            self.last_beat[peer], self.last_change[peer] = beat, now

    def stale(self, now: float) -> list[int]:
        done = {p for p, b in self.last_beat.items() if b and b.state == DONE}
        return [p for p, t in self.last_change.items() if now - t > self.timeout_s and p not in done]


def _end_process(message: str) -> None:
    logger.error(message)
    print(f"[hf_dist_recipes] {message}", file=sys.stderr, flush=True)
    os._exit(LOST_PEER_EXIT_CODE)


class HeartbeatWatchdog:
    """Beats into `store` for `rank` and watches the other ranks; `on_lost(message)` when one goes silent (default:
    print it and end the process with `LOST_PEER_EXIT_CODE`). `beat_once` and `check_once` are one round each; the
    thread started by `start` runs them every `interval_s` seconds."""

    def __init__(
        self,
        store,
        rank: int,
        world_size: int,
        timeout_s: float,
        *,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        host: str | None = None,
        on_lost: Callable[[str], None] = _end_process,
        output_dir: str | None = None,
    ):
        self.store, self.rank, self.timeout_s, self.clock, self.on_lost = store, rank, timeout_s, clock, on_lost
        self.output_dir = output_dir  # named in the lost-peer message, where the ranks' dumps go
        self.interval_s = heartbeat_interval(timeout_s) if interval_s is None else interval_s
        self.host = host or socket.gethostname()
        self.step, self.seq = 0, 0
        self.watch = PeerWatch(watched_peers(rank, world_size), timeout_s, clock())
        self._beat_lock = threading.Lock()  # beats come from the watching thread and from `set_step`
        self.store_failing_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat_once(self, state: str = RUNNING) -> None:
        with self._beat_lock:
            self.seq += 1
            self.store.set(f"{HEARTBEAT_PREFIX}{self.rank}", Beat(self.seq, self.step, self.host, state).encode())

    def set_step(self, step: int) -> None:
        """Record a finished optimizer step and beat at once, so a peer that dies right after it is reported with
        it (one store write per step: about 0.1 ms on one host)."""
        self.step = step
        self.beat_once()

    def check_once(self) -> str | None:
        """The message naming the first silent peer (or the unreachable store), else None."""
        if self.store.check([LOST_KEY]):
            here = f"this rank {self.rank} on {self.host} is at step {self.step}"
            return f"{self.store.get(LOST_KEY).decode()} [reported through the store; {here}]"
        now = self.clock()
        for peer in self.watch.last_beat:
            key = f"{HEARTBEAT_PREFIX}{peer}"
            self.watch.observe(peer, Beat.decode(self.store.get(key)) if self.store.check([key]) else None, now)
        for peer in self.watch.stale(now):
            message = self.lost_peer_message(peer, now)
            if not self.store.check([LOST_KEY]):
                self.store.set(LOST_KEY, message)
            return message
        return None

    def lost_peer_message(self, peer: int, now: float) -> str:
        beat, silent_s = self.watch.last_beat[peer], now - self.watch.last_change[peer]
        where = f"rank {peer} (host {beat.host})" if beat else f"rank {peer} (host unknown: it never sent a heartbeat)"
        last = f"its last step was {beat.step}" if beat else "it reached no step"
        return (
            f"lost {where}: no heartbeat for {silent_s:.0f} s (peer_timeout={self.timeout_s:g} s); {last}, this rank "
            f"{self.rank} on {self.host} is at step {self.step}. Ending rank {self.rank} with exit code "
            f"{LOST_PEER_EXIT_CODE} instead of waiting in a collective. Look at rank {peer}'s log and host (killed, "
            "out of memory, hardware); peer_timeout sets the bound (0: off)." + hang_report_hint(self.output_dir)
        )

    def stuck_rank_message(self, timeout_s: float, output_dir: str | None = None) -> str:
        peers = "; ".join(f"rank {p} ({b.host}): step {b.step}" for p, b in sorted(self.watch.last_beat.items()) if b)
        return (
            f"a collective timed out after {timeout_s:g} s while the peers' heartbeats went on: a rank is alive but "
            f"stuck (data loading, I/O, a deadlock, or a collective the others did not call). Last steps: this rank "
            f"{self.rank} ({self.host}): step {self.step}; {peers}. step_timeout sets this bound once steps run, "
            "ddp_timeout before." + hang_report_hint(output_dir)
        )

    def _round(self) -> str | None:
        try:
            self.beat_once()
            message = self.check_once()
        except Exception as err:  # the store's host (machine 0 under torchrun) is gone or unreachable
            now = self.clock()
            self.store_failing_since = self.store_failing_since or now
            if now - self.store_failing_since <= self.timeout_s:
                return None
            return (
                f"the process group's store has been unreachable for {now - self.store_failing_since:.0f} s "
                f"(peer_timeout={self.timeout_s:g} s): {err}; the rank or machine hosting it (rank 0's machine "
                f"under torchrun) is likely lost. This rank {self.rank} on {self.host} is at step {self.step}; "
                f"ending it with exit code {LOST_PEER_EXIT_CODE}."
            )
        self.store_failing_since = None
        return message

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            message = self._round()
            if message and not self._stop.is_set():
                self.on_lost(message)
                return

    def start(self) -> None:
        self.beat_once()
        self._thread = threading.Thread(target=self._run, name="hf_dist_recipes-heartbeat", daemon=True)
        self._thread.start()

    def longest_silence(self) -> float:
        """Seconds since the most silent watched peer last beat (as this rank saw it)."""
        now = self.clock()
        return max((now - t for t in self.watch.last_change.values()), default=0.0)

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the watching thread to end (it ends the process when a peer is lost)."""
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def stop(self) -> None:
        """Stop watching and tell the peers this rank finished (they stop expecting its beats)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5)
        with contextlib.suppress(Exception):  # the store may already be gone at the very end of a job: nothing to tell
            self.beat_once(DONE)


class HangWatchdogCallback(RecipeCallback):
    """Starts the heartbeat watchdog when training begins (multi-rank runs, `peer_timeout` > 0), sets the
    collective timeout to `step_timeout` once the first optimizer step finished and back to the start-up
    `ddp_timeout` when training ends (a save or evaluation after `train()` may again wait on one rank's I/O).
    While training runs on several ranks, it dumps this rank's state (`comm.flight_recorder`) before a lost peer
    ends the process, when `explain_failure` sees a collective error, and on SIGUSR1."""

    def __init__(
        self,
        peer_timeout: float,
        step_timeout: float,
        startup_timeout: float,
        *,
        save_bound: Callable[[int, float], float] | None = None,
        preemption=None,
    ):
        """`save_bound(bytes_per_rank, current_timeout_s)`: the collective timeout of a save in seconds, applied
        between `on_save_begin` and the save's end (None: a save keeps the current one). `preemption`: the run's
        `checkpoint.preemption.PreemptionCallback`; a SIGTERM it takes asks for a save instead of ending the rank,
        and a rank stuck past its grace ends with this rank's state dump. A failed train() reaches
        `explain_failure` through `on_train_abort`."""
        self.preemption, self.save_bound = preemption, save_bound
        self.peer_timeout, self.step_timeout, self.startup_timeout = peer_timeout, step_timeout, startup_timeout
        self.watchdog: HeartbeatWatchdog | None = None
        self.step_timeout_set = False
        self.save_timeout: float | None = None  # the raised collective timeout while a save runs
        self.output_dir: str | None = None
        self.dump: AutomaticDump | None = None  # set while a multi-rank train() runs
        self.signal_dump: SignalDump | None = None
        self.fatal_stacks: FatalStacks | None = None
        self.step = 0

    def current_timeout(self) -> float:
        """The collective timeout outside a save: step_timeout once steps run, else the start-up ddp_timeout."""
        return self.step_timeout if self.step_timeout_set else self.startup_timeout

    def begin_save(self, bound_s: float) -> float:
        """Raise the collective timeout to `bound_s` seconds (when above the current one) until `end_save`; returns
        the timeout in force during the save."""
        timeout = max(self.current_timeout(), bound_s)
        if _distributed() and timeout != self.current_timeout():
            compat_torch.set_collective_timeout(timeout)
            self.save_timeout = timeout
            logger.info("collective timeout %g s while the checkpoint is written (save bound)", timeout)
        return timeout

    def end_save(self) -> None:
        if self.save_timeout is not None:
            compat_torch.set_collective_timeout(self.current_timeout())
            self.save_timeout = None

    def on_save_begin(self, args, state, control, bytes_per_rank: int, **kwargs):
        if self.save_bound is not None:
            self.begin_save(self.save_bound(bytes_per_rank, self.current_timeout()))

    def on_save_end(self, args, state, control, **kwargs):
        self.end_save()

    def on_save(self, args, state, control, **kwargs):
        self.end_save()  # the engine's files, RNG and trainer state are written: the checkpoint is complete

    def on_train_abort(self, args, state, control, error: BaseException, **kwargs):
        self.explain_failure(error)

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        if not _distributed():
            return
        if not self.step_timeout_set:
            # The arguments gave every group the start-up timeout; DeepSpeed's groups, made since with the engine
            # (`new_group` without a timeout: torch's 30 minutes on Gloo, 10 on NCCL,
            # `_compat.torch.collective_timeout`), get it here, so that start-up means the same on every group until the
            # first step sets step_timeout.
            compat_torch.set_collective_timeout(self.startup_timeout)
        self.output_dir, self.step = args.output_dir, state.global_step
        rank, world = self.runtime.facts.rank, self.runtime.facts.layout.world
        self.dump = AutomaticDump(args.output_dir)
        if self.fatal_stacks is None:  # this process's first train(): no rank of this launch wrote dumps yet
            kept = set_aside_dumps(args.output_dir) if rank == 0 else None
            import torch.distributed as dist

            dist.barrier()  # before any rank opens its files there
            if kept:
                logger.warning("hang dumps of an earlier attempt kept in %s (hf-dist-recipes logs hang %s)", kept, kept)
            self.fatal_stacks = FatalStacks(args.output_dir, rank)
        if self.signal_dump is None and threading.current_thread() is threading.main_thread():
            self.signal_dump = SignalDump(
                args.output_dir,
                describe=lambda: f" (rank {rank}, step {self.step})",
                on_terminate=self.dump,
                defer=None if self.preemption is None else self.preemption.request,
            )
            if self.preemption is not None:
                self.preemption.on_expire = self.signal_dump.terminate
        if self.peer_timeout and self.watchdog is None:
            self.watchdog = HeartbeatWatchdog(
                compat_torch.default_store(),
                rank,
                world,
                self.peer_timeout,
                on_lost=self._on_lost,
                output_dir=args.output_dir,
            )
            self.watchdog.step = state.global_step
            self.watchdog.start()

    def _on_lost(self, message: str) -> None:
        """The heartbeat named a lost peer: write this rank's state, then end the process (`_end_process`)."""
        if self.dump is not None:
            self.dump("lost_peer", message)
        if self.fatal_stacks is not None:
            self.fatal_stacks.close()  # os._exit skips atexit: remove the unused file now
        _end_process(message)

    def on_step_end(self, args, state, control, **kwargs):
        self.step = state.global_step
        if self.watchdog is not None:
            self.watchdog.set_step(state.global_step)
        if self.step_timeout and not self.step_timeout_set and _distributed():
            compat_torch.set_collective_timeout(self.step_timeout)
            self.step_timeout_set = True
            if state.is_world_process_zero:
                logger.info(
                    "collective timeout now %g s (step_timeout) after %g s for start-up (ddp_timeout)",
                    self.step_timeout,
                    self.startup_timeout,
                )

    def explain_failure(self, error: BaseException) -> None:
        """After `train()` raised a collective error ("Connection closed by peer": Gloo raises within about a second
        when a peer's process dies, without naming it), give the heartbeat up to `peer_timeout` to find the lost peer;
        when it does, the process ends with the message naming the rank and its last step. Returns (and the caller
        re-raises `error`) when every peer still beats: then the error was not a lost peer. First this rank's state
        goes to disk (`comm.flight_recorder`), the main thread's stack being the failed call's."""
        if not looks_like_lost_peer(error):
            return
        timed_out = "timed out" in str(error).lower()
        if self.dump is not None:
            first_line = (str(error).splitlines() or [""])[0][:300]
            self.dump("timeout" if timed_out else "lost_peer", f"step {self.step}: {first_line}", error)
        if self.watchdog is None:
            if self.dump is not None:
                print(f"[hf_dist_recipes] a collective failed.{hang_report_hint(self.output_dir)}", file=sys.stderr)
            return
        if timed_out:
            # The collective waited its whole timeout while the heartbeats went on (a lost peer is found within
            # peer_timeout, shorter by default): some rank is alive but stuck. Say so, with every rank's last step.
            if self.watchdog.longest_silence() > 3 * self.watchdog.interval_s:  # a peer may be gone: let it tell
                self.watchdog.join(self.peer_timeout + 2 * self.watchdog.interval_s)
            message = self.watchdog.stuck_rank_message(self.save_timeout or self.current_timeout(), self.output_dir)
            logger.error(message)
            print(f"[hf_dist_recipes] {message}", file=sys.stderr, flush=True)
            return
        logger.error(
            "a collective failed (%s); waiting up to %g s for the heartbeats to name the lost rank",
            str(error).splitlines()[0][:200],
            self.peer_timeout,
        )
        self.watchdog.join(self.peer_timeout + 2 * self.watchdog.interval_s)

    def on_train_end(self, args, state, control, **kwargs):
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if self.signal_dump is not None:
            self.signal_dump.close()
            self.signal_dump = None
        if self.fatal_stacks is not None:
            self.fatal_stacks.close()
            self.fatal_stacks = None
        self.dump = None
        if self.step_timeout_set:
            compat_torch.set_collective_timeout(self.startup_timeout)
            self.step_timeout_set = False


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
