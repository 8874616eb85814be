"""Which torch builds exist: per release, its CUDA builds with the NCCL each one pins, the wheel index, the image.

Sources, so the table can be checked and extended:
- Default build and its NCCL (the wheel on PyPI, linux x86_64): the wheels' `Requires-Dist`
  (nvidia-cuda-runtime-*, nvidia-nccl-cu11/cu12/cu13), as collected in /work/shared/reference/version-facts.md
  "NCCL and CUDA pinned by the default PyPI torch wheel". Rows there name either a whole series ("2.1.x") or
  single patch releases ("2.12.1, 2.13.0"); a patch release the table does not name is refused, not guessed.
- The other CUDA builds of each release, and their NCCL from 2.10 on: pytorch/pytorch RELEASE.md, "Release
  Compatibility Matrix" (Stable CUDA and Experimental CUDA columns; NCCL in parentheses from 2.10). Read from a
  copy of the file whose matrix lists releases 1.12 to 2.14; https://github.com/pytorch/pytorch/blob/main/RELEASE.md
  #release-compatibility-matrix. Where the matrix names no NCCL for a non-default build, the NCCL is None
  (unknown): `pin` then pins no nvidia-nccl distribution and leaves it to the torch wheel's own pin.
- CUDA 13 builds drop GPUs below compute capability 7.5 (RELEASE.md "PyTorch CUDA Support Matrix": 13.0.2 and
  13.2.1 start at Turing 7.5; the 12.6.3 builds keep Maxwell 5.0 to Hopper 9.0; version-facts.md, pytorch PR 194253).
- Wheel index per build: https://download.pytorch.org/whl/cu<major><minor> and .../whl/cpu (pytorch.org "previous
  versions" install commands; the same URLs the matrix's builds are published under).
- Base images: `nvidia/cuda:<version>-cudnn-devel-ubuntu<release>`. devel, because DeepSpeed JIT-builds its ops with
  nvcc, whose CUDA major must equal torch's (DeepSpeed op_builder/builder.py `assert_no_cuda_mismatch`). Tags are
  the ones listed in replicate/cog pkg/config/cuda_compatibility.json (generated from Docker Hub's nvidia/cuda tag
  list: 11.6.2, 11.7.1, 11.8.0, 12.1.1 with cudnn8; 12.4.1, 12.6.3, 12.8.1, 12.9.1 with cudnn 9) and, for 13.0.2 and
  13.2.1, tags used verbatim in many public Dockerfiles (`FROM nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04`,
  `...13.2.1-cudnn-devel-ubuntu24.04`). Not confirmed against the registry itself from here (no network): a tag
  that disappears shows at `docker build`; the CUDA patch levels match the builds RELEASE.md names (12.6.3, 13.0.2,
  13.2.1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from packaging.version import InvalidVersion, Version

CPU = "cpu"
WHEEL_INDEX = "https://download.pytorch.org/whl"
# CUDA 13 wheels are built for compute capability 7.5 and newer only (see the module docstring).
MIN_COMPUTE_CAPABILITY = {13: "7.5"}


@dataclass(frozen=True)
class TorchRelease:
    """One torch minor series. `versions`: the patch releases the default-wheel table names (empty: every patch
    release of the series, the table's "2.1.x"). `builds`: CUDA version -> the NCCL that build pins (None: not
    known); the default build is among them, with the NCCL of the default-wheel table."""

    series: str
    default_cuda: str
    builds: dict[str, str | None] = field(default_factory=dict)
    versions: tuple[str, ...] = ()


RELEASES: tuple[TorchRelease, ...] = (
    # NCCL linked statically in 1.13; its version is not confirmed (version-facts.md).
    TorchRelease("1.13", "11.7", {"11.6": None, "11.7": None}),
    TorchRelease("2.0", "11.7", {"11.7": "2.14.3", "11.8": None}),
    # 2.1.1 did not get NCCL 2.18.6, and 2.1.2's metadata still says 2.18.1 (version-facts.md).
    TorchRelease("2.1", "12.1", {"11.8": None, "12.1": "2.18.1"}),
    TorchRelease("2.2", "12.1", {"11.8": None, "12.1": "2.19.3"}),
    TorchRelease("2.3", "12.1", {"11.8": None, "12.1": "2.20.5"}),
    TorchRelease("2.4", "12.1", {"11.8": None, "12.1": "2.20.5", "12.4": None}),
    TorchRelease("2.5", "12.4", {"11.8": None, "12.1": None, "12.4": "2.21.5"}),
    TorchRelease("2.6", "12.4", {"11.8": None, "12.4": "2.21.5", "12.6": None}, ("2.6.0",)),
    TorchRelease("2.7", "12.6", {"11.8": None, "12.6": "2.26.2", "12.8": None}),
    TorchRelease("2.8", "12.8", {"12.6": None, "12.8": "2.27.3", "12.9": None}, ("2.8.0",)),
    TorchRelease("2.9", "12.8", {"12.6": None, "12.8": "2.27.5", "13.0": None}),
    TorchRelease("2.10", "12.8", {"12.6": "2.27.5", "12.8": "2.27.5", "13.0": "2.28.9"}, ("2.10.0",)),
    TorchRelease("2.11", "13.0", {"12.6": "2.28.9", "12.8": "2.28.9", "13.0": "2.28.9"}, ("2.11.0",)),
    TorchRelease("2.12", "13.0", {"12.6": "2.29.3", "13.0": "2.29.7", "13.2": "2.29.7"}, ("2.12.1",)),
    TorchRelease("2.13", "13.0", {"12.6": "2.29.3", "13.0": "2.29.7", "13.2": "2.29.7"}, ("2.13.0",)),
    TorchRelease("2.14", "13.0", {"12.6": "2.29.3", "13.0": "2.30.7", "13.2": "2.30.7"}, ("2.14.1",)),
    # 2.15.0: the default build alone, from its wheel's Requires-Dist (cuda-toolkit 13.2.2, nvidia-nccl-cu13 2.30.7;
    # PyPI's default moved to CUDA 13.2). Its other builds are not in the copy of RELEASE.md read here: add them from
    # the matrix's 2.15 row.
    TorchRelease("2.15", "13.2", {"13.2": "2.30.7"}, ("2.15.0",)),
)

# nvidia/cuda devel image with cuDNN per CUDA version (sources in the module docstring).
CUDA_IMAGES: dict[str, str] = {
    "11.6": "nvidia/cuda:11.6.2-cudnn8-devel-ubuntu20.04",
    "11.7": "nvidia/cuda:11.7.1-cudnn8-devel-ubuntu22.04",
    "11.8": "nvidia/cuda:11.8.0-cudnn8-devel-ubuntu22.04",
    "12.1": "nvidia/cuda:12.1.1-cudnn8-devel-ubuntu22.04",
    "12.4": "nvidia/cuda:12.4.1-cudnn-devel-ubuntu22.04",
    "12.6": "nvidia/cuda:12.6.3-cudnn-devel-ubuntu24.04",
    "12.8": "nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04",
    "12.9": "nvidia/cuda:12.9.1-cudnn-devel-ubuntu24.04",
    "13.0": "nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04",
    "13.2": "nvidia/cuda:13.2.1-cudnn-devel-ubuntu24.04",
}


@dataclass(frozen=True)
class TorchBuild:
    """One installable torch: `torch` the exact release ("2.13.0"), `cuda` its CUDA ("13.0") or "cpu", `nccl` the
    NCCL its wheel pins (None: CPU build, or not known)."""

    torch: str
    cuda: str
    nccl: str | None

    @property
    def tag(self) -> str:
        """The local version label of this build on the wheel index: "cu130", "cpu"."""
        return build_tag(self.cuda)

    @property
    def index_url(self) -> str:
        return index_url(self.cuda)

    @property
    def nccl_distribution(self) -> str | None:
        """The pip distribution of this build's NCCL ("nvidia-nccl-cu13"), None for a CPU build."""
        return None if self.cuda == CPU else f"nvidia-nccl-cu{cuda_major(self.cuda)}"

    @property
    def image(self) -> str | None:
        return CUDA_IMAGES.get(self.cuda)

    @property
    def min_compute_capability(self) -> str | None:
        return None if self.cuda == CPU else MIN_COMPUTE_CAPABILITY.get(cuda_major(self.cuda))


