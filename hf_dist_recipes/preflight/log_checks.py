"""Preflight check 7, logs: every rank's TensorBoard run was written, and `logs summarize` reads them.

Runs on rank 0 after the training checks, on `<logging_dir>/rank<N>` (RecipeTrainingArguments' `logging_dir`,
default `<output_dir>/tensorboard`). A rank without a run is an error (its metrics would be missing from the real
job's logs); the stragglers and divergences `monitoring.aggregate.summarize_logs` finds are warnings (on a 20-step
run on shared cores they are more likely noise than a slow node, but a real divergence is worth a look).
"""

from __future__ import annotations

import os

from hf_dist_recipes.preflight.result import ERROR, OK, WARNING, CheckResult

FIX_LOGS = (
    "check that every rank can write to the output directory (a shared filesystem, or a local one on each "
    "node) and that RecipeTrainingArguments.per_rank_tensorboard is on"
)


def logs_check(logging_dir: str | os.PathLike, world_size: int, *, tp: int = 1) -> list[CheckResult]:
    from hf_dist_recipes.logs.aggregate import summarize_logs
    from hf_dist_recipes.logs.events import find_rank_files

    try:
        rank_files = find_rank_files(logging_dir)
    except ValueError as err:
        return [CheckResult("logs", ERROR, f"no per-rank TensorBoard run could be read: {err}", fix=FIX_LOGS)]
    missing = [r for r in range(world_size) if r not in rank_files]
    out = []
    if missing:
        out.append(
            CheckResult(
                "logs",
                ERROR,
                f"no TensorBoard run from rank(s) {', '.join(map(str, missing))} under "
                f"{logging_dir} ({len(rank_files)} of {world_size} ranks wrote one)",
                fix=FIX_LOGS,
                ranks=tuple(missing),
            )
        )
    try:
        summary = summarize_logs(logging_dir, tp=tp if tp > 1 else None, workers=1)
    except Exception as err:  # a run that cannot be read is the finding
        return out + [
            CheckResult(
                "logs", ERROR, f"logs summarize could not read {logging_dir}: {type(err).__name__}: {err}", fix=FIX_LOGS
            )
        ]
    for s in summary.stragglers:
        out.append(
            CheckResult(
                "logs",
                WARNING,
                f"logs summarize flags rank {s.rank} ({s.host}) as a straggler: "
                f"{s.slower_by:.0%} slower than the median rank from step {s.from_step}",
                fix="look at that host's load and devices (hf-dist-recipes doctor there); on shared "
                "CPU cores a short run can show this without a slow node",
                ranks=(s.rank,),
            )
        )
    for d in summary.divergences:
        out.append(
            CheckResult(
                "logs",
                WARNING,
                f"logs summarize: {d.tag} differs across ranks {d.ranks} that must "
                f"agree (group {d.group}) from step {d.first_step}: {d.values}",
                fix="see the training check's cross-rank findings; the ranks' seeds, data order or "
                "learning-rate schedule differ",
                ranks=tuple(d.ranks),
            )
        )
    for w in summary.warnings:
        out.append(CheckResult("logs", WARNING, f"logs summarize: {w}", fix=FIX_LOGS))
    if not out:
        tags = len([t for t, s in summary.stats.items() if len(s.steps)])
        out.append(
            CheckResult(
                "logs",
                OK,
                f"all {world_size} ranks wrote a TensorBoard run under {logging_dir}; "
                f"logs summarize read {summary.files} file(s), {summary.records} record(s), {tags} tags "
                f"in {summary.seconds:.2f} s",
                data=summary.to_dict(),
            )
        )
    return out
