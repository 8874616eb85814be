"""The known-issues rules (hf_dist_recipes/doctor/known_issues.toml) and their evaluator.

Every rule is checked against a host it must fire on and one it must not, both written by hand below from
shared/reference/version-facts.md (the torch -> CUDA -> NCCL table, the known-bad rows, the declared minimums and
driver floors): the expectations come from that file, not from running the rules. GPU hosts are plain fact
mappings (the shape of probe.EnvironmentFacts.rule_facts()), since this machine has no GPU, driver or NCCL.

About 560 lines because each of the 38 rules has its hand-written matching and non-matching hosts here (CASES),
from the rows of version-facts.md they come from.
"""

from __future__ import annotations

import importlib.metadata
import platform
import tomllib

import pytest

from hf_dist_recipes.doctor import rule_conditions
from hf_dist_recipes.doctor.rules import RuleFinding, evaluate, load_rules, not_checkable
from tests.support.paths import REPO

RULES = load_rules()
GIB = 1024**3

# A sound 8-GPU HGX H100 node on the pinned stack (torch 2.13 cu130 wheel -> NCCL 2.29.7; driver 580.65.06 is the one
# CUDA 13.0 ships with). No InfiniBand port active, so the uncertain 2.29.7 multi-node row does not apply.
HEALTHY = {
    "python": "3.11.9",
    "torch": "2.13.0",
    "cuda": "13.0",
    "nccl": "2.29.7",
    "nccl_compiled": "2.29.7",
    "deepspeed": "0.19.8",
    "transformers": "5.25.0",
    "accelerate": "1.16.0",
    "datasets": "5.2.0",
    "driver": "580.65.06",
    "driver_cuda": "13.0",
    "nvcc_cuda": "13.0",
    "arch": "x86_64",
    "gpu_count": 8,
    "gpu_names": ["NVIDIA H100 80GB HBM3"] * 8,
    "compute_capabilities": ["9.0"] * 8,
    "nvlink": True,
    "peer_access": True,
    "ib_active": False,
    "nic_names": ["lo", "eth0"],
    "shm_bytes": 64 * GIB,
    "in_container": False,
    "env": {},
}
# Info rules that hold on every host with this project's stack installed (they describe what to do IF it happens).
HEALTHY_INFOS = {
    "torch-2.6-weights-only-zero-checkpoint",
    "transformers-autotp-train-batch-size-auto",
    "deepspeed-stale-jit-build-lock",
    "transformers-fp8-dequant-block-from-scale-grid",
}


def host(*bases: dict, **over) -> dict:
    """HEALTHY with `bases` then `over` laid over it, later ones winning."""
    facts = dict(HEALTHY)
    for base in bases:
        facts.update(base)
    facts.update(over)
    return facts


def stack(torch: str, cuda: str | None, compiled: str | None, **over) -> dict:
    """A host running a given torch wheel, built against NCCL `compiled`, which is also the one installed unless
    `nccl=` says otherwise."""
    return host(**{"torch": torch, "cuda": cuda, "nccl": compiled, "nccl_compiled": compiled, **over})


TORCH_2_0 = {
    "torch": "2.0.1",
    "cuda": "11.7",
    "nccl": "2.14.3",
    "nccl_compiled": "2.14.3",
    "driver": "525.60.13",
    "driver_cuda": "12.0",
    "nvcc_cuda": "11.7",
}
TORCH_2_1 = {
    "torch": "2.1.0",
    "cuda": "12.1",
    "nccl": "2.18.1",
    "nccl_compiled": "2.18.1",
    "driver": "530.30.02",
    "driver_cuda": "12.1",
    "nvcc_cuda": "12.1",
}
TORCH_2_2 = {
    "torch": "2.2.0",
    "cuda": "12.1",
    "nccl": "2.19.3",
    "nccl_compiled": "2.19.3",
    "driver": "530.30.02",
    "driver_cuda": "12.1",
    "nvcc_cuda": "12.1",
}
TORCH_2_3 = {
    "torch": "2.3.0",
    "cuda": "12.1",
    "nccl": "2.20.5",
    "nccl_compiled": "2.20.5",
    "driver": "530.30.02",
    "driver_cuda": "12.1",
    "nvcc_cuda": "12.1",
}
TORCH_2_6 = {
    "torch": "2.6.0",
    "cuda": "12.4",
    "nccl": "2.21.5",
    "nccl_compiled": "2.21.5",
    "driver": "550.54.14",
    "driver_cuda": "12.4",
    "nvcc_cuda": "12.4",
}
TORCH_2_7 = {
    "torch": "2.7.0",
    "cuda": "12.6",
    "nccl": "2.26.2",
    "nccl_compiled": "2.26.2",
    "driver": "560.28.03",
    "driver_cuda": "12.6",
    "nvcc_cuda": "12.6",
}
TORCH_2_11 = {"torch": "2.11.0", "cuda": "13.0", "nccl": "2.28.9", "nccl_compiled": "2.28.9"}
DOCKER_SHM = 64 * 1024**2  # Docker's default /dev/shm
RTX4090_PAIR = {
    "gpu_count": 2,
    "gpu_names": ["NVIDIA GeForce RTX 4090"] * 2,
    "compute_capabilities": ["8.9"] * 2,
    "nvlink": False,
    "peer_access": True,
}
V100 = {"gpu_count": 8, "gpu_names": ["Tesla V100-SXM2-32GB"] * 8, "compute_capabilities": ["7.0"] * 8}
PCIE_PAIR = {
    "gpu_count": 2,
    "gpu_names": ["NVIDIA RTX A6000"] * 2,
    "compute_capabilities": ["8.6"] * 2,
    "nvlink": False,
    "peer_access": True,
}

