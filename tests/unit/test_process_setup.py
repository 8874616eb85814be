"""What the recipe's arguments apply to the process and when, around the process group (comm/process_setup.py):
the records, the start-up timeout on a real one-rank Gloo group, the warning (Gloo) or error (NCCL) for what came
too late, and the torch behaviour that makes a variable too late. Both routes on 2 real ranks:
tests/distributed/test_other_trainers.py (a script's own arguments) and test_checkpoint_lifecycle.py (ours)."""

from __future__ import annotations

import logging
import os
import subprocess
import textwrap
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from hf_dist_recipes._compat import torch as compat_torch
from hf_dist_recipes.comm import process_setup
from hf_dist_recipes.comm.nccl_defaults import ALIASES, FLIGHT_RECORDER_ENV_DEFAULTS
from hf_dist_recipes.comm.process_setup import (
    AFTER_GROUP,
    BEFORE_GROUP,
    COLLECTIVE_TIMEOUT,
    TOO_LATE,
    ProcessSetting,
    apply_startup_timeout,
    check_late_setup,
    current,
    environment_settings,
)
from tests.support.launch import launched_ranks_env, python_for


@pytest.fixture
def gloo_group(tmp_path):
    """A one-rank Gloo group created as accelerate's use_cpu path creates it: no timeout (torch's default)."""

    def make(timeout: timedelta | None = None):
        kwargs = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, **kwargs)

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def no_recorder_env(monkeypatch):
    """The flight recorder's variables unset; monkeypatch removes at teardown what the code under test sets."""
    for name in {alias for aliases in ALIASES.values() for alias in aliases}:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.delenv(process_setup.ALLOW_LATE_ENV, raising=False)


