"""Which NCCL this process uses, for `probe()`: the `nvidia-nccl-cu11/cu12/cu13` distribution installed (the
library torch's wheel loads; version-facts.md "Reading the facts at run time"), further ones beside it (a chance of
loading the wrong libnccl: pytorch 119072), and the libnccl.so actually LOADED: the file in /proc/self/maps (a CUDA
torch loads it at import) and its `ncclGetVersion`. A mismatch with the NCCL torch was compiled against is
NVIDIA/nccl 1212, pytorch 122571.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from hf_dist_recipes.doctor.facts import NcclFacts
from hf_dist_recipes.environment.fingerprint import NCCL_DISTRIBUTIONS  # the wheels torch takes its NCCL from


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


def probe_nccl(
    compiled: str | None, package_version: Callable[[str], str | None], loaded: tuple[str | None, str | None]
) -> NcclFacts:
    """The NCCL facts from torch's `compiled` version, `package_version` (distribution -> version or None) and
    `loaded`, `loaded_nccl()`'s (path, version)."""
    path, version = loaded
    found = [(d, v) for d in NCCL_DISTRIBUTIONS if (v := package_version(d))]
    if not found:
        return NcclFacts(compiled=compiled, loaded=version, loaded_path=path)
    (name, installed), rest = found[0], found[1:]
    return NcclFacts(compiled, installed, f"{name} distribution", tuple(f"{d}=={v}" for d, v in rest), version, path)