# rule id -> (hosts it must fire on, hosts it must not fire on). Each "must not" is the nearest sound neighbour:
# the fixed version, the other architecture, or the workaround variable set.
CASES: dict[str, tuple[list[dict], list[dict]]] = {
    "nccl-2.18.1-tree-ll128-corruption": (
        [host(TORCH_2_1, ib_active=True)],
        [
            host(**{**TORCH_2_1, "nccl": "2.18.3"}, ib_active=True),  # the fixed release
            host(TORCH_2_1, ib_active=True, env={"NCCL_PROTO": "^LL128"}),
            host(TORCH_2_1, ib_active=False),
        ],
    ),
    "nccl-2.18-internal-error": (
        [host(**{**TORCH_2_1, "nccl": "2.18.6"})],
        [host(**{**TORCH_2_1, "nccl": "2.18.6"}, env={"NCCL_DEBUG": "WARN"}), host(TORCH_2_2)],
    ),
    "nccl-2.18-2.19-usb-nic": (
        [
            host(TORCH_2_2, nic_names=["lo", "enx00e04c680001"]),
            host(TORCH_2_1, nic_names=["lo", "enx00e04c680001", "eth0"]),
        ],
        [
            host(TORCH_2_3, nic_names=["lo", "enx00e04c680001"]),  # fixed in NCCL 2.20
            host(TORCH_2_2, nic_names=["lo", "enx00e04c680001"], env={"NCCL_SOCKET_IFNAME": "eth0"}),
            host(TORCH_2_2, nic_names=["lo", "eth0"]),
        ],
    ),
    # `pin --torch 2.1.0 --cuda 12.1` only knows the wheel's pins: the rule must fire on those alone.
    "nccl-cudamemcpyasync-lt-2.18.6": (
        [{"torch": "2.1.0", "cuda": "12.1", "nccl": "2.18.1"}, host(TORCH_2_0)],
        [{"torch": "2.1.2", "cuda": "12.1", "nccl": "2.18.6"}, {"torch": "2.2.0", "cuda": "12.1", "nccl": "2.19.3"}],
    ),
    "nccl-2.19-cumem-alltoall-deadlock": (
        [host(TORCH_2_2)],
        [host(TORCH_2_2, env={"NCCL_CUMEM_ENABLE": "0"}), host(**{**TORCH_2_2, "nccl": "2.20.3"})],
    ),
    "nccl-cumem-cuda-graphs-oom": (
        [host(TORCH_2_6), host(TORCH_2_2)],
        [host(TORCH_2_6, env={"NCCL_CUMEM_ENABLE": "0"}), host(**{**TORCH_2_6, "nccl": "2.22.3"}), host(TORCH_2_1)],
    ),
    "torch-2.2-foreign-libnccl-undefined-symbol": (
        [host(**{**TORCH_2_2, "nccl": "2.18.6"})],  # pip nvidia-nccl-cu12 2.18 next to torch 2.2's 2.19.3
        [host(TORCH_2_2), host(**{**TORCH_2_1, "nccl": "2.18.6"})],
    ),
    "nccl-older-than-compiled": (
        [stack("2.8.0", "12.8", "2.27.3", nccl="2.26.2")],
        [stack("2.8.0", "12.8", "2.27.3"), stack("2.8.0", "12.8", "2.27.3", nccl="2.27.5")],
    ),
    "nccl-lt-2.17-cuda-launch-blocking-hang": (
        [host(TORCH_2_0, env={"CUDA_LAUNCH_BLOCKING": "1"})],
        [
            host(TORCH_2_0, env={"CUDA_LAUNCH_BLOCKING": "0"}),
            host(TORCH_2_0),
            host(**{**TORCH_2_0, "nccl": "2.17.1"}, env={"CUDA_LAUNCH_BLOCKING": "1"}),
        ],
    ),
    "nccl-cumem-host-container-numa": (
        [host(TORCH_2_7, in_container=True)],
        [
            host(TORCH_2_7, in_container=False),
            host(TORCH_2_7, in_container=True, env={"NCCL_CUMEM_HOST_ENABLE": "0"}),
            host(**{**TORCH_2_7, "driver_cuda": "12.4", "driver": "550.54.14"}, in_container=True),
            host(**{**TORCH_2_7, "nccl": "2.26.3"}, in_container=True),
        ],
    ),
    "torch-2.7.0-device-id-nonblocking-hang": (
        [host(TORCH_2_7)],
        [
            host(**{**TORCH_2_7, "torch": "2.7.1"}),
            host(TORCH_2_7, env={"TORCH_NCCL_USE_COMM_NONBLOCKING": "0"}),
            host(TORCH_2_7, gpu_count=0, gpu_names=[], compute_capabilities=[]),
        ],
    ),
    "nccl-2.28.9-2.29.2-aarch64-deadlock": (
        [host(TORCH_2_11, arch="aarch64"), stack("2.12.0", "13.0", "2.29.2", arch="aarch64")],
        [
            host(TORCH_2_11, arch="x86_64"),
            stack("2.12.1", "13.0", "2.29.7", arch="aarch64"),
            stack("2.12.0", "13.0", "2.29.3", arch="aarch64"),
        ],
    ),
    "nccl-2.29.7-multinode-ib-hang-uncertain": (
        [host(ib_active=True)],
        [
            host(ib_active=True, env={"NCCL_PXN_DISABLE": "1"}),
            stack("2.14.1", "13.0", "2.30.7", ib_active=True),
            host(ib_active=False),
        ],
    ),
    "pcie-acs-iommu-p2p-hang": (
        [host(PCIE_PAIR)],
        [
            host(**{**PCIE_PAIR, "nvlink": True}),
            host(PCIE_PAIR, env={"NCCL_P2P_DISABLE": "1"}),
            host(**{**PCIE_PAIR, "peer_access": False}),
            host(**{**PCIE_PAIR, "gpu_count": 1}),
        ],
    ),
    "deepspeed-torch-six": (
        [host(TORCH_2_0, deepspeed="0.8.1"), {"torch": "2.0.0+cu117", "deepspeed": "0.8.1"}],
        [host(TORCH_2_0, deepspeed="0.8.2"), {"torch": "1.13.1", "deepspeed": "0.8.1"}],
    ),
    "deepspeed-0.11.0-breaks-accelerate": (
        [host(TORCH_2_1, deepspeed="0.11.0", accelerate="0.23.0")],
        [
            host(TORCH_2_1, deepspeed="0.11.1", accelerate="0.23.0"),
            host(TORCH_2_1, deepspeed="0.11.0", accelerate=None),
        ],
    ),
    "torch-2.6-weights-only-zero-checkpoint": (
        [host(TORCH_2_6, deepspeed="0.16.4")],
        [host(**{**TORCH_2_6, "torch": "2.5.1"}, deepspeed="0.16.4"), host(deepspeed=None)],
    ),
    "deepspeed-jit-nvcc-cuda-major-mismatch": (
        [host(nvcc_cuda="12.4"), host(TORCH_2_6, nvcc_cuda="11.8")],
        [host(nvcc_cuda="13.1"), host(TORCH_2_6, nvcc_cuda="12.8"), host(nvcc_cuda="12.4", deepspeed=None)],
    ),
    "deepspeed-autotp-zero3-lt-0.19.4": (
        [host(deepspeed="0.19.3")],
        [host(deepspeed="0.19.4"), host(deepspeed="0.19.8")],
    ),
    "transformers-autotp-train-batch-size-auto": ([host()], [host(deepspeed=None)]),
    "deepspeed-stale-jit-build-lock": ([host()], [host(deepspeed=None), host(torch="2.14.1")]),
    # accelerate's check: more than one GPU whose name contains "RTX 40", driver below 550.40.07.
    "rtx40-driver-lt-550.40.07-p2p-ib": (
        [host(RTX4090_PAIR, driver="545.29.06", driver_cuda="12.3", cuda="12.1")],
        [
            host(RTX4090_PAIR, driver="550.40.07", driver_cuda="12.4", cuda="12.1"),
            host(**{**RTX4090_PAIR, "gpu_count": 1, "gpu_names": ["NVIDIA GeForce RTX 4090"]}, driver="545.29.06"),
            host(RTX4090_PAIR, driver="545.29.06", env={"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}),
            host(**{**RTX4090_PAIR, "gpu_names": ["NVIDIA GeForce RTX 3090"] * 2}, driver="545.29.06"),
        ],
    ),
    "driver-below-cuda13-floor": (
        [host(driver="575.51.03", driver_cuda="12.9")],  # the 12.9 toolkit's driver under a cu130 torch
        [host(driver="580.65.06"), host(TORCH_2_6, driver="575.51.03")],
    ),
    "driver-below-cuda12-floor": (
        [host(TORCH_2_6, driver="520.61.05", driver_cuda="11.8")],  # 11.8's driver
        [host(TORCH_2_6, driver="525.60.13", driver_cuda="12.0"), host(TORCH_2_0, driver="520.61.05")],
    ),
    "driver-below-cuda11-floor": (
        [host(**{**TORCH_2_0, "driver": "440.33.01", "driver_cuda": "10.2"})],
        [host(**{**TORCH_2_0, "driver": "450.80.02", "driver_cuda": "11.0"})],
    ),
    "driver-older-than-torch-cuda": (
        [stack("2.8.0", "12.8", "2.27.3", driver="550.54.14", driver_cuda="12.4")],
        [
            stack("2.8.0", "12.8", "2.27.3", driver="570.26", driver_cuda="12.8"),
            stack("2.8.0", "12.8", "2.27.3", driver="580.65.06", driver_cuda="13.0"),
        ],
    ),
    "cuda13-compute-capability-below-7.5": (
        [host(V100)],
        [
            host(V100, cuda="12.6", torch="2.9.0", nccl="2.27.5", nccl_compiled="2.27.5"),  # the cu126 build
            host(gpu_count=1, gpu_names=["Tesla T4"], compute_capabilities=["7.5"]),
        ],
    ),
    "shm-below-512mb": (
        [host(shm_bytes=DOCKER_SHM, in_container=True)],
        [
            host(shm_bytes=GIB, in_container=True),
            host(shm_bytes=512 * 1024**2),
            host(shm_bytes=DOCKER_SHM, env={"NCCL_SHM_DISABLE": "1"}),
            host(shm_bytes=DOCKER_SHM, gpu_count=1, gpu_names=["NVIDIA H100 80GB HBM3"], compute_capabilities=["9.0"]),
        ],
    ),
    "transformers-fp8-dequant-block-from-scale-grid": (
        [host(transformers="5.24.0"), host(transformers="5.25.0")],
        [host(transformers="5.23.0"), host(transformers="5.26.0")],
    ),
    "transformers5-accelerate-below-1.1.0": (
        [host(transformers="5.0.0", accelerate="1.0.1")],
        [host(transformers="5.0.0", accelerate="1.1.0"), host(transformers="4.46.3", accelerate="1.0.1")],
    ),
    "transformers5-deepspeed-below-0.9.3": (
        [host(transformers="5.0.0", deepspeed="0.9.2")],
        [host(transformers="5.0.0", deepspeed="0.9.3"), host(transformers="4.46.3", deepspeed="0.9.2")],
    ),
    "transformers-torch-below-2.6": (
        [host(transformers="5.24.0", torch="2.5.1")],
        [host(transformers="5.24.0", torch="2.6.0")],
    ),
    "transformers-python-below-3.11": (
        [host(transformers="5.25.0", python="3.10.14")],
        [host(transformers="5.25.0", python="3.11.0")],
    ),
    "accelerate-torch-below-2.6": (
        [host(accelerate="1.16.0", torch="2.5.1")],
        [host(accelerate="1.16.0", torch="2.6.0")],
    ),
    "accelerate-python-below-3.11": (
        [host(accelerate="1.16.0", python="3.10.14")],
        [host(accelerate="1.16.0", python="3.11.0")],
    ),
    "deepspeed-torch-below-2.0": (
        [host(deepspeed="0.19.8", torch="1.13.1")],
        [host(deepspeed="0.19.8", torch="2.0.0")],
    ),
    "torch-nccl-async-error-handling-off": (
        [host(env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})],
        [host(env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}), host(env={})],
    ),
    "nccl-debug-verbose-left-on": (
        [host(env={"NCCL_DEBUG": "INFO"}), host(env={"NCCL_DEBUG": "trace"})],
        [host(env={"NCCL_DEBUG": "WARN"}), host(env={"NCCL_DEBUG": "VERSION"})],
    ),
}


