"""Where things are: the repository root every test and launch resolves paths from."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def environment_first_on_path() -> None:
    """Put this environment's executables first on PATH, as an activated environment does: `make` runs
    .venv/bin/python without activating it, and torch builds ops with the first `ninja` on PATH (tests/conftest.py
    says what a second ninja costs)."""
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
