import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import get_cosine_with_hard_restarts_schedule_with_warmup

from hf_dist_recipes.schedules.warmup_cosine import WarmupCosineRestarts, warmup_cosine_restarts_scheduler


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


# --- Property tests (hypothesis): the curve's shape for any warm-up, length, cycle count, floor and re-warm-up. ---
# Bounds come from calculus, not from the code: 0.5 * (1 + cos(pi * x)) falls by at most pi / 2 per unit of x, and
# stays within (pi * d) ** 2 / 4 of its end value at a distance d of phase from either end.


@st.composite
def shapes(draw, rewarm=True):
    warmup = draw(st.integers(0, 40))
    span = draw(st.integers(1, 300))
    cycles = draw(st.integers(1, 6))
    floor = draw(st.sampled_from([0.0, 0.05, 0.1, 0.5, 0.9]))
    cycle = span / cycles
    restart_warmup = draw(st.integers(0, max(0, math.ceil(cycle) - 1))) if rewarm and cycles > 1 else 0
    return WarmupCosineRestarts(
        warmup, warmup + span, num_cycles=cycles, min_lr_ratio=floor, restart_warmup_steps=restart_warmup
    )


def _cycles(s):
    """Steps of each cycle after the warm-up, from first principles: cycle i covers real steps [W + iC, W + (i+1)C)."""
    span = s.total_steps - s.warmup_steps
    return [
        [
            t
            for t in range(s.warmup_steps, s.total_steps)
            if i * span <= (t - s.warmup_steps) * s.num_cycles < (i + 1) * span
        ]
        for i in range(s.num_cycles)
    ]


def _cosine_slope(s):
    """Largest change of the cosine part between two steps: (1 - m) * pi / 2 per cycle's cosine length."""
    return (1 - s.min_lr_ratio) * math.pi / 2 / (s.cycle_steps - s.restart_warmup_steps)


def _near_end(s):
    """How far from the peak or the floor the first or last step of a cosine can be: less than one step of phase."""
    return (1 - s.min_lr_ratio) * (math.pi / (s.cycle_steps - s.restart_warmup_steps)) ** 2 / 4


@settings(max_examples=300, deadline=None)
@given(shapes())
def test_property_warmup_rises_monotonically_to_the_peak(s):
    ramp = [s.multiplier(t) for t in range(s.warmup_steps + 1)]
    assert ramp[0] == pytest.approx(0.0 if s.warmup_steps else 1.0)
    assert all(a < b for a, b in itertools.pairwise(ramp))
    assert ramp[-1] == pytest.approx(1.0, abs=1e-12)  # the peak, where the first cycle starts


@settings(max_examples=300, deadline=None)
@given(shapes())
def test_property_floor_holds(s):
    m = s.min_lr_ratio
    after = [s.multiplier(t) for t in range(s.warmup_steps, s.total_steps + 5)]
    assert all(m - 1e-12 <= v <= 1 + 1e-12 for v in after)
    assert all(s.multiplier(t) == m for t in range(s.total_steps, s.total_steps + 5))


@settings(max_examples=300, deadline=None)
@given(shapes())
def test_property_each_cycle_restarts_at_the_peak_or_rewarms_up_to_it(s):
    cycles = _cycles(s)
    assert [c[0] for c in cycles[1:] if c] == s.restart_steps()
    for i, steps in enumerate(cycles):
        values = [s.multiplier(t) for t in steps]
        if not values:
            continue  # a cycle shorter than one step has none of its own
        top = values.index(max(values))
        # One peak: up (re-warm-up) then down (cosine), nowhere else.
        assert all(a <= b + 1e-12 for a, b in itertools.pairwise(values[: top + 1]))
        assert all(a >= b - 1e-12 for a, b in itertools.pairwise(values[top:]))
        assert max(values) >= 1 - _near_end(s) - 1e-12  # the cycle reaches the peak (within a step of phase)
        if i >= 1 and s.restart_warmup_steps == 0:
            assert values[0] >= 1 - _near_end(s) - 1e-12  # hard restart: the first step is back at the peak
        if i >= 1 and s.restart_warmup_steps > 0:
            # Re-warm-up: the first step is back near the floor and climbs (1 - m) / R per step.
            assert values[0] <= s.min_lr_ratio + (1 - s.min_lr_ratio) / s.restart_warmup_steps + 1e-12


@settings(max_examples=300, deadline=None)
@given(shapes())
def test_property_curve_is_continuous_inside_a_cycle(s):
    m, r = s.min_lr_ratio, s.restart_warmup_steps
    step_bound = max(_cosine_slope(s), (1 - m) / r if r else 0.0) + 1e-12
    for steps in _cycles(s):
        values = [s.multiplier(t) for t in steps]
        assert all(abs(b - a) <= step_bound for a, b in itertools.pairwise(values))
    if r:
        # With re-warm-up there is no jump at a restart either: the last step of a cycle is near the floor, the
        # first of the next starts from it.
        for t in s.restart_steps():
            assert abs(s.multiplier(t) - s.multiplier(t - 1)) <= step_bound + _near_end(s)