def fired(facts) -> set[str]:
    return {f.rule_id for f in evaluate(facts, RULES)}


def test_every_rule_has_hand_written_cases():
    ids = [r.id for r in RULES]
    missing = sorted(set(ids) - set(CASES))
    assert not missing, f"rules without a matching/non-matching host in CASES: {missing}"
    stale = sorted(set(CASES) - set(ids))
    assert not stale, f"CASES entries for rules no longer in known_issues.toml: {stale}"
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_fires_on_matching_host_only(rule_id):
    matching, non_matching = CASES[rule_id]
    assert matching and non_matching
    for facts in matching:
        assert rule_id in fired(facts), facts
    for facts in non_matching:
        assert rule_id not in fired(facts), facts


def test_workaround_variable_silences_its_rule():
    # Every rule naming variables in env_unset stops firing once any one of them is set on a host it fires on.
    checked = 0
    for rule in RULES:
        for cond in rule.conditions:
            if cond.name != "env_unset":
                continue
            facts = CASES[rule.id][0][0]
            assert rule.id in fired(facts)
            for var in cond.value:
                assert rule.id not in fired({**facts, "env": {**facts["env"], var: "0"}}), (rule.id, var)
                checked += 1
    assert checked >= 10


def test_healthy_pinned_host_has_no_error_or_warning():
    findings = evaluate(HEALTHY, RULES)
    assert {f.rule_id for f in findings} == HEALTHY_INFOS
    assert not_checkable(HEALTHY, RULES) == []  # every fact known: every rule decided


