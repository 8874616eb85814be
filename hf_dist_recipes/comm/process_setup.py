"""What creating the recipe's arguments applied to the process, and when: before or after the process group existed.

torch reads some settings once, when the first process group is created: the NCCL variables of
`comm.nccl_defaults` (ProcessGroupNCCL's constructor) and the flight recorder's buffer size (Gloo too: the recorder
is made with the first group; `tests/unit/test_process_setup.py` shows a value set after it is ignored). Others can
change later: every group's collective timeout (`_compat.torch.set_collective_timeout`), the CUDA allocator setting
(`environment.alloc_defaults` hands it to the running allocator).

Two routes reach the recipe's arguments (issue 30 section 1):
- `RecipeTrainingArguments` (or `Recipe<C>`): `apply_process_effects` sets the variables before the stock post-init
  creates the group, so torch reads them. The group's timeout is the one transformers gives it: `ddp_timeout` on
  GPU and DeepSpeed hosts, none (torch's 30 minutes) with `use_cpu` (`_compat.torch.collective_timeout` names the
  lines); `apply_startup_timeout` then sets `ddp_timeout` on every group, before the script loads its model.
- A script's own `TrainingArguments` (or `Seq2SeqTrainingArguments`, trl's configs), which RecipeTrainer upgrades:
  their post-init created the group already, with their own `ddp_timeout` (stock: 1800 s) and without the
  recipe's variables. What can change (the timeout) is changed when the recipe's arguments are made; what cannot
  (the variables torch read at the group's creation, and the timeout under which everything between the user's
  arguments and the trainer ran, such as loading the model) is named in one warning with the fix, and on NCCL is an
  error unless `allow_late_process_setup=True` (or `HF_DIST_RECIPES_ALLOW_LATE_PROCESS_SETUP=1`, for arguments
  that have no such field).

Each route records what it applied in this process's `ProcessRecord` (`current()`; `RecipeRuntime.process`): the
variables, one `ProcessSetting` each and one for the collective timeout (both routes compared:
tests/support/process_state.py), and the seeding: the process's facts, kept off the arguments the user pickles.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Literal

from hf_dist_recipes._compat import torch as compat_torch
from hf_dist_recipes.comm.nccl_defaults import ALIASES
from hf_dist_recipes.core.gather import distributed as group_exists
from hf_dist_recipes.core.gather import process_rank
from hf_dist_recipes.reproducibility.seeding import SeedReport

logger = logging.getLogger(__name__)

When = Literal["before_group", "after_group", "too_late"]
BEFORE_GROUP: When = "before_group"  # applied before the process group existed: read when it was created
AFTER_GROUP: When = "after_group"  # applied after it existed and in force: changed on the live groups, or read later
TOO_LATE: When = "too_late"  # set after the group was created, which had read it already: not in force for this run

COLLECTIVE_TIMEOUT = "collective_timeout_s"  # the name of the timeout's record
# Every variable `comm.nccl_defaults` sets: ProcessGroupNCCL reads them when it is built, the flight recorder (Gloo's
# too) when the first group is made.
READ_AT_GROUP_CREATION = frozenset(ALIASES)
ALLOW_LATE_ENV = "HF_DIST_RECIPES_ALLOW_LATE_PROCESS_SETUP"


@dataclass(frozen=True)
class ProcessSetting:
    """One setting the recipe's arguments applied to the process."""

    name: str  # an environment variable, or COLLECTIVE_TIMEOUT
    value: str
    when: When
    previous: str | None = None  # the value it replaced (the group's timeout until then); None: unset

    @property
    def late(self) -> bool:
        return self.when == TOO_LATE


@dataclass(frozen=True)
class ProcessRecord:
    """What the latest creation of the recipe's arguments did to this process (module docstring): `env_applied`,
    every environment variable it set (`nccl_env_applied`: those of `comm.nccl_defaults`); `settings`, each of them
    and the collective timeout with when, around the process group; `seed_report`, the seeding it did."""

    nccl_env_applied: dict[str, str] = field(default_factory=dict)
    env_applied: dict[str, str] = field(default_factory=dict)
    settings: tuple[ProcessSetting, ...] = ()
    seed_report: SeedReport | None = None


_record = ProcessRecord()


def current() -> ProcessRecord:
    """This process's record (empty before any recipe arguments were created)."""
    return _record


