"""Fixtures and pytest hooks only; the helpers tests import live in tests/support/ (`from tests.support.launch
import accelerate_launch`)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="session")
def no_stale_deepspeed_locks():
    """Fail at once, naming the files, instead of letting every DeepSpeed launch hang on a stale build lock."""
    from hf_dist_recipes.environment.extensions import check_no_stale_locks

    try:
        check_no_stale_locks()
    except ValueError as err:
        pytest.exit(str(err), returncode=3)