def test_every_rule_has_a_source_and_text():
    assert len(RULES) >= 30
    for rule in RULES:
        assert rule.source.strip() and rule.symptom.strip() and rule.fix.strip(), rule.id
        assert rule.severity in ("error", "warning", "info")


def test_ids_other_modules_rely_on():
    by_id = {r.id: r for r in RULES}
    memcpy = by_id["nccl-cudamemcpyasync-lt-2.18.6"]
    assert memcpy.severity == "error"
    assert [(c.name, c.value) for c in memcpy.conditions] == [("nccl", "<2.18.6")]
    six = by_id["deepspeed-torch-six"]
    assert six.severity == "error"
    assert {c.name for c in six.conditions} == {"deepspeed", "torch"}


def test_uncertain_row_is_at_most_a_warning_and_says_so():
    rule = {r.id: r for r in RULES}["nccl-2.29.7-multinode-ib-hang-uncertain"]
    assert rule.severity in ("warning", "info")
    assert "uncertain" in rule.symptom.lower()
    for r in RULES:
        if "uncertain" in (r.symptom + r.source).lower():
            assert r.severity != "error", r.id


def test_pin_of_torch_2_1_is_refused_and_the_pinned_stack_is_not():
    # What `pin` knows of a torch/CUDA pair: the wheel's pins from version-facts.md, nothing about the host.
    errors = [
        f.rule_id
        for f in evaluate({"torch": "2.1.0", "cuda": "12.1", "nccl": "2.18.1"}, RULES)
        if f.severity == "error"
    ]
    assert "nccl-cudamemcpyasync-lt-2.18.6" in errors
    for arch in ("x86_64", "aarch64"):
        pinned = {
            "torch": "2.13.0",
            "cuda": "13.0",
            "nccl": "2.29.7",
            "nccl_compiled": "2.29.7",
            "arch": arch,
            "python": "3.11.9",
            "deepspeed": "0.19.8",
            "transformers": "5.24.0",
            "accelerate": "1.16.0",
        }
        assert [f.rule_id for f in evaluate(pinned, RULES) if f.severity == "error"] == []


