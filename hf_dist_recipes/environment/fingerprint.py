"""Cross-rank consistency: every rank's environment fingerprint, compared before training starts.

A node with another torch build, NCCL or DeepSpeed than the others fails late and obscurely (a collective that
hangs, a checkpoint that does not load, ops compiled for another CUDA). `RecipeTrainer` calls `check_ranks_agree`
in its constructor, once the process group exists: one `all_gather_object` of `environment_fingerprint()` per
rank, and every rank raises the same RuntimeError when they differ, naming each rank (and its host) that differs
from the majority, the fields and both values. All ranks gather the same data and decide alike, so every rank
stops at the same point instead of some waiting in a collective.

The fingerprint is cheap (no deepspeed import; versions from importlib.metadata, which also reads what a rank's
sys.path would import): host (reported, never compared: it differs across nodes by design), python, torch with its
build label, torch's CUDA, the NCCL torch was compiled against, the installed nvidia-nccl-* distribution
(`NCCL_DISTRIBUTIONS`), the packages the doctor reports too (`PACKAGES`: deepspeed, transformers, accelerate,
datasets, hf-dist-recipes), and the NVIDIA driver when NVML answers (CUDA builds only). Those two lists and
`installed_version` live here, in the rank, and the doctor's probe (`doctor/probe.py`, `doctor/probe_nccl.py`)
reads them from here: a rank imports none of the doctor.
"""

from __future__ import annotations

import importlib.metadata
import platform
import socket
from collections import Counter
from collections.abc import Mapping, Sequence

from hf_dist_recipes.core.gather import gather_objects

PACKAGES = ("deepspeed", "transformers", "accelerate", "datasets", "hf-dist-recipes")
# The wheels torch depends on for its NCCL, newest CUDA first (version-facts.md, the wheels' Requires-Dist).
NCCL_DISTRIBUTIONS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
NOT_COMPARED = ("host",)


def installed_version(name: str) -> str | None:
    """Version of the installed distribution `name`, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML library, no driver, no GPU: the driver is unknown, not an error
        return None
    return version.decode() if isinstance(version, bytes) else str(version)


def environment_fingerprint() -> dict[str, str | None]:
    """This process's environment, as the flat mapping of the module docstring (None: absent or unknown)."""
    import torch

    nccl_compiled = None
    if torch.version.cuda:
        try:
            nccl_compiled = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # a build without NCCL
            nccl_compiled = None
    nccl_installed = next((f"{d}=={v}" for d in NCCL_DISTRIBUTIONS if (v := installed_version(d))), None)
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nccl_compiled": nccl_compiled,
        "nccl_installed": nccl_installed,
        **{name: installed_version(name) for name in PACKAGES},
        "driver": _driver() if torch.version.cuda else None,
    }


def fingerprint_differences(fingerprints: Sequence[Mapping[str, object]]) -> dict[int, dict[str, tuple]]:
    """rank -> {field: (this rank's value, the majority's value)} for every rank that differs from the majority
    in some field (`host` not compared). The majority of a field is its most common value; on a tie, the value of
    the lowest rank among the tied ones (rank 0's with 2 ranks)."""
    fields = sorted({k for fp in fingerprints for k in fp} - set(NOT_COMPARED))
    out: dict[int, dict[str, tuple]] = {}
    for name in fields:
        values = [fp.get(name) for fp in fingerprints]
        majority = Counter(values).most_common(1)[0][0]  # Counter keeps first-seen order on ties
        for rank, value in enumerate(values):
            if value != majority:
                out.setdefault(rank, {})[name] = (value, majority)
    return dict(sorted(out.items()))


def describe_differences(fingerprints: Sequence[Mapping[str, object]], diffs: Mapping[int, Mapping[str, tuple]]) -> str:
    """The error message for `fingerprint_differences`: one clause per differing rank."""
    parts = []
    for rank, fields in diffs.items():
        what = ", ".join(f"{name} {value} (the other ranks: {majority})" for name, (value, majority) in fields.items())
        parts.append(f"rank {rank} on host {fingerprints[rank].get('host')}: {what}")
    return (
        f"the ranks' environments differ, so the job stops before training: {'; '.join(parts)}. Install the "
        "same versions on every node: `hf-dist-recipes pin --output DIR` on a good node writes a lock and an "
        "image, `hf-dist-recipes doctor --lock DIR/requirements.lock` on each node names what drifted"
    )


def check_ranks_agree(
    fingerprint: Mapping[str, object] | None = None, *, gathered: Sequence[Mapping] | None = None
) -> list[dict]:
    """All-gather every rank's fingerprint (`environment_fingerprint()` unless given) and raise RuntimeError on
    every rank if they differ. `gathered`: the ranks' fingerprints already collected (no collective; for tests).
    Without an initialized process group (one process) there is nothing to compare. Returns the fingerprints."""
    if gathered is None:
        fingerprint = dict(environment_fingerprint() if fingerprint is None else fingerprint)
        gathered = gather_objects(fingerprint)
        if len(gathered) == 1:
            return gathered
    gathered = [dict(fp) for fp in gathered]
    diffs = fingerprint_differences(gathered)
    if diffs:
        raise RuntimeError(describe_differences(gathered, diffs))
    return gathered
