"""Bad input: one line on stderr naming the problem, exit status 2, no traceback."""

import json
import os
import subprocess
import sys

import pytest

from hf_dist_recipes.cli.main import main
from tests.support.paths import REPO


def _run(capsys, argv):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_missing_config_file(capsys, tmp_path):
    code, _, err = _run(capsys, ["demo", "--dry-run", "--config-file", str(tmp_path / "missing.yaml")])
    assert code == 2
    assert err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err


def test_malformed_config_file(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed_type: DEEPSPEED\nnum_processes: [2\n")
    code, _, err = _run(capsys, ["demo", "--dry-run", "--config-file", str(bad)])
    assert code == 2 and "not valid YAML at line" in err and err.count("\n") == 1


def test_num_processes_disagrees_with_deepspeed_json(capsys, tmp_path):
    (tmp_path / "ds.json").write_text(
        json.dumps(
            {
                "zero_optimization": {"stage": 3},
                "train_batch_size": 64,
                "train_micro_batch_size_per_gpu": 8,
                "gradient_accumulation_steps": 1,
            }
        )
    )
    cfg = tmp_path / "acc.yaml"
    cfg.write_text(
        f"distributed_type: DEEPSPEED\nnum_processes: 2\nuse_cpu: true\n"
        f"deepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n"
    )
    code, _, err = _run(capsys, ["demo", "--dry-run", "--config-file", str(cfg)])
    assert code == 2 and "num_processes=2" in err and "train_batch_size=64" in err and err.count("\n") == 1


def test_gloo_forced_on_a_faked_cuda_host(capsys, monkeypatch):
    # Fake: no GPU here; only the device count that the backend policy reads is replaced.
    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 8)
    code, _, err = _run(capsys, ["demo", "--dry-run", "--backend", "gloo"])
    assert code == 2 and "Gloo was requested on a host with 8 CUDA GPU(s)" in err and err.count("\n") == 1


def test_cpu_config_on_a_faked_cuda_host_is_refused_too(capsys, monkeypatch):
    # use_cpu: true turns the run into Gloo: the same silent slowdown, through the config instead of a flag.
    # Fake: no GPU here; only the device count that the backend policy reads is replaced.
    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 2)
    code, _, err = _run(capsys, ["demo", "--dry-run", "--config-file", "accelerate_configs/cpu_zero3_2proc.yaml"])
    assert code == 2 and "Gloo" in err


def test_faked_cuda_host_picks_gpu_config_and_nccl(capsys, monkeypatch):
    # Fake: no GPU here; only the device count that the demo's choice reads is replaced.
    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 4)
    code, out, _ = _run(capsys, ["demo", "--dry-run", "--json"])
    plan = json.loads(out)
    assert code == 0
    assert plan["backend"] == "nccl" and plan["device"] == "cuda" and plan["num_processes"] == 4
    assert plan["config_file"].endswith("zero3_1node_8gpu.yaml")


def test_dry_run_on_this_host(capsys):
    """Per host, nothing faked: the CPU config with 2 Gloo processes without CUDA, else one NCCL process per GPU."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    code, out, _ = _run(capsys, ["demo", "--dry-run", "--json"])
    plan = json.loads(out)
    expected = ("nccl", gpus, "zero3_1node_8gpu.yaml") if gpus else ("gloo", 2, "cpu_zero3_2proc.yaml")
    assert code == 0 and (plan["backend"], plan["num_processes"]) == expected[:2]
    assert plan["command"][plan["command"].index("--config_file") + 1].endswith(expected[2])


def test_no_command_prints_help_and_exits_2(capsys):
    code, out, _ = _run(capsys, [])
    assert code == 2 and "demo" in out


def test_real_process_exit_code_and_no_traceback(tmp_path):
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-m", "hf_dist_recipes.cli.main", "demo", "--config-file", str(tmp_path / "nope.yaml")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"hf-dist-recipes demo: error: accelerate config {tmp_path / 'nope.yaml'} does not exist; "
        "pass an existing file as --config-file"
    ]


@pytest.mark.parametrize(
    ("argv", "given_as"),
    [(["config", "validate"], "FILE"), (["preflight", "--config-file"], "--config-file")],
)
def test_a_missing_config_is_named_as_the_command_was_given_it(capsys, tmp_path, argv, given_as):
    """Issue 42: `config validate` on a missing file suggested --config-file, a flag that command does not have."""
    import re

    from hf_dist_recipes.cli import conventions
    from hf_dist_recipes.cli.main import build_parser

    missing = str(tmp_path / "nope.yaml")
    code, _, err = _run(capsys, [*argv, missing])
    assert code == 2 and err.strip().endswith(f"pass an existing file as {given_as}"), err
    parser = dict(conventions.commands(build_parser()))[tuple(a for a in argv if not a.startswith("-"))]
    flags = {o for a in parser._actions for o in a.option_strings}
    assert set(re.findall(r"--[a-z][\w-]*", err)) <= flags, err


def test_checkpoint_export_of_a_missing_folder(capsys, tmp_path):
    code, out, err = _run(capsys, ["checkpoint", "export", str(tmp_path / "nope"), "--output", str(tmp_path / "o")])
    assert code == 2 and err.count("\n") == 1 and "no such directory" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_checkpoint_export_of_a_folder_without_deepspeed_files(capsys, tmp_path):
    code, _, err = _run(capsys, ["checkpoint", "export", str(tmp_path), "--output", str(tmp_path / "o")])
    assert code == 2 and "no DeepSpeed zero_pp_rank" in err and err.count("\n") == 1


@pytest.mark.parametrize("size", ["0", "-5GB", "five", "5TB"])
def test_checkpoint_export_bad_shard_size(capsys, tmp_path, size):
    code, _, err = _run(
        capsys, ["checkpoint", "export", str(tmp_path), "--output", str(tmp_path / "o"), f"--max-shard-size={size}"]
    )
    assert code == 2 and "--max-shard-size" in err and err.count("\n") == 1


def test_a_reader_that_goes_away_ends_the_command_quietly():
    # `hf-dist-recipes config list | head -0`: the pipe's reader is gone before the command writes. Without the
    # handler the interpreter prints a BrokenPipeError traceback at exit (seen with `logs hang ... | head`).
    read_end, write_end = os.pipe()
    os.close(read_end)
    done = subprocess.run(
        [sys.executable, "-m", "hf_dist_recipes.cli.main", "config", "list"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
    )
    os.close(write_end)
    assert done.returncode == 141 and done.stderr == "", done.stderr
