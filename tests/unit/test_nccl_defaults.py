"""The NCCL defaults are applied only where no name of the same setting is set, under the names torch reads without
a deprecation warning (an older name set too made every rank warn: issue 30)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hf_dist_recipes.comm import process_setup
from hf_dist_recipes.comm.nccl_defaults import (
    ALIASES,
    FLIGHT_RECORDER_ENV_DEFAULTS,
    NCCL_ENV_DEFAULTS,
    apply_flight_recorder_env_defaults,
    apply_nccl_env_defaults,
    flight_recorder_prefix,
    nccl_env_defaults,
)

TORCH_HEADERS = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d"


# The NCCL process group nothing launched in this process, asked for by accelerate's PartialState: accelerate 1.16
# asks for its world size first ("rendezvous", on any host); 1.10-1.15 first refuse NCCL where torch has none (a CPU
# build; their message spells it "avaliable"). Either way it fails after the arguments applied their defaults,
# which is what these tests read.
NO_GROUP_HERE = r"rendezvous|backend nccl is not avaliable"


def test_empty_environment_gets_every_default_and_the_dump_dir(tmp_path):
    env: dict[str, str] = {}
    applied = apply_nccl_env_defaults(str(tmp_path), env)
    prefix = str(tmp_path / "flight_recorder" / "rank_")
    assert applied == env
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == prefix
    assert (tmp_path / "flight_recorder").is_dir()
    # Only the current names: torch 2.13 warns for an older one (Utils.hpp getCvar*, WARN_ENV_VAR_ONCE).
    assert not {"TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"} & set(env)


def test_user_values_and_old_names_are_kept(tmp_path):
    env = {
        "NCCL_ASYNC_ERROR_HANDLING": "1",  # old name: the user chose
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",  # recorder off, under the older of its two names
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/elsewhere/x_",
    }
    before = dict(env)
    applied = apply_nccl_env_defaults(str(tmp_path), env)
    assert set(applied) == {"TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ENABLE_MONITORING"}
    assert {k: env[k] for k in before} == before
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"):
        assert name not in env
    assert not (tmp_path / "flight_recorder").exists()


def test_everything_set_applies_nothing(tmp_path):
    env = {name: "x" for name in nccl_env_defaults(str(tmp_path))}
    assert apply_nccl_env_defaults(str(tmp_path), env) == {}


def test_static_dict_is_the_run_independent_part(tmp_path):
    assert set(nccl_env_defaults(str(tmp_path))) - set(NCCL_ENV_DEFAULTS) == {"TORCH_FR_DUMP_TEMP_FILE"}
    assert flight_recorder_prefix("rel").startswith(os.path.abspath("rel"))


def test_every_name_is_one_torch_reads():
    """Fails when torch renames a variable: each name must appear in the installed torch's c10d headers or its
    compiled library (the flight recorder's dump file names are only in the library)."""
    text = "".join(p.read_text(errors="ignore") for p in TORCH_HEADERS.glob("*.hpp"))
    libs = list((Path(torch.__file__).parent / "lib").glob("libtorch_cpu.so")) + list(
        (Path(torch.__file__).parent / "lib").glob("libtorch_cuda.so")
    )
    binary = b"".join(p.read_bytes() for p in libs)
    names = {alias for aliases in ALIASES.values() for alias in aliases}
    missing = [n for n in sorted(names) if n not in text and n.encode() not in binary]
    assert not missing, f"torch {torch.__version__} no longer reads {missing}"


def test_the_arguments_apply_them_on_a_gpu_host_and_keep_what_the_user_set(tmp_path, monkeypatch):
    # Fake: only the device count the backend policy reads is replaced (8, whatever this host has), so the arguments
    # take the NCCL path. The environment is real (os.environ, restored by monkeypatch).
    from hf_dist_recipes import RecipeTrainingArguments

    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "0")  # a rank a launcher started: NCCL is chosen only there
    for names in ALIASES.values():
        for name in names:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")  # the user's choice
    # bf16=False: transformers checks bf16 against the real device, not the faked GPUs. The arguments then go on to
    # accelerate's PartialState, which with the NCCL backend asks for the world size of a process group that nothing
    # launched in this process created (ValueError, on any host): that failure shows the defaults were in the
    # environment BEFORE the group was needed, which is when torch reads them.
    with pytest.raises(ValueError, match=NO_GROUP_HERE):
        RecipeTrainingArguments(output_dir=str(tmp_path), bf16=False)
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"  # kept
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == NCCL_ENV_DEFAULTS["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"].startswith(str(tmp_path))


