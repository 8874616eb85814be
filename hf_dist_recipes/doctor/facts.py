"""The facts of an environment that decide whether distributed training works, as typed values (`probe.py`
reads them; the doctor's checks and the known-issues rules judge them).

`EnvironmentFacts.rule_facts()` flattens them into the `RuleFacts` mapping the known-issues rules evaluate
(`doctor/rules.py`); its keys, in order, are `RULE_FACT_KEYS`, None where a fact is unknown. The JSON of
`to_dict()` (what `doctor --json` prints under "facts") is these dataclasses' fields, with `peer_access` as
`PeerPair` objects and `rule_facts` added; `core.findings.json_schema` derives its schema from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import ClassVar, TypedDict

from hf_dist_recipes.core.findings import JSON_TYPE
from hf_dist_recipes.environment import cuda_host


class RuleFacts(TypedDict):
    """The flat mapping the known-issues rules evaluate (None: unknown). Versions are strings: `torch` without its
    "+cpu"-style local tag, `cuda` torch's build CUDA (None for a CPU build), `nccl` the loaded NCCL, else the
    installed one, else the compiled one; `driver` "580.65.06", `driver_cuda` "13.0", `nvcc_cuda` "12.4" and
    `deepspeed` ... `datasets` None when not installed. `arch`: "x86_64", "aarch64"; `compute_capabilities`: like
    ["9.0"]; `nvlink`: any NVLink active (None without NVML); `peer_access`: every pair of GPUs can access each
    other (None with fewer than 2 GPUs); `ib_active`: an InfiniBand/RoCE port is ACTIVE; `env`: the NCCL_, TORCH_
    and CUDA_ variables set."""

    python: str
    torch: str
    cuda: str | None
    nccl: str | None
    nccl_compiled: str | None
    deepspeed: str | None
    transformers: str | None
    accelerate: str | None
    datasets: str | None
    driver: str | None
    driver_cuda: str | None
    nvcc_cuda: str | None
    arch: str
    gpu_count: int
    gpu_names: list[str]
    compute_capabilities: list[str]
    nvlink: bool | None
    peer_access: bool | None
    ib_active: bool
    nic_names: list[str]
    shm_bytes: int | None
    in_container: bool
    env: dict[str, str]


RULE_FACT_KEYS: tuple[str, ...] = tuple(RuleFacts.__annotations__)

# One ordered pair of GPUs in JSON ("from" is a Python keyword, hence the functional form).
PeerPair = TypedDict("PeerPair", {"from": int, "to": int, "can_access": bool})


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
    peer_access: tuple[tuple[int, int, bool], ...] = field(default=(), metadata={JSON_TYPE: list[PeerPair]})
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
    json_extra: ClassVar[dict[str, object]] = {"rule_facts": RuleFacts}  # the key to_dict adds

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

    def rule_facts(self) -> RuleFacts:
        """The flat mapping the known-issues rules evaluate (`RuleFacts`, keys in RULE_FACT_KEYS order)."""
        return {
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
