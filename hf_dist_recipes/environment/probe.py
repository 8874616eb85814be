"""`probe()`: the facts of this environment that decide whether distributed training works, in one typed value.

Collected (each source can be injected, so tests replay recorded GPU hosts on a machine without one):
- host name, Python, `platform.machine()`;
- torch: version, build CUDA (`torch.version.cuda`), cuDNN (`torch.backends.cudnn.version()`, torch's integer),
  the NCCL it was COMPILED against (`torch.cuda.nccl.version()`, CUDA builds only), what it sees of the GPUs;
- the NCCL INSTALLED: the `nvidia-nccl-cu11/cu12/cu13` distribution, which is the library torch's wheel loads
  (version-facts.md "Reading the facts at run time"; a mismatch: NVIDIA/nccl 1212, pytorch 122571), and the one
  LOADED: the libnccl.so file in /proc/self/maps (a CUDA torch loads it at import) and its `ncclGetVersion`;
- the NVIDIA driver and the highest CUDA it runs (NVML `nvmlSystemGetDriverVersion`,
  `nvmlSystemGetCudaDriverVersion_v2`; nvidia-smi's driver when NVML is missing), and the GPU device files and
  `nvidia-smi -L` (`cuda_host.inspect_host`);
- GPUs: name, compute capability, memory (torch when it sees them, else NVML, which ignores
  CUDA_VISIBLE_DEVICES); peer access between every pair (`torch.cuda.can_device_access_peer`); active NVLinks per
  GPU (`nvmlDeviceGetNvLinkState` per link; absent links raise and count as inactive);
- InfiniBand / RoCE ports from sysfs (`<sysfs>/class/infiniband/<dev>/ports/<n>/state`, `link_layer`), network
  interfaces (`<sysfs>/class/net`, with each one's `operstate` and `ifindex`), the size of /dev/shm (`os.statvfs`),
  whether this is a container (`/.dockerenv`, `/run/.containerenv`);
- nvcc's CUDA release (`nvcc --version`, from PATH or `$CUDA_HOME/bin`), which DeepSpeed's op JIT build compares
  with torch's;
- versions of deepspeed, transformers, accelerate, datasets and hf-dist-recipes from importlib.metadata: never
  imported (importing deepspeed alone takes seconds; the doctor answers in under 3 s);
- the environment variables set whose names start with NCCL_, TORCH_ or CUDA_.
A source that cannot be read is a fact ("unavailable: <why>"), never an exception.

`EnvironmentFacts.rule_facts()` flattens the facts for the known-issues rules (`environment/rules.py`), with
exactly these keys (None when unknown):
    python, torch (base version, "+cpu"-style local tag stripped), cuda (torch's build CUDA, None for a CPU build),
    nccl (the loaded NCCL, else the installed one, else the compiled one), nccl_compiled, deepspeed, transformers,
    accelerate, datasets (version strings), driver ("580.65.06"), driver_cuda ("13.0"), nvcc_cuda ("12.4"),
    arch ("x86_64", "aarch64"), gpu_count (int), gpu_names (list[str]), compute_capabilities (list like ["9.0"]),
    nvlink (bool | None: any NVLink active; None without NVML), peer_access (bool | None: every pair of GPUs can
    access each other; None with fewer than 2 GPUs), ib_active (bool: an InfiniBand/RoCE port is ACTIVE),
    nic_names (list[str]), shm_bytes (int | None), in_container (bool), env (dict[str, str] of the variables above).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from hf_dist_recipes.environment import cuda_host

RULE_FACT_KEYS = (
    "python",
    "torch",
    "cuda",
    "nccl",
    "nccl_compiled",
    "deepspeed",
    "transformers",
    "accelerate",
    "datasets",
    "driver",
    "driver_cuda",
    "nvcc_cuda",
    "arch",
    "gpu_count",
    "gpu_names",
    "compute_capabilities",
    "nvlink",
    "peer_access",
    "ib_active",
    "nic_names",
    "shm_bytes",
    "in_container",
    "env",
)
PACKAGES = ("deepspeed", "transformers", "accelerate", "datasets", "hf-dist-recipes")
# The wheels torch depends on for its NCCL, newest CUDA first (version-facts.md, the wheels' Requires-Dist).
NCCL_DISTRIBUTIONS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_")
CONTAINER_MARKERS = ("/.dockerenv", "/run/.containerenv")  # Docker's, Podman's
NVCC_TIMEOUT_S = 5.0  # nvcc --version answers in tens of milliseconds; a broken toolkit must not stall the doctor
NVML_FEATURE_ENABLED = 1  # pynvml.NVML_FEATURE_ENABLED: an NVLink link that is up
NVML_INSTALL_HINT = "pip install hf-dist-recipes[nvml] (nvidia-ml-py)"


@dataclass(frozen=True)
class TorchFacts:
    """torch as this process sees it. `version`: torch.__version__ with its local tag ("2.13.0+cpu");
    `cuda`: build CUDA or None; `cudnn`: torch's cuDNN integer (e.g. 91002) or None; `nccl_compiled`: "2.29.7" or
    None; `cuda_available` / `device_count`: what torch.cuda says; `gpu_problem`: why torch sees no GPU on a machine
    that has some (cuda_host.check_torch_sees_gpus's message, with its fix), else None."""

    version: str
    cuda: str | None = None
    cudnn: int | None = None
    nccl_compiled: str | None = None
    cuda_available: bool = False
    device_count: int = 0
    gpu_problem: str | None = None

    @property
    def base_version(self) -> str:
        return self.version.split("+")[0]


@dataclass(frozen=True)
class NcclFacts:
    """`compiled`: the NCCL torch was built against; `installed`: the version of `installed_from` (a
    nvidia-nccl-* distribution, the library torch loads); `others`: further nvidia-nccl-* distributions installed
    next to it ("nvidia-nccl-cu12==2.18.1"), each a chance of loading the wrong libnccl (pytorch 119072);
    `loaded` / `loaded_path`: the ncclGetVersion and file of the libnccl this process has loaded (None: none)."""

    compiled: str | None = None
    installed: str | None = None
    installed_from: str | None = None
    others: tuple[str, ...] = ()
    loaded: str | None = None
    loaded_path: str | None = None


@dataclass(frozen=True)
class DriverFacts:
    """`version`: the NVIDIA driver ("550.54.14"); `cuda`: the highest CUDA it runs ("12.4"); `source`: "nvml" or
    "nvidia-smi"; `nvml_unavailable`: why NVML could not be read (None when it was)."""

    version: str | None = None
    cuda: str | None = None
    source: str | None = None
    nvml_unavailable: str | None = None


@dataclass(frozen=True)
class Gpu:
    """One GPU. `memory_bytes`: total memory; `nvlinks_active`: NVLink links up (None when NVML is unavailable);
    `source`: "torch" or "nvml"."""

    index: int
    name: str
    compute_capability: str | None = None
    memory_bytes: int | None = None
    nvlinks_active: int | None = None
    source: str = "torch"


@dataclass(frozen=True)
class IbPort:
    """One InfiniBand/RoCE port from sysfs. `state`: "ACTIVE", "DOWN", "INIT"... (sysfs writes "4: ACTIVE");
    `link_layer`: "InfiniBand" or "Ethernet" (RoCE)."""

    device: str
    port: int
    state: str
    link_layer: str | None = None

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


@dataclass(frozen=True)
class NetInterface:
    """One IP network interface from sysfs (`<sysfs>/class/net/<name>`). `operstate`: "up", "down", or "unknown" (lo
    and some virtual interfaces); `ifindex`: the kernel's index, the order getifaddrs lists interfaces in (None when
    unreadable)."""

    name: str
    operstate: str
    ifindex: int | None = None


@dataclass(frozen=True)
class EnvironmentFacts:
    """Everything `probe()` found. `peer_access`: (i, j, can) for every ordered pair of GPUs torch sees;
    `nvcc_cuda`: nvcc's CUDA release ("12.4") or None, `nvcc`: its path; `shm_bytes`: size of /dev/shm in bytes,
    `shm_error` why it could not be read; `packages`: distribution -> version (None: not installed);
    `env`: the NCCL_/TORCH_/CUDA_ variables that are set."""

    host: str
    python: str
    arch: str
    torch: TorchFacts
    nccl: NcclFacts
    driver: DriverFacts
    nvidia_host: cuda_host.NvidiaHost
    gpus: tuple[Gpu, ...] = ()
    peer_access: tuple[tuple[int, int, bool], ...] = ()
    ib_ports: tuple[IbPort, ...] = ()
    nic_names: tuple[str, ...] = ()
    net_interfaces: tuple[NetInterface, ...] = ()
    shm_bytes: int | None = None
    shm_error: str | None = None
    in_container: bool = False
    nvcc: str | None = None
    nvcc_cuda: str | None = None
    packages: Mapping[str, str | None] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)

    def nvlink(self) -> bool | None:
        """Any NVLink up; None when no GPU had its links read (no NVML)."""
        counts = [g.nvlinks_active for g in self.gpus if g.nvlinks_active is not None]
        return any(c > 0 for c in counts) if counts else None

    def all_peer_access(self) -> bool | None:
        """Every pair of GPUs can access each other; None with fewer than 2 GPUs seen by torch."""
        return all(can for _, _, can in self.peer_access) if self.peer_access else None

    def to_dict(self) -> dict:
        """JSON-able: every field, plus `rule_facts` (the flat mapping the rules read)."""
        data = asdict(self)
        data["peer_access"] = [{"from": i, "to": j, "can_access": can} for i, j, can in self.peer_access]
        data["packages"] = dict(self.packages)
        data["env"] = dict(self.env)
        data["rule_facts"] = self.rule_facts()
        return data

    def rule_facts(self) -> dict:
        """The flat mapping the known-issues rules evaluate; keys in the module docstring (RULE_FACT_KEYS)."""
        facts = {
            "python": self.python,
            "torch": self.torch.base_version,
            "cuda": self.torch.cuda,
            "nccl": self.nccl.loaded or self.nccl.installed or self.nccl.compiled,
            "nccl_compiled": self.nccl.compiled,
            "deepspeed": self.packages.get("deepspeed"),
            "transformers": self.packages.get("transformers"),
            "accelerate": self.packages.get("accelerate"),
            "datasets": self.packages.get("datasets"),
            "driver": self.driver.version,
            "driver_cuda": self.driver.cuda,
            "nvcc_cuda": self.nvcc_cuda,
            "arch": self.arch,
            "gpu_count": len(self.gpus),
            "gpu_names": [g.name for g in self.gpus],
            "compute_capabilities": [g.compute_capability for g in self.gpus if g.compute_capability],
            "nvlink": self.nvlink(),
            "peer_access": self.all_peer_access(),
            "ib_active": any(p.active for p in self.ib_ports),
            "nic_names": list(self.nic_names),
            "shm_bytes": self.shm_bytes,
            "in_container": self.in_container,
            "env": dict(self.env),
        }
        return facts


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def installed_version(name: str) -> str | None:
    """Version of the installed distribution `name`, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cuda_version_from_int(value: int) -> str:
    """NVML/CUDA's integer version as "major.minor": 12040 -> "12.4" (CUDA encodes 1000*major + 10*minor)."""
    return f"{value // 1000}.{(value % 1000) // 10}"


