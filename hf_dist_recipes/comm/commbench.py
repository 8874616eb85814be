"""Measure collectives with the real backend: all_reduce, all_gather and reduce_scatter over a range of message
sizes, with the definitions of nccl-tests (NVIDIA/nccl-tests doc/PERFORMANCE.md), and each ring link's bandwidth.

Run it inside any launch (`torchrun -m hf_dist_recipes.comm.commbench`,
`accelerate launch -m hf_dist_recipes.comm.commbench`) or through `hf-dist-recipes commbench`, which launches it.
Definitions, per op and size:

- time: the mean per-iteration time of K timed iterations (after warm-up ones), the largest over the ranks;
- size S: the total data size as nccl-tests counts it: the array each rank reduces for all_reduce, the gathered
  output (n * the per-rank input) for all_gather, the input (n * the per-rank output) for reduce_scatter;
- algbw = S / time, busbw = algbw * 2(n-1)/n (all_reduce) or algbw * (n-1)/n (all_gather, reduce_scatter), in GB/s
  of 10^9 bytes as nccl-tests reports them. busbw is comparable with the hardware's link bandwidth at any n.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

from hf_dist_recipes.core.gather import gather_objects
from hf_dist_recipes.core.sizes import parse_size, parse_sizes

OPS = ("all_reduce", "all_gather", "reduce_scatter")
# The torch function each op is measured with (reported with the results: Gloo runs the same calls). torch 2.13
# deprecates all_gather_into_tensor / reduce_scatter_tensor as aliases of these two.
CALLS = {"all_reduce": "all_reduce", "all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}
DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M"
DEFAULT_ITERS = 20
DEFAULT_WARMUP = 5
DEFAULT_LINK_SIZE = "4M"
DEFAULT_FRACTION = 0.5
ELEMENT_BYTES = 4  # float32, like nccl-tests' default
GB = 1e9  # nccl-tests' GB/s are 10^9 bytes per second


def message_bytes(size: int, world_size: int) -> int:
    """`size` rounded down to a whole float32 element per rank chunk (all_gather and reduce_scatter split S into n
    equal parts), at least one element per rank. The rounded size is the one reported."""
    unit = ELEMENT_BYTES * world_size
    return max(unit, size // unit * unit)


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' correction from algbw to busbw: 2(n-1)/n for all_reduce, (n-1)/n for all_gather/reduce_scatter."""
    n = world_size
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    raise ValueError(f"unknown op {op!r}; use one of {', '.join(OPS)}")


def bandwidths(op: str, size_bytes: int, time_s: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 bytes/s) for `size_bytes` (S as nccl-tests counts it) moved in `time_s`."""
    algbw = size_bytes / time_s / GB
    return algbw, algbw * bus_factor(op, world_size)


def flag_outliers(values: Mapping[Hashable, float], fraction: float = DEFAULT_FRACTION) -> list[Hashable]:
    """The keys whose value (a bandwidth: higher is better) is below `fraction` (default 0.5) of the median of all
    values, in the mapping's order. Fewer than 2 values: nothing to compare, nothing flagged."""
    if not 0 < fraction <= 1:
        raise ValueError(f"--fraction must be in (0, 1], got {fraction}; e.g. --fraction 0.5")
    if len(values) < 2:
        return []
    limit = fraction * statistics.median(values.values())
    return [key for key, value in values.items() if value < limit]


@dataclass(frozen=True)
class BenchSettings:
    """What to measure. `sizes` in bytes (rounded per world size by `message_bytes`); `iters` timed and `warmup`
    untimed iterations per op and size; `link_bytes` per point-to-point ring transfer; `fraction` of the median
    below which a link or rank is flagged."""

    sizes: tuple[int, ...] = parse_sizes(DEFAULT_SIZES, "--sizes")
    iters: int = DEFAULT_ITERS
    warmup: int = DEFAULT_WARMUP
    link_bytes: int = parse_size(DEFAULT_LINK_SIZE, "--link-size")
    fraction: float = DEFAULT_FRACTION


