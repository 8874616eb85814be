"""commbench's arithmetic and choices without a launch: nccl-tests' bus bandwidth factors and algbw (expected values
computed by hand below, from NVIDIA/nccl-tests doc/PERFORMANCE.md), rounding, outlier flagging,
the plan (GPU counts passed in, since this machine has none) and the Gloo/NCCL side-by-side."""

from __future__ import annotations

import argparse
import re

import pytest

from hf_dist_recipes.comm.commbench import (
    BenchSettings,
    bandwidths,
    bus_factor,
    commbench_command_parser,
    flag_outliers,
    message_bytes,
    settings_of,
)
from hf_dist_recipes.comm.commbench_launch import plan_commbench, side_by_side, worker_launch
from hf_dist_recipes.comm.commbench_render import render


def test_bus_factors_are_nccl_tests_formulas():
    # all_reduce 2(n-1)/n: n=2 -> 2*1/2 = 1 (busbw = algbw); n=8 -> 2*7/8 = 14/8 = 1.75
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_reduce", 8) == 1.75
    # all_gather and reduce_scatter (n-1)/n: n=2 -> 1/2; n=8 -> 7/8 = 0.875; n=4 -> 3/4
    assert bus_factor("all_gather", 2) == 0.5
    assert bus_factor("all_gather", 8) == 0.875
    assert bus_factor("reduce_scatter", 4) == 0.75
    with pytest.raises(ValueError, match="unknown op 'broadcast'"):
        bus_factor("broadcast", 2)


def test_algbw_and_busbw_in_gb_per_s():
    # 16 MiB = 16 * 1024 * 1024 = 16,777,216 bytes in 10 ms: 1,677,721,600 B/s = 1.6777216 GB/s (10^9 bytes).
    algbw, busbw = bandwidths("all_reduce", 16 * 1024 * 1024, 0.010, 4)
    assert algbw == pytest.approx(1.6777216)
    assert busbw == pytest.approx(1.6777216 * 1.5)  # n=4: 2*3/4 = 1.5
    algbw, busbw = bandwidths("reduce_scatter", 1_000_000, 0.001, 8)  # 1e6 B in 1 ms = 1 GB/s
    assert (algbw, busbw) == (pytest.approx(1.0), pytest.approx(0.875))


def test_message_bytes_rounds_to_whole_float32_chunks():
    assert message_bytes(1024, 2) == 1024  # 8-byte unit divides 1024
    assert message_bytes(1024, 3) == 1020  # unit 3 * 4 = 12 bytes; 1024 // 12 = 85; 85 * 12 = 1020
    assert message_bytes(1, 3) == 12  # at least one element per rank


SLOW_LINK = {(0, 1): 10.0, (1, 2): 9.5, (2, 3): 2.0, (3, 0): 10.5}


def test_flag_outliers_names_the_slow_link():
    # median of 2.0, 9.5, 10.0, 10.5 = (9.5 + 10.0) / 2 = 9.75; half of it 4.875; only 2.0 is below
    assert flag_outliers(SLOW_LINK) == [(2, 3)]


def test_flag_outliers_flags_nothing_when_all_are_close():
    assert flag_outliers({0: 10.0, 1: 9.0, 2: 11.0, 3: 8.0}) == []  # median 9.5, limit 4.75


def test_flag_outliers_fraction_is_settable():
    values = {0: 10.0, 1: 9.0, 2: 11.0, 3: 8.0}
    assert flag_outliers(values, fraction=0.9) == [3]  # limit 0.9 * 9.5 = 8.55: only 8.0 below
    assert flag_outliers(SLOW_LINK, fraction=0.1) == []  # limit 0.975: 2.0 is above
    assert flag_outliers({0: 1.0}) == []  # one value: nothing to compare with
    for bad in (0, 1.5, -0.2):
        with pytest.raises(ValueError, match="--fraction must be in"):
            flag_outliers(values, bad)


def test_plan_on_a_cpu_host():
    plan = plan_commbench(BenchSettings(), cuda_devices=0)
    assert (plan.num_processes, plan.backends) == (2, ("gloo",))
    with pytest.raises(ValueError, match="--backend nccl needs CUDA GPUs and this host has none visible"):
        plan_commbench(BenchSettings(), backend="nccl", cuda_devices=0)
    with pytest.raises(ValueError, match="--num-processes must be a whole number of processes >= 2, got 1"):
        plan_commbench(BenchSettings(), num_processes=1, cuda_devices=0)
    with pytest.raises(ValueError, match="--iters must be"):
        plan_commbench(BenchSettings(iters=0), cuda_devices=0)


