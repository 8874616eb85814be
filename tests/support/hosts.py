"""What this host has, read from the host and not through the code under test (torch's GPUs, NVML, the CPU flags of
/proc/cpuinfo), counted once in the pytest process (where no test hid the GPUs), and the skips that follow from it,
each written once. A test expects what its host has, never the build machine's facts written as constants: CI and
developers run on 2-core CPU machines whose CPUs differ, and `make test` also runs on GPU hosts."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from hf_dist_recipes.environment.cuda_host import inspect_host

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

# The NVIDIA GPUs as the device files and nvidia-smi show them (a host whose torch cannot use them still counts).
NVIDIA_HOST = bool(inspect_host().gpu_count)


def needs_gpus(count: int) -> pytest.MarkDecorator:
    """Skip the NCCL variant of a CPU test unless this host has `count` CUDA GPUs, naming how many it has."""
    need = "a CUDA GPU" if count == 1 else f">= {count} CUDA GPUs"
    return pytest.mark.skipif(GPUS < count, reason=f"NCCL variant: needs {need}, this host has {GPUS}")


needs_two_gpus = needs_gpus(2)

# A DeepSpeed launch on the CPU of a machine with NVIDIA GPUs needs a CPU request for RecipeTrainingArguments
# (ACCELERATE_USE_CPU), and that request makes accelerate 1.16 drop DeepSpeed (the preflight's backend check
# reports it). Until the arguments take the YAML's use_cpu another way, the preflight's launches run on CPU-only hosts.
cpu_only_host = pytest.mark.skipif(
    NVIDIA_HOST,
    reason="a DeepSpeed CPU launch on a GPU host needs ACCELERATE_USE_CPU, which drops DeepSpeed (tests.support.hosts)",
)


def _nvml_note() -> str | None:
    """What NVML says on this host, asked of pynvml directly (not through monitoring.system_metrics) for the GPU this
    process's device 0 is: None when it answers the per-GPU queries the system metrics sample (utilization, memory,
    power), else the start of the note those metrics write instead: "NVML unavailable" (no driver library, no GPU;
    nvidia-ml-py itself is in requirements.lock, so it imports everywhere) or "NVML stopped answering" (a query the
    GPU refuses, such as utilization under MIG)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no driver library (a CPU host), a driver that does not load
        return "NVML unavailable"
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
        except Exception:
            return "NVML unavailable"
        try:
            pynvml.nvmlDeviceGetUtilizationRates(handle)
            pynvml.nvmlDeviceGetMemoryInfo(handle)
            pynvml.nvmlDeviceGetPowerUsage(handle)
        except Exception:
            return "NVML stopped answering"
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()  # NVML counts its inits: a callback's own nvmlInit later is unaffected


NVML_NOTE = _nvml_note()


def cpu_flags() -> frozenset[str]:
    """This host's CPU flags as the kernel reports them (the `flags` lines of /proc/cpuinfo; empty where the file is
    missing or lists none, as on a CPU that is not x86)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return frozenset()
    return frozenset(f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split())


# oneDNN's x86 instruction-set levels (src/cpu/x64/cpu_isa_traits.hpp `mayiuse`) in /proc/cpuinfo's names.
AVX512_CORE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
# avx512_core_fp16: AVX512-FP16 on top of avx512_core_bf16 (+ VNNI, BF16) and avx2_vnni; the AMX levels include it.
AVX512_CORE_FP16 = AVX512_CORE | {"avx512_vnni", "avx512_bf16", "avx512_fp16", "avx2", "avx_vnni"}
ONEDNN_ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def cpu_fp16_kernels() -> tuple[bool | None, str]:
    """(whether oneDNN has fp16 kernels on this CPU, why it cannot be told), read from /proc/cpuinfo alone. This is
    what torch's mkldnn fp16 check answers, and with it DeepSpeed's CPU accelerator (`is_fp16_supported`): ideep's
    `has_fp16_type_support` asks for oneDNN's effective level at least avx512_core_fp16 or exactly avx2_vnni_2,
    and oneDNN takes any AVX-512 level before avx2_vnni_2 (`get_max_cpu_isa`). None, with the reason, where the
    flags cannot tell: no x86 flags, a level capped by ONEDNN_MAX_CPU_ISA, or a CPU without AVX-512 but with
    AVX-VNNI, whose avx2_vnni_2 needs AVX-NE-CONVERT and AVX-VNNI-INT8 (CPUID 7.1 EDX, which /proc/cpuinfo does
    not list: Alder Lake lacks them, Arrow Lake and Sierra Forest have them)."""
    flags = cpu_flags()
    if not flags:
        return None, "/proc/cpuinfo lists no x86 CPU flags"
    for name in ONEDNN_ISA_CAPS:
        if os.environ.get(name):
            return None, f"{name}={os.environ[name]} caps oneDNN's instruction set"
    if AVX512_CORE <= flags:
        return AVX512_CORE_FP16 <= flags, ""
    if {"avx2", "avx_vnni"} <= flags:
        return None, "AVX-VNNI without AVX-512: AVX-NE-CONVERT decides, and /proc/cpuinfo does not list it"
    return False, ""
