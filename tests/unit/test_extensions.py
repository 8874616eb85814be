import getpass
import logging
import os
import stat
import time
from pathlib import Path

import pytest
import torch

from hf_dist_recipes.doctor import op_builds
from hf_dist_recipes.doctor.op_builds import check_no_stale_locks, stale_locks
from hf_dist_recipes.environment import extensions


@pytest.fixture(autouse=True)
def _a_lock_file_blocks(monkeypatch):
    """Fake: torch 2.13's build lock, a file that blocks while it exists, whatever torch is installed (torch 2.14's
    OS-level lock never goes stale; test_compat checks which one the installed torch has)."""
    monkeypatch.setattr(op_builds, "lock_file_blocks", lambda: True)


def _lock(root, age_s):
    path = root / "py311_cpu" / "fused_adam" / "lock"
    path.parent.mkdir(parents=True)
    path.write_text("")
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_old_lock_without_a_build_is_stale(tmp_path, monkeypatch):
    # Fake: the process scan's answer (no build runs); the real scan is tested with a stand-in compiler below.
    monkeypatch.setattr(op_builds, "build_running", lambda: False)
    lock = _lock(tmp_path, 3600)
    assert stale_locks(tmp_path) == [lock]
    with pytest.raises(ValueError, match=f"rm {lock}"):
        check_no_stale_locks(tmp_path)


def test_fresh_lock_or_running_build_is_not_stale(tmp_path, monkeypatch):
    # Fake: the process scan's answer (no build runs); the real scan is tested with a stand-in compiler below.
    monkeypatch.setattr(op_builds, "build_running", lambda: False)
    _lock(tmp_path, 10)
    assert stale_locks(tmp_path) == []
    monkeypatch.setattr(op_builds, "build_running", lambda: True)  # Fake: a build runs
    assert stale_locks(tmp_path, older_than_s=0) == []


def test_root_follows_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert op_builds.extensions_root() == tmp_path
    assert stale_locks() == []


def test_the_demo_refuses_to_launch_into_a_stale_lock(tmp_path, monkeypatch, capsys):
    from hf_dist_recipes.cli.main import main

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    # Fake: the process scan's answer (no build runs); the real scan is tested with a stand-in compiler below.
    monkeypatch.setattr(op_builds, "build_running", lambda: False)
    _lock(tmp_path, 3600)
    assert main(["demo", "--dry-run"]) == 2
    assert "stale DeepSpeed build lock" in capsys.readouterr().err


# Node-local build folder. TMPDIR points at tmp_path (a local disk on any host), so nothing lands in the real /tmp.