def _cpu_host(monkeypatch, tmp_path) -> None:
    """Fake a CPU host in full: torch sees no GPU and the machine has none (no NVIDIA device files, no nvidia-smi).
    The device count alone is not a CPU host on a GPU machine: there the arguments stop at GPUs torch cannot see
    (environment.cuda_host) before any default is applied."""
    from hf_dist_recipes.environment import cuda_host

    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 0)
    (tmp_path / "dev").mkdir(exist_ok=True)
    monkeypatch.setattr(cuda_host, "DEV_DIR", str(tmp_path / "dev"))
    monkeypatch.setattr(cuda_host, "NVIDIA_SMI", str(tmp_path / "no-nvidia-smi"))


def test_a_cpu_host_gets_the_flight_recorder_only(tmp_path, monkeypatch):
    from hf_dist_recipes import RecipeTrainingArguments

    _cpu_host(monkeypatch, tmp_path)
    _unset(monkeypatch, ())
    RecipeTrainingArguments(output_dir=str(tmp_path))
    assert process_setup.current().nccl_env_applied == {}
    assert process_setup.current().env_applied == FLIGHT_RECORDER_ENV_DEFAULTS == {"TORCH_FR_BUFFER_SIZE": "2000"}
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ
    assert not (tmp_path / "flight_recorder").exists()  # Gloo writes no dump of its own: nothing to point at


def test_a_users_recorder_size_is_kept_on_gloo_under_either_name():
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        env = {name: "0"}
        assert apply_flight_recorder_env_defaults(env) == {} and env == {name: "0"}
    env: dict[str, str] = {}
    assert apply_flight_recorder_env_defaults(env) == env == FLIGHT_RECORDER_ENV_DEFAULTS


# --- PYTORCH_CUDA_ALLOC_CONF (environment.alloc_defaults): set beside the NCCL defaults, where CUDA is used ---


def _unset(monkeypatch, names) -> None:
    """Unset `names` so that monkeypatch removes at teardown what the code under test sets (delenv of an absent
    variable records nothing), the NCCL defaults the faked GPU host also gets included."""
    for name in (*names, *{alias for aliases in ALIASES.values() for alias in aliases}):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_alloc_conf_is_set_where_unset_and_handed_to_the_running_allocator():
    from hf_dist_recipes.environment.alloc_defaults import ALLOC_CONF_NAMES, apply_alloc_conf_default

    handed: list[str] = []
    env: dict[str, str] = {}
    assert apply_alloc_conf_default(env, apply=handed.append) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} and handed == ["expandable_segments:True"]
    for name in ALLOC_CONF_NAMES:  # any name torch reads the settings from: the user configured the allocator
        env = {name: "max_split_size_mb:512"}
        assert apply_alloc_conf_default(env, apply=handed.append) == {}
        assert env == {name: "max_split_size_mb:512"} and len(handed) == 1


def test_every_alloc_conf_name_is_one_torch_reads():
    """Fails when torch renames them: each name must be in the installed torch's allocator config header."""
    from hf_dist_recipes.environment.alloc_defaults import ALLOC_CONF_NAMES

    header = (Path(torch.__file__).parent / "include" / "c10" / "cuda" / "CUDAAllocatorConfig.h").read_text()
    assert [n for n in ALLOC_CONF_NAMES if f'"{n}"' not in header] == []


