"""The text table of a commbench result (`comm.commbench` writes the dict, rank 0 or the launcher renders
it): one run (results, ring links, ranks, flags) or a NCCL/Gloo side-by-side. Its own module so that the benchmark,
run inside a launch, and the launcher both use it without importing each other."""

from __future__ import annotations

from hf_dist_recipes.core.sizes import format_size


def _size(n: int) -> str:
    return format_size(n, short=True)  # "64M": nccl-tests' labels, and what --sizes takes


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(result: dict) -> str:
    """The table of one run (results, ring links, ranks, flags), or of a side-by-side (both runs, then the ratios)."""
    if result.get("side_by_side"):
        lines = [render(run) for run in result["runs"]]
        lines.append(
            "Gloo vs NCCL on this machine (time per op; the ratio is what a training falling back to Gloo "
            "pays on each collective):"
        )
        lines.append(f"  {'op':<15}{'size':>8}{'nccl us':>12}{'gloo us':>12}{'gloo/nccl':>11}")
        for r in result["comparison"]:
            lines.append(
                f"  {r['op']:<15}{_size(r['size_bytes']):>8}{r['nccl_time_us']:>12.1f}"
                f"{r['gloo_time_us']:>12.1f}{r['gloo_slower_x']:>10.1f}x"
            )
        return "\n".join(lines)
    lines = [
        f"commbench: {result['world_size']} ranks, {result['backend']} on {result['device']}, "
        f"host(s) {', '.join(result['hosts'])}, {result['dtype']}, {result['iters']} timed iterations "
        "(time = slowest rank's mean; bandwidths in GB/s as nccl-tests defines them)",
        f"  {'op':<15}{'size':>8}{'time us':>12}{'algbw':>9}{'busbw':>9}  call",
    ]
    for r in result["results"]:
        lines.append(
            f"  {r['op']:<15}{_size(r['size_bytes']):>8}{_num(r['time_us'], '12.1f')}"
            f"{_num(r['algbw_GBps'], '9.3f')}{_num(r['busbw_GBps'], '9.3f')}  {r['call']} {r['note']}".rstrip()
        )
    lines.append(
        f"ring links (each alone, {_size(result['links'][0]['size_bytes'])} per send):"
        if result["links"]
        else f"ring links: {result.get('links_note') or 'none'}"
    )
    for x in result["links"]:
        flag = "  SLOW" if x["flagged"] else ""
        lines.append(
            f"  rank {x['src']} ({x['src_host']}) -> rank {x['dst']} ({x['dst_host']}): "
            f"{x['GBps']:.3f} GB/s, {x['time_us']:.1f} us{flag}"
        )
    for x in result["ranks"]:
        flag = "  SLOW" if x["flagged"] else ""
        lines.append(
            f"  rank {x['rank']} ({x['host']}): own all_reduce {_size(x['size_bytes'])} {x['time_us']:.1f} us{flag}"
        )
    flagged = result["flagged"]
    if flagged["links"] or flagged["ranks"]:
        lines.append(
            f"flagged below {result['fraction']:g} x the median: links {flagged['links']}, ranks {flagged['ranks']}"
        )
    else:
        lines.append(f"no link or rank below {result['fraction']:g} x the median")
    return "\n".join(lines)
