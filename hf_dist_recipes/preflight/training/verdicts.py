"""The rows of checks 5 and 6: pure functions of every rank's `RunFacts` (gathered, in rank order), so every rank
decides the same. What each row asks is in the package docstring (`hf_dist_recipes.preflight.training`)."""

from __future__ import annotations

import math

from hf_dist_recipes.core.layout import RankLayout
from hf_dist_recipes.preflight.result import ERROR, OK, WARNING, CheckResult
from hf_dist_recipes.preflight.training.facts import ExpectedSettings, RunFacts

TRAINING, FAILURE_PATHS = "training", "failure_paths"
SCHEDULE_RTOL = 1e-6
RESUME_LOSS_RTOL = 1e-4


def _failed(name: str, what: str, ranks: list[RunFacts], fix: str) -> CheckResult | None:
    bad = [i for i, r in enumerate(ranks) if r.error]
    if not bad:
        return None
    return CheckResult(
        name,
        ERROR,
        f"{what}: the run failed on rank(s) {', '.join(map(str, bad))}: {ranks[bad[0]].error}",
        fix,
        tuple(bad),
        {"errors": {str(i): ranks[i].error for i in bad}},
    )


def training_results(ranks: list[RunFacts], steps: int) -> list[CheckResult]:
    failed = _failed(
        TRAINING,
        "training",
        ranks,
        "the real job would fail the same way under this launch config: "
        "fix what the error names (the launch log has the traceback)",
    )
    if failed:
        return [failed]
    return [loss_result(ranks[0], steps), clip_result(ranks), schedule_result(ranks), agreement_result(ranks)]


