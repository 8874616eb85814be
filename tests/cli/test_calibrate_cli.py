"""`hf-dist-recipes calibrate` for real on this host (GPUs hidden): one run, shared by the assertions, measures CPU
Adam (2 processes at once, a small partition) and Gloo between 2 launched ranks (commbench's launch: the one launch
of this module), writes the profile, and that profile changes the estimate's terms by the formula of
planning/comm.py. Bad inputs exit 2 before anything is measured."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from hf_dist_recipes.cli.main import main
from hf_dist_recipes.planning.calibration import RATE_KINDS, read_profile
from hf_dist_recipes.planning.elements import rank_elements
from hf_dist_recipes.planning.models import introspect
from hf_dist_recipes.planning.plan import ParallelPlan
from tests.support.launch import launched_ranks_env, python_for
from tests.support.paths import REPO

PARTITION = 2_000_000


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("calibrate") / "profile.json"
    argv = ["--output", str(out), "--partition-params", str(PARTITION), "--processes", "2", "--steps", "3", "--json"]
    env = launched_ranks_env(os.environ)
    proc = subprocess.run(
        [*python_for(env), "-m", "hf_dist_recipes.cli.main", "calibrate", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # the cpu_adam op's first build is a minute or more on 2 cores
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, json.loads(proc.stdout), proc.stderr


@pytest.mark.distributed
def test_calibrate_measures_what_a_cpu_host_can_and_says_what_stays_assumed(calibrated):
    path, printed, progress = calibrated
    profile = read_profile(path)
    assert printed == json.loads(path.read_text())  # --json prints what it wrote
    assert profile.device == "cpu" and set(profile.rates) == set(RATE_KINDS)
    assert set(profile.measured()) == {"cpu_adam_params_per_s", "intra_node_gbps"}
    assert set(profile.assumed()) == {"pcie_gbps", "matmul_tflops", "inter_node_gbps"}
    assert "no CUDA device" in profile.rates["pcie_gbps"].how and "commbench" in profile.rates["inter_node_gbps"].how
    adam = profile.rates["cpu_adam_params_per_s"]
    assert adam.value > 1e6 and "2 process(es) at once" in adam.how and "gloo" in profile.rates["intra_node_gbps"].how
    assert profile.context["partition_params"] == PARTITION and profile.context["processes"] == 2
    assert profile.context["threads_per_process"] == 1  # OMP_NUM_THREADS=1 (conftest), what accelerate gives ranks
    assert set(profile.versions) == {"torch", "deepspeed", "hf-dist-recipes"} and profile.created
    assert "calibrate [" in progress and "CPU Adam:" in progress and "commbench [gloo]" in progress


@pytest.mark.distributed
def test_the_profile_changes_the_estimates_terms(calibrated, capsys):
    path, _, _ = calibrated
    profile = read_profile(path)
    argv = ["config", "estimate", "--model", "llama-3.1-8b", "--gpus-per-node", "2", "--offload-optimizer", "--json"]
    assert main(argv) == 0
    before = json.loads(capsys.readouterr().out)["estimates"][0]["step"]
    assert main([*argv, "--profile", str(path)]) == 0
    after = json.loads(capsys.readouterr().out)
    step = after["estimates"][0]["step"]
    # CPU Adam: the 2 ranks' optimizer partitions at the measured rate of the node (2 processes at once).
    partition = rank_elements(ParallelPlan(procs_per_node=2, offload_optimizer=True), introspect("llama-3.1-8b"))
    rate = profile.rates["cpu_adam_params_per_s"].value
    assert step["offload_parts"]["CPU Adam"] == pytest.approx(partition.optimizer * 2 / rate)
    assert before["offload_parts"]["CPU Adam"] == pytest.approx(partition.optimizer * 2 / 2e9)
    # ZeRO inside the node at Gloo's measured bus bandwidth instead of the preset's 360 GB/s; compute unchanged.
    intra = profile.rates["intra_node_gbps"].value
    zero_bytes = step["bytes_by_kind"]["intra"]["zero"]
    assert step["seconds_by_kind"]["zero"] == pytest.approx(zero_bytes / (intra * 1e9))
    assert step["compute_s"] == before["compute_s"] and step["offload_parts"]["gradient copies"] == pytest.approx(
        before["offload_parts"]["gradient copies"]
    )
    assert {f: s["source"] for f, s in after["rates"].items()} == {
        "cpu_adam_params_per_s": "profile",
        "pcie_gbps": "assumed",
        "intra_node_gbps": "profile",
        "inter_node_gbps": "assumed",
        "compute_efficiency": "assumed",
    }
    # Measured on CPU for a GPU plan: the estimate says the intra-node rate is Gloo's.
    assert any("Gloo between processes" in w for w in after["warnings"])


def test_bad_inputs_exit_2_before_measuring(capsys, tmp_path):
    assert main(["calibrate", "--output", str(tmp_path)]) == 2
    assert "is a directory; give a file name" in capsys.readouterr().err
    assert main(["calibrate", "--output", str(tmp_path / "p.json"), "--processes", "0"]) == 2
    assert "--processes must be a positive integer" in capsys.readouterr().err
    missing = tmp_path / "none.json"
    assert main(["calibrate", "--output", str(tmp_path / "p.json"), "--commbench", str(missing)]) == 2
    assert "commbench result" in capsys.readouterr().err and not (tmp_path / "p.json").exists()
