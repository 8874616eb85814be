import random

import numpy as np
import pytest
import torch

from hf_dist_recipes import seed_everything
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.seeding import rng_fingerprint


def _weights_digest(model) -> float:
    return float(sum(p.detach().double().sum() * (i + 1) for i, p in enumerate(model.parameters())))


def test_same_seed_gives_same_state_and_same_model():
    first = seed_everything(123)
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    model_a = _weights_digest(build_tiny_deepseek())
    second = seed_everything(123)
    assert first.fingerprint == second.fingerprint
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws
    assert _weights_digest(build_tiny_deepseek()) == model_a


def test_different_seeds_differ():
    assert seed_everything(1).fingerprint != seed_everything(2).fingerprint


def test_fingerprint_does_not_advance_the_generators():
    seed_everything(7)
    before = rng_fingerprint()
    assert rng_fingerprint() == before
    torch.rand(1)
    assert rng_fingerprint() != before


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "42", True])
def test_bad_seed_is_refused_with_the_fix(bad):
    with pytest.raises(ValueError, match="seed"):
        seed_everything(bad)