def test_plan_on_a_gpu_host_puts_gloo_next_to_nccl():
    # The GPU count is passed in: this machine has no GPU.
    plan = plan_commbench(BenchSettings(), cuda_devices=8)
    assert (plan.num_processes, plan.backends) == (8, ("nccl",))
    plan = plan_commbench(BenchSettings(), backend="gloo", cuda_devices=8)
    assert plan.backends == ("nccl", "gloo")
    assert "--allow-gloo-on-cuda" in worker_launch(plan, "gloo", "out.json").argv()
    assert "--allow-gloo-on-cuda" not in worker_launch(plan, "nccl", "out.json").argv()
    with pytest.raises(ValueError, match="--num-processes 9 needs 9 GPUs .* 8 visible; e.g. --num-processes 8"):
        plan_commbench(BenchSettings(), num_processes=9, cuda_devices=8)
    with pytest.raises(ValueError, match="2 needs 2 GPUs .* 1 visible; one GPU has no GPU-to-GPU link"):
        plan_commbench(BenchSettings(), cuda_devices=1)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return set(re.findall(r"--[\w-]+", parser.format_usage())) - {"--help"}


def test_one_parser_for_the_subcommand_the_ranks_and_the_launcher_between_them():
    """The flags are defined once (commbench_command_parser): the subcommand adds the launcher's, the rank's parser
    what the launcher hands it; the launcher's argv parses back into the settings it came from."""
    sub = commbench_command_parser(argparse.ArgumentParser().add_subparsers())
    rank = commbench_command_parser()
    shared = {"--backend", "--sizes", "--iters", "--warmup", "--link-size", "--fraction", "--json"}
    assert _flags(sub) == shared | {"--num-processes"}
    assert _flags(rank) == shared | {"--output", "--allow-gloo-on-cuda"}
    settings = BenchSettings(sizes=(1000, 4096), iters=3, warmup=1, link_bytes=65536, fraction=0.25)
    plan = plan_commbench(settings, cuda_devices=0)
    argv = worker_launch(plan, "gloo", "out.json").argv()
    args = rank.parse_args(argv[argv.index("hf_dist_recipes.comm.commbench") + 1 :])
    assert settings_of(args) == settings and (args.backend, args.output) == ("gloo", "out.json")
    assert settings_of(sub.parse_args([])) == settings_of(rank.parse_args([])) == BenchSettings()


def _run(backend, times):
    rows = [
        {"op": op, "size_bytes": size, "time_us": t, "algbw_GBps": None, "busbw_GBps": None, "call": op, "note": ""}
        for (op, size), t in times.items()
    ]
    return {"world_size": 2, "backend": backend, "results": rows}


def test_side_by_side_ratio():
    nccl = _run("nccl", {("all_reduce", 1024): 20.0, ("all_reduce", 2048): 100.0, ("all_gather", 1024): 10.0})
    gloo = _run("gloo", {("all_reduce", 1024): 60.0, ("all_reduce", 2048): 250.0, ("all_gather", 1024): None})
    both = side_by_side(nccl, gloo)
    rows = both["comparison"]
    # 60 / 20 = 3x; 250 / 100 = 2.5x; all_gather unsupported on the Gloo side: no ratio
    assert [(r["op"], r["size_bytes"], r["gloo_slower_x"]) for r in rows] == [
        ("all_reduce", 1024, 3.0),
        ("all_reduce", 2048, 2.5),
    ]
    both["runs"] = [_full(run) for run in both["runs"]]
    out = render(both)
    assert "  all_reduce           1K        20.0        60.0       3.0x" in out
    assert "  all_reduce           2K       100.0       250.0       2.5x" in out


def _full(run: dict) -> dict:
    """`run` with the fields render() needs besides the results (a run without links or ranks)."""
    return {
        **run,
        "device": "cuda",
        "hosts": ["h"],
        "dtype": "float32",
        "iters": 3,
        "fraction": 0.5,
        "links": [],
        "ranks": [],
        "flagged": {"links": [], "ranks": []},
    }


def test_render_marks_the_slow_link():
    result = {
        "world_size": 2,
        "backend": "gloo",
        "device": "cpu",
        "hosts": ["a", "b"],
        "dtype": "float32",
        "iters": 3,
        "fraction": 0.5,
        "results": [
            {
                "op": "all_reduce",
                "size_bytes": 1024,
                "time_us": 10.0,
                "algbw_GBps": 0.1,
                "busbw_GBps": 0.1,
                "call": "torch.distributed.all_reduce",
                "note": "",
            }
        ],
        "links": [
            {
                "src": 0,
                "dst": 1,
                "src_host": "a",
                "dst_host": "b",
                "size_bytes": 1024,
                "time_us": 9.0,
                "GBps": 0.1,
                "flagged": True,
            },
            {
                "src": 1,
                "dst": 0,
                "src_host": "b",
                "dst_host": "a",
                "size_bytes": 1024,
                "time_us": 1.0,
                "GBps": 1.0,
                "flagged": False,
            },
        ],
        "ranks": [],
        "flagged": {"links": [[0, 1]], "ranks": []},
    }
    out = render(result)
    assert "rank 0 (a) -> rank 1 (b): 0.100 GB/s, 9.0 us  SLOW" in out
    assert "rank 1 (b) -> rank 0 (a): 1.000 GB/s, 1.0 us\n" in out
    assert "flagged below 0.5 x the median: links [[0, 1]]" in out
