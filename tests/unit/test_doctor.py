"""The doctor's checks, each once passing and once failing, on recorded hosts.

Fakes: this machine has no NVIDIA GPU, driver, NVML, nvidia-smi or InfiniBand, so the GPU hosts are recordings
replayed through the probe's injected sources (tests/fixtures/env/, fake_env.py), with `torch.version.cuda` set to
the CUDA build the recorded host runs. A single fact is then changed with dataclasses.replace where a check needs
the failing case of one fact only.

About 470 lines: one concept (each check of doctor_checks.py, once passing and once failing), sharing the recorded
hosts' fixtures; split by check, every file would rebuild those hosts.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "env"
sys.path.insert(0, str(FIXTURES))

import fake_env  # noqa: E402
from fake_env import fake_host  # noqa: E402

from hf_dist_recipes.doctor import doctor, doctor_checks  # noqa: E402
from hf_dist_recipes.doctor.doctor import run_checks  # noqa: E402
from hf_dist_recipes.doctor.doctor_checks import Check  # noqa: E402

# Written out here, independently of core/findings.py: statuses least to most severe, and how a rule's severity shows.
STATUSES = ("ok", "warning", "error")
SEVERITY_STATUS = {"error": "error", "warning": "warning", "info": "ok"}
STACK = {"deepspeed": "0.19.8", "transformers": "5.24.0", "accelerate": "1.16.0", "datasets": "5.2.0"}
H100_PKGS = {**STACK, "nvidia-nccl-cu12": "2.21.5"}  # the NCCL a torch cu124 wheel pins, as torch compiled


def no_rules(facts):
    return []


@pytest.fixture
def cuda124(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # a torch cu124 wheel; this host's is a CPU build
    monkeypatch.setattr(torch.version, "hip", None)


@pytest.fixture
def h100(tmp_path, cuda124):
    facts = fake_host(tmp_path, "nvml_h100x8.json", packages=H100_PKGS, sysfs=FIXTURES / "sysfs_ib")
    return replace(facts, shm_bytes=16 * 1024**3)  # this machine's /dev/shm would otherwise decide the shm check


def test_check_status_is_validated():
    with pytest.raises(ValueError, match="ok.*warning.*error"):
        Check("x", "fine", "detail")


def test_sound_h100_node_passes_every_check(h100):
    report = run_checks(h100, evaluate=no_rules)
    assert [(c.name, c.status) for c in report.checks if c.status != "ok"] == []
    assert report.exit_code() == 0 and report.exit_code(strict=True) == 0


def test_versions(h100):
    ok = doctor_checks.check_versions(h100)
    assert ok.status == "ok" and "deepspeed 0.19.8" in ok.detail and "torch 2.13.0" in ok.detail
    missing = doctor_checks.check_versions(replace(h100, packages={**STACK, "deepspeed": None}))
    assert missing.status == "warning" and "not installed: deepspeed" in missing.detail
    assert "pip install deepspeed" in missing.fix


def test_torch_sees_the_gpus(tmp_path, h100, monkeypatch):
    ok = doctor_checks.check_torch_sees_gpus(h100)
    assert ok.status == "ok" and ok.detail == "8 GPU(s): NVIDIA H100 80GB HBM3"
    # The same node with a CPU-only wheel: cuda_host's reason and install fix, split into detail and fix.
    monkeypatch.setattr(torch.version, "cuda", None)
    blind = fake_host(
        tmp_path,
        "nvml_h100x8.json",
        visible=0,
        packages=STACK,
        dev_dir=fake_env.dev_dir(tmp_path, 8),
        nvidia_smi=fake_env.fake_nvidia_smi(tmp_path),
    )
    err = doctor_checks.check_torch_sees_gpus(blind)
    assert err.status == "error" and "8 NVIDIA GPU(s)" in err.detail and "CPU-only build" in err.detail
    assert err.fix.startswith("install the CUDA build of the same torch, keeping")
    assert f"pip install torch=={torch.__version__.split('+')[0]}" in err.fix
    assert run_checks(blind, evaluate=no_rules).exit_code() == 1


def test_driver_floor_of_the_torch_build(tmp_path, h100, monkeypatch):
    ok = doctor_checks.check_driver(h100)  # 550.54.14 >= 525.60.13, the CUDA 12.x floor
    assert ok.status == "ok" and "550.54.14" in ok.detail and ">= 525.60.13" in ok.detail
    # The same driver under a cu130 torch: CUDA 13.x needs >= 580 (NVIDIA CUDA Compatibility guide).
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    cu130 = fake_host(tmp_path, "nvml_h100x8.json", packages=H100_PKGS)
    err = doctor_checks.check_driver(cu130)
    assert err.status == "error" and "driver 550.54.14 runs CUDA <= 12.4" in err.detail and ">= 580" in err.detail
    assert "upgrade the driver to >= 580" in err.fix


def test_driver_whose_cuda_major_is_short_even_above_the_floor(h100):
    # A driver number above the 13.x floor reporting CUDA 12.8 cannot run a CUDA 13 build either.
    facts = replace(
        h100, torch=replace(h100.torch, cuda="13.0"), driver=replace(h100.driver, version="580.65.06", cuda="12.8")
    )
    assert doctor_checks.check_driver(facts).status == "error"
    assert doctor_checks.check_driver(replace(facts, driver=replace(facts.driver, cuda="13.0"))).status == "ok"


def test_driver_not_needed_by_a_cpu_build_and_unknown_on_a_gpu_host(h100):
    cpu = replace(h100, torch=replace(h100.torch, cuda=None))
    assert doctor_checks.check_driver(cpu).status == "ok"
    unknown = replace(h100, driver=replace(h100.driver, version=None, nvml_unavailable="NVMLError: x"))
    check = doctor_checks.check_driver(unknown)
    assert check.status == "warning" and "NVMLError: x" in check.detail


def test_nccl_compiled_vs_installed(tmp_path, cuda124, h100):
    assert doctor_checks.check_nccl(h100).status == "ok"
    differ = fake_host(tmp_path, "nvml_h100x8.json", packages={**STACK, "nvidia-nccl-cu12": "2.18.1"})
    warn = doctor_checks.check_nccl(differ)
    assert warn.status == "warning" and "compiled against NCCL 2.21.5" in warn.detail and "2.18.1" in warn.detail
    assert warn.fix.startswith("pip install nvidia-nccl-cu12==2.21.5")
    two = fake_host(
        tmp_path, "nvml_h100x8.json", packages={**STACK, "nvidia-nccl-cu12": "2.21.5", "nvidia-nccl-cu11": "2.14.3"}
    )
    several = doctor_checks.check_nccl(two)
    assert several.status == "warning" and "nvidia-nccl-cu11==2.14.3" in several.detail
    assert several.fix == "pip uninstall nvidia-nccl-cu11, keeping the one torch pins"


def test_infiniband(tmp_path, cuda124, h100):
    ok = doctor_checks.check_infiniband(h100)
    assert ok.status == "ok" and "mlx5_0/1 ACTIVE (InfiniBand)" in ok.detail
    down = fake_host(tmp_path, "nvml_h100x8.json", packages=H100_PKGS, sysfs=FIXTURES / "sysfs_ib_down")
    warn = doctor_checks.check_infiniband(down)
    assert warn.status == "warning" and "no port ACTIVE" in warn.detail and "NCCL_IB_DISABLE=1" in warn.fix
    absent = doctor_checks.check_infiniband(replace(h100, ib_ports=()))
    assert absent.status == "ok" and absent.detail.startswith("not present")


def test_peer_access(tmp_path, cuda124, h100):
    ok = doctor_checks.check_peer_access(h100)
    assert ok.status == "ok" and ok.detail == "all 56 GPU pairs; NVLink active"  # 8 * 7 ordered pairs
    pair = fake_host(tmp_path, "nvml_rtx4090x2.json", packages=STACK)
    warn = doctor_checks.check_peer_access(pair)
    assert warn.status == "warning" and warn.detail.startswith("2 of 2 GPU pairs cannot access each other (0->1, 1->0)")
    assert "no NVLink" in warn.detail and "NCCL_P2P_DISABLE=1" in warn.fix
    single = doctor_checks.check_peer_access(replace(h100, peer_access=(), torch=replace(h100.torch, device_count=1)))
    assert single.status == "ok" and single.detail.startswith("not applicable: 1 GPU")


def test_shm_threshold(h100):
    mib = 1024 * 1024
    assert doctor_checks.check_shm(replace(h100, shm_bytes=512 * mib)).status == "ok"  # DeepSpeed warns below 512 MiB
    small = doctor_checks.check_shm(replace(h100, shm_bytes=512 * mib - 1))
    assert small.status == "warning" and "--shm-size" in small.fix
    assert doctor_checks.check_shm(replace(h100, shm_bytes=64 * mib)).detail.startswith("64 MiB, under 512 MiB")
    unknown = doctor_checks.check_shm(replace(h100, shm_bytes=None, shm_error="/dev/shm: No such file"))
    assert unknown.status == "warning" and "No such file" in unknown.detail


def test_debug_variables(tmp_path, cuda124):
    quiet = fake_host(tmp_path, "nvml_h100x8.json", packages=H100_PKGS, environ={"NCCL_DEBUG": "WARN"})
    assert doctor_checks.check_debug_variables(quiet).status == "ok"
    loud = fake_host(
        tmp_path,
        "nvml_h100x8.json",
        packages=H100_PKGS,
        environ={"NCCL_DEBUG": "info", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
    )
    warn = doctor_checks.check_debug_variables(loud)
    assert warn.status == "warning" and "NCCL_DEBUG=info, TORCH_DISTRIBUTED_DEBUG=DETAIL" in warn.detail
    assert "NCCL_DEBUG=WARN" in warn.fix


def test_declared_minimums(h100):
    assert doctor_checks.check_declared_minimums(h100).status == "ok"
    # transformers 5.25 requires torch >= 2.6 (package metadata): an older torch under it is an error.
    old_torch = replace(
        h100, torch=replace(h100.torch, version="2.5.1+cu124"), packages={**STACK, "transformers": "5.25.0"}
    )
    err = doctor_checks.check_declared_minimums(old_torch)
    assert err.status == "error" and "transformers 5.25.0 needs torch >=2.6, found 2.5.1" in err.detail
    assert "accelerate 1.16.0 needs torch >=2.6, found 2.5.1" in err.detail
    old_accelerate = replace(h100, packages={**STACK, "accelerate": "1.0.1"})
    assert (
        "transformers 5.24.0 needs accelerate >=1.1.0, found 1.0.1"
        in doctor_checks.check_declared_minimums(old_accelerate).detail
    )


def test_rule_findings_become_checks(h100):
    seen = {}

    def evaluate(facts):
        seen.update(facts)
        return [
            SimpleNamespace(
                rule_id="nccl-2.18-internal-error",
                severity="warning",
                symptom="every network error is 'internal error'",
                fix="NCCL_DEBUG=WARN",
                source="NVIDIA/nccl 1092",
            ),
            SimpleNamespace(rule_id="x", severity="error", symptom="s", fix="f", source="src"),
        ]

    report = run_checks(h100, evaluate=evaluate)
    assert seen == h100.rule_facts()  # the rules see the flat mapping
    rules = [c for c in report.checks if c.name.startswith("rule ")]
    assert [(c.name, c.status, c.source) for c in rules] == [
        ("rule nccl-2.18-internal-error", "warning", "NVIDIA/nccl 1092"),
        ("rule x", "error", "src"),
    ]
    assert report.exit_code() == 1


def test_exit_codes(h100):
    warn = replace(h100, shm_bytes=1)
    assert run_checks(warn, evaluate=no_rules).exit_code() == 0
    assert run_checks(warn, evaluate=no_rules).exit_code(strict=True) == 1
    err = replace(h100, torch=replace(h100.torch, cuda="13.0"))  # driver 550 under a CUDA 13 build
    assert run_checks(err, evaluate=no_rules).exit_code() == 1


def test_lock_drift_is_an_error_per_package_naming_both_versions(h100):
    # lock_drift stands in for doctor/lock.py's (same signature), to test the doctor's side alone.
    def drift(lock, installed):
        return [
            SimpleNamespace(package=p, locked=lock.packages.get(p), installed=installed.get(p))
            for p in sorted(set(lock.packages) | set(installed))
            if installed.get(p) != lock.packages.get(p)
        ]

    lock = SimpleNamespace(
        packages={"torch": "2.13.0", "deepspeed": "0.19.8", "einops": "0.8.1"},
        python="3.11.7",
        path="run/requirements.lock",
    )
    installed = {"torch": "2.13.0", "deepspeed": "0.19.7", "ipython": "9.0.0"}
    checks = doctor.lock_checks(lock, installed, drift, python="3.12.1")
    assert [(c.name, c.status, c.detail) for c in checks] == [
        ("lock python", "error", "python: locked 3.11.7, running 3.12.1"),
        ("lock deepspeed", "error", "deepspeed: locked 0.19.8, installed 0.19.7"),
        ("lock einops", "error", "einops: locked 0.8.1, installed nothing"),
        ("lock ipython", "error", "ipython: locked nothing, installed 9.0.0"),
    ]
    assert checks[1].fix == "pip install deepspeed==0.19.8" and checks[1].source == "run/requirements.lock"
    assert checks[3].fix.startswith("pip uninstall ipython")
    same = doctor.lock_checks(
        SimpleNamespace(packages={"torch": "2.13.0"}, python="3.11.7", path="l"),
        {"torch": "2.13.0"},
        drift,
        python="3.11.7",
    )
    assert [(c.name, c.status) for c in same] == [("lock", "ok")]


def test_the_packaged_rules_are_wired_in(tmp_path, monkeypatch):
    # helper B's rules: every finding of evaluate() on the facts is one check, with the finding's status and source.
    rules = pytest.importorskip("hf_dist_recipes.doctor.rules")
    # torch 2.2 with its NCCL 2.19.3 on the recorded H100 node: cuMem all-to-all deadlock (NVIDIA/nccl 1116).
    monkeypatch.setattr(torch.version, "cuda", "12.1")
    facts = fake_host(tmp_path, "nvml_h100x8.json", packages={**STACK, "nvidia-nccl-cu12": "2.19.3"})
    facts = replace(
        facts,
        torch=replace(facts.torch, version="2.2.2+cu121", nccl_compiled="2.19.3"),
        nccl=replace(facts.nccl, compiled="2.19.3"),
    )
    findings = rules.evaluate(facts.rule_facts())
    assert any("1116" in f.source for f in findings)
    all_checks = run_checks(facts).checks
    summary = next(c for c in all_checks if c.name == "known issues")
    unknown = rules.not_checkable(facts.rule_facts())
    assert summary.status == "ok" and summary.detail.startswith(
        f"{len(rules.load_rules())} known-bad combinations checked, {len(findings)} apply"
    )
    assert (f"; {len(unknown)} not checkable here" in summary.detail) == bool(unknown)
    # Each finding is a check of its own, or (restating a fact check that already says it at least as loudly) named
    # in that check.
    checks = {c.name: c for c in all_checks if c.name.startswith("rule ")}
    folded = [f for f in findings if f"rule {f.rule_id}" not in checks]
    assert all(f.rule_id in doctor.COVERED_BY for f in folded)
    for f in folded:
        loud = STATUSES.index(SEVERITY_STATUS[f.severity])
        assert any(
            STATUSES.index(c.status) >= loud and f"known_issues.toml {f.rule_id}" in c.source for c in all_checks
        )
    shown = [f for f in findings if f not in folded]
    assert list(checks) == [f"rule {f.rule_id}" for f in shown] and len(shown) >= 1
    assert [c.status for c in checks.values()] == [SEVERITY_STATUS[f.severity] for f in shown]
    assert [c.source for c in checks.values()] == [f.source for f in shown]


def test_nccl_loaded_from_outside_the_distribution_or_at_another_version(h100):
    # The loaded libnccl as /proc/self/maps and ncclGetVersion would give it (faked: no libnccl on this host).
    path = "/usr/lib/x86_64-linux-gnu/libnccl.so.2"
    warn = doctor_checks.check_nccl(replace(h100, nccl=replace(h100.nccl, loaded="2.18.1", loaded_path=path)))
    assert warn.status == "warning" and f"torch loaded {path} (NCCL 2.18.1)" in warn.detail
    assert warn.fix.startswith("remove /usr/lib/x86_64-linux-gnu from LD_LIBRARY_PATH")
    lib = "/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"
    other = doctor_checks.check_nccl(replace(h100, nccl=replace(h100.nccl, loaded="2.18.1", loaded_path=lib)))
    assert other.status == "warning" and "compiled against NCCL 2.21.5 but NCCL 2.18.1 is loaded" in other.detail
    same = doctor_checks.check_nccl(replace(h100, nccl=replace(h100.nccl, loaded="2.21.5", loaded_path=lib)))
    assert same.status == "ok" and same.detail.startswith("NCCL 2.21.5")


def test_unreadable_gpu_is_an_error_with_a_fix(h100):
    problem = "torch counts 8 GPU(s) but cannot read them: RuntimeError: ECC. Fix: run nvidia-smi"
    err = doctor_checks.check_torch_sees_gpus(replace(h100, torch=replace(h100.torch, gpu_problem=problem)))
    assert (err.status, err.detail, err.fix) == (
        "error",
        "torch counts 8 GPU(s) but cannot read them: RuntimeError: ECC.",
        "run nvidia-smi",
    )


def test_a_rule_restating_a_failing_check_is_folded_into_it():
    checks = [Check("/dev/shm", "warning", "64 MiB", "bigger", "ds_report"), Check("driver", "ok", "fine")]
    rules = [
        Check("rule shm-below-512mb", "warning", "small shm", "f", "s"),
        Check("rule driver-below-cuda12-floor", "error", "old driver", "f", "s"),  # the check says ok: kept
        Check("rule other", "warning", "x", "f", "s"),
    ]
    kept = doctor.fold_duplicates(checks, rules)
    assert [c.name for c in kept] == ["rule driver-below-cuda12-floor", "rule other"]
    assert checks[0].source == "ds_report; known_issues.toml shm-below-512mb"
    # A rule louder than the check that covers it is shown as well.
    louder = doctor.fold_duplicates([Check("/dev/shm", "warning", "d")], [Check("rule shm-below-512mb", "error", "")])
    assert [c.name for c in louder] == ["rule shm-below-512mb"]


def test_small_shm_is_one_line_with_the_packaged_rules(h100):
    pytest.importorskip("hf_dist_recipes.doctor.rules")
    checks = run_checks(replace(h100, shm_bytes=64 * 1024 * 1024)).checks
    shm = [c for c in checks if "shm" in c.name]
    assert [(c.name, c.status) for c in shm] == [("/dev/shm", "warning")]
    assert "known_issues.toml shm-below-512mb" in shm[0].source


def test_build_locks_check_reads_the_real_lock_files(tmp_path):
    # A real lock file, aged past the stale limit with os.utime (an hour), under a build root of its own.
    import os
    import time

    from hf_dist_recipes.doctor import op_builds

    if op_builds.build_running():
        pytest.skip("a compiler runs on this machine now: a lock may be live")
    facts = None  # the check reads the machine, not the probe's facts
    assert doctor_checks.check_build_locks(facts, root=tmp_path).status == "ok"
    lock = tmp_path / "py311_cpu_torch2.13.0" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    old = time.time() - 3600
    os.utime(lock, (old, old))
    check = doctor_checks.check_build_locks(facts, root=tmp_path)
    assert check.status == "error" and str(lock) in check.detail and f"rm {lock}" in check.fix


def _fake_ninja(folder, version):
    # An executable that answers `--version` as that ninja release does: this machine may have one ninja or two, and
    # which versions is not ours to choose. The check runs it as torch runs ninja.
    folder.mkdir(parents=True, exist_ok=True)
    return fake_env.executable(folder / "ninja", f"echo {version}\n")


def test_ninja_check_compares_the_ninja_on_path_with_the_environments(tmp_path, h100):
    env_bin, system_bin = tmp_path / "venv" / "bin", tmp_path / "usr" / "bin"
    python = str(env_bin / "python")
    _fake_ninja(env_bin, "1.13.2")
    # activated environment: its own ninja is first on PATH
    check = doctor_checks.check_ninja(h100, search_path=f"{env_bin}:{system_bin}", interpreter=python)
    assert check.status == "ok" and str(env_bin / "ninja") in check.detail and "1.13.2" in check.detail
    # not activated: the system's 1.11 builds the ops some jobs, the environment's 1.13 others
    _fake_ninja(system_bin, "1.11.1")
    check = doctor_checks.check_ninja(h100, search_path=f"{system_bin}:{env_bin}", interpreter=python)
    assert check.status == "warning"
    assert "1.11.1" in check.detail and "1.13.2" in check.detail and "rebuild every op" in check.detail
    assert f"export PATH={env_bin}:$PATH" in check.fix
    # two files of one version keep one log format: nothing to rebuild
    _fake_ninja(system_bin, "1.13.2")
    assert doctor_checks.check_ninja(h100, search_path=str(system_bin), interpreter=python).status == "ok"


def test_ninja_check_names_a_ninja_missing_from_path(tmp_path, h100):
    env_bin, empty = tmp_path / "venv" / "bin", tmp_path / "empty"
    empty.mkdir()
    _fake_ninja(env_bin, "1.13.2")
    check = doctor_checks.check_ninja(h100, search_path=str(empty), interpreter=str(env_bin / "python"))
    assert check.status == "warning" and "Ninja is required" in check.detail and str(env_bin) in check.fix
    nowhere = str(tmp_path / "nowhere" / "python")
    check = doctor_checks.check_ninja(h100, search_path=str(empty), interpreter=nowhere)
    assert h100.rule_facts()["deepspeed"] and check.status == "warning" and "pip install ninja" in check.fix
    no_deepspeed = replace(h100, packages={k: v for k, v in h100.packages.items() if k != "deepspeed"})
    assert doctor_checks.check_ninja(no_deepspeed, search_path=str(empty), interpreter=nowhere).status == "ok"


def test_an_info_rule_restating_a_quiet_check_is_folded_but_a_warning_is_not():
    checks = [Check("build locks", "ok", "none")]
    kept = doctor.fold_duplicates(checks, [Check("rule deepspeed-stale-jit-build-lock", "ok", "generic advice")])
    assert kept == [] and "deepspeed-stale-jit-build-lock" in checks[0].source
    kept = doctor.fold_duplicates([Check("/dev/shm", "ok", "d")], [Check("rule shm-below-512mb", "warning", "")])
    assert [c.name for c in kept] == ["rule shm-below-512mb"]


# --- nccl network: which HCA ports and IP interfaces NCCL would use (doctor/nccl_net.py) ---
# sysfs_multi_nic is a recorded multi-NIC host: IP interfaces lo (index 1), eno1 (2, management), ens1f0 (3, the
# RoCE NIC's netdev), ens1f1 (4, down), docker0 (5); verbs ports mlx5_0, mlx5_1, mlx5_10 (InfiniBand, ACTIVE),
# mlx5_2 (Ethernet = RoCE, ACTIVE), mlx5_3 (Ethernet, DOWN).


def _multi_nic(tmp_path, **environ):
    facts = fake_host(
        tmp_path, "nvml_h100x8.json", packages=H100_PKGS, sysfs=FIXTURES / "sysfs_multi_nic", environ=environ
    )
    return doctor_checks.check_nccl_network(facts)


def test_nccl_network_on_a_sound_node_is_ipoib_and_its_active_port(h100):
    check = doctor_checks.check_nccl_network(h100)  # sysfs_ib: ib0, eth0, lo; mlx5_0 ACTIVE, mlx5_1 DOWN
    # By hand: NCCL's search takes the ib* interfaces first (ib0 alone); every ACTIVE port is mlx5_0:1.
    assert check.status == "ok"
    assert (
        "HCA ports: mlx5_0:1 (InfiniBand)" in check.detail
        and "IP interfaces: ib0 [NCCL's search: IPoIB" in check.detail
    )
    assert "env.html" in check.source


def test_nccl_network_on_a_multi_nic_host_names_the_pins(tmp_path, cuda124):
    check = _multi_nic(tmp_path)
    # By hand: no ib* interface, so all but docker*/lo that are up: eno1 (2) then ens1f0 (3); ens1f1 is down.
    # Every ACTIVE port, in device-name order: mlx5_0, mlx5_1, mlx5_10 (InfiniBand) and mlx5_2 (RoCE).
    assert check.status == "warning"
    assert "HCA ports: mlx5_0:1 (InfiniBand), mlx5_1:1 (InfiniBand), mlx5_10:1 (InfiniBand), mlx5_2:1 (Ethernet)" in (
        check.detail
    )
    assert "IP interfaces: eno1, ens1f0" in check.detail and "bootstraps over eno1" in check.detail
    assert "two fabrics" in check.detail
    assert "export NCCL_IB_HCA==mlx5_0:1,mlx5_1:1,mlx5_10:1" in check.fix
    assert "export NCCL_SOCKET_IFNAME==<the one on the network the nodes share: eno1 or ens1f0>" in check.fix


def test_nccl_network_pinned_is_ok_and_a_prefix_token_is_named(tmp_path, cuda124):
    pinned = _multi_nic(tmp_path, NCCL_IB_HCA="=mlx5_0:1,mlx5_1:1", NCCL_SOCKET_IFNAME="=ens1f0")
    assert pinned.status == "ok"
    assert "HCA ports: mlx5_0:1 (InfiniBand), mlx5_1:1 (InfiniBand) [NCCL_IB_HCA==mlx5_0:1,mlx5_1:1]" in pinned.detail
    assert "IP interfaces: ens1f0 [NCCL_SOCKET_IFNAME==ens1f0]" in pinned.detail
    # Without '=', the guide's note: mlx5_1 is a prefix and also selects mlx5_10.
    prefix = _multi_nic(tmp_path, NCCL_IB_HCA="mlx5_1", NCCL_SOCKET_IFNAME="=eno1")
    assert prefix.status == "warning" and "HCA ports: mlx5_1:1 (InfiniBand), mlx5_10:1 (InfiniBand)" in prefix.detail
    assert "'mlx5_1' is a prefix: it also selects mlx5_10" in prefix.detail
    assert prefix.fix.endswith("export NCCL_IB_HCA==mlx5_1")
    excluded = _multi_nic(tmp_path, NCCL_IB_HCA="^=mlx5_2", NCCL_SOCKET_IFNAME="=eno1")  # the RoCE port out
    assert excluded.status == "ok"
    assert "HCA ports: mlx5_0:1 (InfiniBand), mlx5_1:1 (InfiniBand), mlx5_10:1 (InfiniBand) [" in excluded.detail


def test_nccl_network_filters_that_select_nothing(tmp_path, cuda124):
    none = _multi_nic(tmp_path, NCCL_IB_HCA="mlx4", NCCL_SOCKET_IFNAME="=eno1")
    assert none.status == "warning" and "matches no ACTIVE port: NCCL falls back to TCP sockets" in none.detail
    down = _multi_nic(tmp_path, NCCL_IB_HCA="=mlx5_0", NCCL_SOCKET_IFNAME="=ens1f1")  # ens1f1 is down
    assert down.status == "error" and "matches no interface that is up" in down.detail
    off = _multi_nic(tmp_path, NCCL_IB_DISABLE="1", NCCL_SOCKET_IFNAME="=eno1")
    assert off.status == "ok" and "HCA ports: none (TCP sockets between nodes) [none: NCCL_IB_DISABLE" in off.detail