@pytest.fixture
def unset(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(extensions, "MOUNTS", str(tmp_path / "no-mounts-file"))  # fs types read per test below
    return tmp_path


def test_unset_dir_is_set_to_a_private_node_local_folder(unset):
    chosen = extensions.use_node_local_extensions_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(chosen)
    assert chosen.parent == unset / f"torch_extensions-{getpass.getuser()}"
    assert stat.S_IMODE(chosen.parent.stat().st_mode) == 0o700  # nobody else can put a library there
    assert torch.__version__.split("+")[0] in chosen.name
    assert op_builds.extensions_root() == chosen


def test_incompatible_builds_get_different_folders(unset, monkeypatch):
    # Fake: the torch build's CUDA version (one CPU wheel is installed here), to name the folders of three builds.
    monkeypatch.setattr(torch.version, "hip", None)
    names = set()
    for cuda in (None, "12.8", "13.0"):
        monkeypatch.setattr(torch.version, "cuda", cuda)
        names.add(extensions.node_local_extensions_dir().name)
    assert len(names) == 3 and any("cu130" in n for n in names) and any("cpu" in n for n in names)


def test_explicit_dir_is_kept(unset, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(unset / "mine"))
    assert extensions.use_node_local_extensions_dir() == unset / "mine"
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(unset / "mine")
    assert op_builds.extensions_root() == unset / "mine"
    assert not (unset / f"torch_extensions-{getpass.getuser()}").exists()


def test_stale_lock_check_looks_where_builds_now_go(unset, monkeypatch):
    # Fake: the process scan's answer (no build runs); the real scan is tested with a stand-in compiler below.
    monkeypatch.setattr(op_builds, "build_running", lambda: False)
    lock = _lock(extensions.node_local_extensions_dir(), 3600)
    assert stale_locks() == [lock]


def test_the_arguments_set_the_dir_before_deepspeed(unset):
    from hf_dist_recipes import RecipeTrainingArguments

    RecipeTrainingArguments(output_dir=str(unset / "out"))
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(extensions.node_local_extensions_dir())


def test_a_folder_others_can_write_is_refused(unset):
    parent = extensions.node_local_extensions_dir().parent
    parent.mkdir(mode=0o777)
    parent.chmod(0o777)
    with pytest.raises(ValueError, match="not a folder of this user alone.*set TORCH_EXTENSIONS_DIR"):
        extensions.use_node_local_extensions_dir()
    parent.rmdir()
    parent.symlink_to(unset / "elsewhere")
    with pytest.raises(ValueError, match="not a folder of this user alone"):
        extensions.use_node_local_extensions_dir()
    assert "TORCH_EXTENSIONS_DIR" not in os.environ


def test_network_or_noexec_tmpdir_is_passed_over(unset, monkeypatch, caplog):
    # A fake mount table: the real one of a cluster node cannot be made here.
    mounts = unset / "mounts"
    mounts.write_text(f"/dev/sda1 / ext4 rw,relatime 0 0\nfiler:/scratch {unset} nfs4 rw,relatime 0 0\n")
    monkeypatch.setattr(extensions, "MOUNTS", str(mounts))
    assert extensions.node_local_base() == Path("/tmp")
    mounts.write_text(
        f"/dev/sda1 / ext4 rw,relatime 0 0\ntmpfs /tmp tmpfs rw,nosuid,noexec 0 0\n"
        f"/dev/nvme0n1 {unset} xfs rw,noexec 0 0\n"
    )
    assert extensions.node_local_base() is None
    with caplog.at_level(logging.WARNING, logger=extensions.__name__):
        assert extensions.use_node_local_extensions_dir() is None
    assert "TORCH_EXTENSIONS_DIR" not in os.environ and "set TORCH_EXTENSIONS_DIR" in caplog.text


def test_launch_header_names_the_ops_of_the_plan(tmp_path):
    from hf_dist_recipes.planning.generate import jit_built_ops, launch_header_lines, write_configs
    from hf_dist_recipes.planning.plan import ParallelPlan

    assert jit_built_ops(ParallelPlan(device="cpu", offload_optimizer=True)) == ["cpu_adam", "deepspeed_shm_comm"]
    assert jit_built_ops(ParallelPlan()) == []
    # DS_PIN_MEMORY_BACKEND=native (the scripts' and the arguments' exact pinning) loads DeepSpeed's pin_memory op.
    assert jit_built_ops(ParallelPlan(offload_optimizer=True)) == ["cpu_adam", "pin_memory"]
    assert jit_built_ops(ParallelPlan(offload_params=True)) == ["pin_memory"]
    cpu_offload = " ".join(launch_header_lines(["cpu_adam", "deepspeed_shm_comm"]))
    gpu = " ".join(launch_header_lines())
    assert "cpu_adam" in cpu_offload and "deepspeed_shm_comm" in cpu_offload
    assert "cpu_adam" not in gpu and "once per node" in gpu and "TORCH_EXTENSIONS_DIR" in gpu
    lines = launch_header_lines(["cpu_adam", "deepspeed_shm_comm"])
    assert 1 <= len(lines) <= 3 and all(len("# " + line) <= 120 for line in lines)
    # In the files: a DeepSpeed plan's YAML carries the lines, another engine's does not.
    ds = write_configs(ParallelPlan(device="cpu", procs_per_node=2, offload_optimizer=True), tmp_path / "ds", name="ds")
    fsdp = write_configs(ParallelPlan(engine="fsdp2", tp=2, procs_per_node=2), tmp_path / "fsdp", name="fsdp")
    assert "JIT-builds its ops (cpu_adam, deepspeed_shm_comm)" in ds.yaml_file.read_text()
    assert "JIT-builds" not in fsdp.yaml_file.read_text()


def test_real_lock_and_real_process_scan_live_while_a_build_runs_stale_after(tmp_path):
    """No fake in the check: a real lock file, made the way torch's JIT build makes it (cpp_extension._jit_compile
    takes `FileBaton(<build dir>/lock)`), and the real process scan (psutil over every process of this machine).
    What stands in: the building compiler is /usr/bin/sleep copied as `ninja` (the kernel names a process after the
    file it executes, which is what the scan reads), and the lock's age of an hour is set with os.utime instead of
    waited for."""
    import shutil
    import subprocess

    from torch.utils.file_baton import FileBaton

    if op_builds.build_running():
        pytest.skip("a real compiler or ninja runs on this machine now: a lock cannot be seen going stale")
    build_dir = tmp_path / "py311_cpu" / "cpu_adam"
    build_dir.mkdir(parents=True)
    baton = FileBaton(str(build_dir / "lock"))
    assert baton.try_acquire()
    lock = build_dir / "lock"
    old = time.time() - 3600
    os.utime(lock, (old, old))
    ninja = tmp_path / "bin" / "ninja"
    ninja.parent.mkdir()
    shutil.copy2(shutil.which("sleep"), ninja)
    build = subprocess.Popen([str(ninja), "60"])
    try:
        assert op_builds.build_running()
        assert stale_locks(tmp_path) == []  # live: a build holds it
        check_no_stale_locks(tmp_path)
    finally:
        build.kill()
        build.wait(timeout=10)
    assert stale_locks(tmp_path) == [lock]  # the build is gone, the lock stayed: what a killed run leaves
    with pytest.raises(ValueError, match=f"rm {lock}"):
        check_no_stale_locks(tmp_path)
    baton.release()
    assert stale_locks(tmp_path) == []
