"""The console's helpers for events (hf_dist_recipes.monitoring.console): who says them, and how ranks are written.
That rank 0 alone says an event of several ranks is proven on 2 real ranks (tests/distributed/test_nonfinite.py)."""

from __future__ import annotations

import logging

from hf_dist_recipes.monitoring.console import on_rank_zero, rank_list, warn_once


def test_ranks_are_written_sorted_with_runs_as_ranges():
    assert rank_list([9, 3, 0, 1, 2, 4, 5, 6, 7, 12, 13]) == "0-7, 9, 12, 13"
    assert rank_list([1, 0]) == "0, 1"  # a run of two stays two ranks
    assert rank_list([5, 5]) == "5" and rank_list([]) == ""


def test_one_process_outside_a_process_group_is_rank_zero_and_says_it(caplog):
    logger = logging.getLogger("tests.console")
    with caplog.at_level(logging.WARNING, logger="tests.console"):
        warn_once(logger, "Spike: %s", "step 1")
    assert on_rank_zero() and [r.getMessage() for r in caplog.records] == ["Spike: step 1"]
