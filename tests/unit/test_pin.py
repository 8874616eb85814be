"""The lock (doctor/lock.py), the torch build table and the Dockerfile `pin` writes (doctor/pin.py).

Expected values come from independent sources: `pip freeze --all` of this interpreter for the installed versions,
/work/shared/reference/version-facts.md for torch 2.13.0's default build (CUDA 13.0, NCCL 2.29.7), hand-written
locks for the round trip and the drift."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.utils import canonicalize_name

from hf_dist_recipes.comm.nccl_defaults import NCCL_ENV_DEFAULTS
from hf_dist_recipes.doctor import doctor, torch_builds
from hf_dist_recipes.doctor.lock import Drift, Lock, installed_versions, lock_drift, read_lock, write_lock
from hf_dist_recipes.doctor.pin import pin, plan_lock
from tests.support.paths import REPO


def _pip_freeze() -> tuple[dict[str, str], set[str]]:
    """name -> version from `pip freeze --all` (an independent reader of the same site-packages), and the names
    pip lists as editable / local installs."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--all", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pins, local = {}, set()
    for line in out.splitlines():
        m = re.match(r"^# Editable install with no version control \((.+)==(.+)\)$", line)
        if m:
            pins[canonicalize_name(m.group(1))] = m.group(2)
            local.add(canonicalize_name(m.group(1)))
        elif "==" in line and not line.startswith(("#", "-e")):
            name, version = line.split("==", 1)
            pins[canonicalize_name(name)] = version
        elif line.startswith("-e ") and os.path.isfile(os.path.join(line[3:], "pyproject.toml")):
            # This pip prints an editable folder without its version: the folder's pyproject.toml has both.
            project = tomllib.loads(open(os.path.join(line[3:], "pyproject.toml")).read())["project"]
            pins[canonicalize_name(project["name"])] = project["version"]
            local.add(canonicalize_name(project["name"]))
        elif line.startswith("-e ") and "#egg=" in line:
            # In a git checkout pip prints `-e git+file:///...@<commit>#egg=<name>`: the version is the checkout's.
            project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
            pins[canonicalize_name(line.rsplit("#egg=", 1)[1])] = project["version"]
            local.add(canonicalize_name(line.rsplit("#egg=", 1)[1]))
        elif " @ " in line:  # name @ file:///... (a local, non-editable install)
            local.add(canonicalize_name(line.split(" @ ")[0]))
    return pins, local


def test_lock_of_this_environment_lists_exactly_what_pip_freeze_lists(tmp_path):
    # deepspeed imports setuptools, which appends its `_vendor` folder to sys.path: its bundled copies (tomli, wheel,
    # ...) must not be locked. Imported here so the case is tested in every worker, not only after a deepspeed test.
    import setuptools  # noqa: F401

    assert any(os.path.basename(p) == "_vendor" for p in sys.path), "setuptools no longer extends sys.path"
    result = pin(tmp_path)
    lock = read_lock(result.lock_path)
    frozen, local = _pip_freeze()
    locked = dict(lock.packages)
    # torch's "+cpu" label lives in the header, not the pin.
    assert lock.torch_build == frozen["torch"].partition("+")[2]
    locked["torch"] = f"{locked['torch']}+{lock.torch_build}"
    assert locked == frozen
    assert set(lock.local) == local  # the editable hf-dist-recipes: a comment pin, read back as a pin
    assert lock.python == ".".join(map(str, sys.version_info[:3]))
    # The lock of this environment has no drift against this environment, through the doctor's own check.
    assert lock_drift(lock, installed_versions()) == []
    assert [c.status for c in doctor.lock_checks(lock)] == ["ok"]


def test_lock_round_trips(tmp_path):
    lock = Lock(
        {"accelerate": "1.16.0", "hf-dist-recipes": "0.1.0", "nvidia-nccl-cu13": "2.29.7", "torch": "2.13.0"},
        "cu130",
        "13.0",
        "https://download.pytorch.org/whl/cu130",
        "2.29.7",
        "3.11.7",
        {"hf-dist-recipes": "file:///src"},
    )
    back = read_lock(write_lock(tmp_path / "requirements.lock", lock).path)
    assert back == lock
    cpu = Lock({"torch": "2.13.0"}, "cpu", None, "https://download.pytorch.org/whl/cpu", None, "3.11.7")
    assert read_lock(write_lock(tmp_path / "cpu.lock", cpu).path) == cpu
    # pip reads the same file: every non-comment line is an exact pin (the local one is a comment).
    lines = [x for x in (tmp_path / "requirements.lock").read_text().splitlines() if not x.startswith("#")]
    assert lines == ["accelerate==1.16.0", "nvidia-nccl-cu13==2.29.7", "torch==2.13.0"]


@pytest.mark.parametrize(
    "bad, line", [("numpy>=1.0", 3), ("torch==2.13.0\ntorch==2.12.1", 4), ("torch==not.a.version!", 3)]
)
def test_malformed_lock_names_file_and_line(tmp_path, bad, line):
    path = tmp_path / "requirements.lock"
    path.write_text(f"# torch-build: cpu\naccelerate==1.16.0\n{bad}\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:{line}:")):
        read_lock(path)