def cuda_major(cuda: str) -> int:
    return int(cuda.split(".")[0])


def normalize_cuda(cuda: str) -> str:
    """ "12.6", "12.6.3", "cu126", "CU126" -> "12.6"; "cpu" / "none" -> "cpu". ValueError on anything else."""
    text = str(cuda).strip().lower()
    if text in (CPU, "none"):
        return CPU
    if text.startswith("cu") and text[2:].isdigit() and len(text) >= 5:
        return f"{text[2:-1]}.{text[-1]}"
    parts = text.split(".")
    if len(parts) >= 2 and all(p.isdigit() for p in parts):
        return f"{int(parts[0])}.{int(parts[1])}"
    raise ValueError(f"CUDA version {cuda!r} not understood: write it as 13.0, 12.6 (or cu130) or cpu")


def build_tag(cuda: str) -> str:
    """ "13.0" -> "cu130", "cpu" -> "cpu": the wheel's local version label and the index's last path part."""
    return CPU if cuda == CPU else "cu" + cuda.replace(".", "")


def index_url(cuda: str) -> str:
    return f"{WHEEL_INDEX}/{build_tag(cuda)}"


def release_of(torch_version: str) -> TorchRelease | None:
    """The release series `torch_version` ("2.13.0", "2.13.0+cu126") belongs to, if the table knows that patch."""
    try:
        version = Version(torch_version)
    except InvalidVersion:
        return None
    base = version.base_version
    series = f"{version.major}.{version.minor}"
    for release in RELEASES:
        if release.series == series and (not release.versions or base in release.versions):
            return release
    return None