def _probe_torch(torch_cuda, dev_dir: str | None, nvidia_smi: str | None) -> tuple[TorchFacts, list[Gpu], list]:
    import torch

    cuda_mod = torch.cuda if torch_cuda is None else torch_cuda
    cudnn = None
    try:
        cudnn = torch.backends.cudnn.version()
    except Exception:  # a broken cuDNN install reads as unknown; the GPU checks report the real problem
        cudnn = None
    compiled = None
    if torch.version.cuda is not None:
        try:
            compiled = ".".join(str(p) for p in cuda_mod.nccl.version())
        except Exception:  # a build without NCCL (Windows, some source builds)
            compiled = None
    available = bool(cuda_mod.is_available())
    count = int(cuda_mod.device_count()) if available else 0
    gpus, pairs, problem = [], [], None
    try:
        for i in range(count):
            props = cuda_mod.get_device_properties(i)
            major, minor = cuda_mod.get_device_capability(i)
            gpus.append(Gpu(i, _text(cuda_mod.get_device_name(i)), f"{major}.{minor}", int(props.total_memory)))
        for i in range(count):
            for j in range(count):
                if i != j:
                    pairs.append((i, j, bool(cuda_mod.can_device_access_peer(i, j))))
    except Exception as e:  # a GPU that fails to initialise (ECC, fallen off the bus): a fact, not a crash
        problem = (
            f"torch counts {count} GPU(s) but cannot read them: {type(e).__name__}: {e}. Fix: run "
            "nvidia-smi; a GPU it does not list or marks with errors needs a reset or the node drained"
        )
    if problem is None:
        try:
            cuda_host.check_torch_sees_gpus(cuda_devices=count, dev_dir=dev_dir, nvidia_smi=nvidia_smi)
        except ValueError as err:
            problem = str(err)
    facts = TorchFacts(torch.__version__, torch.version.cuda, cudnn, compiled, available, count, problem)
    return facts, gpus, pairs


