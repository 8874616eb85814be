"""What torch's flight recorder costs a training step on 2 CPU ranks (Gloo): recorder off (TORCH_FR_BUFFER_SIZE=0)
against on (2000 entries, the recipe's default for every backend), side by side in one run.

torch reads the buffer size once per process, so each setting is its own 2-rank job; the jobs alternate
(off, on, off, on, ...) so that load on a shared machine falls on both alike. Each rank trains a tiny dense Llama
(2 layers, hidden 64; dense because DDP waits for every parameter's gradient, which a MoE's unrouted experts never
get) under DDP with AdamW on random tokens and times each step after a barrier
(median of the steps), then times one-element all_reduces (median, the recorder's cost per collective: it records
the op, sizes and the calling Python frames). A ZeRO-3 step makes many more collectives than DDP's; its cost is then
collectives per step x the per-collective difference, set against the step's time (printed with --zero3-*).

Usage: python benchmarks/flight_recorder_cost.py [--rounds 3] [--steps 40] [--collectives 2000]
       [--zero3-collectives-per-step 60 --zero3-step-s 0.5]
Prints one line per job and the ratios (on / off) as a table; the recorded results are in benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rank_main(rank: int, port: int, steps: int, collectives: int) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    faulthandler.dump_traceback_later(120, exit=True)  # a rank stuck for 2 minutes prints where, and ends
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    model = torch.nn.parallel.DistributedDataParallel(LlamaForCausalLM(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(rank))
    step_s = []
    for i in range(steps + 5):
        dist.barrier()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= 5:  # warm-up steps not counted
            step_s.append(time.perf_counter() - start)
    one = torch.ones(1)
    coll_s = []
    dist.barrier()
    for _ in range(collectives):
        start = time.perf_counter()
        dist.all_reduce(one)
        coll_s.append(time.perf_counter() - start)
    if rank == 0:
        print(json.dumps({"step_s": statistics.median(step_s), "collective_s": statistics.median(coll_s)}), flush=True)
    # Not destroy_process_group + return: freeing the DDP model after the group is gone blocked in a futex at times
    # (seen here, about one job in three); the measurement is out, so leave at once.
    sys.stdout.flush()
    os._exit(0)


def job(buffer_size: int, steps: int, collectives: int) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE=str(buffer_size), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)
    cmd = [sys.executable, __file__, "--rank", "{r}", "--port", str(port), "--steps", str(steps)]
    cmd += ["--collectives", str(collectives)]
    procs = [subprocess.Popen([c.format(r=r) for c in cmd], env=env, stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise SystemExit(f"a job (buffer {buffer_size}) did not end within 300 s") from None
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed (buffer {buffer_size}): {outs}")
    return json.loads(outs[0].strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--collectives", type=int, default=2000)
    parser.add_argument("--zero3-collectives-per-step", type=float, default=None)
    parser.add_argument("--zero3-step-s", type=float, default=None)
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.port, args.steps, args.collectives)
        return
    results: dict[int, list[dict]] = {0: [], 2000: []}
    for round_ in range(args.rounds):
        for size in (0, 2000):
            r = job(size, args.steps, args.collectives)
            results[size].append(r)
            print(
                f"round {round_} TORCH_FR_BUFFER_SIZE={size}: step {r['step_s'] * 1e3:.2f} ms, "
                f"all_reduce(1) {r['collective_s'] * 1e6:.1f} us",
                flush=True,
            )
    step_ratios = [on["step_s"] / off["step_s"] for off, on in zip(results[0], results[2000], strict=True)]
    per_coll = [on["collective_s"] - off["collective_s"] for off, on in zip(results[0], results[2000], strict=True)]
    print("\n| measure | off (0) | on (2000) | on / off |\n|---|---|---|---|")
    off_step = statistics.median(r["step_s"] for r in results[0])
    on_step = statistics.median(r["step_s"] for r in results[2000])
    print(
        f"| DDP step, median of rounds | {off_step * 1e3:.2f} ms | {on_step * 1e3:.2f} ms | "
        f"{statistics.median(step_ratios):.4f} (rounds: {', '.join(f'{x:.4f}' for x in step_ratios)}) |"
    )
    off_c = statistics.median(r["collective_s"] for r in results[0])
    on_c = statistics.median(r["collective_s"] for r in results[2000])
    print(f"| all_reduce of 1 element | {off_c * 1e6:.1f} us | {on_c * 1e6:.1f} us | {on_c / off_c:.4f} |")
    extra = statistics.median(per_coll)
    print(f"\nrecorder cost per collective (median of rounds): {extra * 1e6:.1f} us")
    if args.zero3_collectives_per_step and args.zero3_step_s:
        share = extra * args.zero3_collectives_per_step / args.zero3_step_s
        print(
            f"ZeRO-3 step ({args.zero3_collectives_per_step:g} collectives, {args.zero3_step_s:g} s): "
            f"{share * 100:.3f}% of a step"
        )


if __name__ == "__main__":
    main()
