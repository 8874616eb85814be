"""Practice 6 in the arguments: the recipe's schedule type, and its settings given in `lr_scheduler_kwargs` moved
into the arguments' fields (`RecipeTrainingArguments.__post_init__` calls `schedule_kwargs_into_fields`)."""

from __future__ import annotations

import dataclasses

from transformers.trainer_utils import SchedulerType

from hf_dist_recipes._compat import transformers as compat_transformers
from hf_dist_recipes.schedules.warmup_cosine import (
    DEFAULT_NUM_CYCLES,
    SCHEDULE_KWARGS,
    validate_min_lr_ratio,
    validate_num_cycles,
    validate_restart_warmup_steps,
)

RECIPE_SCHEDULER = SchedulerType.COSINE_WITH_RESTARTS

# trl's trainers (SFT, DPO, GRPO, ...) fine-tune: the schedule's end is known, and a jump back to the peak in the
# middle of the data undoes part of what the first cycle learned (docs/practices/6-schedule.md). Under them the
# recipe's schedule is the warm-up and one cosine; hard restarts stay the default of pre-training runs.
FINE_TUNE_NUM_CYCLES = 1
FINE_TUNE_PACKAGES = ("trl",)


def default_num_cycles(arguments_class: type) -> int:
    """Cosine cycles of the recipe's schedule when `lr_scheduler_kwargs` names none: 1 where the user's arguments
    class (`Recipe<C>`'s `C`) comes from trl, else `DEFAULT_NUM_CYCLES` (3)."""
    base = getattr(arguments_class, "_recipe_base", arguments_class)
    fine_tune = base.__module__.split(".")[0] in FINE_TUNE_PACKAGES
    return FINE_TUNE_NUM_CYCLES if fine_tune else DEFAULT_NUM_CYCLES


class SchedulerKwargError(ValueError, TypeError):
    """A key of `lr_scheduler_kwargs` the schedule does not take, found when the arguments are built. The stock
    Trainer hands the kwargs to the schedule's function when it builds the scheduler, which raises Python's
    TypeError naming the key: the message starts with that sentence, then `fix`; the class is a TypeError too."""

    def __init__(self, fix: str, schedule: SchedulerType, key: str):
        name = compat_transformers.scheduler_function_name(schedule)
        super().__init__(f"{name}() got an unexpected keyword argument '{key}': {fix}")


def schedule_kwargs_into_fields(args) -> None:
    """`min_lr_ratio` and `restart_warmup_steps` given in `args.lr_scheduler_kwargs` move into the fields of the same
    names (`args`: a `RecipeTrainingArguments`, after the stock post-init parsed a JSON string).

    A plain `TrainingArguments` (upgraded by RecipeTrainer) can carry them only there. Moved, each value has one
    home that `create_scheduler` reads, and the stock `Trainer.create_scheduler`, which hands `lr_scheduler_kwargs`
    to transformers' `get_cosine_with_hard_restarts_schedule_with_warmup`, is not given keys it rejects (a TypeError
    when training starts). A field left at its default takes the kwargs' value; a field set to another value is an
    error: which one was meant cannot be told."""
    kwargs = dict(args.lr_scheduler_kwargs or {})
    ours = [name for name in kwargs if name in ("min_lr_ratio", "restart_warmup_steps")]
    if args.lr_scheduler_type != RECIPE_SCHEDULER:
        chosen = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)  # a SchedulerType by now
        if ours:
            raise SchedulerKwargError(
                f"lr_scheduler_kwargs {ours} only apply to lr_scheduler_type='{RECIPE_SCHEDULER.value}', not "
                f"'{chosen}'; remove them or use lr_scheduler_type='{RECIPE_SCHEDULER.value}'",
                args.lr_scheduler_type,
                ours[0],
            )
        if args.min_lr_ratio or args.restart_warmup_steps:
            raise ValueError(
                f"min_lr_ratio={args.min_lr_ratio} and restart_warmup_steps={args.restart_warmup_steps} only apply "
                f"to lr_scheduler_type='{RECIPE_SCHEDULER.value}', not '{chosen}'; leave them at 0 "
                "or use the recipe's schedule"
            )
        return
    unknown = [name for name in kwargs if name not in SCHEDULE_KWARGS]
    if unknown:
        raise SchedulerKwargError(
            f"lr_scheduler_kwargs has {', '.join(map(repr, unknown))}, which {RECIPE_SCHEDULER.value} does not "
            f"take; accepted keys: {', '.join(SCHEDULE_KWARGS)}",
            RECIPE_SCHEDULER,
            unknown[0],
        )
    validate_restart_warmup_steps(args.restart_warmup_steps)
    if "num_cycles" in kwargs:
        validate_num_cycles(kwargs["num_cycles"])
    validators = {"min_lr_ratio": validate_min_lr_ratio, "restart_warmup_steps": validate_restart_warmup_steps}
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    for name in ours:
        value = validators[name](kwargs.pop(name))
        current, default = getattr(args, name), defaults[name]
        if current != default and current != value:
            raise ValueError(
                f"{name} is given twice: {name}={current} and lr_scheduler_kwargs={{'{name}': {value}}}; "
                f"give it once, as {name}=... or in lr_scheduler_kwargs"
            )
        setattr(args, name, value)
    args.lr_scheduler_kwargs = kwargs
