"""The environment probe: recorded GPU hosts replayed through injected sources, and the real probe of this host.

Fakes: this machine has no NVIDIA GPU, driver, NVML, nvidia-smi or InfiniBand. NVML, torch.cuda, nvidia-smi, nvcc
and sysfs are replaced by recordings under tests/fixtures/env/ (see fake_env.py); `torch.version.cuda` is set to a
CUDA build's value where the recorded host has one. Everything else (Python, versions, /dev/shm) is real.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import sys
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "env"
sys.path.insert(0, str(FIXTURES))

import fake_env  # noqa: E402
from fake_env import FakeNvml, fake_host  # noqa: E402

from hf_dist_recipes.doctor.facts import RULE_FACT_KEYS  # noqa: E402
from hf_dist_recipes.doctor.probe import probe  # noqa: E402

# The flat keys helper B's rules read, written out from the brief (not from the module).
BRIEF_KEYS = [
    "python",
    "torch",
    "cuda",
    "nccl",
    "nccl_compiled",
    "deepspeed",
    "transformers",
    "accelerate",
    "datasets",
    "driver",
    "driver_cuda",
    "nvcc_cuda",
    "arch",
    "gpu_count",
    "gpu_names",
    "compute_capabilities",
    "nvlink",
    "peer_access",
    "ib_active",
    "nic_names",
    "shm_bytes",
    "in_container",
    "env",
]


@pytest.fixture
def cuda124(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # a torch cu124 wheel; this host's is a CPU build


def test_rule_fact_keys_are_the_briefs(tmp_path, cuda124):
    facts = fake_host(tmp_path, "nvml_h100x8.json")
    assert list(RULE_FACT_KEYS) == BRIEF_KEYS
    assert list(facts.rule_facts()) == BRIEF_KEYS


def test_h100_node_from_recorded_nvml(tmp_path, cuda124):
    facts = fake_host(
        tmp_path,
        "nvml_h100x8.json",
        packages={"nvidia-nccl-cu12": "2.21.5", "deepspeed": "0.16.4", "transformers": "4.50.0"},
    )
    rf = facts.rule_facts()
    assert rf["driver"] == "550.54.14" and facts.driver.source == "nvml"
    assert rf["driver_cuda"] == "12.4"  # NVML's 12040 = 1000 * 12 + 10 * 4
    assert rf["gpu_count"] == 8 and rf["gpu_names"] == ["NVIDIA H100 80GB HBM3"] * 8
    assert rf["compute_capabilities"] == ["9.0"] * 8
    assert facts.gpus[0].memory_bytes == 81559 * 2**20  # nvidia-smi's 81559 MiB
    assert [g.nvlinks_active for g in facts.gpus] == [18] * 8 and rf["nvlink"] is True
    assert rf["peer_access"] is True and len(facts.peer_access) == 8 * 7  # every ordered pair
    assert rf["cuda"] == "12.4" and rf["nccl_compiled"] == "2.21.5"
    assert rf["nccl"] == "2.21.5" and facts.nccl.installed_from == "nvidia-nccl-cu12 distribution"
    assert rf["deepspeed"] == "0.16.4" and rf["transformers"] == "4.50.0" and rf["accelerate"] is None
    assert facts.driver.nvml_unavailable is None and facts.torch.gpu_problem is None


def test_rtx4090_pair_has_no_nvlink_and_no_peer_access(tmp_path, cuda124):
    rf = fake_host(tmp_path, "nvml_rtx4090x2.json").rule_facts()
    assert rf["gpu_count"] == 2 and rf["compute_capabilities"] == ["8.9", "8.9"]
    assert rf["nvlink"] is False and rf["peer_access"] is False
    assert rf["driver"] == "535.104.05" and rf["driver_cuda"] == "12.2"


def test_installed_nccl_differs_from_compiled_and_extra_distributions_are_listed(tmp_path, cuda124):
    facts = fake_host(
        tmp_path, "nvml_h100x8.json", packages={"nvidia-nccl-cu12": "2.18.1", "nvidia-nccl-cu11": "2.14.3"}
    )
    assert facts.nccl.compiled == "2.21.5" and facts.nccl.installed == "2.18.1"
    assert facts.rule_facts()["nccl"] == "2.18.1"  # what is loaded wins over what was compiled
    assert facts.nccl.others == ("nvidia-nccl-cu11==2.14.3",)


def test_without_nccl_distribution_the_compiled_version_stands_in(tmp_path, cuda124):
    rf = fake_host(tmp_path, "nvml_h100x8.json").rule_facts()
    assert rf["nccl"] == "2.21.5" and rf["nccl_compiled"] == "2.21.5"


def test_nvml_failure_is_a_fact_and_nvidia_smi_gives_the_driver(tmp_path, cuda124):
    smi = fake_env.fake_nvidia_smi(tmp_path, driver="550.54.14")
    facts = fake_host(
        tmp_path, "nvml_h100x8.json", nvml=FakeNvml(init_error=fake_env.NVMLError("Driver Not Loaded")), nvidia_smi=smi
    )
    assert facts.driver.nvml_unavailable == "NVMLError: Driver Not Loaded"
    assert facts.driver.version == "550.54.14" and facts.driver.source == "nvidia-smi"
    assert facts.driver.cuda is None  # only NVML says which CUDA the driver runs
    rf = facts.rule_facts()
    assert rf["gpu_count"] == 8 and rf["nvlink"] is None  # GPUs from torch, links unknown without NVML


def test_torch_blind_on_a_gpu_host_keeps_nvmls_gpus_and_cuda_hosts_reason(tmp_path, monkeypatch):
    # A CPU-only torch wheel on the recorded 8 x H100 node: torch sees nothing, the host has 8 GPUs.
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    facts = fake_host(
        tmp_path,
        "nvml_h100x8.json",
        visible=0,
        dev_dir=fake_env.dev_dir(tmp_path, 8),
        nvidia_smi=fake_env.fake_nvidia_smi(tmp_path),
    )
    assert facts.torch.device_count == 0 and facts.torch.nccl_compiled is None
    assert "8 NVIDIA GPU(s)" in facts.torch.gpu_problem and "CPU-only build" in facts.torch.gpu_problem
    assert [g.source for g in facts.gpus] == ["nvml"] * 8 and facts.rule_facts()["gpu_count"] == 8


def test_infiniband_ports_from_sysfs(tmp_path):
    facts = probe(
        nvml=FakeNvml(init_error=RuntimeError("no driver")),
        sysfs_root=str(FIXTURES / "sysfs_ib"),
        nvidia_smi=str(tmp_path / "absent"),
        dev_dir=str(tmp_path),
        nvcc="",
        environ={},
    )
    ports = [(p.device, p.port, p.state, p.link_layer, p.active) for p in facts.ib_ports]
    assert ports == [("mlx5_0", 1, "ACTIVE", "InfiniBand", True), ("mlx5_1", 1, "DOWN", "Ethernet", False)]
    assert facts.rule_facts()["ib_active"] is True
    assert facts.rule_facts()["nic_names"] == ["eth0", "ib0", "lo"]
    down = probe(
        nvml=FakeNvml(init_error=RuntimeError("no driver")),
        sysfs_root=str(FIXTURES / "sysfs_ib_down"),
        nvidia_smi=str(tmp_path / "absent"),
        dev_dir=str(tmp_path),
        nvcc="",
        environ={},
    )
    assert [p.state for p in down.ib_ports] == ["DOWN"] and down.rule_facts()["ib_active"] is False


def test_shm_size_and_a_missing_shm(tmp_path):
    facts = probe(
        nvml=FakeNvml(init_error=RuntimeError("x")),
        dev_shm=str(tmp_path),
        sysfs_root=str(tmp_path),
        nvidia_smi=str(tmp_path / "absent"),
        dev_dir=str(tmp_path),
        nvcc="",
        environ={},
    )
    assert facts.shm_bytes == shutil.disk_usage(tmp_path).total and facts.shm_error is None
    gone = probe(
        nvml=FakeNvml(init_error=RuntimeError("x")),
        dev_shm=str(tmp_path / "nope"),
        sysfs_root=str(tmp_path),
        nvidia_smi=str(tmp_path / "absent"),
        dev_dir=str(tmp_path),
        nvcc="",
        environ={},
    )
    assert gone.shm_bytes is None and "No such file" in gone.shm_error


def test_nvcc_from_path_or_cuda_home_and_its_release(tmp_path):
    # A recorded CUDA 12.4 toolkit's `nvcc --version`; this machine's toolkit (if any) is left out of PATH.
    nvcc = fake_env.fake_nvcc(tmp_path)
    common = dict(
        nvml=FakeNvml(init_error=RuntimeError("x")),
        sysfs_root=str(tmp_path),
        nvidia_smi=str(tmp_path / "absent"),
        dev_dir=str(tmp_path),
    )
    on_path = probe(environ={"PATH": str(tmp_path / "bin")}, **common)
    assert on_path.nvcc == nvcc and on_path.rule_facts()["nvcc_cuda"] == "12.4"
    home = probe(environ={"PATH": str(tmp_path / "empty"), "CUDA_HOME": str(tmp_path)}, **common)
    assert home.nvcc == nvcc and home.nvcc_cuda == "12.4"
    none = probe(environ={"PATH": str(tmp_path / "empty")}, **common)
    assert none.nvcc is None and none.nvcc_cuda is None


def test_only_nccl_torch_cuda_variables_are_kept(tmp_path):
    env = {
        "NCCL_DEBUG": "INFO",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "HOME": "/root",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "XNCCL_X": "1",
    }
    facts = probe(
        nvml=FakeNvml(init_error=RuntimeError("x")),
        sysfs_root=str(tmp_path),
        nvcc="",
        environ=env,
        nvidia_smi=str(tmp_path / "absent"),
        dev_dir=str(tmp_path),
    )
    assert facts.rule_facts()["env"] == {
        "CUDA_VISIBLE_DEVICES": "0,1",
        "NCCL_DEBUG": "INFO",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    }


def test_container_markers(tmp_path):
    marker = tmp_path / ".dockerenv"
    common = dict(
        nvml=FakeNvml(init_error=RuntimeError("x")),
        sysfs_root=str(tmp_path),
        nvcc="",
        environ={},
        nvidia_smi=str(tmp_path / "absent"),
        dev_dir=str(tmp_path),
        container_markers=(str(marker),),
    )
    assert probe(**common).in_container is False
    marker.write_text("")
    assert probe(**common).in_container is True


def test_to_dict_is_json_and_carries_the_rule_facts(tmp_path, cuda124):
    facts = fake_host(tmp_path, "nvml_h100x8.json", sysfs=FIXTURES / "sysfs_ib")
    data = json.loads(json.dumps(facts.to_dict()))
    assert data["rule_facts"]["gpu_count"] == 8 and data["gpus"][3]["name"] == "NVIDIA H100 80GB HBM3"
    assert data["ib_ports"][0] == {"device": "mlx5_0", "port": 1, "state": "ACTIVE", "link_layer": "InfiniBand"}
    assert {"from": 0, "to": 1, "can_access": True} in data["peer_access"]


def test_real_probe_of_this_host():
    """No fakes: what this machine (or a GPU host running the suite) really has."""
    facts = probe()
    rf = facts.rule_facts()
    assert rf["python"] == platform.python_version() and rf["arch"] == platform.machine()
    assert rf["torch"] == torch.__version__.split("+")[0] and rf["cuda"] == torch.version.cuda
    for name in ("deepspeed", "transformers", "accelerate", "datasets"):
        assert rf[name] == importlib.metadata.version(name)
    assert facts.packages["hf-dist-recipes"] == importlib.metadata.version("hf-dist-recipes")
    assert rf["gpu_count"] == torch.cuda.device_count()
    assert rf["shm_bytes"] > 0
    assert rf["nic_names"] == sorted(os.listdir("/sys/class/net"))
    if not torch.cuda.is_available() and not os.path.exists("/dev/nvidia0"):  # this project's CPU machine
        assert rf["gpu_count"] == 0 and rf["driver"] is None and rf["peer_access"] is None
        assert facts.driver.nvml_unavailable  # why NVML could not be read, e.g. "NVMLError_LibraryNotFound: ..."


SITE = "/venv/lib/python3.11/site-packages"
MAPS = f"""7f2a1c000000-7f2a1c200000 r-xp 00000000 08:01 1234 {SITE}/torch/lib/libtorch_cuda.so
7f2a1e000000-7f2a1e100000 r--p 00000000 08:01 5678 {{nccl}}
7f2a1f000000-7f2a1f001000 rw-p 00000000 00:00 0
7ffd0000000-7ffd0021000 rw-p 00000000 00:00 0                          [stack]
"""


def test_loaded_nccl_from_proc_maps(tmp_path, cuda124):
    # /proc/self/maps of a CUDA torch process (recorded layout); ncclGetVersion is faked: no libnccl on this host.
    lib = f"{SITE}/nvidia/nccl/lib/libnccl.so.2"
    maps = tmp_path / "maps"
    maps.write_text(MAPS.format(nccl=lib))
    asked = []
    facts = fake_host(
        tmp_path,
        "nvml_h100x8.json",
        packages={"nvidia-nccl-cu12": "2.21.5"},
        proc_maps=str(maps),
        nccl_get_version=lambda path: asked.append(path) or 21806,
    )  # 2*10000 + 18*100 + 6
    assert asked == [lib]
    assert facts.nccl.loaded == "2.18.6" and facts.nccl.loaded_path == lib
    assert facts.rule_facts()["nccl"] == "2.18.6"  # loaded beats installed (2.21.5) and compiled (2.21.5)


def test_nccl_version_integers():
    from hf_dist_recipes.doctor.probe_nccl import nccl_version_from_int

    assert nccl_version_from_int(22105) == "2.21.5"  # NCCL_VERSION(2,21,5) = 2*10000 + 21*100 + 5 (>= 2.9)
    assert nccl_version_from_int(2804) == "2.8.4"  # before 2.9: 2*1000 + 8*100 + 4


def test_no_libnccl_mapped_in_this_cpu_process():
    from hf_dist_recipes.doctor.probe_nccl import loaded_nccl

    if torch.version.cuda is None:  # a CPU torch loads no NCCL
        assert loaded_nccl() == (None, None)
    assert loaded_nccl("/nonexistent/maps") == (None, None)


def test_a_gpu_torch_cannot_read_is_a_fact_not_a_crash(tmp_path, cuda124):
    # Faked: a GPU that fails at initialisation, as torch reports it (RuntimeError from the CUDA runtime).
    class Broken(fake_env.FakeTorchCuda):
        def get_device_properties(self, i):
            raise RuntimeError("CUDA error: uncorrectable ECC error encountered")

    facts = probe(
        nvml=FakeNvml(init_error=RuntimeError("x")),
        sysfs_root=str(tmp_path),
        nvcc="",
        environ={},
        nvidia_smi=str(tmp_path / "absent"),
        dev_dir=str(tmp_path),
        proc_maps=str(tmp_path / "none"),
        torch_cuda=Broken(fake_env.recording("nvml_h100x8.json")),
    )
    assert facts.torch.device_count == 8 and facts.gpus == ()
    assert "uncorrectable ECC error" in facts.torch.gpu_problem


def test_nvlinks_follow_cuda_visible_devices(tmp_path, cuda124):
    # torch sees GPUs 6 and 3 of the recorded 8 (CUDA_VISIBLE_DEVICES=6,3); NVML numbers all 8. Link counts are
    # made to differ per GPU so the mapping shows.
    rec = fake_env.recording("nvml_h100x8.json")
    for i, gpu in enumerate(rec["gpus"]):
        gpu["nvlinks"] = i
    facts = probe(
        nvml=FakeNvml(rec),
        torch_cuda=fake_env.FakeTorchCuda(rec, visible=2),
        sysfs_root=str(tmp_path),
        nvcc="",
        environ={"CUDA_VISIBLE_DEVICES": "6,3"},
        nvidia_smi=str(tmp_path / "absent"),
        dev_dir=str(tmp_path),
        proc_maps=str(tmp_path / "none"),
    )
    assert [g.nvlinks_active for g in facts.gpus] == [6, 3]
    uuids = probe(
        nvml=FakeNvml(rec),
        torch_cuda=fake_env.FakeTorchCuda(rec, visible=2),
        sysfs_root=str(tmp_path),
        nvcc="",
        environ={"CUDA_VISIBLE_DEVICES": "GPU-5f2c,GPU-0a9b"},
        nvidia_smi=str(tmp_path / "x"),
        dev_dir=str(tmp_path),
        proc_maps=str(tmp_path / "none"),
    )
    assert [g.nvlinks_active for g in uuids.gpus] == [None, None] and uuids.rule_facts()["nvlink"] is None


def test_network_interfaces_with_state_and_index_from_sysfs(tmp_path):
    facts = probe(
        nvml=FakeNvml(init_error=RuntimeError("no driver")),
        sysfs_root=str(FIXTURES / "sysfs_multi_nic"),
        nvidia_smi=str(tmp_path / "absent"),
        dev_dir=str(tmp_path),
        nvcc="",
        environ={},
    )
    got = [(n.name, n.operstate, n.ifindex) for n in facts.net_interfaces]
    assert got == [
        ("docker0", "up", 5),
        ("eno1", "up", 2),
        ("ens1f0", "up", 3),
        ("ens1f1", "down", 4),
        ("lo", "unknown", 1),
    ]
    assert [p.device for p in facts.ib_ports] == ["mlx5_0", "mlx5_1", "mlx5_10", "mlx5_2", "mlx5_3"]
    assert facts.to_dict()["net_interfaces"][1] == {"name": "eno1", "operstate": "up", "ifindex": 2}
