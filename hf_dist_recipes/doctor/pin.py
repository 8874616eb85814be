"""`pin`: a lock of exact versions and a Dockerfile reproducing it, for this environment or a chosen torch build.

- Without a torch: the running environment as it is (`lock.installed_versions()`), with the running torch's build
  (its "+cpu"-style label, else `torch.version.cuda`), that build's wheel index and the installed nvidia-nccl-* NCCL.
- With `torch` (and `cuda`, default: that release's default build on PyPI): the running environment's versions
  with torch replaced by that release, the CUDA packages the running torch pulled in (`nvidia-*`, `cuda-*`, triton)
  dropped -- the chosen torch wheel pins its own, exactly -- and `nvidia-nccl-cu<major>` pinned to the NCCL of the
  chosen build (`torch_builds`). A pair the table does not know is refused, naming the builds that exist. A known-bad
  pair is refused too: the known-issues rules (`rules.evaluate`) run on the facts the lock would produce (torch,
  CUDA, NCCL, Python and the locked deepspeed/transformers/accelerate/datasets; hardware unknown), and any "error"
  finding refuses it, naming the rule, its symptom and its fix.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from packaging.utils import canonicalize_name

from hf_dist_recipes.doctor import dockerfile, torch_builds
from hf_dist_recipes.doctor.lock import (
    Lock,
    installed_versions,
    local_distributions,
    lock_of,
    python_version,
    running_torch_build,
    split_local,
    write_lock,
)
from hf_dist_recipes.environment import cuda_host


class RefusedPair(ValueError):
    """A torch/CUDA pair a known-issues rule marks as an error: the command ran and found a problem (exit 1), where
    an unknown pair or an unwritable folder is input it cannot use (exit 2)."""


# What a torch wheel pulls in for its CUDA build and pins itself: replaced along with torch.
_TORCH_RUNTIME = re.compile(r"^(nvidia-.*|cuda-.*|triton|pytorch-triton)$")
_NCCL_DIST = re.compile(r"^nvidia-nccl-cu\d+$")


@dataclass(frozen=True)
class PinResult:
    """What `pin` wrote: the lock, the two files, the base image and the notes written into the Dockerfile."""

    lock: Lock
    lock_path: str
    dockerfile_path: str
    image: str
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "lock": self.lock_path,
            "dockerfile": self.dockerfile_path,
            "image": self.image,
            "torch": self.lock.packages.get("torch"),
            "torch_build": self.lock.torch_build,
            "cuda": self.lock.cuda,
            "index_url": self.lock.index_url,
            "nccl": self.lock.nccl,
            "python": self.lock.python,
            "packages": len(self.lock.packages),
            "notes": list(self.notes),
        }


def _nccl_installed(installed: Mapping[str, str]) -> str | None:
    for name in sorted(installed, reverse=True):  # cu13 before cu12
        if _NCCL_DIST.match(canonicalize_name(name)):
            return installed[name]
    return None


def refusing_findings(
    build: torch_builds.TorchBuild, packages: Mapping[str, str], python: str, evaluate: Callable | None = None
) -> list:
    """The "error" findings of the known-issues rules on the facts a lock of `build` + `packages` produces."""
    if evaluate is None:
        from hf_dist_recipes.doctor.rules import evaluate
    facts = {
        "python": python,
        "torch": build.torch,
        "cuda": None if build.cuda == torch_builds.CPU else build.cuda,
        "nccl": build.nccl,
        "nccl_compiled": build.nccl,
        **{k: packages.get(k) for k in ("deepspeed", "transformers", "accelerate", "datasets")},
    }
    return [f for f in evaluate(facts) if f.severity == "error"]


def plan_lock(
    torch: str | None = None,
    cuda: str | None = None,
    *,
    installed: Mapping[str, str] | None = None,
    python: str | None = None,
    evaluate: Callable | None = None,
) -> tuple[Lock, str | None, tuple[str, ...]]:
    """The lock to write, the CUDA base image (None: CPU) and notes for the Dockerfile; see the module docstring.
    ValueError for an unknown or known-bad pair, or `cuda` without `torch`."""
    installed = installed_versions() if installed is None else dict(installed)
    python = python or python_version()
    local = local_distributions()
    if torch is None:
        if cuda is not None:
            raise ValueError(
                "--cuda needs --torch: name the torch release to pin with it (e.g. --torch 2.13.0 "
                "--cuda 13.0), or omit both to pin this environment"
            )
        tag, build_cuda = running_torch_build()
        if "torch" in installed and tag is None:
            raise ValueError("cannot tell the running torch's build; pin a chosen one with --torch X --cuda Y")
        torch_version = split_local(installed.get("torch", ""))[0]
        build = torch_builds.TorchBuild(torch_version, build_cuda or torch_builds.CPU, _nccl_installed(installed))
        packages = installed
    else:
        build = torch_builds.lookup(torch, cuda)
        packages = {
            canonicalize_name(k): v for k, v in installed.items() if not _TORCH_RUNTIME.match(canonicalize_name(k))
        }
        refused = refusing_findings(build, packages, python, evaluate)
        if refused:
            raise RefusedPair(
                f"torch {build.torch} {build.tag} (NCCL {build.nccl or 'unknown'}) is refused by "
                + "; ".join(f"rule {f.rule_id}: {f.symptom.rstrip('.')}; fix: {f.fix.rstrip('.')}" for f in refused)
            )
        packages["torch"] = build.torch
        if build.nccl_distribution and build.nccl:
            packages[build.nccl_distribution] = build.nccl
        tag = build.tag
    lock = lock_of(
        packages,
        torch_build=tag,
        cuda=None if build.cuda == torch_builds.CPU else build.cuda,
        index_url=build.index_url,
        nccl=build.nccl,
        python=python,
        local=local,
    )
    notes = []
    if build.cuda != torch_builds.CPU:
        floor = cuda_host.min_driver_for_cuda(build.cuda)
        if floor:
            notes.append(
                f"CUDA {build.cuda} needs an NVIDIA driver >= {floor} on the host (CUDA minor-version compatibility)."
            )
        if build.min_compute_capability:
            notes.append(
                f"torch's CUDA {build.cuda} build runs on GPUs of compute capability >= "
                f"{build.min_compute_capability} only (pytorch RELEASE.md CUDA support matrix)."
            )
        if build.image is None:
            raise ValueError(
                f"no nvidia/cuda base image known for CUDA {build.cuda}; known: {', '.join(torch_builds.CUDA_IMAGES)}"
            )
    return lock, build.image if build.cuda != torch_builds.CPU else None, tuple(notes)


def pin(
    output: str | os.PathLike,
    torch: str | None = None,
    cuda: str | None = None,
    *,
    installed: Mapping[str, str] | None = None,
    python: str | None = None,
    evaluate: Callable | None = None,
    env: Mapping[str, str] | None = None,
) -> PinResult:
    """Write `output`/requirements.lock and `output`/Dockerfile (the folder is created). `env`: the ENV lines
    (default `nccl_defaults.NCCL_ENV_DEFAULTS`). ValueError for a refused pair or an output that cannot be written."""
    from hf_dist_recipes.core.user_values import writable_dir

    writable_dir(output, "--output", "pinned")  # before anything is resolved: a bad folder is one line at once
    if env is None:
        from hf_dist_recipes.comm.nccl_defaults import NCCL_ENV_DEFAULTS as env
    python = python or python_version()
    lock, image, notes = plan_lock(torch, cuda, installed=installed, python=python, evaluate=evaluate)
    text = dockerfile.render_dockerfile(lock, env, image=image, python=python, notes=notes)
    output = os.fspath(output)
    lock_path = os.path.join(output, dockerfile.LOCK_NAME)
    docker_path = os.path.join(output, dockerfile.DOCKERFILE_NAME)
    try:
        os.makedirs(output, exist_ok=True)
        written = write_lock(lock_path, lock)
        with open(docker_path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        raise ValueError(
            f"--output {output}: cannot write there ({err.strerror or err}); choose a folder you can write to"
        ) from None
    return PinResult(written, lock_path, docker_path, image or f"python:{python}-slim", notes)
