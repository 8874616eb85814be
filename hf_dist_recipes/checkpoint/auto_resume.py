"""Resume by itself: which checkpoint `train()` resumes from, given its `resume_from_checkpoint` and the arguments'
`auto_resume`, and the lines that say so.

- a path: that checkpoint, as given (an explicit choice always wins, complete or not);
- True (the stock "the last checkpoint of output_dir"): the newest complete one (`checkpoint.manifest`), each newer
  incomplete one named; when there is none, the stock Trainer's ValueError ("No valid checkpoint found in output
  directory (...)") with the fix added;
- None or False with `auto_resume`: the same, or a fresh start when there is none; without `auto_resume`: a fresh
  start, as the stock Trainer.

`auto_resume` defaults to off (a stock script keeps stock behaviour); `HF_DIST_RECIPES_AUTO_RESUME=1` in the job's
environment turns it on (the generated Slurm and torchrun scripts export it, unless the job sets it to 0).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hf_dist_recipes.checkpoint.manifest import newest_complete_checkpoint

AUTO_RESUME_ENV = "HF_DIST_RECIPES_AUTO_RESUME"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def resolve_auto_resume(value: bool, environ: dict[str, str] | None = None) -> bool:
    """`auto_resume`, turned on by `HF_DIST_RECIPES_AUTO_RESUME=1` (the job's environment overrides the script's
    default; `0` or unset leaves the argument as it is)."""
    raw = (os.environ if environ is None else environ).get(AUTO_RESUME_ENV, "").strip().lower()
    if raw not in _TRUE + _FALSE:
        raise ValueError(f"{AUTO_RESUME_ENV}={raw!r}: set it to 1 (resume from the newest complete checkpoint) or 0")
    return bool(value) or raw in _TRUE


@dataclass(frozen=True)
class ResumePlan:
    """What `train()` hands the stock Trainer (`checkpoint`: a path, or None for a fresh start) and the lines to
    log on rank 0 (each skipped checkpoint with its problems, then the decision; none for a stock call)."""

    checkpoint: str | None
    lines: list[str] = field(default_factory=list)


def plan_resume(
    resume_from_checkpoint: str | bool | None, auto_resume: bool, output_dir: str, rank: int = 0, world: int = 1
) -> ResumePlan:
    """The checkpoint `train(resume_from_checkpoint)` resumes from (module docstring). With world > 1, call it on every
    rank: each hashes its share of the candidate's files (`checkpoint.manifest.newest_complete_checkpoint`)."""
    if isinstance(resume_from_checkpoint, str | os.PathLike):
        return ResumePlan(os.fspath(resume_from_checkpoint))
    asked = resume_from_checkpoint is True
    if not asked and not auto_resume:
        return ResumePlan(None)
    choice = newest_complete_checkpoint(output_dir, rank, world)
    lines = [s.line() for s in choice.skipped]
    why = "resume_from_checkpoint=True" if asked else "auto_resume"
    if choice.checkpoint is not None:
        return ResumePlan(choice.checkpoint, [*lines, f"{why}: resuming from {choice.checkpoint}"])
    if asked:  # the stock Trainer's sentence first (a script may match it), then what the recipe found and the fix
        raise ValueError(
            f"No valid checkpoint found in output directory ({output_dir}): resume_from_checkpoint=True takes the "
            "newest complete checkpoint"
            + (f" ({'; '.join(lines)})" if lines else "")
            + "; pass a checkpoint's path to resume from it as it is, or train without resume_from_checkpoint"
        )
    return ResumePlan(None, [*lines, f"auto_resume: no complete checkpoint in {output_dir}, starting fresh"])
