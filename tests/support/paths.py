"""Where things are: the repository root every test and launch resolves paths from."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
