"""Preflight check 3, communication: a short commbench over the live process group (`hf_dist_recipes.comm.commbench`).

`commbench.run_benchmark` with PREFLIGHT_BENCH: all-reduce, all-gather and reduce-scatter at three sizes (4 KiB,
256 KiB, 4 MiB), 5 timed iterations after 2 warm-up ones, and each ring link rank i -> i+1 alone with 1 MiB
messages: a few seconds on CPU, well under one on GPUs. The ranks and links commbench flags (below half the median,
`commbench.flag_outliers`) are warnings naming them and their hosts; an op the backend refuses is an error. The
numbers are a smoke test of the fabric, not a benchmark: `hf-dist-recipes commbench` measures properly.
"""

from __future__ import annotations

from hf_dist_recipes.core.sizes import format_size
from hf_dist_recipes.preflight.result import ERROR, OK, WARNING, CheckResult

PREFLIGHT_SIZES = "4K,256K,4M"
FIX_SLOW = (
    "run hf-dist-recipes commbench on these machines for the full picture; look at the flagged host's "
    "network (ibstat, NCCL_DEBUG=INFO for the transport used) and load"
)


def bench_settings():
    from hf_dist_recipes.comm.commbench import BenchSettings
    from hf_dist_recipes.core.sizes import parse_size, parse_sizes

    return BenchSettings(sizes=parse_sizes(PREFLIGHT_SIZES), iters=5, warmup=2, link_bytes=parse_size("1M"))


def communication_check() -> list[CheckResult]:
    """Check 3 on every rank (the benchmark's collectives involve all); the same results on every rank."""
    import torch
    import torch.distributed as dist

    from hf_dist_recipes.comm.commbench import run_benchmark

    if not dist.is_initialized() or dist.get_world_size() < 2:
        return [CheckResult("communication", OK, "one process: no communication to measure")]
    backend = str(dist.get_backend())
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if "nccl" in backend and torch.cuda.is_available()
        else torch.device("cpu")
    )
    result = run_benchmark(bench_settings(), device, backend)
    return interpret(result)


def interpret(result: dict) -> list[CheckResult]:
    """The findings in a `commbench.run_benchmark` result."""
    out = []
    refused = [r for r in result["results"] if r["time_us"] is None]
    for r in refused:
        out.append(
            CheckResult(
                "communication",
                ERROR,
                f"{r['op']} of {r['size_bytes']} bytes: {r['note']}",
                fix="use the backend the policy picks for the host (NCCL on GPUs)",
            )
        )
    below = f"below {result['fraction']:.0%} of the median"
    slow = [
        (
            f"link rank {x['src']} ({x['src_host']}) -> rank {x['dst']} ({x['dst_host']}): {x['GBps']:.3f} GB/s, "
            f"{below} link",
            (x["src"], x["dst"]),
        )
        for x in result["links"]
        if x["flagged"]
    ] + [
        (f"rank {x['rank']} ({x['host']}): all-reduce at {x['algbw_GBps']:.3f} GB/s, {below} rank", (x["rank"],))
        for x in result["ranks"]
        if x["flagged"]
    ]
    out += [CheckResult("communication", WARNING, text, fix=FIX_SLOW, ranks=ranks) for text, ranks in slow]
    timed = [r for r in result["results"] if r["time_us"] is not None]
    summary = {
        r["op"]: r for r in timed if r["size_bytes"] == max(x["size_bytes"] for x in timed if x["op"] == r["op"])
    }
    data = {k: result[k] for k in ("backend", "device", "world_size", "results", "links", "ranks", "flagged")}
    if not out:
        what = ", ".join(
            f"{op} {format_size(r['size_bytes'])} {r['busbw_GBps']:.3f} GB/s busbw" for op, r in summary.items()
        )
        links = [x["GBps"] for x in result["links"]]
        out.append(
            CheckResult(
                "communication",
                OK,
                f"{result['backend']} on {result['device']}, "
                f"{result['world_size']} ranks: {what}; {len(links)} ring links "
                f"{min(links):.3f}-{max(links):.3f} GB/s, none flagged",
                data=data,
            )
        )
    else:
        out[0] = CheckResult(out[0].name, out[0].status, out[0].detail, out[0].fix, out[0].ranks, data)
    return out