def known_builds() -> list[str]:
    """Every (torch, CUDA) pair the table knows, as "2.13.0 cu130" / "2.1.x cu121" lines' words."""
    out = []
    for r in RELEASES:
        for version in r.versions or (f"{r.series}.x",):
            out.append(f"{version} ({', '.join([*r.builds, CPU])})")
    return out


def lookup(torch_version: str, cuda: str | None = None) -> TorchBuild:
    """The build of `torch_version` for `cuda` (default: the release's default build on PyPI). ValueError naming
    the builds that exist when the table has no such release or no such build of it."""
    release = release_of(torch_version)
    if release is None:
        raise ValueError(
            f"no torch {torch_version} in the table of known builds; known: {'; '.join(known_builds())}"
            " (hf_dist_recipes/doctor/torch_builds.py, from the wheels' metadata and pytorch "
            "RELEASE.md)"
        )
    base = Version(torch_version).base_version
    cuda = release.default_cuda if cuda is None else normalize_cuda(cuda)
    if cuda == CPU:
        return TorchBuild(base, CPU, None)
    if cuda not in release.builds:
        raise ValueError(
            f"torch {base} has no CUDA {cuda} build; its builds: "
            f"{', '.join(f'{c} ({build_tag(c)})' for c in release.builds)}, or cpu"
        )
    return TorchBuild(base, cuda, release.builds[cuda])


def default_tag(torch_version: str) -> str | None:
    """The build PyPI's untagged wheel of `torch_version` is ("cu130" for 2.13.0), None if not in the table."""
    release = release_of(torch_version)
    return None if release is None else build_tag(release.default_cuda)
