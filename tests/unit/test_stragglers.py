"""Straggler detection logic by hand: busy-time ratios, the threshold, M windows in a row, recovery; and the
arguments' checks. The cross-rank run is tests/distributed/test_straggler_ranks.py."""

from __future__ import annotations

import pytest

from hf_dist_recipes import RecipeTrainingArguments
from hf_dist_recipes.monitoring.stragglers import (
    StragglerCallback,
    StragglerDetector,
    busy_ratios,
    validate_straggler_settings,
)
from hf_dist_recipes.runtime import LogRecord, RecipeRuntime


def test_busy_ratios_subtract_each_ranks_wait():
    # Synchronous training: every rank's step takes 0.30 s; rank 2 arrived last (waited 0.00 s), ranks 0, 1, 3
    # waited 0.10 s for it. Busy times 0.20, 0.20, 0.30, 0.20; median 0.20 -> rank 2 is 0.30 / 0.20 = 1.5.
    ratios = busy_ratios([0.3, 0.3, 0.3, 0.3], [0.1, 0.1, 0.0, 0.1])
    assert ratios == pytest.approx([1.0, 1.0, 1.5, 1.0])


def test_busy_ratios_two_ranks_median_is_their_mean():
    # 2 ranks: busy 0.05 and 0.10 s, median 0.075 -> 0.05/0.075 = 2/3 and 0.10/0.075 = 4/3.
    assert busy_ratios([0.1, 0.1], [0.05, 0.0]) == pytest.approx([2 / 3, 4 / 3])


def test_raw_step_times_alone_would_find_nobody():
    # The reason for the waits: equal step times and equal waits give every rank 1.0.
    assert busy_ratios([0.3, 0.3], [0.0, 0.0]) == [1.0, 1.0]
    assert busy_ratios([0.0, 0.0], [0.0, 0.0]) == [1.0, 1.0]  # no time measured: nobody is slow
    with pytest.raises(ValueError, match="one step time and one wait per rank"):
        busy_ratios([0.1, 0.1], [0.0])


def test_flagged_only_after_m_windows_in_a_row():
    det = StragglerDetector(threshold=0.2, windows=2)
    assert det.update([1.0, 1.3]) == ([], [])  # slow once: not yet
    assert det.update([1.0, 1.1]) == ([], [])  # back under 1.2: the count restarts
    assert det.update([1.0, 1.3]) == ([], [])
    assert det.update([1.0, 1.25]) == ([1], [])  # second slow window in a row: flagged
    assert det.flagged == {1}
    assert det.update([1.0, 1.4]) == ([], [])  # still slow: reported once, not again
    assert det.update([1.0, 1.2]) == ([], [1])  # exactly 1 + threshold is not slower by MORE: recovered
    assert det.flagged == set()
    assert det.update([1.0, 1.3]) == ([], [])  # after recovery it takes M windows again


def test_one_window_flags_at_once_and_several_ranks_in_rank_order():
    det = StragglerDetector(threshold=0.5, windows=1)
    assert det.update([1.6, 1.0, 1.51, 1.5]) == ([0, 2], [])  # 1.5 is not more than 50% slower
    assert det.update([1.0, 1.0, 1.0, 1.0]) == ([], [0, 2])


def test_a_different_world_size_starts_the_books_again():
    det = StragglerDetector(threshold=0.2, windows=1)
    assert det.update([1.0, 1.5]) == ([1], [])
    assert det.update([1.0, 1.0, 1.0]) == ([], [])  # not a recovery of a rank of another world
    assert det.flagged == set()


@pytest.mark.parametrize(
    "steps, threshold, windows, match",
    [
        (-1, 0.2, 2, "straggler_check_steps must be an integer >= 0"),
        (True, 0.2, 2, "straggler_check_steps"),
        (50, 0.0, 2, "straggler_threshold must be a number > 0"),
        (50, "0.2", 2, "straggler_threshold"),
        (50, 0.2, 0, "straggler_windows must be an integer >= 1"),
    ],
)
def test_bad_settings_name_the_fix(steps, threshold, windows, match):
    with pytest.raises(ValueError, match=match):
        validate_straggler_settings(steps, threshold, windows)
    with pytest.raises(ValueError, match="use "):
        StragglerCallback(steps, threshold, windows)


def test_arguments_carry_and_check_the_settings(tmp_path):
    args = RecipeTrainingArguments(output_dir=str(tmp_path), report_to="none")
    assert (args.straggler_check_steps, args.straggler_threshold, args.straggler_windows) == (50, 0.2, 2)
    with pytest.raises(ValueError, match="straggler_windows"):
        RecipeTrainingArguments(output_dir=str(tmp_path), report_to="none", straggler_windows=0)


def test_one_process_checks_nothing_and_logs_nothing():
    class State:
        global_step = 0

    class Args:
        process_index, device = 0, "cpu"

    cb = StragglerCallback(check_steps=1, threshold=0.2, windows=1)
    cb.set_runtime(RecipeRuntime())
    cb.on_train_begin(Args(), State(), None)  # no process group here
    for step in range(5):
        State.global_step = step
        cb.on_step_begin(Args(), State(), None)
    assert cb.runtime.logs.take() == LogRecord() and cb.events == []
