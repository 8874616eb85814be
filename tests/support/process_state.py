"""The process state of a recipe job when training begins, read from outside the recipe (issue 30 section 1): every
process group's collective timeout, read back from torch's Gloo backend as tests/unit/test_watchdog.py reads it,
the arguments' `ddp_timeout`, what the arguments say they applied and when (`comm.process_setup.current()`), and the
recipe's warnings while the arguments and the trainer were made.

A script's own `TrainingArguments` (the plain route: its post-init creates the process group before RecipeTrainer
upgrades them) and `RecipeTrainingArguments` (the recipe's post-init creates it) must end in the same state:
tests/distributed/test_other_trainers.py launches the first, tests/distributed/test_checkpoint_lifecycle.py the
second, and both check it here, against one expectation."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from hf_dist_recipes.comm.nccl_defaults import FLIGHT_RECORDER_ENV_DEFAULTS


def group_timeout_s(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def read_process_state(args) -> dict:
    """This rank's state now (JSON-ready)."""
    from torch.distributed import distributed_c10d

    groups = [g for g in distributed_c10d._world.pg_map if not distributed_c10d._rank_not_in_group(g)]
    from hf_dist_recipes.comm.process_setup import current

    record = current()
    return {
        "default_group_timeout_s": group_timeout_s(dist.group.WORLD),
        "group_timeouts_s": sorted(group_timeout_s(g) for g in groups),
        "ddp_timeout": args.ddp_timeout,
        "process_setup": [dataclasses.asdict(s) for s in record.settings] or None,
        "env_applied": dict(record.env_applied),
    }


class ProcessStateAtTrainBegin(TrainerCallback):
    """Reads `read_process_state` once, when the first `train()` begins (the engine and its groups exist then)."""

    def __init__(self):
        self.state: dict | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.state is None:
            self.state = read_process_state(args)


@contextlib.contextmanager
def recipe_warnings():
    """The messages of the warnings the recipe's loggers (`hf_dist_recipes.*`) emit inside the block."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    root = logging.getLogger("hf_dist_recipes")
    root.addHandler(handler)
    try:
        yield messages
    finally:
        root.removeHandler(handler)


def expected_settings(ddp_timeout: int) -> list[tuple[str, str]]:
    """What the recipe applies to a CPU/Gloo rank whose launch environment sets none of it: the flight recorder's
    buffer size under both of torch's names, and the start-up collective timeout."""
    return sorted([*FLIGHT_RECORDER_ENV_DEFAULTS.items(), ("collective_timeout_s", str(ddp_timeout))])


def check_process_state(state: dict, warnings: list[str], *, rank: int, group_before_arguments: bool) -> None:
    """One expectation for both routes: every group's timeout at train begin is the arguments' `ddp_timeout`, the
    same settings were applied, each recorded with when; `group_before_arguments` (the plain route) adds that the
    variables torch read at the group's creation came too late, named in one warning with the fix (rank 0's)."""
    ddp_timeout = state["ddp_timeout"]
    assert ddp_timeout == 7200, state  # the recipe's default in both routes (the plain one left 1800 untouched)
    assert state["default_group_timeout_s"] == ddp_timeout, state
    assert set(state["group_timeouts_s"]) == {ddp_timeout}, state
    setup = state["process_setup"]
    assert setup is not None, "the arguments recorded nothing they applied (comm.process_setup.current())"
    assert sorted((s["name"], s["value"]) for s in setup) == expected_settings(ddp_timeout), setup
    assert state["env_applied"] == dict(FLIGHT_RECORDER_ENV_DEFAULTS), state
    when = {s["name"]: s["when"] for s in setup}
    # transformers 5.24 passes no timeout to a use_cpu group (the recipe route) and the plain route's group has the
    # stock 1800 s: in both the recipe changes it on the existing groups
    assert when.pop("collective_timeout_s") == "after_group", setup
    assert set(when.values()) == {"too_late" if group_before_arguments else "before_group"}, setup
    late = [w for w in warnings if "TORCH_FR_BUFFER_SIZE" in w]
    if group_before_arguments and rank == 0:
        assert len(late) == 1, warnings
        assert "RecipeTrainingArguments" in late[0] and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in late[0], late[0]
        assert "1800" in late[0], late[0]  # the timeout the group had until the recipe's arguments
    else:
        assert late == [], warnings