@settings(max_examples=200, deadline=None)
@given(shapes(rewarm=False))
def test_property_hard_restarts_without_floor_are_transformers_schedule(s):
    s = WarmupCosineRestarts(s.warmup_steps, s.total_steps, num_cycles=s.num_cycles)  # no floor
    stock = get_cosine_with_hard_restarts_schedule_with_warmup(
        _optimizer(), s.warmup_steps, s.total_steps, num_cycles=s.num_cycles
    ).lr_lambdas[0]
    assert [s.multiplier(t) for t in range(s.total_steps + 2)] == pytest.approx(
        [stock(t) for t in range(s.total_steps + 2)], abs=1e-9
    )


def test_hard_restarts_jump_where_rewarmup_climbs():
    """The two restart styles, worked by hand: W=0, T=40, 2 cycles of 20 steps, floor 0.1, R=4."""
    hard = WarmupCosineRestarts(0, 40, num_cycles=2, min_lr_ratio=0.1)
    soft = WarmupCosineRestarts(0, 40, num_cycles=2, min_lr_ratio=0.1, restart_warmup_steps=4)
    assert hard.restart_steps() == soft.restart_steps() == [20]
    # Step 19: 1 step before the end of a 20-step cosine, 0.1 + 0.9 * 0.5 * (1 + cos(pi * 19 / 20)).
    assert soft.multiplier(19) == hard.multiplier(19) == pytest.approx(0.1 + 0.45 * (1 + math.cos(0.95 * math.pi)))
    assert hard.multiplier(20) == pytest.approx(1.0)
    # Re-warm-up: 0.1 + 0.9 * u / 4 for u = 0..3, the peak at u = 4, then cosine over the 16 steps left.
    assert [soft.multiplier(t) for t in (20, 21, 22, 23, 24)] == pytest.approx([0.1, 0.325, 0.55, 0.775, 1.0])
    assert soft.multiplier(32) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 8 / 16)))  # = 0.55
    assert soft.multiplier(40) == 0.1


def test_restart_warmup_must_fit_in_a_cycle():
    with pytest.raises(ValueError, match=r"restart_warmup_steps=20 must be shorter than a cycle \(20 steps"):
        WarmupCosineRestarts(0, 40, num_cycles=2, restart_warmup_steps=20)
    with pytest.raises(ValueError, match="restart_warmup_steps must be a whole number"):
        WarmupCosineRestarts(0, 40, num_cycles=2, restart_warmup_steps=-1)
    assert WarmupCosineRestarts(0, 40, num_cycles=1, restart_warmup_steps=99).multiplier(5) > 0.9  # no restart


def test_trainer_from_plain_arguments_follows_the_schedule_kwargs(tmp_path):
    """A plain TrainingArguments carrying the options in lr_scheduler_kwargs (before: a TypeError from
    transformers' function at create_scheduler, and the floor ignored). Expected values by hand: W=2, T=42, so two
    cycles of 20 steps, the restart at step 22; floor 0.1, re-warm-up R=4; on an SGD optimizer with lr 1."""
    from transformers import TrainingArguments

    from hf_dist_recipes import RecipeTrainer

    plain = TrainingArguments(
        output_dir=str(tmp_path),
        report_to=[],
        warmup_steps=2,
        lr_scheduler_type="cosine_with_restarts",
        lr_scheduler_kwargs={"num_cycles": 2, "min_lr_ratio": 0.1, "restart_warmup_steps": 4},
    )
    model = torch.nn.Linear(2, 2)
    trainer = RecipeTrainer(model=model, args=plain)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = trainer.create_scheduler(42, optimizer)
    lrs = [optimizer.param_groups[0]["lr"]]  # what the optimizer would apply, read from it
    for _ in range(45):
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs[:3] == pytest.approx([0.0, 0.5, 1.0])  # warm-up t / 2
    # Step 21: 19 of the first cycle's 20 steps, 0.1 + 0.9 * 0.5 * (1 + cos(pi * 19 / 20)).
    assert lrs[21] == pytest.approx(0.1 + 0.45 * (1 + math.cos(0.95 * math.pi)))
    assert lrs[22:27] == pytest.approx([0.1, 0.325, 0.55, 0.775, 1.0])  # 0.1 + 0.9 * u / 4, u = 0..4
    assert lrs[34] == pytest.approx(0.55)  # halfway through the 16 cosine steps left: 0.1 + 0.45 * (1 + cos(pi/2))
    assert lrs[42:] == pytest.approx([0.1] * 4)
