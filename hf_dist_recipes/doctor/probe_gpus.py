"""What torch and NVML see of the GPUs and the driver, for `probe()`: each reader returns facts, never raises.

torch: its build CUDA, cuDNN, the NCCL it was compiled against, the GPUs it sees (name, compute capability,
memory) and peer access between every pair (`torch.cuda.can_device_access_peer`), with cuda_host's verdict when it
sees none on a machine that has some. NVML: the driver and the highest CUDA it runs (`nvmlSystemGetDriverVersion`,
`nvmlSystemGetCudaDriverVersion_v2`) and every GPU of the host with its active NVLinks (`nvmlDeviceGetNvLinkState`
per link; absent links raise and count as inactive). `merge_gpus` keeps torch's view (it honours
CUDA_VISIBLE_DEVICES) with NVML's link counts.
"""

from __future__ import annotations

from hf_dist_recipes.doctor.facts import DriverFacts, Gpu, TorchFacts
from hf_dist_recipes.environment import cuda_host

NVML_FEATURE_ENABLED = 1  # pynvml.NVML_FEATURE_ENABLED: an NVLink link that is up
# A dependency of the package: missing only after `pip install --no-deps` or an image built from another lock.
NVML_INSTALL_HINT = "pip install 'nvidia-ml-py>=13.580.65,<14', a dependency of hf-dist-recipes"


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def probe_torch(torch_cuda, dev_dir: str | None, nvidia_smi: str | None) -> tuple[TorchFacts, list[Gpu], list]:
    """torch's facts, the GPUs it sees and (i, j, can) for every ordered pair; `torch_cuda` replaces torch.cuda."""
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


def probe_nvml(nvml) -> tuple[DriverFacts, list[Gpu]]:
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
            # CUDA encodes its version as 1000 x major + 10 x minor: 12040 -> "12.4".
            version = int(nvml.nvmlSystemGetCudaDriverVersion_v2())
            cuda = f"{version // 1000}.{(version % 1000) // 10}"
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


def merge_gpus(from_torch: list[Gpu], from_nvml: list[Gpu], visible: str | None) -> tuple[Gpu, ...]:
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
