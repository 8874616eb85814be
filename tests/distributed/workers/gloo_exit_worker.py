"""One plain Gloo rank (env rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), for
tests/distributed/test_gloo_exit.py and benchmarks/gloo_exit.py.

    gloo_exit_worker.py MODE COLLECTIVES [--sleep-s S] [--raise] [--barrier-timeout-s T]

Makes COLLECTIVES all_reduces on the default group and as many on a subgroup of every rank (kept referenced, as
DeepSpeed keeps its groups), then exits per MODE: `none` (the group left to interpreter shutdown), `destroy`
(`destroy_process_group` at exit, what most scripts do), `recipe` (`hf_dist_recipes.comm.backend`'s exit handler, as
RecipeTrainer registers it). Before exiting it sleeps S seconds (a rank that ends later than its peers), or with
--raise ends in an uncaught exception. Prints `exit handler done at <unix time>` when the recipe's handler returns.
"""

from __future__ import annotations

import argparse
import atexit
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("none", "destroy", "recipe"))
    p.add_argument("collectives", type=int)
    p.add_argument("--sleep-s", type=float, default=0.0)
    p.add_argument("--raise", dest="fail", action="store_true")
    p.add_argument("--barrier-timeout-s", type=float, default=None)
    opts = p.parse_args()
    dist.init_process_group("gloo")
    every_rank = dist.new_group(list(range(dist.get_world_size())))
    for i in range(opts.collectives):
        dist.all_reduce(torch.full((1024,), float(i)))
        dist.all_reduce(torch.ones(16), group=every_rank)
    if opts.mode == "destroy":
        atexit.register(dist.destroy_process_group)
    elif opts.mode == "recipe":
        from hf_dist_recipes.comm import backend

        def handler() -> None:
            timeout = {} if opts.barrier_timeout_s is None else {"barrier_timeout_s": opts.barrier_timeout_s}
            backend.destroy_gloo_group(**timeout)
            print(f"exit handler done at {time.time():.3f}", flush=True)

        atexit.register(handler)
    time.sleep(opts.sleep_s)
    if opts.fail:
        raise RuntimeError("this rank fails")


if __name__ == "__main__":
    main()
