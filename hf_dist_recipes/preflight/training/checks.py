"""`run_training_checks`: checks 5 and 6 on every rank of the running launch (the package docstring says what they
ask): the runs (`run.run_once`), every rank's facts gathered, the rows decided (`verdicts`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

from hf_dist_recipes.core.gather import gather_objects
from hf_dist_recipes.preflight.result import CheckResult
from hf_dist_recipes.preflight.training.facts import RunFacts
from hf_dist_recipes.preflight.training.verdicts import nan_result, resume_result, training_results

DEFAULT_STEPS = 20
MIN_STEPS = 8  # quarters of at least 2 steps, and a checkpoint in the middle
MAX_PARAMS = 50_000_000  # the runs build the model whole on every rank, on whatever device: tiny models only
OUTPUT_FOLDERS = ("training", "tensorboard", "failure_paths")

Progress = Callable[[str], None]


def run_training_checks(
    model_config,
    *,
    steps: int = DEFAULT_STEPS,
    output_dir: str | os.PathLike,
    seed: int | None = None,
    tp: int | None = None,
    on_progress: Progress | None = None,
    peer_timeout: float | None = None,
    step_timeout: float | None = None,
) -> list[CheckResult]:
    """Checks 5 and 6 on every rank of the running launch; the same list of results on every rank.

    `model_config`: a transformers config of a small causal LM (the preflight's tiny model of the user's family);
    `steps`: optimizer steps of the training run (default 20, at least MIN_STEPS); `output_dir`: where the runs
    write (see the package docstring); `seed`: this rank's seed (default: RecipeTrainingArguments' 42); a rank given
    another seed than the others is reported, not stopped. `tp`: the launch's TP degree, as the preflight read it
    from the launch config (None: from the DeepSpeed JSON the launcher handed the ranks). `on_progress`: called on
    every rank with one line per stage. A run that raises on every rank alike (a config the engine refuses) becomes
    an error row naming it. `peer_timeout`, `step_timeout` (seconds): the runs' hang bounds
    (`RecipeTrainingArguments` fields of the same names; default theirs, 120 s and 600 s): a rank that dies or
    hangs during a run ends every rank within them.
    """
    from hf_dist_recipes.preflight.training.run import count_params, run_once

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < MIN_STEPS:
        raise ValueError(f"steps must be a whole number >= {MIN_STEPS}, got {steps!r}; e.g. --steps {DEFAULT_STEPS}")
    params = count_params(model_config)
    if params > MAX_PARAMS:
        raise ValueError(
            f"the training checks build the model whole on every rank; {params:,} parameters is more "
            f"than {MAX_PARAMS:,}: give a tiny config of the same family (the preflight's default)"
        )
    say = on_progress or (lambda line: None)
    root = Path(output_dir)
    check_unused(root)
    save_at = steps // 2
    timeouts = {k: v for k, v in (("peer_timeout", peer_timeout), ("step_timeout", step_timeout)) if v is not None}

    # What the training run and the failure-paths run below share.
    run = functools.partial(run_once, model_config, steps=steps, seed=seed, tp=tp, timeouts=timeouts)
    say(f"training: {steps} steps with the launch's plan")
    main: list[RunFacts] = gather_objects(run(root / "training", logging_dir=root / "tensorboard", save_at=save_at))
    results = training_results(main, steps)
    nan_step = save_at + 2
    say(f"failure paths: resume from the checkpoint at step {save_at}, then a NaN on the last rank at step {nan_step}")
    if any(r.error for r in main):  # decided from gathered data: every rank skips it alike
        resumed = [RunFacts.failed("not run: the training run, which writes the checkpoint, failed")] * len(main)
    else:
        # One run for both failure paths: the resumed run's step save_at + 1 is compared with the uninterrupted
        # run's, then its step save_at + 2 gets the NaN (one engine build fewer: about 6 s on 2 CPU ranks).
        resume = root / "training" / f"checkpoint-{save_at}"
        resumed = gather_objects(
            run(root / "failure_paths", resume=resume, nan_step=nan_step, stop_after=nan_step + 1, digests=True)
        )
    results.append(resume_result(main, resumed, save_at))
    results.append(nan_result(resumed, nan_step))
    return results


def check_unused(root: Path) -> None:
    """ValueError on every rank when any rank finds the runs' folders already written (a run would refuse to mix
    its TensorBoard curves into an earlier launch's, or resume from another run's checkpoint). Decided from
    gathered data: on nodes with their own disks the ranks may see different files."""
    found = sorted(
        str(root / name) for name in OUTPUT_FOLDERS if (root / name).is_dir() and any((root / name).iterdir())
    )
    everywhere = sorted({path for paths in gather_objects(found) for path in paths})
    if everywhere:
        raise ValueError(
            f"{', '.join(everywhere)} already written by an earlier run; give the preflight a new "
            "--output-dir (it never deletes anything)"
        )
