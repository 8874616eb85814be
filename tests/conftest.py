"""Fixtures and pytest hooks only; the helpers tests import live in tests/support/ (`from tests.support.launch
import accelerate_launch`)."""

from __future__ import annotations

import pytest

from tests.support.launch_count import COUNTER as LAUNCHES


@pytest.fixture(autouse=True, scope="session")
def no_stale_deepspeed_locks():
    """Fail at once, naming the files, instead of letting every DeepSpeed launch hang on a stale build lock."""
    from hf_dist_recipes.environment.extensions import check_no_stale_locks

    try:
        check_no_stale_locks()
    except ValueError as err:
        pytest.exit(str(err), returncode=3)


@pytest.fixture(autouse=True, scope="session")
def count_launches():
    """Count the session's multi-process launches (tests.support.launch_count), printed in the summary."""
    LAUNCHES.start()
    yield
    LAUNCHES.stop()


def pytest_runtest_logstart(nodeid, location):
    LAUNCHES.current = nodeid


def pytest_terminal_summary(terminalreporter):
    for line in LAUNCHES.summary_lines():
        terminalreporter.write_line(line)