def test_the_arguments_set_expandable_segments_on_a_gpu_host_before_cuda(tmp_path, monkeypatch):
    # Fake: only the device count the arguments read is replaced (8, whatever this host has), so they take the CUDA
    # path. The environment and the allocator config are real: os.environ (restored by monkeypatch) and this
    # process's torch allocator settings, which a CPU build parses too (and ignores), reset before and after.
    from hf_dist_recipes import RecipeTrainingArguments
    from hf_dist_recipes._compat import torch as compat_torch
    from hf_dist_recipes.environment.alloc_defaults import ALLOC_CONF_NAMES

    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "0")  # a rank a launcher started: NCCL is chosen only there
    _unset(monkeypatch, ALLOC_CONF_NAMES)
    compat_torch.set_allocator_settings("expandable_segments:False")
    try:
        # As in the NCCL test above: the arguments then fail at the NCCL process group nothing launched here; the
        # allocator setting was applied before (and before anything read the GPUs' capability).
        with pytest.raises(ValueError, match=NO_GROUP_HERE):
            RecipeTrainingArguments(output_dir=str(tmp_path), bf16=False)
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        # the running process's allocator too (the settings it last parsed: torch 2.13's private getter)
        assert torch._C._accelerator_getAllocatorSettings() == "expandable_segments:True"
    finally:
        compat_torch.set_allocator_settings("expandable_segments:False")


def test_a_user_alloc_conf_is_kept_and_a_cpu_host_gets_none(tmp_path, monkeypatch):
    from hf_dist_recipes import RecipeTrainingArguments
    from hf_dist_recipes.environment.alloc_defaults import ALLOC_CONF_NAMES

    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 8)  # fake, as above
    monkeypatch.setenv("LOCAL_RANK", "0")  # a rank a launcher started: NCCL is chosen only there
    _unset(monkeypatch, ALLOC_CONF_NAMES)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:256")  # the user's, under torch's newer name
    with pytest.raises(ValueError, match=NO_GROUP_HERE):
        RecipeTrainingArguments(output_dir=str(tmp_path), bf16=False)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and os.environ["PYTORCH_ALLOC_CONF"] == "max_split_size_mb:256"
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.delenv("LOCAL_RANK")  # one process on its own again
    _cpu_host(monkeypatch, tmp_path)  # nothing set or listed
    RecipeTrainingArguments(output_dir=str(tmp_path))
    assert set(process_setup.current().env_applied) <= set(FLIGHT_RECORDER_ENV_DEFAULTS)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


_RECORDER_PROCESS = """
import sys, torch, torch.distributed as dist
from hf_dist_recipes.comm.nccl_defaults import apply_flight_recorder_env_defaults
print(apply_flight_recorder_env_defaults())
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
dist.all_reduce(torch.ones(1))  # the recorder reads its size here, at its first use
dist.destroy_process_group()
"""


@pytest.mark.parametrize("older_name_too", [False, True])
def test_the_recorder_default_draws_no_deprecation_warning_from_torch(tmp_path, older_name_too):
    """What every rank of `make demo` printed (issue 30): "Environment variable TORCH_NCCL_TRACE_BUFFER_SIZE is
    deprecated; use TORCH_FR_BUFFER_SIZE instead". A fresh process applies the Gloo default and runs a collective:
    torch says nothing. The control sets the older name as well, as the defaults did: torch warns, so the check
    sees the warning where it is."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not any(k in names for names in ALIASES.values())}
    if older_name_too:
        env["TORCH_NCCL_TRACE_BUFFER_SIZE"] = "2000"
    proc = subprocess.run(
        [sys.executable, "-W", "always", "-c", _RECORDER_PROCESS, str(tmp_path / "store")],
        env=dict(env, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    warned = "TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated" in proc.stdout + proc.stderr
    assert warned is older_name_too, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == ("{}" if older_name_too else "{'TORCH_FR_BUFFER_SIZE': '2000'}")
