import math

import pytest
import torch
from transformers import get_cosine_with_hard_restarts_schedule_with_warmup

from hf_dist_recipes.schedules import WarmupCosineRestarts, warmup_cosine_restarts_scheduler


def _lrs(scheduler, steps):
    out = []
    for _ in range(steps):
        out.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return out


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def test_matches_transformers_hard_restarts_without_floor():
    ours = warmup_cosine_restarts_scheduler(_optimizer(), WarmupCosineRestarts(10, 100, num_cycles=3))
    stock = get_cosine_with_hard_restarts_schedule_with_warmup(_optimizer(), 10, 100, num_cycles=3)
    assert _lrs(ours, 101) == pytest.approx(_lrs(stock, 101), abs=1e-12)


def test_warmup_is_linear_and_restarts_jump_back_to_peak():
    s = WarmupCosineRestarts(warmup_steps=10, total_steps=100, num_cycles=3)
    assert [s.multiplier(t) for t in (0, 5, 10)] == [0.0, 0.5, 1.0]
    restarts = s.restart_steps()
    assert restarts == [40, 70]
    for r in restarts:
        assert s.multiplier(r - 1) < 0.01  # end of a cycle: near zero
        assert s.multiplier(r) == pytest.approx(1.0)  # hard restart: back at the peak


def test_floor_holds_everywhere_after_warmup():
    s = WarmupCosineRestarts(warmup_steps=5, total_steps=60, num_cycles=2, min_lr_ratio=0.1)
    after = [s.multiplier(t) for t in range(5, 70)]
    assert min(after) == pytest.approx(0.1, abs=1e-3)
    assert all(0.1 - 1e-12 <= m <= 1.0 for m in after)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(warmup_steps=0, total_steps=0), "total_steps"),
        (dict(warmup_steps=20, total_steps=10), "warmup_steps"),
        (dict(warmup_steps=1, total_steps=10, num_cycles=0), "num_cycles"),
        (dict(warmup_steps=1, total_steps=10, min_lr_ratio=1.0), "min_lr_ratio"),
    ],
)
def test_invalid_shapes_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WarmupCosineRestarts(**kwargs)


def test_scheduler_pickles_for_checkpoints():
    import pickle

    sched = warmup_cosine_restarts_scheduler(_optimizer(), WarmupCosineRestarts(2, 10))
    state = pickle.loads(pickle.dumps(sched.state_dict()))
    assert state["last_epoch"] == 0
    assert math.isclose(sched.lr_lambdas[0](2), 1.0)