def _this_machine_versions() -> dict:
    import torch

    def dist(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    nccl = None
    if torch.version.cuda and torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return {
        "python": platform.python_version(),
        "torch": torch.__version__.split("+")[0],
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "nccl_compiled": nccl,
        "deepspeed": dist("deepspeed"),
        "transformers": dist("transformers"),
        "accelerate": dist("accelerate"),
        "datasets": dist("datasets"),
        "arch": platform.machine(),
    }


def test_this_machines_versions_fire_no_error():
    facts = _this_machine_versions()
    assert facts["deepspeed"] and facts["transformers"] and facts["accelerate"]
    errors = [f for f in evaluate(facts, RULES) if f.severity == "error"]
    assert errors == [], errors


def test_unknown_facts_are_not_checkable_not_matches():
    assert "nccl-cudamemcpyasync-lt-2.18.6" in not_checkable({}, RULES)
    assert evaluate({}, RULES) == []
    # an unreadable version is unknown, never a match
    assert "nccl-cudamemcpyasync-lt-2.18.6" in not_checkable({"nccl": "unavailable: no NVML"}, RULES)
    # one condition false decides it, whatever is unknown
    assert "deepspeed-torch-six" not in not_checkable({"torch": "1.13.1"}, RULES)
    assert "deepspeed-torch-six" in not_checkable({"torch": "2.1.0"}, RULES)


def test_findings_carry_evidence_and_come_errors_first():
    findings = evaluate(host(TORCH_2_1, env={"NCCL_DEBUG": "INFO"}), RULES)
    severities = [f.severity for f in findings]
    assert severities == sorted(severities, key=("error", "warning", "info").index)
    assert {"error", "info"} <= set(severities)
    memcpy = next(f for f in findings if f.rule_id == "nccl-cudamemcpyasync-lt-2.18.6")
    assert isinstance(memcpy, RuleFinding) and memcpy.source and memcpy.fix
    assert any("2.18.1" in line for line in memcpy.evidence)


def test_default_rules_are_the_packaged_file_and_ship_as_package_data():
    assert [r.id for r in load_rules()] == [r.id for r in RULES]
    path = REPO / "hf_dist_recipes" / "doctor" / "known_issues.toml"
    assert [r.id for r in load_rules(path)] == [r.id for r in RULES]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    shipped = pyproject["tool"]["setuptools"]["package-data"]["hf_dist_recipes.doctor"]
    assert "known_issues.toml" in shipped


def test_env_prefixes_match_what_the_probe_collects():
    from hf_dist_recipes.doctor import facts, probe

    assert tuple(rule_conditions.COLLECTED_ENV_PREFIXES) == tuple(probe.ENV_PREFIXES)
    assert set(rule_conditions.VERSION_FACTS) <= set(facts.RULE_FACT_KEYS)


GOOD = """
[[rule]]
id = "x-rule"
severity = "warning"
symptom = "s"
fix = "f"
source = "NVIDIA/nccl issue 1"
[rule.when]
nccl = "<2.18.6"
"""


def _load(tmp_path, text):
    path = tmp_path / "rules.toml"
    path.write_text(text)
    return load_rules(path)


def test_loader_accepts_a_minimal_rule(tmp_path):
    (rule,) = _load(tmp_path, GOOD)
    assert rule.id == "x-rule" and rule.check({"nccl": "2.18.1"}) is True


@pytest.mark.parametrize(
    "broken, message",
    [
        (GOOD.replace('source = "NVIDIA/nccl issue 1"\n', ""), "no source"),
        (GOOD.replace('"NVIDIA/nccl issue 1"', '"  "'), "no source"),
        (GOOD.replace('nccl = "<2.18.6"', 'ncl = "<2.18.6"'), "did you mean 'nccl'"),
        (GOOD.replace('nccl = "<2.18.6"', 'nccl = "less than 2.18"'), "not a packaging specifier"),
        (GOOD.replace('"warning"', '"fatal"'), "severity"),
        (GOOD + GOOD, "defined twice"),
        (GOOD.replace('id = "x-rule"', 'id = "X_Rule"'), "kebab-case"),
        (GOOD.replace('nccl = "<2.18.6"', 'env_unset = ["DS_SKIP_CUDA_CHECK"]'), "only collects"),
        (GOOD.replace('nccl = "<2.18.6"', 'gpu_name_matches = "RTX ("'), "invalid regular expression"),
        (GOOD.replace('nccl = "<2.18.6"', 'below = {nccl = "ncl_compiled"}'), "not a version fact"),
        (GOOD.replace('[rule.when]\nnccl = "<2.18.6"\n', ""), "no [rule.when]"),
        (GOOD.replace("severity", "sevrity"), "unknown key"),
        (GOOD.replace('nccl = "<2.18.6"', 'ib_active = "yes"'), "true or false"),
    ],
)
def test_loader_refuses_broken_rules(tmp_path, broken, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        _load(tmp_path, broken)
