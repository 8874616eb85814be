"""Real 2-rank Gloo jobs that hang, each leaving the dumps `hf-dist-recipes logs hang` reads. One launch, every
scenario at once: `python tests/distributed/workers/hang_scenarios_worker.py OUT [SCENARIO ...]` imports torch
once, then forks two rank processes per scenario, each pair its own job (own TCPStore port, process-group timeout
TIMEOUT_S), and writes `OUT/<scenario>/flight_recorder/` through `comm.flight_recorder.dump_rank_state`, as the
recipe's callbacks do. Prints one line `scenario <name>: <seconds> s` per scenario when both ranks are done.

Scenarios (after two matched all_reduces, the "steps" before the bug):
- skip: rank 0 all_reduces in a rank-dependent branch that rank 1 skips; rank 1 is busy elsewhere and is dumped on
  demand (a thread, as `SignalDump` does on SIGUSR1) once rank 0's collective has timed out and rank 0 has dumped;
- op: rank 0 all_reduce, rank 1 all_gather at the same point; both time out and dump;
- shape: both all_reduce the same number of bytes in different shapes (2x3 and 6): Gloo completes it (the silent
  form of the bug), both ranks are then dumped on demand;
- size_abort: both all_reduce, rank 0 4 elements, rank 1 6: Gloo aborts rank 0's process ("Received data size
  doesn't match expected size", SIGABRT: it writes nothing), rank 1 fails and dumps;
- frozen: rank 1 stops itself (SIGSTOP) before the collective; rank 0 times out and dumps, rank 1 writes nothing
  (the launcher SIGKILLs it at the end);
- three (3 ranks, a sub-group "pair" of ranks 0 and 1): the pair all_reduces alike, then on the default group ranks
  0 and 1 all_reduce 4 elements and rank 2 the same bytes as 2x2 (Gloo completes it); all three dumped on demand.
The lines the diagnosis must name carry a `# HANG-MARK <name>` comment (tests read them from here).
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

# The flight recorder's dump (`_dump_fr_trace`) imports torch._dynamo and torch._inductor on first use: imported
# here, before the forks, instead of once in each of the 13 ranks (about 1.3 s of one core each, 2026-12-07).
import torch._dynamo  # noqa: E402,F401
import torch.distributed as dist  # noqa: E402

from hf_dist_recipes.comm.flight_recorder import FatalStacks, dump_rank_state, flight_recorder_dir  # noqa: E402
from tests.support.launch import free_port  # noqa: E402

SCENARIOS = ("skip", "op", "shape", "size_abort", "frozen", "three")
WORLD = {"three": 3}  # ranks per scenario; 2 unless named
TIMEOUT_S = 4.0  # the process group's collective timeout: how long the hang lasts before the dumps
DONE_S = 240.0  # a rank process that is not done by then is killed


def wait_for(path: Path, limit_s: float = 120.0) -> None:
    end = time.monotonic() + limit_s
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.05)


def idle_then_dump(out: Path, after: Path | None, message: str) -> None:
    """A rank that is not in a collective, dumped on demand: another thread writes the main thread's state (once
    `after` exists, when given) while the main thread waits here."""
    done = threading.Event()

    def dump() -> None:
        if after is not None:
            wait_for(after)
        dump_rank_state(out, "signal", message)
        done.set()

    threading.Thread(target=dump, daemon=True).start()
    while not done.is_set():
        time.sleep(0.05)  # HANG-MARK idle


def scenario(name: str, rank: int, out: Path) -> None:
    pair = dist.new_group([0, 1], group_desc="pair") if name == "three" else None  # every rank calls new_group
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.all_reduce(t)
    try:
        if name == "skip":
            if rank == 0:
                dist.all_reduce(t)  # HANG-MARK skip-r0
            else:
                idle_then_dump(out, flight_recorder_dir(out) / "stack_rank_0.json", "dumped on demand")
        elif name == "op":
            if rank == 0:
                dist.all_reduce(t)  # HANG-MARK op-r0
            else:
                dist.all_gather([torch.zeros(4), torch.zeros(4)], t)  # HANG-MARK op-r1
        elif name == "shape":
            dist.all_reduce(torch.ones(2, 3) if rank == 0 else torch.ones(6))  # HANG-MARK shape
            idle_then_dump(out, None, "dumped on demand")
        elif name == "size_abort":
            dist.all_reduce(torch.ones(4 if rank == 0 else 6))  # HANG-MARK size_abort
        elif name == "three":
            if rank in (0, 1):
                dist.all_reduce(t, group=pair)
            dist.all_reduce(torch.ones(4) if rank != 2 else torch.ones(2, 2))  # HANG-MARK three
            idle_then_dump(out, None, "dumped on demand")
        elif name == "frozen":
            if rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            dist.all_reduce(t)  # HANG-MARK frozen-r0
    except RuntimeError as err:  # Gloo's timeout (or the peer's closed socket)
        dump_rank_state(out, "timeout", f"collective failed: {str(err).splitlines()[0][:200]}", error=err)


def rank_main(name: str, rank: int, port: int, out: Path) -> None:
    world = WORLD.get(name, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    FatalStacks(out, rank)  # as the recipe's callback does: a rank Gloo aborts leaves its stacks
    scenario(name, rank, out)


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    names = argv[1:] or list(SCENARIOS)
    children: dict[int, tuple[str, int]] = {}
    start = time.monotonic()
    for name in names:
        port = free_port()
        for rank in range(WORLD.get(name, 2)):
            pid = os.fork()
            if pid == 0:  # the rank: never returns into the launcher's code
                code = 0
                try:
                    rank_main(name, rank, port, out / name)
                except BaseException as err:  # noqa: BLE001 - report, then leave without Gloo's teardown
                    print(f"scenario {name} rank {rank}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
                    code = 1
                os._exit(code)
            children[pid] = (name, rank)
    ended: dict[str, list[int]] = {n: [] for n in names}
    deadline = time.monotonic() + DONE_S
    while children and time.monotonic() < deadline:
        for pid, (name, rank) in list(children.items()):
            if name == "frozen" and rank == 1:
                if (flight_recorder_dir(out / name) / "stack_rank_0.json").exists():
                    os.kill(pid, signal.SIGKILL)  # the frozen rank never comes back: the test is over
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                del children[pid]
                ended[name].append(rank)
                if len(ended[name]) == WORLD.get(name, 2):
                    print(f"scenario {name}: {time.monotonic() - start:.1f} s", flush=True)
        time.sleep(0.05)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return 1 if children else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