def record(*, fresh: bool = False, **facts) -> ProcessRecord:
    """Put `facts` (fields of `ProcessRecord`) into this process's record, a new one with `fresh`; returns it."""
    global _record
    _record = replace(ProcessRecord() if fresh else _record, **facts)
    return _record


def group_backend() -> str | None:
    """The default group's backend ("gloo", "nccl", "cpu:gloo,cuda:nccl"); None without a process group."""
    import torch.distributed as dist

    return str(dist.get_backend()) if group_exists() else None


def environment_settings(applied: dict[str, str], *, group_existed: bool) -> list[ProcessSetting]:
    """`applied` (variable -> value, what the arguments set) as records: before the group, or after it and so too late
    for a variable torch read at the group's creation."""
    return [
        ProcessSetting(
            name,
            value,
            BEFORE_GROUP if not group_existed else TOO_LATE if name in READ_AT_GROUP_CREATION else AFTER_GROUP,
        )
        for name, value in applied.items()
    ]


def apply_startup_timeout(seconds: float, *, group_existed: bool) -> ProcessSetting | None:
    """Make `seconds` the collective timeout of every process group (the start-up timeout: `ddp_timeout`); None
    without a process group. The record says BEFORE_GROUP when the group was created by these arguments with this
    timeout already, else AFTER_GROUP with the timeout it replaced."""
    if not group_exists():
        return None
    previous = compat_torch.collective_timeout()
    # Every group, not only the default one: a group made earlier by `new_group` (DeepSpeed's, in a second job of the
    # process) has a timeout of its own; reading first keeps the record true when nothing had to change.
    compat_torch.set_collective_timeout(seconds)
    when = BEFORE_GROUP if not group_existed and previous == seconds else AFTER_GROUP
    return ProcessSetting(COLLECTIVE_TIMEOUT, _number(seconds), when, None if previous is None else _number(previous))


def late_setup_message(settings: list[ProcessSetting], *, group_existed: bool, arguments: str) -> str | None:
    """What came after the process group and could not take effect, with the fix; None when nothing did.
    `arguments`: how to make the recipe's arguments instead (`RecipeTrainingArguments(...)`)."""
    late = [s for s in settings if s.late]
    timeout = next((s for s in settings if s.name == COLLECTIVE_TIMEOUT), None)
    short_start = (
        group_existed
        and timeout is not None
        and timeout.previous is not None
        and float(timeout.previous) < float(timeout.value)
    )
    if not late and not short_start:
        return None
    parts, others = [], []
    if late:
        exports = " ".join(f"{s.name}={s.value}" for s in late)
        parts.append(f"torch read {exports} when it created the group, so they are not in force for this run")
        others.append(f"export {exports} in the launch environment")
    if short_start:
        parts.append(
            f"the collective timeout was {timeout.previous} s until now, so whatever ran before (loading the model) "
            f"was bounded by {timeout.previous} s, not ddp_timeout={timeout.value} (in force from here on)"
        )
        others.append(
            f"give your arguments ddp_timeout={timeout.value} (transformers passes it to the group on GPU and "
            "DeepSpeed launches)"
        )
    return (
        "the process group existed before the recipe's arguments (a script's own TrainingArguments made it, which "
        f"RecipeTrainer then upgraded, or an Accelerator, or init_process_group): {'; '.join(parts)}. Fix: make "
        f"{arguments} first, before anything that creates the group and before loading the model (they apply "
        f"these before their post-init creates it), or {' and '.join(others)}"
    )


def check_late_setup(
    settings: list[ProcessSetting], *, group_existed: bool, arguments: str, backend: str | None, allow: bool
) -> None:
    """One warning (global rank 0) naming what came too late and the fix; on NCCL, where the late variables are
    its error handling and flight recorder, a ValueError on every rank unless `allow` or ALLOW_LATE_ENV is set."""
    message = late_setup_message(settings, group_existed=group_existed, arguments=arguments)
    if message is None:
        return
    allowed = allow or os.environ.get(ALLOW_LATE_ENV, "").lower() in ("1", "true", "yes")
    if backend is not None and "nccl" in backend and any(s.late for s in settings) and not allowed:
        raise ValueError(
            f"{message}; or accept torch's values: allow_late_process_setup=True (arguments without that field: "
            f"{ALLOW_LATE_ENV}=1)"
        )
    if process_rank() == 0:
        logger.warning(message)


def _number(seconds: float) -> str:
    return f"{seconds:g}"
