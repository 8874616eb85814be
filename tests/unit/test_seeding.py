import random

import numpy as np
import pytest
import torch

from hf_dist_recipes import seed_everything
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.reproducibility.seeding import rng_fingerprint
from tests.support.models import SMALL


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


def test_arguments_seed_so_a_model_built_after_them_is_reproducible(tmp_path):
    # The HF examples' order: arguments, then the model, no set_seed. torch is disturbed in between runs.
    from hf_dist_recipes import RecipeTrainingArguments

    def run(seed):
        torch.manual_seed(1234 + seed)
        RecipeTrainingArguments(output_dir=str(tmp_path), seed=seed, report_to="none")
        return _weights_digest(build_tiny_deepseek(**SMALL))

    assert run(5) == run(5)
    assert run(5) != run(6)
