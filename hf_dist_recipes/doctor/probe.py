"""`probe()`: the facts of this environment that decide whether distributed training works, in one typed value.

Collected (each source can be injected, so tests replay recorded GPU hosts on a machine without one):
- host name, Python, `platform.machine()`;
- torch: version, build CUDA (`torch.version.cuda`), cuDNN (`torch.backends.cudnn.version()`, torch's integer),
  the NCCL it was COMPILED against (`torch.cuda.nccl.version()`, CUDA builds only), what it sees of the GPUs
  (`probe_gpus.py`);
- the NCCL INSTALLED (the `nvidia-nccl-*` distribution) and the one LOADED (`probe_nccl.py`);
- the NVIDIA driver and the highest CUDA it runs (NVML; nvidia-smi's driver when NVML is missing), and the GPU
  device files and `nvidia-smi -L` (`cuda_host.inspect_host`);
- GPUs: name, compute capability, memory (torch when it sees them, else NVML, which ignores
  CUDA_VISIBLE_DEVICES); peer access between every pair; active NVLinks per GPU (`probe_gpus.py`);
- InfiniBand / RoCE ports from sysfs (`<sysfs>/class/infiniband/<dev>/ports/<n>/state`, `link_layer`), network
  interfaces (`<sysfs>/class/net`, with each one's `operstate` and `ifindex`), the size of /dev/shm (`os.statvfs`),
  whether this is a container (`/.dockerenv`, `/run/.containerenv`);
- nvcc's CUDA release (`nvcc --version`, from PATH or `$CUDA_HOME/bin`), which DeepSpeed's op JIT build compares
  with torch's;
- versions of deepspeed, transformers, accelerate, datasets and hf-dist-recipes from importlib.metadata: never
  imported (importing deepspeed alone takes seconds; the doctor answers in under 3 s); the list and the reader are
  `environment/fingerprint.py`'s, the versions every rank compares;
- the environment variables set whose names start with NCCL_, TORCH_ or CUDA_.
A source that cannot be read is a fact ("unavailable: <why>"), never an exception. The facts' types and the flat
mapping the known-issues rules read (`rule_facts()`) are in `facts.py`.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence

from hf_dist_recipes.doctor.facts import DriverFacts, EnvironmentFacts, IbPort, NetInterface
from hf_dist_recipes.doctor.probe_gpus import merge_gpus, probe_nvml, probe_torch
from hf_dist_recipes.doctor.probe_nccl import loaded_nccl, probe_nccl
from hf_dist_recipes.environment import cuda_host
from hf_dist_recipes.environment.fingerprint import PACKAGES, installed_version

ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_")
CONTAINER_MARKERS = ("/.dockerenv", "/run/.containerenv")  # Docker's, Podman's
NVCC_TIMEOUT_S = 5.0  # nvcc --version answers in tens of milliseconds; a broken toolkit must not stall the doctor


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _probe_ib(sysfs_root: str) -> tuple[IbPort, ...]:
    base = os.path.join(sysfs_root, "class", "infiniband")
    ports = []
    for dev in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        port_dir = os.path.join(base, dev, "ports")
        names = os.listdir(port_dir) if os.path.isdir(port_dir) else []
        for port in sorted((n for n in names if n.isdigit()), key=int):
            state = _read(os.path.join(port_dir, port, "state")) or "unknown"
            ports.append(
                IbPort(
                    dev, int(port), state.split(":", 1)[-1].strip(), _read(os.path.join(port_dir, port, "link_layer"))
                )
            )
    return tuple(ports)


def _probe_net(sysfs_root: str) -> tuple[NetInterface, ...]:
    base = os.path.join(sysfs_root, "class", "net")
    found = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        index = _read(os.path.join(base, name, "ifindex"))
        state = _read(os.path.join(base, name, "operstate")) or "unknown"
        found.append(NetInterface(name, state, int(index) if index and index.isdigit() else None))
    return tuple(found)


def _probe_nvcc(nvcc: str | None, environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(path, CUDA release) of nvcc: `nvcc` when given, else PATH, else $CUDA_HOME/bin/nvcc."""
    path = nvcc
    if path is None:
        path = shutil.which("nvcc", path=environ.get("PATH"))
        home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
        if path is None and home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            path = os.path.join(home, "bin", "nvcc")
    if not path:
        return None, None
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=NVCC_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return path, None
    # "Cuda compilation tools, release 12.4, V12.4.131"
    found = re.search(r"release (\d+\.\d+)", done.stdout)
    return path, found.group(1) if found else None