def test_variables_say_whether_the_group_read_them():
    applied = {"TORCH_FR_BUFFER_SIZE": "2000", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    before = environment_settings(applied, group_existed=False)
    assert [(s.name, s.when) for s in before] == [
        ("TORCH_FR_BUFFER_SIZE", BEFORE_GROUP),
        ("PYTORCH_CUDA_ALLOC_CONF", BEFORE_GROUP),
    ]
    after = environment_settings(applied, group_existed=True)
    # The allocator setting is handed to the running allocator (alloc_defaults): after the group, still in force.
    assert [(s.name, s.when, s.late) for s in after] == [
        ("TORCH_FR_BUFFER_SIZE", TOO_LATE, True),
        ("PYTORCH_CUDA_ALLOC_CONF", AFTER_GROUP, False),
    ]


def test_no_group_no_timeout_record():
    assert not dist.is_initialized()
    assert apply_startup_timeout(7200, group_existed=False) is None


def test_a_group_without_a_timeout_gets_ddp_timeout_on_every_group(gloo_group):
    gloo_group()  # as transformers 5.24 + accelerate 1.16 make a use_cpu group: torch's 30 minutes
    sub = dist.new_group([0])  # as DeepSpeed's groups: torch's default too
    assert compat_torch.collective_timeout() == 1800 and compat_torch.collective_timeout(sub) == 1800
    record = apply_startup_timeout(7200, group_existed=False)
    assert record == ProcessSetting(COLLECTIVE_TIMEOUT, "7200", AFTER_GROUP, previous="1800")
    assert compat_torch.collective_timeout() == compat_torch.collective_timeout(sub) == 7200
    dist.all_reduce(torch.ones(1))  # the group still works


def test_a_group_created_with_ddp_timeout_was_set_before(gloo_group):
    gloo_group(timedelta(seconds=7200))  # the GPU and DeepSpeed paths pass ddp_timeout to the group
    assert apply_startup_timeout(7200, group_existed=False) == ProcessSetting(
        COLLECTIVE_TIMEOUT, "7200", BEFORE_GROUP, previous="7200"
    )


LATE = [
    ProcessSetting("TORCH_FR_BUFFER_SIZE", "2000", TOO_LATE),
    ProcessSetting(COLLECTIVE_TIMEOUT, "7200", AFTER_GROUP, previous="1800"),
]


def test_gloo_warns_once_naming_what_came_late_and_the_fix(caplog, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    with caplog.at_level(logging.WARNING, logger="hf_dist_recipes"):
        check_late_setup(LATE, group_existed=True, arguments="Recipe(...)", backend="gloo", allow=False)
    (message,) = [r.getMessage() for r in caplog.records]
    assert "TORCH_FR_BUFFER_SIZE=2000" in message and "make Recipe(...) first" in message
    assert "bounded by 1800 s, not ddp_timeout=7200" in message and "export TORCH_FR_BUFFER_SIZE=2000" in message
    caplog.clear()
    monkeypatch.setenv("RANK", "1")  # the other ranks say nothing
    check_late_setup(LATE, group_existed=True, arguments="X", backend="gloo", allow=False)
    assert caplog.records == []


def test_nccl_stops_unless_allowed(caplog, monkeypatch):
    monkeypatch.delenv(process_setup.ALLOW_LATE_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="TORCH_FR_BUFFER_SIZE=2000.*allow_late_process_setup=True"):
        check_late_setup(LATE, group_existed=True, arguments="X", backend="nccl", allow=False)
    with caplog.at_level(logging.WARNING, logger="hf_dist_recipes"):
        check_late_setup(LATE, group_existed=True, arguments="X", backend="nccl", allow=True)
        monkeypatch.setenv(process_setup.ALLOW_LATE_ENV, "1")  # for arguments without the field
        check_late_setup(LATE, group_existed=True, arguments="X", backend="cpu:gloo,cuda:nccl", allow=False)
    assert len(caplog.records) == 2
    # Only the timeout's past (nothing torch read): a warning on NCCL too, the timeout holds from now on.
    monkeypatch.delenv(process_setup.ALLOW_LATE_ENV)
    check_late_setup(LATE[1:], group_existed=True, arguments="X", backend="nccl", allow=False)


def test_nothing_late_nothing_said(caplog):
    settled = [
        ProcessSetting("TORCH_FR_BUFFER_SIZE", "2000", BEFORE_GROUP),
        ProcessSetting(COLLECTIVE_TIMEOUT, "7200", AFTER_GROUP, previous="1800"),  # our own use_cpu group
    ]
    with caplog.at_level(logging.WARNING, logger="hf_dist_recipes"):
        check_late_setup(settled, group_existed=False, arguments="X", backend="nccl", allow=False)
    assert caplog.records == []


def test_recipe_arguments_made_after_the_group_fix_its_timeout_and_name_the_rest(
    gloo_group, no_recorder_env, tmp_path, caplog, monkeypatch
):
    """The plain route in one process: a group already there (a script's own arguments made it) when the
    recipe's arguments are made."""
    from hf_dist_recipes import RecipeTrainingArguments

    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 0)
    monkeypatch.setenv("RANK", "0")
    gloo_group()
    with caplog.at_level(logging.WARNING, logger="hf_dist_recipes"):
        args = RecipeTrainingArguments(output_dir=str(tmp_path))
    assert current().settings == (
        *(ProcessSetting(name, value, TOO_LATE) for name, value in FLIGHT_RECORDER_ENV_DEFAULTS.items()),
        ProcessSetting(COLLECTIVE_TIMEOUT, "7200", AFTER_GROUP, previous="1800"),
    )
    assert compat_torch.collective_timeout() == args.ddp_timeout == 7200
    (message,) = [r.getMessage() for r in caplog.records if "process group existed" in r.getMessage()]
    assert "TORCH_FR_BUFFER_SIZE=2000" in message and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in message  # current name


def test_recipe_arguments_without_a_group_apply_everything_before_it(no_recorder_env, tmp_path, monkeypatch):
    from hf_dist_recipes import RecipeTrainingArguments

    monkeypatch.setattr("hf_dist_recipes.comm.backend.cuda_device_count", lambda: 0)
    RecipeTrainingArguments(output_dir=str(tmp_path))
    assert current().settings == tuple(
        ProcessSetting(name, value, BEFORE_GROUP) for name, value in FLIGHT_RECORDER_ENV_DEFAULTS.items()
    )


def test_the_gloo_flight_recorder_reads_its_buffer_size_when_the_first_group_is_made(tmp_path):
    """Why the recorder's variables count as too late after the group, on Gloo too (torch 2.13): the CPU recorder is
    made with the first group and reads TORCH_FR_BUFFER_SIZE then; 0 set after it still records, 0 set before
    records nothing. A process of its own each: the recorder is one per process."""
    script = textwrap.dedent(
        """
        import os, pickle, sys
        import torch, torch.distributed as dist
        from torch._C import _distributed_c10d as c10d
        for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
            os.environ.pop(name, None)
        when = sys.argv[1]
        if when == "before":
            os.environ["TORCH_FR_BUFFER_SIZE"] = "0"
        dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
        if when == "after":
            os.environ["TORCH_FR_BUFFER_SIZE"] = "0"
        dist.all_reduce(torch.ones(1))
        print(len(pickle.loads(c10d._dump_fr_trace()).get("entries", [])))
        dist.destroy_process_group()
        """
    )
    (tmp_path / "recorder.py").write_text(script)
    # Forked warm in a session that launches (tests.support.launch.python_for): a fork of a server that imported torch
    # and made no group, so its recorder is made here too, as in a new interpreter.
    env = launched_ranks_env(os.environ)
    entries = {}
    for when in ("before", "after"):
        run = subprocess.run(
            [*python_for(env), str(tmp_path / "recorder.py"), when, str(tmp_path / f"store_{when}")],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        entries[when] = int(run.stdout.split()[-1])
    assert entries == {"before": 0, "after": 1}
