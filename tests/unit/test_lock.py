"""The two locks: requirements.lock (runtime: what a training image installs) and requirements-dev.lock (what make
installs: the runtime lock plus the extras). Each pins every package exactly, inside pyproject.toml's ranges; the
runtime lock holds exactly the package's runtime requirements and theirs (no test, lint or docs tool), and the
development lock holds it unchanged."""

import re
import tomllib
from importlib.metadata import PackageNotFoundError, distribution

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support.paths import REPO

RUNTIME, DEV = REPO / "requirements.lock", REPO / "requirements-dev.lock"
# What `pip freeze` leaves out of a lock by itself (the installer's own tools), though a package may require them.
FREEZE_SKIPS = {"pip", "setuptools", "wheel", "distribute"}


def _lock(path) -> dict[str, Version]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, ver = line.partition("==")
        assert sep, f"{path.name}: not an exact pin: {line!r}"
        pins[canonicalize_name(name)] = Version(ver)
    return pins


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _runtime_requirements() -> list[Requirement]:
    return [Requirement(r) for r in _project()["dependencies"]]


def _declared() -> list[Requirement]:
    reqs = list(_project()["dependencies"])
    for extra in _project().get("optional-dependencies", {}).values():
        reqs += extra
    return [Requirement(r) for r in reqs]


def _closure(requirements: list[Requirement]) -> set[str]:
    """The names of `requirements` and of everything they require, transitively, as installed here (no extras of
    the dependencies unless a requirement names one; markers evaluated for this interpreter)."""
    env = default_environment()
    seen: set[str] = set()
    todo = [(r, "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
            continue
        name = canonicalize_name(req.name)
        key = f"{name}[{','.join(sorted(req.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue  # not installed: the pin checks below name it
        for sub in dist.requires or []:
            sub_req = Requirement(sub)
            # a dependency's own requirement applies plainly, or under an extra this requirement asked for
            for wanted in ("", *req.extras):
                if sub_req.marker is None or sub_req.marker.evaluate({**env, "extra": wanted}):
                    todo.append((Requirement(re.sub(r";.*$", "", sub)), ""))
                    break
    return {key.partition("[")[0] for key in seen}


def test_every_declared_dependency_is_pinned_inside_its_range():
    runtime, dev = _lock(RUNTIME), _lock(DEV)
    for pins, reqs, path in ((runtime, _runtime_requirements(), RUNTIME), (dev, _declared(), DEV)):
        for req in reqs:
            name = canonicalize_name(req.name)
            assert name in pins, f"{req.name} is declared in pyproject.toml but not pinned in {path.name}"
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"{path.name} pins {req.name}=={pins[name]}, outside {req}"
            )


def test_the_runtime_lock_is_the_runtime_requirements_and_theirs_and_no_tool():
    """Exactly the closure of `dependencies` over the installed metadata (this .venv installed the dev lock, which
    holds the runtime lock): nothing missing that an image would need, and no pytest, ruff, mkdocs or matplotlib."""
    closure = _closure(_runtime_requirements()) - FREEZE_SKIPS
    pinned = set(_lock(RUNTIME))
    assert pinned - closure == set(), f"{RUNTIME.name} pins what the runtime does not require: {pinned - closure}"
    assert closure - pinned == set(), f"{RUNTIME.name} misses runtime requirements: {closure - pinned}"
    for tool in ("pytest", "ruff", "mkdocs", "twine", "ipykernel", "matplotlib", "hypothesis"):
        assert tool not in pinned, tool


def test_the_development_lock_holds_the_runtime_lock_unchanged():
    runtime, dev = _lock(RUNTIME), _lock(DEV)
    changed = {name: (str(v), str(dev.get(name))) for name, v in runtime.items() if dev.get(name) != v}
    assert changed == {}, f"{DEV.name} pins these differently from {RUNTIME.name}: {changed}"
    assert {"pytest", "ruff", "mkdocs", "matplotlib", "trl"} <= set(dev)


def test_declared_ranges_are_bounded_on_both_ends():
    # A lower bound is the oldest release proven (the floor set in .ci/run); an upper bound keeps a fresh install
    # from drifting into a release nobody ran.
    for req in _declared():
        assert any(s.operator in (">=", "==", "~=") for s in req.specifier), f"{req} has no lower bound"
        assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), f"{req} has no upper bound"


def test_torch_pin_has_no_local_build_tag():
    # "+cpu" would stop a GPU host from installing the CUDA build of the same version.
    for path in (RUNTIME, DEV):
        assert str(_lock(path)["torch"]) == "2.13.0", path.name