def test_drift_names_the_package_and_both_versions():
    lock = Lock({"accelerate": "1.16.0", "deepspeed": "0.19.8", "torch": "2.13.0"}, "cpu")
    installed = {"Accelerate": "1.15.0", "torch": "2.13.0+cpu", "einops": "0.8.2"}
    assert lock_drift(lock, installed) == [
        Drift("accelerate", "1.16.0", "1.15.0"),
        Drift("deepspeed", "0.19.8", None),
        Drift("einops", None, "0.8.2"),
    ]
    # Same release, another build: drift, naming both builds.
    assert lock_drift(Lock({"torch": "2.13.0"}, "cpu"), {"torch": "2.13.0+cu126"}) == [
        Drift("torch", "2.13.0+cpu", "2.13.0+cu126")
    ]
    # PyPI's unlabelled 2.13.0 wheel is the cu130 build (version-facts.md).
    assert lock_drift(Lock({"torch": "2.13.0"}, "cu130"), {"torch": "2.13.0"}) == []
    assert lock_drift(Lock({"torch": "2.13.0"}, "cpu"), {"torch": "2.13.0"}) != []
    # The doctor's check of the same drift: one error per package, naming both versions.
    checks = doctor.lock_checks(lock, installed)
    assert [(c.name, c.status, c.detail) for c in checks][0] == (
        "lock accelerate",
        "error",
        "accelerate: locked 1.16.0, installed 1.15.0",
    )


def test_dockerfile_for_torch_2_13_cu130(tmp_path):
    result = pin(tmp_path, "2.13.0", "13.0")
    text = (tmp_path / "Dockerfile").read_text()
    lock = read_lock(tmp_path / "requirements.lock")
    # version-facts.md: torch 2.13.0's PyPI wheel is CUDA 13.0 with NCCL 2.29.7.
    assert lock.packages["torch"] == "2.13.0" and lock.packages["nvidia-nccl-cu13"] == "2.29.7"
    assert (lock.torch_build, lock.cuda, lock.nccl) == ("cu130", "13.0", "2.29.7")
    from_line = next(x for x in text.splitlines() if x.startswith("FROM "))
    assert re.fullmatch(r"FROM nvidia/cuda:13\.0\.\d+-cudnn-devel-ubuntu\d\d\.04", from_line)
    assert (
        "RUN pip install --no-cache-dir -r /tmp/requirements.lock --extra-index-url "
        "https://download.pytorch.org/whl/cu130"
    ) in text
    assert "ENV DS_BUILD_OPS=0" in text
    for name, value in NCCL_ENV_DEFAULTS.items():
        assert f"ENV {name}={value}" in text.splitlines()
    assert "compute capability >= 7.5" in text and "driver >= 580" in text
    assert result.image == from_line.removeprefix("FROM ")
    # Without --cuda: the release's PyPI build, the same one.
    assert plan_lock("2.13.0")[0].torch_build == "cu130"


def test_cu126_build_of_2_13_pins_its_own_nccl():
    # pytorch RELEASE.md's matrix: 2.13's CUDA 12.6 build carries NCCL 2.29.3, not the cu130 build's 2.29.7.
    lock, image, _ = plan_lock(
        "2.13.0",
        "cu126",
        installed={
            "torch": "2.13.0+cu130",
            "nvidia-nccl-cu13": "2.29.7",
            "nvidia-cublas": "13.1.0.3",
            "einops": "0.8.2",
        },
    )
    assert lock.packages == {"einops": "0.8.2", "nvidia-nccl-cu12": "2.29.3", "torch": "2.13.0"}
    assert image.startswith("nvidia/cuda:12.6.")


def test_cpu_environment_gets_python_slim_and_the_cpu_index(tmp_path):
    pin(tmp_path, "2.13.0", "cpu")
    text = (tmp_path / "Dockerfile").read_text()
    assert f"FROM python:{'.'.join(map(str, sys.version_info[:3]))}-slim" in text
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in text
    assert "nvidia-nccl" not in (tmp_path / "requirements.lock").read_text()


def test_known_bad_pair_is_refused_naming_the_rule(tmp_path):
    with pytest.raises(ValueError) as err:
        pin(tmp_path, "2.1.0", "12.1")
    assert "rule nccl-cudamemcpyasync-lt-2.18.6" in str(err.value) and "fix:" in str(err.value)
    assert not (tmp_path / "requirements.lock").exists()


def test_unknown_pair_is_refused_naming_the_builds_that_exist(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"no CUDA 11\.8 build; its builds: 12\.6 \(cu126\), 13\.0 \(cu130\), "
        r"13\.2 \(cu132\), or cpu",
    ):
        pin(tmp_path, "2.13.0", "11.8")
    with pytest.raises(ValueError, match="no torch 2.13.9 in the table"):
        pin(tmp_path, "2.13.9")
    with pytest.raises(ValueError, match="--cuda needs --torch"):
        pin(tmp_path, cuda="13.0")


def test_every_build_has_an_image_of_its_cuda_and_cuda13_needs_turing():
    for release in torch_builds.RELEASES:
        assert release.default_cuda in release.builds
        for cuda in release.builds:
            image = torch_builds.CUDA_IMAGES[cuda]
            assert image.startswith(f"nvidia/cuda:{cuda}.") and "-devel-" in image, image
            build = torch_builds.lookup(release.versions[0] if release.versions else f"{release.series}.0", cuda)
            assert build.index_url == f"https://download.pytorch.org/whl/cu{cuda.replace('.', '')}"
            assert build.min_compute_capability == ("7.5" if cuda.startswith("13.") else None)


def test_env_values_with_spaces_are_quoted(tmp_path):
    pin(tmp_path, "2.13.0", "13.0", env={"NCCL_SOCKET_IFNAME": "^lo,docker", "NCCL_DEBUG_FILE": "/tmp/nccl %h.log"})
    lines = (tmp_path / "Dockerfile").read_text().splitlines()
    assert "ENV NCCL_SOCKET_IFNAME=^lo,docker" in lines and 'ENV NCCL_DEBUG_FILE="/tmp/nccl %h.log"' in lines