def probe(
    *,
    nvml=None,
    torch_cuda=None,
    sysfs_root: str = "/sys",
    dev_shm: str = "/dev/shm",
    dev_dir: str | None = None,
    nvidia_smi: str | None = None,
    nvcc: str | None = None,
    environ: Mapping[str, str] | None = None,
    package_version: Callable[[str], str | None] | None = None,
    container_markers: Sequence[str] = CONTAINER_MARKERS,
    proc_maps: str = "/proc/self/maps",
    nccl_get_version: Callable[[str], int | None] | None = None,
) -> EnvironmentFacts:
    """The facts of this environment (see the module docstring). Every argument replaces one source, for tests:
    `nvml`: a pynvml-like module (default: import pynvml); `torch_cuda`: a torch.cuda-like object (default
    torch.cuda); `sysfs_root` (default /sys); `dev_shm`: the directory whose size is measured (default /dev/shm);
    `dev_dir` / `nvidia_smi`: the /dev directory and nvidia-smi executable (cuda_host's defaults); `nvcc`: the nvcc
    to ask (default: PATH, then $CUDA_HOME/bin; "" for none); `environ` (default os.environ); `package_version`:
    distribution name -> version or None (default importlib.metadata); `container_markers`: files whose presence
    means a container; `proc_maps` (default /proc/self/maps) / `nccl_get_version` (path -> ncclGetVersion's
    integer, default through ctypes): where the loaded libnccl is found and how its version is read."""
    environ = os.environ if environ is None else environ
    package_version = package_version or installed_version
    torch_facts, torch_gpus, pairs = probe_torch(torch_cuda, dev_dir, nvidia_smi)
    driver, nvml_gpus = probe_nvml(nvml)
    host = cuda_host.inspect_host(dev_dir=dev_dir, nvidia_smi=nvidia_smi)
    if driver.version is None and host.driver_version:
        driver = DriverFacts(host.driver_version, None, "nvidia-smi", driver.nvml_unavailable)
    try:
        st = os.statvfs(dev_shm)
        shm_bytes, shm_error = st.f_frsize * st.f_blocks, None
    except OSError as e:
        shm_bytes, shm_error = None, f"{dev_shm}: {e.strerror or e}"
    net = os.path.join(sysfs_root, "class", "net")
    nvcc_path, nvcc_cuda = _probe_nvcc(nvcc, environ)
    return EnvironmentFacts(
        host=socket.gethostname(),
        python=platform.python_version(),
        arch=platform.machine(),
        torch=torch_facts,
        nccl=probe_nccl(torch_facts.nccl_compiled, package_version, loaded_nccl(proc_maps, nccl_get_version)),
        driver=driver,
        nvidia_host=host,
        gpus=merge_gpus(torch_gpus, nvml_gpus, environ.get("CUDA_VISIBLE_DEVICES")),
        peer_access=tuple(pairs),
        ib_ports=_probe_ib(sysfs_root),
        nic_names=tuple(sorted(os.listdir(net))) if os.path.isdir(net) else (),
        net_interfaces=_probe_net(sysfs_root),
        shm_bytes=shm_bytes,
        shm_error=shm_error,
        in_container=any(os.path.exists(m) for m in container_markers),
        nvcc=nvcc_path,
        nvcc_cuda=nvcc_cuda,
        packages={name: package_version(name) for name in PACKAGES},
        env={k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES)},
    )


if __name__ == "__main__":  # python -m hf_dist_recipes.doctor.probe: the facts as JSON
    import json

    json.dump(probe().to_dict(), sys.stdout, indent=2)
    print()