def _probe_nvml(nvml) -> tuple[DriverFacts, list[Gpu]]:
    """Driver and GPUs from NVML; DriverFacts.nvml_unavailable says why when it cannot be read."""
    try:
        if nvml is None:
            import pynvml as nvml
    except ImportError:
        return DriverFacts(nvml_unavailable=f"nvidia-ml-py is not installed ({NVML_INSTALL_HINT})"), []
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded on a host without a driver
        return DriverFacts(nvml_unavailable=f"{type(e).__name__}: {e}"), []
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        try:
            cuda = cuda_version_from_int(int(nvml.nvmlSystemGetCudaDriverVersion_v2()))
        except Exception:
            cuda = None
        gpus = []
        max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
        for i in range(int(nvml.nvmlDeviceGetCount())):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
            active = 0
            for link in range(max_links):
                try:
                    active += nvml.nvmlDeviceGetNvLinkState(h, link) == NVML_FEATURE_ENABLED
                except Exception:  # NVML raises for a link the GPU does not have (every link on PCIe cards)
                    continue
            gpus.append(
                Gpu(
                    i,
                    _text(nvml.nvmlDeviceGetName(h)),
                    f"{major}.{minor}",
                    int(nvml.nvmlDeviceGetMemoryInfo(h).total),
                    active,
                    "nvml",
                )
            )
        return DriverFacts(driver, cuda, "nvml"), gpus
    except Exception as e:  # a driver that stops answering half-way
        return DriverFacts(nvml_unavailable=f"{type(e).__name__}: {e}"), []
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _merge_gpus(from_torch: list[Gpu], from_nvml: list[Gpu], visible: str | None) -> tuple[Gpu, ...]:
    """torch's view (it honours CUDA_VISIBLE_DEVICES) with NVML's link counts; NVML's list when torch sees none.
    NVML numbers every GPU of the host: torch's GPU i is NVML's i when both see as many, else NVML's
    CUDA_VISIBLE_DEVICES[i] when that lists plain indices; otherwise the link counts stay unknown."""
    if not from_torch:
        return tuple(from_nvml)
    names = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if len(from_nvml) == len(from_torch):
        order = list(range(len(from_torch)))
    elif len(names) >= len(from_torch) and all(n.isdigit() and int(n) < len(from_nvml) for n in names):
        order = [int(n) for n in names[: len(from_torch)]]
    else:
        return tuple(from_torch)
    return tuple(
        Gpu(t.index, t.name, t.compute_capability, t.memory_bytes, from_nvml[k].nvlinks_active, "torch")
        for t, k in zip(from_torch, order, strict=True)
    )


