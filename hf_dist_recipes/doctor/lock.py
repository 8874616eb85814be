"""The lock `hf-dist-recipes pin` writes and `hf-dist-recipes doctor --lock` compares with the running environment.

Format (pip's requirements format, so `pip install -r requirements.lock` reads it as is):

    # hf-dist-recipes pin: exact versions of every installed distribution. ...
    # python: 3.11.7
    # torch-build: cu130
    # cuda: 13.0
    # index-url: https://download.pytorch.org/whl/cu130
    # nccl: 2.29.7
    accelerate==1.16.0
    ...
    torch==2.13.0

One `name==version` line per distribution, names canonicalized (PEP 503), sorted. A distribution installed from a
local folder (pip's direct_url.json `dir_info`, e.g. an editable install of this project) is on no index, so its pin
is a comment pip skips, `# local: hf-dist-recipes==0.1.0 file:///src`, which `read_lock` still reads as a pin.
torch is pinned WITHOUT its local version label ("+cpu", "+cu126"): the label is the build, recorded in the
`# torch-build:` header with the CUDA it stands for and the wheel index that serves it (pip, given that index,
picks the labelled wheel: `2.13.0+cu126` satisfies `==2.13.0` and sorts above it). `# cuda: none`, `# nccl: none`
for a CPU build. Other `#` lines are comments. Anything else is an error naming the file and line.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

HEADER_KEYS = ("python", "torch-build", "cuda", "index-url", "nccl")
NONE = "none"
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#=]+)$")
_HEADER = re.compile(r"^#\s*([a-z-]+):\s*(.*?)\s*$")
_LOCAL = re.compile(r"^#\s*local:\s*(\S+)(?:\s+(\S+))?\s*$")


@dataclass(frozen=True)
class Lock:
    """Exact versions by canonical name (torch without its local label) and the torch build they go with.
    `torch_build`: "cpu", "cu130"...; `cuda`: "13.0" or None (CPU); `index_url`: the wheel index of that build;
    `nccl`: the NCCL the build pins (None: CPU or unknown); `python`: "3.11.7"."""

    packages: dict[str, str]
    torch_build: str | None = None
    cuda: str | None = None
    index_url: str | None = None
    nccl: str | None = None
    python: str | None = None
    local: dict[str, str] = field(default_factory=dict)  # name -> where it was installed from (not on an index)
    path: str | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Drift:
    """A package whose installed version is not the locked one; `locked` or `installed` is None when the package
    is missing on that side."""

    package: str
    locked: str | None
    installed: str | None


def split_local(version: str) -> tuple[str, str | None]:
    """ "2.13.0+cpu" -> ("2.13.0", "cpu"); "2.13.0" -> ("2.13.0", None)."""
    public, sep, local = version.partition("+")
    return public, (local if sep else None)


def _installed_distributions() -> list[importlib.metadata.Distribution]:
    """The distributions installed in this interpreter, as pip sees them: sys.path less any folder inside a package's
    `_vendor` tree. setuptools (imported by deepspeed and torch's extension builder) appends its `_vendor` folder to
    sys.path, which makes its bundled copies (autocommand, jaraco.text, tomli, wheel) look installed; a lock naming
    them would install them as real packages, and whether they show depended on what the process had imported."""
    paths = [p for p in sys.path if "_vendor" not in os.path.normpath(p).split(os.sep)]
    return list(importlib.metadata.distributions(path=paths))


def installed_versions() -> dict[str, str]:
    """Every distribution importlib.metadata sees in this interpreter, by canonical name, with its version exactly
    as installed (torch keeps its "+cpu"-style label here; `write_lock` moves it to the header). The first
    distribution found wins on duplicates, as importlib.metadata.version() does (sys.path order)."""
    versions: dict[str, str] = {}
    for dist in _installed_distributions():
        name = dist.metadata["Name"]
        if name:
            versions.setdefault(canonicalize_name(name), dist.version)
    return versions


def local_distributions() -> dict[str, str]:
    """Distributions installed from a local folder (editable or not), by canonical name, with that folder's URL."""
    import json

    out: dict[str, str] = {}
    for dist in _installed_distributions():
        text, name = dist.read_text("direct_url.json"), dist.metadata["Name"]
        if text and name:
            try:
                info = json.loads(text)
            except ValueError:
                continue
            if "dir_info" in info:
                out.setdefault(canonicalize_name(name), info.get("url", ""))
    return out


def running_torch_build() -> tuple[str | None, str | None]:
    """(build tag, CUDA) of the running torch: its local label when it has one, else what torch.version.cuda says
    (PyPI's untagged linux wheel is a CUDA build). (None, None) without torch."""
    from hf_dist_recipes.doctor.torch_builds import CPU, build_tag, normalize_cuda

    try:
        import torch
    except ImportError:
        return None, None
    cuda = torch.version.cuda
    _, label = split_local(torch.__version__)
    if label is not None:
        return label, (None if label == CPU or cuda is None else normalize_cuda(cuda))
    return (build_tag(normalize_cuda(cuda)), normalize_cuda(cuda)) if cuda else (CPU, None)


def lock_of(
    installed: Mapping[str, str],
    *,
    torch_build: str | None = None,
    cuda: str | None = None,
    index_url: str | None = None,
    nccl: str | None = None,
    python: str | None = None,
    local: Mapping[str, str] | None = None,
) -> Lock:
    """A Lock of `installed` (name -> version as installed); torch's local label becomes `torch_build` unless one
    is given. `local`: name -> URL of the distributions installed from a folder (`local_distributions()`)."""
    packages = {canonicalize_name(k): v for k, v in installed.items()}
    if "torch" in packages:
        packages["torch"], label = split_local(packages["torch"])
        torch_build = torch_build or label
    local = {canonicalize_name(k): v for k, v in (local or {}).items() if canonicalize_name(k) in packages}
    return Lock(dict(sorted(packages.items())), torch_build, cuda, index_url, nccl, python, local)


def render_lock(lock: Lock) -> str:
    header = [
        "# hf-dist-recipes pin: exact versions of every distribution (canonical names). torch is pinned without its",
        "# local label: the build below says which wheel, and pip finds it on the index-url:",
        "# pip install -r requirements.lock --extra-index-url <index-url>",
        f"# python: {lock.python or NONE}",
        f"# torch-build: {lock.torch_build or NONE}",
        f"# cuda: {lock.cuda or NONE}",
        f"# index-url: {lock.index_url or NONE}",
        f"# nccl: {lock.nccl or NONE}",
    ]
    pins = [
        f"# local: {name}=={version} {lock.local[name]}".rstrip() if name in lock.local else f"{name}=={version}"
        for name, version in sorted(lock.packages.items())
    ]
    return "\n".join(header + pins) + "\n"


def write_lock(path: str | os.PathLike, lock: Lock) -> Lock:
    """Write `lock` to `path` (a file; its folder must exist). Returns the lock with its path."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_lock(lock))
    return Lock(
        lock.packages, lock.torch_build, lock.cuda, lock.index_url, lock.nccl, lock.python, lock.local, os.fspath(path)
    )


def read_lock(path: str | os.PathLike) -> Lock:
    """The lock in `path`. ValueError naming the file and line on a line that is not `name==version`, a comment or
    blank, on a duplicated package, or on an invalid version."""
    path = os.fspath(path)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    packages: dict[str, str] = {}
    local: dict[str, str] = {}
    header: dict[str, str | None] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line:
            continue
        where = f"{path}:{number}"
        m = _LOCAL.match(line)
        if m:
            line, local_url = m.group(1), m.group(2) or ""
        elif line.startswith("#"):
            m = _HEADER.match(line)
            if m and m.group(1) in HEADER_KEYS:
                header[m.group(1)] = None if m.group(2) in ("", NONE) else m.group(2)
            continue
        else:
            local_url = None
        m = _PIN.match(line)
        if m is None:
            raise ValueError(
                f"{where}: {raw!r} is not an exact pin; each line of a lock is name==version, a "
                "'# ' comment or blank (write a lock with hf-dist-recipes pin --output DIR)"
            )
        name, version = canonicalize_name(m.group(1)), m.group(2)
        try:
            Version(version)
        except InvalidVersion:
            raise ValueError(f"{where}: {version!r} is not a valid version for {name}") from None
        if name in packages:
            raise ValueError(f"{where}: {name} is pinned twice ({packages[name]} and {version}); keep one line")
        packages[name] = version
        if local_url is not None:
            local[name] = local_url
    return Lock(
        packages,
        header.get("torch-build"),
        header.get("cuda"),
        header.get("index-url"),
        header.get("nccl"),
        header.get("python"),
        local,
        path,
    )


def lock_drift(lock: Lock, installed: Mapping[str, str]) -> list[Drift]:
    """The packages whose installed version differs from the lock, sorted by name; a package locked but not
    installed, or installed but not locked, is drift too (None on the missing side). `installed`: name -> version
    as installed (`installed_versions()`). torch compares its release and its build: an installed local label
    ("+cu126") must be the lock's `torch_build`; an unlabelled torch is PyPI's default build of that release."""
    from hf_dist_recipes.doctor.torch_builds import default_tag

    have = {canonicalize_name(k): v for k, v in installed.items()}
    out = []
    for name in sorted(set(lock.packages) | set(have)):
        locked, current = lock.packages.get(name), have.get(name)
        if locked is None or current is None:
            out.append(Drift(name, locked, current))
            continue
        if name == "torch":
            public, label = split_local(current)
            label = label or default_tag(public)
            if public != split_local(locked)[0] or (lock.torch_build and label and label != lock.torch_build):
                out.append(Drift(name, f"{locked}+{lock.torch_build}" if lock.torch_build else locked, current))
        elif _same(locked, current) is False:
            out.append(Drift(name, locked, current))
    return out


def _same(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))
