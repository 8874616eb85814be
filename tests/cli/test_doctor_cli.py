"""`hf-dist-recipes doctor`: the table, --json against its schema, exit codes, --lock errors, no DeepSpeed import.

Fakes: the GPU hosts are recordings (tests/fixtures/env/) replayed through the probe's injected sources, because
this machine has no NVIDIA GPU, driver, NVML or InfiniBand; the CLI's `probe` is replaced by one returning them.
The real probe of this machine runs too (first and last tests).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jsonschema  # installed with nbformat (the dev extra); the schema is checked by the real validator
import pytest
import torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "env"
sys.path.insert(0, str(FIXTURES))

from fake_env import fake_host  # noqa: E402

from hf_dist_recipes.cli.main import main  # noqa: E402
from hf_dist_recipes.doctor import doctor as doctor_module  # noqa: E402
from hf_dist_recipes.doctor import probe as probe_module  # noqa: E402
from hf_dist_recipes.doctor.doctor import REPORT_SCHEMA  # noqa: E402

STACK = {
    "deepspeed": "0.19.8",
    "transformers": "5.24.0",
    "accelerate": "1.16.0",
    "datasets": "5.2.0",
    "nvidia-nccl-cu12": "2.21.5",
}


@pytest.fixture
def host(monkeypatch, tmp_path):
    """Make the CLI probe a recorded host: host(rec_name, **changes) -> the facts it will report."""
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # a torch cu124 wheel; this machine's is a CPU build
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(doctor_module, "rule_checks", lambda facts, evaluate=None: [])  # rules: their own tests

    def use(rec_name, **changes):
        facts = fake_host(tmp_path, rec_name, packages=STACK, sysfs=FIXTURES / "sysfs_ib")
        facts = replace(facts, shm_bytes=16 * 1024**3, **changes)
        monkeypatch.setattr(probe_module, "probe", lambda: facts)
        return facts

    return use


def test_json_of_this_machine_validates_against_the_schema(capsys):
    code = main(["doctor", "--json"])
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, REPORT_SCHEMA)
    assert data["exit_code"] == code
    assert data["facts"]["rule_facts"]["gpu_count"] == torch.cuda.device_count()
    statuses = {c["status"] for c in data["checks"]}
    assert code == (1 if "error" in statuses else 0)


def test_schema_rejects_what_it_must():
    good = {"facts": {}, "checks": [], "exit_code": 0}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, REPORT_SCHEMA)  # facts without their keys
    bad_check = {"name": "x", "status": "fine", "detail": "", "fix": "", "source": ""}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad_check, REPORT_SCHEMA["properties"]["checks"]["items"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(3, REPORT_SCHEMA["properties"]["exit_code"])


def test_sound_recorded_host_exits_0_and_the_table_has_every_check(host, capsys):
    host("nvml_h100x8.json")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for name in (
        "versions",
        "torch sees the GPUs",
        "driver",
        "nccl",
        "infiniband",
        "nccl network",
        "peer access",
        "/dev/shm",
        "debug variables",
        "declared minimums",
        "build locks",
        "ninja",
    ):
        assert f"ok       {name}" in out
    assert "fix:" not in out and out.rstrip().endswith("12 ok, 0 notice(s), 0 warning(s), 0 error(s); exit 0")


def test_warning_exits_0_or_1_with_strict_and_shows_the_fix(host, capsys):
    # Two RTX 4090 without peer access: a warning, with its fix under it.
    host("nvml_rtx4090x2.json")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "WARNING  peer access" in out and "fix: GeForce cards have no P2P" in out
    assert main(["doctor", "--strict"]) == 1
    capsys.readouterr()
    assert main(["doctor", "--strict", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, REPORT_SCHEMA)
    assert data["exit_code"] == 1 and data["facts"]["rule_facts"]["peer_access"] is False


def test_error_exits_1(host, capsys, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # driver 550.54.14 under a CUDA 13 torch: needs >= 580
    host("nvml_h100x8.json")
    assert main(["doctor"]) == 1  # found problems; 2 is for a doctor that could not run (a missing --lock)
    out = capsys.readouterr().out
    assert "ERROR    driver" in out and "fix: upgrade the driver to >= 580" in out


def test_missing_lock_file_is_one_line_and_exit_2(capsys, tmp_path):
    assert main(["doctor", "--lock", str(tmp_path / "nope.lock")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        f"hf-dist-recipes doctor: error: --lock {tmp_path / 'nope.lock'}: no such file; write one "
        "with hf-dist-recipes pin --output DIR"
    )


def test_doctor_does_not_import_deepspeed():
    # Importing deepspeed takes seconds; the doctor reads its version from the package metadata instead.
    code = (
        "import sys; from hf_dist_recipes.cli.main import main; rc = main(['doctor', '--json']); "
        "assert 'deepspeed' not in sys.modules, 'deepspeed imported'; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr
    assert "deepspeed imported" not in done.stderr
    assert json.loads(done.stdout)["facts"]["packages"]["deepspeed"] is not None


def _lock_text(deepspeed: str) -> str:
    """A lock in `pin`'s format (doctor/lock.py docstring), written here from importlib.metadata: every
    installed distribution pinned, torch without its local label, which goes to the torch-build header."""
    import importlib.metadata
    import platform

    from packaging.utils import canonicalize_name

    pins = {}
    for dist in importlib.metadata.distributions():
        if dist.metadata["Name"]:
            pins.setdefault(canonicalize_name(dist.metadata["Name"]), dist.version)
    torch_version, _, label = pins["torch"].partition("+")
    pins["torch"], pins["deepspeed"] = torch_version, deepspeed
    header = [f"# python: {platform.python_version()}", f"# torch-build: {label or 'none'}"]
    return "\n".join(header + [f"{n}=={v}" for n, v in sorted(pins.items())]) + "\n"


def test_lock_drift_names_the_package_and_both_versions(tmp_path, capsys):
    pytest.importorskip("hf_dist_recipes.doctor.lock")
    import importlib.metadata

    installed = importlib.metadata.version("deepspeed")
    same = tmp_path / "same.lock"
    same.write_text(_lock_text(installed))
    main(["doctor", "--json", "--lock", str(same)])
    checks = json.loads(capsys.readouterr().out)["checks"]
    assert [c for c in checks if c["name"].startswith("lock")] == [
        {"name": "lock", "status": "ok", "detail": f"the environment matches {same}", "fix": "", "source": str(same)}
    ]
    drifted = tmp_path / "drifted.lock"
    drifted.write_text(_lock_text("0.9.3"))
    assert main(["doctor", "--lock", str(drifted)]) == 1
    out = capsys.readouterr().out
    assert f"ERROR    lock deepspeed        deepspeed: locked 0.9.3, installed {installed}" in out
    assert "fix: pip install deepspeed==0.9.3" in out