def check_settings(s: BenchSettings) -> BenchSettings:
    """`s`, or ValueError naming the flag to fix."""
    from hf_dist_recipes.core.user_values import positive_int

    positive_int(s.iters, "--iters", DEFAULT_ITERS, unit="iterations")
    positive_int(s.warmup, "--warmup", DEFAULT_WARMUP, minimum=0, unit="iterations")
    flag_outliers({}, s.fraction)
    if not s.sizes:
        raise ValueError("--sizes is empty; e.g. --sizes 1K,1M,64M")
    return s


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], s: BenchSettings, device) -> float:
    """Mean seconds per call of `fn` on this rank: warm-up calls, a barrier so every rank starts together, then
    `s.iters` calls ended by a device sync (NCCL calls return before the GPU has finished)."""
    import torch.distributed as dist

    for _ in range(s.warmup):
        fn()
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(s.iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / s.iters


def _collective(op: str, size: int, n: int, device) -> Callable[[], object]:
    import torch
    import torch.distributed as dist

    full = torch.ones(size // ELEMENT_BYTES, dtype=torch.float32, device=device)
    chunk = torch.ones(size // ELEMENT_BYTES // n, dtype=torch.float32, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "all_gather":
        return lambda: dist.all_gather_single(full, chunk)
    return lambda: dist.reduce_scatter_single(chunk, full)


def measure_collectives(s: BenchSettings, device, progress: Callable[[str], None]) -> tuple[list[dict], dict]:
    """Result rows (op, size) and {op: {size: [each rank's own mean seconds]}}. An op the backend refuses on this
    device gives rows with time and bandwidths None and the error in "note" (on every rank alike: the refusal
    happens before any data moves)."""
    import torch.distributed as dist

    n = dist.get_world_size()
    rows, own = [], {}
    for op in OPS:
        start = time.perf_counter()
        own[op] = {}
        for size in sorted({message_bytes(x, n) for x in s.sizes}):
            row = {
                "op": op,
                "size_bytes": size,
                "time_us": None,
                "algbw_GBps": None,
                "busbw_GBps": None,
                "call": f"torch.distributed.{CALLS[op]}",
                "note": "",
            }
            try:
                mine = _timed(_collective(op, size, n, device), s, device)
            except (RuntimeError, NotImplementedError) as err:
                row["note"] = f"unsupported by this backend on {device.type}: {str(err).splitlines()[0][:160]}"
                rows.append(row)
                continue
            times = gather_objects(mine)
            own[op][size] = times
            algbw, busbw = bandwidths(op, size, max(times), n)
            row.update(time_us=max(times) * 1e6, algbw_GBps=algbw, busbw_GBps=busbw)
            rows.append(row)
        progress(f"{op}: {len(s.sizes)} size(s) in {time.perf_counter() - start:.1f} s")
    return rows, own


def measure_ring_links(s: BenchSettings, device, hosts: list[str]) -> list[dict]:
    """Each ring link rank i -> rank (i+1) % n measured alone (the other ranks wait), so a slow link is not hidden
    by the others: `s.iters` sends of `s.link_bytes` after `s.warmup` untimed ones; time = the slower end's."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    size = message_bytes(s.link_bytes, 1)
    buf = torch.ones(size // ELEMENT_BYTES, dtype=torch.float32, device=device)
    links = []
    for src in range(n):
        dst = (src + 1) % n
        if rank == src:
            mine = _timed(lambda dst=dst: dist.send(buf, dst), s, device)
        elif rank == dst:
            mine = _timed(lambda src=src: dist.recv(buf, src), s, device)
        else:
            mine = _timed(lambda: None, s, device)  # joins the barrier inside
        seconds = max(gather_objects(mine)[r] for r in (src, dst))
        links.append(
            {
                "src": src,
                "dst": dst,
                "src_host": hosts[src],
                "dst_host": hosts[dst],
                "size_bytes": size,
                "time_us": seconds * 1e6,
                "GBps": size / seconds / GB,
            }
        )
    return links


def rank_speeds(own: dict, hosts: list[str]) -> list[dict]:
    """Each rank's own all_reduce time at the largest size measured, as a bandwidth (S / the rank's time). A rank
    that is late to a collective makes the others wait, so a slow rank shows here only partly: the links tell more."""
    sizes = own.get("all_reduce") or {}
    if not sizes:
        return []
    size = max(sizes)
    return [
        {"rank": r, "host": hosts[r], "size_bytes": size, "time_us": t * 1e6, "algbw_GBps": size / t / GB}
        for r, t in enumerate(sizes[size])
    ]


def run_benchmark(s: BenchSettings, device, backend: str, progress: Callable[[str], None] = lambda line: None) -> dict:
    """Every measurement as one JSON-ready dict (the same on every rank). Needs an initialised process group."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    hosts = gather_objects(socket.gethostname())
    rows, own = measure_collectives(s, device, progress)
    links, links_note = [], ""
    if backend == "gloo" and device.type == "cuda":
        # Gloo's send/recv take CPU tensors only; a refused send would leave its peer waiting in recv.
        links_note = "not measured: Gloo has no send/recv for CUDA tensors (the NCCL run measures the links)"
    else:
        links = measure_ring_links(s, device, hosts)
    progress(f"ring links: {len(links)} measured")
    ranks = rank_speeds(own, hosts)
    slow_links = flag_outliers({(x["src"], x["dst"]): x["GBps"] for x in links}, s.fraction)
    slow_ranks = flag_outliers({x["rank"]: x["algbw_GBps"] for x in ranks}, s.fraction)
    for x in links:
        x["flagged"] = (x["src"], x["dst"]) in slow_links
    for x in ranks:
        x["flagged"] = x["rank"] in slow_ranks
    return {
        "world_size": n,
        "backend": backend,
        "device": device.type,
        "hosts": sorted(set(hosts)),
        "rank_hosts": hosts,
        "torch": torch.__version__,
        "dtype": "float32",
        "iters": s.iters,
        "warmup": s.warmup,
        "fraction": s.fraction,
        "results": rows,
        "links": links,
        "links_note": links_note,
        "ranks": ranks,
        "flagged": {"links": [list(k) for k in slow_links], "ranks": slow_ranks},
    }


COMMAND_DESCRIPTION = """Measure all_reduce, all_gather and reduce_scatter on N local processes with the real backend
(NCCL on GPUs, Gloo on CPU), per message size, with the nccl-tests definitions of algbw and busbw; then each ring link
alone, flagging links and ranks far below the median.

`--backend gloo` on a GPU host runs Gloo AND NCCL and shows them side by side: what a training that fell back to
Gloo pays on each collective. Inside your own launch (other hosts too):
`torchrun ... -m hf_dist_recipes.comm.commbench`."""


def commbench_command_parser(subparsers=None) -> argparse.ArgumentParser:
    """commbench's flags, defined once (accelerate's `commands/*_command_parser` shape). With `subparsers`: the
    `hf-dist-recipes commbench` subcommand, which launches the ranks (`--num-processes`); the caller sets what it
    runs. Without: the parser of one rank inside a launch (`python -m hf_dist_recipes.comm.commbench`), with the
    flags the launcher hands its ranks (`--output`, `--allow-gloo-on-cuda`; `settings_args`)."""
    if subparsers is not None:
        parser = subparsers.add_parser(
            "commbench",
            help="measure collective bandwidth (all_reduce, all_gather, reduce_scatter) and ring links",
            description=COMMAND_DESCRIPTION,
            epilog="Example: hf-dist-recipes commbench --sizes 1M,64M,256M --iters 50\n"
            "On a GPU host: hf-dist-recipes commbench --backend gloo   (Gloo next to NCCL, with the ratio)",
        )
        parser.add_argument("--num-processes", type=int, help="local processes (default: one per visible GPU, else 2)")
    else:
        parser = argparse.ArgumentParser(prog="python -m hf_dist_recipes.comm.commbench", description=__doc__)
    parser.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        help="default: NCCL with GPUs, Gloo without (hf-dist-recipes commbench --backend gloo on a GPU host: both, "
        "side by side)",
    )
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help="message sizes, comma-separated; 1K = 1KiB = 1024 bytes, 1KB = 1000, and so on (default: %(default)s)",
    )
    parser.add_argument(
        "--iters", type=int, default=DEFAULT_ITERS, help="timed iterations per op and size (default: %(default)s)"
    )
    parser.add_argument(
        "--warmup", type=int, default=DEFAULT_WARMUP, help="untimed iterations first (default: %(default)s)"
    )
    parser.add_argument(
        "--link-size", default=DEFAULT_LINK_SIZE, help="bytes per ring-link send (default: %(default)s)"
    )
    parser.add_argument(
        "--fraction",
        type=float,
        default=DEFAULT_FRACTION,
        help="flag a link or rank below this fraction of the median (default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    if subparsers is None:
        parser.add_argument(
            "--allow-gloo-on-cuda", action="store_true", help="measure Gloo on a GPU host (CUDA tensors)"
        )
        parser.add_argument("--output", help="rank 0 writes the JSON result here (default: print it)")
    return parser


def settings_of(args: argparse.Namespace) -> BenchSettings:
    """The `BenchSettings` of parsed commbench flags; ValueError naming the flag of a size it cannot read."""
    return BenchSettings(
        sizes=parse_sizes(args.sizes, "--sizes"),
        iters=args.iters,
        warmup=args.warmup,
        link_bytes=parse_size(args.link_size, "--link-size"),
        fraction=args.fraction,
    )


def settings_args(s: BenchSettings) -> list[str]:
    """The commbench flags that give `s` back through `settings_of` (what the launcher passes its ranks)."""
    flags = {"--sizes": ",".join(map(str, s.sizes)), "--iters": s.iters, "--warmup": s.warmup}
    flags.update({"--link-size": s.link_bytes, "--fraction": s.fraction})
    return [text for flag, value in flags.items() for text in (flag, str(value))]


def main(argv: list[str] | None = None) -> int:
    """Entry point inside a launch: reads RANK/WORLD_SIZE/LOCAL_RANK and MASTER_ADDR/PORT (torchrun and accelerate
    set them), initialises the process group, measures, and rank 0 writes JSON to --output or prints a report."""
    import json
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from hf_dist_recipes.comm.backend import destroy_gloo_group, resolve_backend

    args = commbench_command_parser().parse_args(argv)
    s = check_settings(settings_of(args))
    if "RANK" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ValueError(
            "run inside a launch of >= 2 processes (torchrun --nproc-per-node 2 -m "
            "hf_dist_recipes.comm.commbench), or use: hf-dist-recipes commbench"
        )
    backend = resolve_backend(args.backend, allow_gloo_on_cuda=args.allow_gloo_on_cuda)
    use_cuda = torch.cuda.is_available()  # Gloo on a GPU host moves CUDA tensors, as DDP over Gloo would
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # A few minutes, not torch's 30: a benchmark that stalls that long has found its answer.
    dist.init_process_group(backend, timeout=timedelta(minutes=5))
    rank = dist.get_rank()

    def progress(line: str) -> None:
        if rank == 0:
            print(f"commbench [{backend}]: {line}", file=sys.stderr, flush=True)

    finished = False
    try:
        result = run_benchmark(s, device, backend, progress)
        finished = True
    finally:
        # A finished Gloo rank meets its peers before the destroy: torn down while a peer still works, it can abort
        # after its results are in (backend.destroy_gloo_group, measured). A failing one, and NCCL, destroy at once.
        if not (finished and destroy_gloo_group()):
            dist.destroy_process_group()
    if rank == 0:
        if args.output:
            with open(args.output, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2)
        else:
            from hf_dist_recipes.comm.commbench_render import render

            print(json.dumps(result, indent=2) if args.json else render(result))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as err:
        print(f"commbench: error: {err}", file=sys.stderr)
        sys.exit(2)
