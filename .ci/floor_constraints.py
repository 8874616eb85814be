"""Print pip constraints pinning every requirement pyproject.toml declares to its lower bound: the floor set that
.ci/run installs into a second venv (`pip install -c <this output> ...`). Arguments: the extras to include beside
the runtime `dependencies` (e.g. `trl dev`). A requirement without a `>=` bound is an error: every range is proven
at both ends (tests/unit/test_lock.py)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement


def floor_pins(project: dict, extras: list[str]) -> list[str]:
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    pins: dict[str, str] = {}
    for text in reqs:
        req = Requirement(text)
        lower = [s.version for s in req.specifier if s.operator == ">="]
        if len(lower) != 1:
            raise ValueError(f"{text}: needs exactly one >= bound to have a floor")
        if pins.setdefault(req.name, lower[0]) != lower[0]:
            raise ValueError(f"{req.name} is declared with two lower bounds: {pins[req.name]} and {lower[0]}")
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


if __name__ == "__main__":
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    print("\n".join(floor_pins(tomllib.loads(pyproject.read_text())["project"], sys.argv[1:])))
