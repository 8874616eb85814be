"""How often 2 Gloo ranks abort at exit (SIGABRT, "terminate called without an active exception") by how they end
their process group, side by side in one run: `none` (left to interpreter shutdown), `destroy`
(`destroy_process_group` at exit) and `recipe` (hf_dist_recipes.comm.backend.destroy_gloo_group: a monitored
barrier, then destroy; what RecipeTrainer registers). The modes alternate round by round so that load on a shared
machine falls on all alike. Each job: tests/distributed/workers/gloo_exit_worker.py on 2 ranks, COLLECTIVES
all_reduces on the default group and on a subgroup, then exit.

Usage: python benchmarks/gloo_exit.py [--rounds 20] [--collectives 200]
Prints the aborts per mode; the recorded results are in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from hf_dist_recipes.core.launch import free_port

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "distributed" / "workers" / "gloo_exit_worker.py"
MODES = ("none", "destroy", "recipe")


def job(mode: str, collectives: int) -> bool:
    """One 2-rank job; True if a rank aborted."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
        env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), mode, str(collectives)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    return any(p.returncode == -6 or "terminate called" in o for p, o in zip(procs, outputs, strict=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--collectives", type=int, default=200)
    opts = p.parse_args()
    aborts = dict.fromkeys(MODES, 0)
    for round_ in range(1, opts.rounds + 1):
        for mode in MODES:
            aborts[mode] += job(mode, opts.collectives)
        print(f"round {round_}/{opts.rounds}: " + ", ".join(f"{m} {n}" for m, n in aborts.items()), flush=True)
    print("\n| mode | jobs | jobs with an aborted rank |\n|---|---|---|")
    for mode in MODES:
        print(f"| {mode} | {opts.rounds} | {aborts[mode]} |")


if __name__ == "__main__":
    main()
