import math

import pytest

from hf_dist_recipes.stability.gradients import validate_max_grad_norm


def test_default_norm_passes():
    assert validate_max_grad_norm(1.0) == 1.0


@pytest.mark.parametrize("off", [0, 0.0, None])
def test_clipping_off_needs_opt_out(off):
    with pytest.raises(ValueError, match="allow_unclipped_gradients=True"):
        validate_max_grad_norm(off)
    assert validate_max_grad_norm(off, allow_unclipped=True) == 0.0


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_nonsense_norms(bad):
    with pytest.raises(ValueError, match="positive finite"):
        validate_max_grad_norm(bad)
