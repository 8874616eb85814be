"""A machine with NVIDIA GPUs whose torch cannot use them: stop, instead of training on the CPU.

`RecipeTrainingArguments` sets `use_cpu=True` when torch sees no CUDA device, which is right on a CPU-only host.
On a GPU node the same happens silently when torch cannot reach its GPUs, and the job trains on the CPU about a
hundred times slower. The usual causes, each named with its fix by `check_torch_sees_gpus`:
- a CPU-only torch wheel (`torch.version.cuda is None`), e.g. `pip install torch` resolved to `+cpu`;
- `CUDA_VISIBLE_DEVICES` that hides every GPU ("", "-1", or SLURM's "NoDevFiles");
- an NVIDIA driver older than the wheel's CUDA needs (NVIDIA's minor-version compatibility floors below);
- a broken driver (`nvidia-smi` fails, e.g. "Driver/library version mismatch" after an upgrade without reboot);
- anything else torch reports itself (its "CUDA initialization: ..." warning is repeated).

Training on the CPU on such a machine is fine when it was asked for (`cpu_request`): `use_cpu=True`;
`ACCELERATE_USE_CPU` true (what `accelerate launch` sets from a config's `use_cpu: true` for its plain launcher);
or `HF_DIST_RECIPES_USE_CPU` true, for the ranks of a DeepSpeed config with `use_cpu: true`, to which accelerate
1.16's DeepSpeed launcher passes nothing of it (and ACCELERATE_USE_CPU would turn DeepSpeed off in
AcceleratorState). Only a run that nothing asked to be on the CPU is stopped.

The GPUs are found without torch: the device files `/dev/nvidia<N>` (not nvidiactl, nvidia-uvm, nvidia-modeset)
and `nvidia-smi -L`. `DEV_DIR` and `NVIDIA_SMI` are module-level so tests can point them at fakes.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DEV_DIR = "/dev"
NVIDIA_SMI = "nvidia-smi"
SMI_TIMEOUT_S = 10.0  # nvidia-smi answers in well under a second; a hung driver must not hang the arguments
PROBE_TIMEOUT_S = 120.0  # a fresh interpreter importing torch to replay its CUDA warning (seconds)
DEVICE_FILE = re.compile(r"nvidia(\d+)")
# Set by accelerate 1.16 `launch` from the config's use_cpu (utils/launch.py prepare_simple_launcher_cmd_env) and
# read by transformers 5.24 TrainingArguments and accelerate's PartialState; true values as accelerate's str_to_bool.
CPU_REQUEST_ENV = "ACCELERATE_USE_CPU"
# This package's own request, read only here: accelerate 1.16 prepare_deepspeed_cmd_env does not pass use_cpu on.
RECIPE_CPU_ENV = "HF_DIST_RECIPES_USE_CPU"
TRUE_VALUES = ("y", "yes", "t", "true", "on", "1")
# Where the install fix points: a lock of this environment, and an image of the CUDA build, from `pin`.
PIN_HINT = (
    "the other versions exact (hf-dist-recipes pin --output DIR --torch <version> --cuda 13.0 writes a "
    "lock and a Dockerfile for that build)"
)

# Lowest Linux driver per CUDA major version under minor-version compatibility: NVIDIA "CUDA Compatibility"
# guide, table "CUDA Toolkit and Minimum Required Driver Version for CUDA Minor Version Compatibility"
# (11.x >= 450.80.02, 12.x >= 525.60.13, 13.x >= 580); /work/shared/reference/version-facts.md "Driver floors".
MIN_DRIVER_BY_CUDA_MAJOR: dict[int, str] = {11: "450.80.02", 12: "525.60.13", 13: "580"}


@dataclass(frozen=True)
class NvidiaHost:
    """What the machine shows of NVIDIA GPUs, independently of torch.

    `device_files`: names of `/dev/nvidia<N>`; `smi_gpus`: GPU lines of `nvidia-smi -L` (None: no nvidia-smi);
    `driver_version`: from nvidia-smi (None when unknown); `smi_error`: nvidia-smi's own message when it exists
    but failed (a driver that does not answer).
    """

    device_files: tuple[str, ...] = ()
    smi_gpus: tuple[str, ...] | None = None
    driver_version: str | None = None
    smi_error: str | None = None

    @property
    def gpu_count(self) -> int:
        return max(len(self.device_files), len(self.smi_gpus or ()))

    def evidence(self) -> str:
        seen = []
        if self.device_files:
            seen.append(", ".join(self.device_files[:2]) + (", ..." if len(self.device_files) > 2 else ""))
        if self.smi_gpus:
            seen.append(f"nvidia-smi: {self.smi_gpus[0]}" + (", ..." if len(self.smi_gpus) > 1 else ""))
        return "; ".join(seen)


def nvidia_device_files(dev_dir: str | None = None) -> list[str]:
    """Paths of the per-GPU device files `<dev_dir>/nvidia<N>` (default `DEV_DIR`), by GPU number."""
    base = dev_dir or DEV_DIR
    try:
        names = os.listdir(base)
    except OSError:
        return []
    gpus = sorted((int(m.group(1)), n) for n in names if (m := DEVICE_FILE.fullmatch(n)))
    return [os.path.join(base, n) for _, n in gpus]


def _run_smi(nvidia_smi: str | None, *args: str) -> tuple[bool, str] | None:
    """(succeeded, output) of nvidia-smi with `args`; None when there is no nvidia-smi."""
    exe = shutil.which(nvidia_smi or NVIDIA_SMI)
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return False, f"nvidia-smi did not answer within {SMI_TIMEOUT_S:.0f} s"
    except OSError as err:
        return False, str(err)
    return done.returncode == 0, (done.stdout + done.stderr).strip()


def inspect_host(*, dev_dir: str | None = None, nvidia_smi: str | None = None) -> NvidiaHost:
    """The NVIDIA GPUs of this machine as its device files and nvidia-smi show them."""
    files = tuple(nvidia_device_files(dev_dir))
    listed = _run_smi(nvidia_smi, "-L")
    if listed is None:
        return NvidiaHost(device_files=files)
    ok, text = listed
    if not ok:
        return NvidiaHost(device_files=files, smi_gpus=(), smi_error=text.splitlines()[0] if text else "failed")
    # "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-...)"; MIG lines are indented under their GPU.
    gpus = tuple(line.strip() for line in text.splitlines() if line.startswith("GPU "))
    driver = _run_smi(nvidia_smi, "--query-gpu=driver_version", "--format=csv,noheader")
    version = driver[1].splitlines()[0].strip() if driver and driver[0] and driver[1] else None
    return NvidiaHost(device_files=files, smi_gpus=gpus, driver_version=version)


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))


def min_driver_for_cuda(cuda: str) -> str | None:
    """Lowest Linux driver that runs CUDA `cuda` (e.g. "12.4") under minor-version compatibility; None if unknown."""
    parts = _version_tuple(cuda)
    return MIN_DRIVER_BY_CUDA_MAJOR.get(parts[0]) if parts else None


def visible_devices_hide_all(value: str | None) -> bool:
    """Whether CUDA_VISIBLE_DEVICES=`value` leaves no GPU visible, by torch's own reading
    (torch/cuda/__init__.py `_parse_visible_devices`: the list stops at the first entry that is not a GPU- or MIG-
    UUID and does not start with a non-negative number, so "", "-1" and SLURM's "NoDevFiles" hide every GPU)."""
    if value is None:
        return False
    first = value.split(",")[0].strip()
    if first.startswith(("GPU-", "MIG-")):
        return False
    number = re.match(r"[+-]?\d+", first)
    return number is None or int(number.group()) < 0


def torch_cuda_warnings(python: str | None = None) -> list[str]:
    """The warnings torch gives when it looks for CUDA ("CUDA initialization: ...", "The NVIDIA driver on your
    system is too old ..."). torch gives them once per process (c10 `device_count` caches its answer), so when this
    process has already asked, a fresh interpreter (`python`, default this one) asks again."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.is_available()
    found = [str(w.message) for w in caught]
    if found:
        return found
    try:
        done = subprocess.run(
            [python or sys.executable, "-W", "always", "-c", "import torch; torch.cuda.is_available()"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    # "<file>:<line>: UserWarning: CUDA initialization: ..." (one line, or continued on the next ones)
    return [m.group(1).strip() for m in re.finditer(r"Warning: (.+)", done.stderr)]


def _reason_and_fix(host: NvidiaHost) -> tuple[str, str]:
    base_version = torch.__version__.split("+")[0]
    if torch.version.cuda is None:
        kind = f"a ROCm build (HIP {torch.version.hip})" if torch.version.hip else "a CPU-only build"
        return (
            f"torch {torch.__version__} is {kind}",
            f"install the CUDA build of the same torch, keeping {PIN_HINT}: pip install torch=={base_version} "
            "--index-url https://download.pytorch.org/whl/cu130 (needs driver >= 580; whl/cu126 for drivers "
            ">= 525.60.13)",
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible_devices_hide_all(visible):
        return (
            f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU",
            "unset CUDA_VISIBLE_DEVICES or list the GPUs to use (e.g. 0,1,2,3); under SLURM request them "
            "with --gpus-per-node",
        )
    floor = min_driver_for_cuda(torch.version.cuda)
    if host.driver_version and floor and _version_tuple(host.driver_version) < _version_tuple(floor):
        return (
            f"the NVIDIA driver {host.driver_version} is older than torch's CUDA {torch.version.cuda} needs "
            f"(>= {floor})",
            f"upgrade the driver to >= {floor}, or install a torch build for an older CUDA that this driver runs "
            f"(pip install torch=={base_version} --index-url https://download.pytorch.org/whl/cu126 needs "
            ">= 525.60.13)",
        )
    if host.smi_error:
        return (
            f"the NVIDIA driver does not answer (nvidia-smi: {host.smi_error})",
            "fix the driver install (after a driver upgrade, reboot the node) until nvidia-smi lists the GPUs",
        )
    said = torch_cuda_warnings()
    if said:
        return (f"torch says: {' / '.join(said)}", "fix what torch names, until torch.cuda.is_available() is True")
    return (
        "torch.cuda.is_available() is False and torch gave no reason",
        "check that this process may open the /dev/nvidia* files (containers: --gpus all) and that "
        "python -c 'import torch; print(torch.cuda.device_count())' counts the GPUs",
    )


def cpu_request(use_cpu: bool, environ: dict[str, str] | None = None) -> str | None:
    """Who explicitly asked to train on the CPU, in words ("use_cpu=True", "ACCELERATE_USE_CPU=true",
    "HF_DIST_RECIPES_USE_CPU=1"), or None when nothing did. `use_cpu`: the arguments' value as the user gave it;
    `environ` defaults to os.environ."""
    if use_cpu:
        return "use_cpu=True"
    env = os.environ if environ is None else environ
    for name in (CPU_REQUEST_ENV, RECIPE_CPU_ENV):
        value = env.get(name)
        if value is not None and value.strip().lower() in TRUE_VALUES:
            return f"{name}={value}"
    return None


def check_torch_sees_gpus(
    *,
    cuda_devices: int,
    allow_cpu_with_gpus: bool = False,
    cpu_requested_by: str | None = None,
    dev_dir: str | None = None,
    nvidia_smi: str | None = None,
) -> NvidiaHost | None:
    """Raise ValueError with the reason and the fix when torch sees no GPU (`cuda_devices` == 0) on a machine
    that has NVIDIA GPUs. Returns what was found of them (None when torch sees GPUs, nothing is looked up then).
    `allow_cpu_with_gpus`: training on the CPU is meant; only a warning is logged. `cpu_requested_by`: who asked
    for the CPU explicitly (`cpu_request`), then it is only noted. `dev_dir` / `nvidia_smi` default to `DEV_DIR` /
    `NVIDIA_SMI`."""
    if cuda_devices:
        return None
    host = inspect_host(dev_dir=dev_dir, nvidia_smi=nvidia_smi)
    if not host.gpu_count:  # nvidia-smi alone (a driver install on a CPU node) is no GPU to lose
        return host
    if cpu_requested_by:
        logger.warning(
            "training on the CPU as %s asks, although this machine has %d NVIDIA GPU(s) (%s)",
            cpu_requested_by,
            host.gpu_count,
            host.evidence(),
        )
        return host
    if allow_cpu_with_gpus:
        logger.warning(
            "training on the CPU although this machine has %d NVIDIA GPU(s) (%s): allow_cpu_with_gpus is set",
            host.gpu_count,
            host.evidence(),
        )
        return host
    reason, fix = _reason_and_fix(host)
    raise ValueError(
        f"this machine has {host.gpu_count} NVIDIA GPU(s) ({host.evidence()}) but torch sees none, so training "
        f"would run on the CPU, about 100x slower: {reason}. Fix: {fix}. To train on the CPU on purpose ask for "
        "it: use_cpu=True (or an accelerate config with use_cpu: true), or allow_cpu_with_gpus=True "
        "(--allow_cpu_with_gpus)."
    )
