import os
import time

import pytest

from hf_dist_recipes import extensions
from hf_dist_recipes.extensions import check_no_stale_locks, stale_locks


def _lock(root, age_s):
    path = root / "py311_cpu" / "fused_adam" / "lock"
    path.parent.mkdir(parents=True)
    path.write_text("")
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_old_lock_without_a_build_is_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(extensions, "build_running", lambda: False)
    lock = _lock(tmp_path, 3600)
    assert stale_locks(tmp_path) == [lock]
    with pytest.raises(ValueError, match=f"rm {lock}"):
        check_no_stale_locks(tmp_path)


def test_fresh_lock_or_running_build_is_not_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(extensions, "build_running", lambda: False)
    _lock(tmp_path, 10)
    assert stale_locks(tmp_path) == []
    monkeypatch.setattr(extensions, "build_running", lambda: True)
    assert stale_locks(tmp_path, older_than_s=0) == []


def test_root_follows_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions.extensions_root() == tmp_path
    assert stale_locks() == []


def test_the_demo_refuses_to_launch_into_a_stale_lock(tmp_path, monkeypatch, capsys):
    from hf_dist_recipes.cli.main import main

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(extensions, "build_running", lambda: False)
    _lock(tmp_path, 3600)
    assert main(["demo", "--dry-run"]) == 2
    assert "stale DeepSpeed build lock" in capsys.readouterr().err