def nccl_version_from_int(code: int) -> str:
    """ncclGetVersion's integer as "x.y.z": 10000 * x + 100 * y + z since NCCL 2.9 (22105 -> "2.21.5"), 1000 * x
    + 100 * y + z before (2804 -> "2.8.4"); nccl.h NCCL_VERSION."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def _nccl_get_version(path: str) -> int | None:
    """ncclGetVersion of the library at `path` (already loaded, so dlopen returns that same copy)."""
    import ctypes

    version = ctypes.c_int()
    if ctypes.CDLL(path).ncclGetVersion(ctypes.byref(version)) != 0:  # not ncclSuccess
        return None
    return version.value


def loaded_nccl(
    maps: str = "/proc/self/maps", get_version: Callable[[str], int | None] | None = None
) -> tuple[str | None, str | None]:
    """(path, version) of the libnccl.so this process has mapped, read from `maps`; (None, None) when none is."""
    try:
        with open(maps) as f:
            paths = [parts[5].strip() for line in f if len(parts := line.split(None, 5)) == 6]
    except OSError:
        return None, None
    found = next((p for p in paths if os.path.basename(p).startswith("libnccl.so")), None)
    if found is None:
        return None, None
    try:
        code = (get_version or _nccl_get_version)(found)
    except (OSError, AttributeError):  # an unreadable file, or a library without the symbol
        code = None
    return found, nccl_version_from_int(code) if code else None


def _probe_nccl(
    compiled: str | None, package_version: Callable[[str], str | None], loaded: tuple[str | None, str | None]
) -> NcclFacts:
    path, version = loaded
    found = [(d, v) for d in NCCL_DISTRIBUTIONS if (v := package_version(d))]
    if not found:
        return NcclFacts(compiled=compiled, loaded=version, loaded_path=path)
    (name, installed), rest = found[0], found[1:]
    return NcclFacts(compiled, installed, f"{name} distribution", tuple(f"{d}=={v}" for d, v in rest), version, path)


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
    torch_facts, torch_gpus, pairs = _probe_torch(torch_cuda, dev_dir, nvidia_smi)
    driver, nvml_gpus = _probe_nvml(nvml)
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
        nccl=_probe_nccl(torch_facts.nccl_compiled, package_version, loaded_nccl(proc_maps, nccl_get_version)),
        driver=driver,
        nvidia_host=host,
        gpus=_merge_gpus(torch_gpus, nvml_gpus, environ.get("CUDA_VISIBLE_DEVICES")),
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


if __name__ == "__main__":  # python -m hf_dist_recipes.environment.probe: the facts as JSON
    import json

    json.dump(probe().to_dict(), sys.stdout, indent=2)
    print()
