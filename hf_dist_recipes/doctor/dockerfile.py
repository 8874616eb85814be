"""The Dockerfile `hf-dist-recipes pin` writes next to its requirements.lock: an image that reproduces the lock.

- Base: for a CUDA build, the `nvidia/cuda:<cuda>-cudnn-devel-ubuntu..` image of that CUDA version
  (`torch_builds.CUDA_IMAGES`): devel, because DeepSpeed JIT-builds its ops with nvcc and stops when nvcc's CUDA
  major differs from torch's (DeepSpeed op_builder/builder.py `assert_no_cuda_mismatch`). Python, the version the
  lock was written with, from the deadsnakes PPA (with its headers, which the op builds need) into a venv. For a CPU
  build, `python:<version>-slim`.
- `pip install -r requirements.lock --extra-index-url <the build's wheel index>`: PyPI for everything else, the
  PyTorch index for the torch build (pip takes `2.13.0+cu126` there over PyPI's `2.13.0`: it satisfies the pin and
  sorts higher). `DS_BUILD_OPS=0`: DeepSpeed installs without building ops; they build on first use, with the
  image's nvcc.
- `ENV` lines for `nccl_defaults.NCCL_ENV_DEFAULTS` (async error handling, flight recorder), so every container
  starts with them; a `docker run -e` or the job's own environment still overrides them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from hf_dist_recipes.doctor.lock import Lock

LOCK_NAME = "requirements.lock"
DOCKERFILE_NAME = "Dockerfile"
VENV = "/opt/venv"


def _env_value(value: str) -> str:
    """`value` as a Dockerfile ENV value: bare when it is one plain word, else double-quoted (JSON escapes, which
    the Dockerfile parser reads the same way for quotes and backslashes)."""
    return value if re.fullmatch(r"[A-Za-z0-9_./:^,=+-]+", value) else json.dumps(value)


def render_dockerfile(
    lock: Lock, env: Mapping[str, str], *, image: str | None, python: str, notes: tuple[str, ...] = ()
) -> str:
    """The Dockerfile text for `lock`. `image`: the CUDA base image (None: a CPU build, python:<python>-slim);
    `python`: "3.11.7"; `env`: the ENV lines; `notes`: comment lines about the build (driver floor, GPUs)."""
    if not lock.index_url:
        raise ValueError(
            "the lock names no wheel index for its torch build (# index-url:); write it with hf-dist-recipes pin"
        )
    minor = ".".join(python.split(".")[:2])  # "3.11.7" -> "3.11"
    torch = lock.packages.get("torch", "not locked")
    lines = [
        f"# Written by hf-dist-recipes pin: torch {torch} ({lock.torch_build or 'no torch'}; CUDA "
        f"{lock.cuda or 'none'}; NCCL {lock.nccl or 'none'}) with the exact versions of {LOCK_NAME}.",
        f"# Build: docker build -t <name> <the folder holding this file and {LOCK_NAME}>",
        *(f"# {note}" for note in notes),
    ]
    if image is None:
        lines += [
            f"FROM python:{python}-slim",
            "ENV PYTHONUNBUFFERED=1",
            "# A C++ compiler: DeepSpeed JIT-builds its CPU ops (cpu_adam) on first use.",
            "RUN apt-get update && apt-get install -y --no-install-recommends build-essential \\",
            " && rm -rf /var/lib/apt/lists/*",
        ]
    else:
        lines += [
            f"FROM {image}",
            "ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1",
            f"# Python {minor}, the lock's, from the deadsnakes PPA (-dev: DeepSpeed's op builds need the headers).",
            "RUN apt-get update && apt-get install -y --no-install-recommends software-properties-common gpg-agent \\",
            " && add-apt-repository -y ppa:deadsnakes/ppa && apt-get update \\",
            f" && apt-get install -y --no-install-recommends python{minor} python{minor}-dev python{minor}-venv git \\",
            " && rm -rf /var/lib/apt/lists/*",
            f"RUN python{minor} -m venv {VENV}",
            f"ENV PATH={VENV}/bin:$PATH",
        ]
    lines += [
        "# DeepSpeed installs without building its ops; they build on first use"
        + (" (CPU ops, with the system compiler)." if image is None else ", with this image's nvcc."),
        "ENV DS_BUILD_OPS=0",
        f"COPY {LOCK_NAME} /tmp/{LOCK_NAME}",
        f"RUN pip install --no-cache-dir -r /tmp/{LOCK_NAME} --extra-index-url {lock.index_url}",
    ]
    for name, url in sorted(lock.local.items()):
        lines.append(
            f"# {name}=={lock.packages[name]} was installed from a local folder ({url or 'unknown'}), "
            "on no index: COPY it in and `pip install --no-deps` it."
        )
    if env:
        lines.append("# Hang-proof NCCL defaults (hf_dist_recipes.comm.nccl_defaults); docker run -e overrides them.")
        lines += [f"ENV {name}={_env_value(value)}" for name, value in env.items()]
    return "\n".join(lines) + "\n"
