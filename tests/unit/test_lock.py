"""requirements.lock pins every package exactly, and those pins satisfy pyproject.toml's ranges."""

import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support.paths import REPO


def _lock() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, ver = line.partition("==")
        assert sep, f"not an exact pin: {line!r}"
        pins[canonicalize_name(name)] = Version(ver)
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def test_every_declared_dependency_is_pinned_inside_its_range():
    pins = _lock()
    for req in _declared():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is declared in pyproject.toml but not pinned in requirements.lock"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"lock pins {req.name}=={pins[name]}, outside {req}"
        )


def test_declared_ranges_are_bounded_above():
    # An unbounded range lets a fresh install drift past what the lock was tested with.
    for req in _declared():
        assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), f"{req} has no upper bound"


def test_torch_pin_has_no_local_build_tag():
    # "+cpu" would stop a GPU host from installing the CUDA build of the same version.
    assert str(_lock()["torch"]) == "2.13.0"
