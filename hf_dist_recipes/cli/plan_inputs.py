"""What the plan commands (`config generate`, `estimate`, `validate`) take about the hardware: the --hardware preset,
the rate flags and --profile (`hardware_flags`, `profile_flag`), the rates they resolve to and where each came from
(`hardware_and_sources`), the --gpu-memory check, and DeepSpeed's import kept off stdout for --json."""

from __future__ import annotations

import argparse
import contextlib
import sys

from hf_dist_recipes.planning.plan import ParallelPlan


def deepspeed_logs_to_stderr() -> None:
    """Import DeepSpeed with stdout pointed at stderr: its logger binds the stream it sees at import time and
    prints an accelerator notice, which would otherwise corrupt --json output."""
    if "deepspeed" not in sys.modules:
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed  # noqa: F401


def check_gpu_memory(gib: float | None) -> None:
    """ValueError (a usage error, exit 2) for a --gpu-memory (GiB per GPU) that is not positive."""
    if gib is not None and not gib > 0:
        raise ValueError(f"--gpu-memory must be a positive number of GiB, got {gib:g}; e.g. --gpu-memory 80")


def hardware_flags(parser: argparse.ArgumentParser) -> None:
    from hf_dist_recipes.planning.comm import HARDWARE

    group = parser.add_argument_group("hardware (step-time model; defaults from --hardware)")
    group.add_argument(
        "--hardware",
        choices=sorted(HARDWARE),
        help="GPU type whose defaults to use (h100 when not given): H100/H200 SXM, A100 SXM; one NIC per GPU; named, "
        "it also gives its DGX's host memory where --host-memory is not given",
    )
    group.add_argument("--intra-node-gbps", type=float, help="NCCL bus bandwidth inside a node, GB/s per GPU")
    group.add_argument("--inter-node-gbps", type=float, help="network bandwidth per GPU across nodes, GB/s")
    group.add_argument("--gpu-tflops", type=float, help="dense bf16 peak of one GPU, TFLOP/s")
    group.add_argument("--compute-efficiency", type=float, help="fraction of the peak the matmuls reach (0-1]")
    group.add_argument("--pcie-gbps", type=float, help="host <-> GPU bandwidth for offload, GB/s")
    group.add_argument(
        "--cpu-adam-rate", type=float, help="parameters per second one node's CPUs update with CPU Adam (offload)"
    )
    profile_flag(group)


def profile_flag(group) -> None:
    group.add_argument(
        "--profile",
        metavar="FILE",
        help="rates measured by `hf-dist-recipes calibrate --output FILE`; precedence: a rate flag above > the "
        "profile's measured rate > the --hardware preset (rates the profile marks assumed keep the preset's)",
    )


def hardware_and_sources(args: argparse.Namespace, plan: ParallelPlan | None = None):
    """(the Hardware of --hardware with --profile's measured rates and then the flags given on top, where each rate
    came from (`planning.calibration.hardware_with`), warnings
    about a profile measured unlike `plan` runs: `calibration.profile_warnings`)."""
    from hf_dist_recipes.planning.calibration import hardware_with, profile_warnings, read_profile
    from hf_dist_recipes.planning.comm import HARDWARE

    flags = {
        field: getattr(args, flag)
        for field, flag in (
            ("intra_node_gbps", "intra_node_gbps"),
            ("inter_node_gbps", "inter_node_gbps"),
            ("gpu_tflops", "gpu_tflops"),
            ("compute_efficiency", "compute_efficiency"),
            ("pcie_gbps", "pcie_gbps"),
            ("cpu_adam_params_per_s", "cpu_adam_rate"),
        )
        if getattr(args, flag, None) is not None
    }
    profile = read_profile(args.profile) if getattr(args, "profile", None) else None
    base = HARDWARE[getattr(args, "hardware", None) or "h100"]
    hw, sources = hardware_with(base, profile, flags, profile_path=getattr(args, "profile", None) or "")
    device, procs = (plan.device, plan.procs_per_node) if plan else ("cuda", None)
    return hw, sources, profile_warnings(profile, sources, device, procs)
