"""`hf-dist-recipes pin`: files written, --json, a known-bad pair as one line with exit 1 (a problem found, as doctor
reports the same rule); an unknown pair and an unwritable output as one line with exit 2 (input it cannot use)."""

from __future__ import annotations

import json

from hf_dist_recipes.cli.main import main
from hf_dist_recipes.doctor.lock import read_lock


def test_pin_chosen_build_writes_lock_and_dockerfile_and_json(capsys, tmp_path):
    out = tmp_path / "pinned"
    assert main(["pin", "--output", str(out), "--torch", "2.13.0", "--cuda", "13.0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["lock"] == str(out / "requirements.lock") and data["dockerfile"] == str(out / "Dockerfile")
    # version-facts.md: 2.13.0 on CUDA 13.0 pins NCCL 2.29.7.
    assert (data["torch"], data["torch_build"], data["cuda"], data["nccl"]) == ("2.13.0", "cu130", "13.0", "2.29.7")
    assert data["index_url"] == "https://download.pytorch.org/whl/cu130"
    assert data["image"].startswith("nvidia/cuda:13.0.")
    assert read_lock(data["lock"]).packages["nvidia-nccl-cu13"] == "2.29.7"
    assert f"FROM {data['image']}" in (out / "Dockerfile").read_text()


def test_pin_this_environment_text(capsys, tmp_path):
    assert main(["pin", "--output", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert f"wrote {tmp_path / 'requirements.lock'}" in text and f"wrote {tmp_path / 'Dockerfile'}" in text


def test_known_bad_pair_is_one_line_naming_the_rule_exit_1(capsys, tmp_path):
    assert main(["pin", "--output", str(tmp_path / "pinned"), "--torch", "2.1.0", "--cuda", "12.1"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith("hf-dist-recipes pin: error: torch 2.1.0 cu121") and "nccl-cudamemcpyasync-lt-2.18.6" in err
    assert not (tmp_path / "pinned").exists()  # refused before anything is written


def test_unknown_pair_is_refused_exit_2(capsys, tmp_path):
    assert main(["pin", "--output", str(tmp_path), "--torch", "2.13.0", "--cuda", "11.8"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "its builds: 12.6 (cu126), 13.0 (cu130), 13.2 (cu132)" in err


def test_unwritable_output_is_one_line_exit_2(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a file where a folder must go: fails even for root
    assert main(["pin", "--output", str(blocker / "pinned")]) == 2
    err = capsys.readouterr().err
    # The check every writing command shares (user_values.writable_dir), before any version is resolved.
    assert err == (
        f"hf-dist-recipes pin: error: --output {blocker / 'pinned'}: {blocker} is a file, not a directory; "
        "e.g. --output pinned\n"
    )


def test_doctor_reads_the_lock_pin_wrote_and_names_a_drifted_package(capsys, tmp_path):
    import importlib.metadata

    assert main(["pin", "--output", str(tmp_path)]) == 0
    lock = tmp_path / "requirements.lock"
    capsys.readouterr()
    assert main(["doctor", "--lock", str(lock), "--json"]) in (0, 1)  # this host's own warnings aside
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    assert checks["lock"]["status"] == "ok"
    real = importlib.metadata.version("accelerate")
    lock.write_text(lock.read_text().replace(f"\naccelerate=={real}\n", "\naccelerate==0.0.1\n"))
    assert main(["doctor", "--lock", str(lock)]) == 1  # the doctor ran and found the drift
    assert f"accelerate: locked 0.0.1, installed {real}" in capsys.readouterr().out