def quarter_means(losses: list[float]) -> tuple[float, float]:
    """(mean of the first quarter, mean of the last quarter) of `losses`, each quarter at least one value."""
    q = max(1, len(losses) // 4)
    return sum(losses[:q]) / q, sum(losses[-q:]) / q


def loss_result(rank0: RunFacts, steps: int) -> CheckResult:
    losses = [rank0.loss[s] for s in sorted(rank0.loss)]
    data = {"losses": losses, "steps": steps}
    if len(losses) < 4 or not all(math.isfinite(x) for x in losses):
        bad = [s for s in sorted(rank0.loss) if not math.isfinite(rank0.loss[s])]
        return CheckResult(
            TRAINING,
            ERROR,
            f"loss: {len(losses)} losses logged over {steps} steps; non-finite at step(s) {bad}",
            "a loss that is NaN or Inf from the start points at precision or "
            "the model config: try bf16=False, a smaller learning rate, or the shipped CPU config",
            data=data,
        )
    first, last = quarter_means(losses)
    data.update(first_quarter=first, last_quarter=last, drop=first - last, relative_drop=(first - last) / first)
    detail = (
        f"loss: mean of the last quarter {last:.4f} < first quarter {first:.4f} "
        f"({100 * (first - last) / first:.1f}% lower over {steps} steps)"
    )
    if last < first:
        return CheckResult(TRAINING, OK, detail, data=data)
    return CheckResult(
        TRAINING,
        ERROR,
        detail.replace(" < ", " is not below "),
        "the model does not learn under this plan: compare with the shipped CPU config "
        "(accelerate_configs/cpu_zero3_2proc.yaml); check the learning rate and the optimizer in "
        "the DeepSpeed JSON",
        data=data,
    )


def clip_result(ranks: list[RunFacts]) -> CheckResult:
    expected = ranks[0].expected.clip
    # rank -> sorted clip values it applied (engine and ZeRO optimizer)
    seen = {i: sorted(set().union(*(s.clip_values() for s in r.steps.values()))) for i, r in enumerate(ranks)}
    norms = [n for n in ranks[0].grad_norm.values() if math.isfinite(n)]
    engaged = sum(n > expected for n in norms) if expected > 0 else 0
    data = {
        "expected": expected,
        "applied": {str(i): v for i, v in seen.items()},
        "pre_clip_norms": norms,
        "steps_above_clip": engaged,
        "source": "engine" if ranks[0].expected.deepspeed else "Trainer",
    }
    if expected <= 0:
        return CheckResult(
            TRAINING,
            ERROR,
            "clipping: off (gradient_clipping 0)",
            'set gradient_clipping to 1.0 (or "auto") in the DeepSpeed JSON',
            data=data,
        )
    odd = tuple(i for i, v in seen.items() if v != [expected])
    if odd:
        shown = "; ".join(f"rank {i}: {seen[i]}" for i in odd)
        return CheckResult(
            TRAINING,
            ERROR,
            f"clipping: the engine applies another value than {expected:g} ({shown})",
            'set gradient_clipping to "auto" in the DeepSpeed JSON so the engine uses max_grad_norm',
            odd,
            data,
        )
    return CheckResult(
        TRAINING,
        OK,
        f"clipping: the {data['source']} clips at {expected:g} on every rank; pre-clip "
        f"norm above it at {engaged} of {len(norms)} steps",
        data=data,
    )


def expected_learning_rates(expected: ExpectedSettings, applied: list[bool]) -> list[float]:
    """The learning rate of each step under the recipe's schedule, computed from the settings alone: step s applies
    the multiplier of the number of steps applied before it (the engine does not advance a skipped step)."""
    from hf_dist_recipes.schedules.warmup_cosine import WarmupCosineRestarts

    schedule = WarmupCosineRestarts(
        warmup_steps=expected.warmup_steps,
        total_steps=expected.total_steps,
        num_cycles=expected.num_cycles,
        min_lr_ratio=expected.min_lr_ratio,
        restart_warmup_steps=expected.restart_warmup_steps,
    )
    out, done = [], 0
    for ok in applied:
        out.append(expected.peak_lr * schedule.multiplier(done))
        done += bool(ok)
    return out


def schedule_result(ranks: list[RunFacts]) -> CheckResult:
    expected = ranks[0].expected
    steps = sorted(ranks[0].steps)
    seen = [ranks[0].steps[s].lr for s in steps]
    applied = [ranks[0].steps[s].applied is not False for s in steps]
    want = expected_learning_rates(expected, applied)
    data = {
        "learning_rates": seen,
        "expected": want,
        "warmup_steps": expected.warmup_steps,
        "num_cycles": expected.num_cycles,
        "min_lr_ratio": expected.min_lr_ratio,
    }
    bad = [
        s
        for s, got, exp in zip(steps, seen, want, strict=True)
        if not math.isclose(got, exp, rel_tol=SCHEDULE_RTOL, abs_tol=1e-12)
    ]
    data["mismatched_steps"] = bad
    if expected.scheduler_type != "cosine_with_restarts" and not bad:
        return CheckResult(
            TRAINING,
            WARNING,
            f"schedule: {expected.scheduler_type}, not the recipe's",
            "use lr_scheduler_type='cosine_with_restarts' (the default)",
            data=data,
        )
    if bad:
        s = bad[0]
        fix = (
            "remove the `scheduler` section from the DeepSpeed JSON: it replaces the recipe's schedule"
            if expected.ds_scheduler
            else "the engine does not follow RecipeTrainer.create_scheduler: check the DeepSpeed JSON and the versions "
            "(hf-dist-recipes doctor)"
        )
        return CheckResult(
            TRAINING,
            ERROR,
            f"schedule: step {s} applied lr {seen[steps.index(s)]:.6g}, the recipe's "
            f"warm-up + cosine with restarts gives {want[steps.index(s)]:.6g} ({len(bad)} of "
            f"{len(steps)} steps differ)",
            fix,
            data=data,
        )
    return CheckResult(
        TRAINING,
        OK,
        f"schedule: the {len(steps)} learning rates applied follow the recipe's warm-up "
        f"({expected.warmup_steps} step(s)) + cosine with {expected.num_cycles} cycle(s), "
        f"peak {expected.peak_lr:g}",
        data=data,
    )


def agreement_result(ranks: list[RunFacts]) -> CheckResult:
    mismatches = ranks[0].mismatches  # decided from gathered data: the same on every rank
    data = {
        "rank_check": ranks[0].rank_check,
        "mismatches": [
            {"step": m.step, "what": m.what, "ranks": list(m.ranks), "message": m.message} for m in mismatches
        ],
    }
    if not mismatches:
        weights = ranks[0].rank_check.get("rank_check/weights_ok")
        how = "weights as built" if weights == 1.0 else "weights (broadcast at build)"
        return CheckResult(
            TRAINING,
            OK,
            f"agreement: seeds, data order, {how}, and at every step the step and "
            "learning rate (and loss, batch, dropout inside TP groups) agree across the ranks",
            data=data,
        )
    odd = tuple(sorted({r for m in mismatches for r in m.ranks}))
    fixes = list(dict.fromkeys(m.fix for m in mismatches))
    more = f" (+{len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
    return CheckResult(TRAINING, ERROR, f"agreement: {mismatches[0].message}{more}", "; ".join(fixes), odd, data)


def _ranks_failed(what: str, problems: dict[int, list[str]], fix: str, data: dict) -> CheckResult:
    """A failure-path error naming each rank's `problems` (rank -> what is wrong there)."""
    shown = "; ".join(f"rank {i}: {', '.join(v)}" for i, v in problems.items())
    return CheckResult(FAILURE_PATHS, ERROR, f"{what}: {shown}", fix, tuple(problems), data)


def _nan_issues(r: RunFacts, step: int, bad_rank: int, group: list[int]) -> tuple[list[str], list[int], list | None]:
    """(what is wrong on rank `r` with the NaN at `step` on `bad_rank`, the steps it did not apply, the ranks its
    gradient-health report flagged at `step`: None when it did not report exactly that one skip)."""
    issues = []
    applied = [s for s in sorted(r.steps) if r.steps[s].applied is False]
    if applied != [step]:
        issues.append(f"steps not applied {applied}, expected [{step}]")
    before, at, after = (r.steps[s].weights if s in r.steps else None for s in (step - 1, step, step + 1))
    if before is None or at != before:
        issues.append(f"weights changed at step {step}")
    if after is None or after == at:
        issues.append(f"weights did not change at step {step + 1}")
    # Under TP the NaN also reaches the gradients of the bad rank's TP partners (TP's backward all-reduces
    # activation gradients inside the group): they may be flagged too, no rank outside the group.
    skip = r.skips[0] if len(r.skips) == 1 and r.skips[0].step == step else None
    flagged = list(skip.ranks) if skip else None
    if r.skipped_steps != 1 or flagged is None or bad_rank not in flagged or not set(flagged) <= set(group):
        shown = [[s.step, list(s.ranks)] for s in r.skips]
        issues.append(
            f"skip count {r.skipped_steps}, skipped at {shown} (expected step {step}, "
            f"rank {bad_rank}, only ranks of {group})"
        )
    reported = next((s for s in r.skips if s.step == step), None)
    if step not in r.events or reported is None or bad_rank not in reported.loss_ranks:
        issues.append(
            f"no nonfinite_event naming step {step} and the loss of rank {bad_rank} (got {r.events.get(step, '')!r})"
        )
    return issues, applied, flagged


def nan_result(ranks: list[RunFacts], step: int) -> CheckResult:
    failed = _failed(
        FAILURE_PATHS,
        "nan",
        ranks,
        "the non-finite skip must work under this config before a long "
        "run: see the error; nonfinite_policy='halt' stops with a checkpoint instead",
    )
    if failed:
        return failed
    world = len(ranks)
    bad_rank = world - 1
    group = RankLayout(world=world, tp=ranks[0].expected.tp).tp_group(bad_rank)
    problems: dict[int, list[str]] = {}
    per_rank = {}
    for i, r in enumerate(ranks):
        issues, applied, flagged = _nan_issues(r, step, bad_rank, group)
        if issues:
            problems[i] = issues
        per_rank[str(i)] = {
            "not_applied": applied,
            "skipped_steps": r.skipped_steps,
            "flagged_ranks": flagged,
            "event": r.events.get(step, ""),
        }
    data = {"step": step, "rank": bad_rank, "tp_group": group, "ranks": per_rank}
    if problems:
        return _ranks_failed(
            f"nan: a NaN loss on rank {bad_rank} at step {step} was not skipped cleanly",
            problems,
            "a non-finite step must be refused on every rank: check the "
            "DeepSpeed version (hf-dist-recipes doctor) and that nonfinite_policy is not 'off'",
            data,
        )
    return CheckResult(
        FAILURE_PATHS,
        OK,
        f"nan: a NaN loss on rank {bad_rank} at step {step} was skipped on all "
        f"{world} ranks (weights unchanged across it, 1 skip counted, the event names rank "
        f"{bad_rank})",
        data=data,
    )


def _resume_issues(a: RunFacts, b: RunFacts, step: int) -> list[str]:
    """What differs between the uninterrupted run `a` and the resumed run `b` at `step`, on one rank."""
    issues = []
    la, lb = a.loss.get(step), b.loss.get(step)
    if min(b.steps, default=None) != step:
        issues.append(f"the resumed run began at step {min(b.steps, default=None)}, not {step}")
    if la is None or lb is None or not math.isclose(la, lb, rel_tol=RESUME_LOSS_RTOL):
        issues.append(f"loss {lb} against {la}")
    if b.batches.get(step) != a.batches.get(step):
        issues.append("another batch")
    lr_a = a.steps[step].lr if step in a.steps else None
    lr_b = b.steps[step].lr if step in b.steps else None
    if lr_a is None or lr_b is None or not math.isclose(lr_a, lr_b, rel_tol=SCHEDULE_RTOL, abs_tol=1e-12):
        issues.append(f"learning rate {lr_b} against {lr_a}")
    return issues


def resume_result(main: list[RunFacts], resumed: list[RunFacts], save_at: int) -> CheckResult:
    failed = _failed(
        FAILURE_PATHS,
        "resume",
        resumed,
        "a job that cannot resume loses everything since its start at the first failure: see the error",
    )
    if failed:
        return failed
    step = save_at + 1
    problems: dict[int, list[str]] = {}
    per_rank = {}
    for i, (a, b) in enumerate(zip(main, resumed, strict=True)):
        issues = _resume_issues(a, b, step)
        if issues:
            problems[i] = issues
        per_rank[str(i)] = {
            "loss": b.loss.get(step),
            "uninterrupted_loss": a.loss.get(step),
            "lr": b.steps[step].lr if step in b.steps else None,
            "same_batch": b.batches.get(step) == a.batches.get(step),
        }
    data = {"saved_at": save_at, "step": step, "tolerance": RESUME_LOSS_RTOL, "ranks": per_rank}
    if problems:
        return _ranks_failed(
            f"resume: the run resumed from step {save_at} does not reproduce step {step}",
            problems,
            "under this launch config a restarted job would not continue "
            "where it stopped: the checkpoint does not restore the whole state (weights, optimizer, "
            "scheduler, data position, RNG); look in the launch log for missing or unexpected keys "
            "when the checkpoint was loaded",
            data,
        )
    diff = max(abs(v["loss"] - v["uninterrupted_loss"]) for v in per_rank.values())
    data["max_loss_difference"] = diff
    return CheckResult(
        FAILURE_PATHS,
        OK,
        f"resume: saved at step {save_at}, resumed, step {step} reproduced on every "
        f"rank (same batch and learning rate, loss difference {diff:.2g})",
        data=data,
    )
