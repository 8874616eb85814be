"""Practice 4: seed every rank the same way.

`seed_everything` seeds Python, NumPy and torch (CPU and every CUDA device) with one value and returns a
`SeedReport`. `RecipeTrainingArguments` calls it when created, so scripts in the order of the HuggingFace examples
(arguments, then the model, then the trainer, no `set_seed`) build the same weights on every run; `RecipeTrainer`
seeds again before `model_init`.

`SeedReport.fingerprint` hashes the RNG states right after seeding: it is a function of the seed value only, kept
as information (per-rank TensorBoard text, the demo summary), not as proof. The proof is what the run actually did,
compared across ranks by `reproducibility.rank_agreement`: the weights each rank built, its data order, and during
training the step, learning rate and tensor-parallel losses.
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

from hf_dist_recipes.core.gather import process_rank
from hf_dist_recipes.core.user_values import setting

MAX_SEED = 2**32 - 1  # NumPy's legacy seeding refuses anything larger


@dataclass(frozen=True)
class SeedReport:
    """What one rank was seeded with. `fingerprint`: 16 hex chars of SHA-256 over the Python, NumPy and torch
    CPU RNG states right after seeding."""

    seed: int
    rank: int
    fingerprint: str
    deterministic: bool


def rng_fingerprint() -> str:
    """Hash of the current Python, NumPy and torch CPU RNG states (16 hex chars); reading does not advance them."""
    digest = hashlib.sha256()
    digest.update(repr(random.getstate()).encode())
    np_state = np.random.get_state()
    digest.update(np_state[1].tobytes())
    digest.update(repr(np_state[2:]).encode())
    digest.update(torch.get_rng_state().numpy().tobytes())
    return digest.hexdigest()[:16]


def validate_seed(seed: object, name: str = "seed") -> int:
    """Return `seed` as an int in [0, 2**32 - 1], or raise ValueError naming the fix. `name`: the setting as the
    user wrote it (`seed` for the arguments, `--seed` for the demo's flag)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{name} must be an integer, got {seed!r} ({type(seed).__name__}); e.g. {setting(name, 42)}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{name} must be between 0 and {MAX_SEED}, got {seed}; e.g. {setting(name, 42)}")
    return seed


def seed_everything(seed: int, *, deterministic: bool = False) -> SeedReport:
    """Seed Python's `random`, NumPy and torch (all CUDA devices included) with `seed`.

    `deterministic=True` also asks torch for deterministic kernels (slower; see transformers'
    `enable_full_determinism`). PYTHONHASHSEED is exported so that worker processes started later hash alike;
    it cannot change hashing in the already running interpreter.
    """
    seed = validate_seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device as well
    if deterministic:
        from transformers.trainer_utils import enable_full_determinism

        enable_full_determinism(seed)
    return SeedReport(seed=seed, rank=process_rank(), fingerprint=rng_fingerprint(), deterministic=deterministic)
