"""The doctor: every check of an environment's facts, the known-issue rules that apply, and a lock's drift, as one
report with its exit code and JSON schema.

`run_checks(facts, lock=None)` returns a `DoctorReport` with, in order:
- the checks of `doctor_checks.py` (`FACT_CHECKS`: versions, torch sees the GPUs, driver, nccl, infiniband, nccl
  network, peer access, /dev/shm, debug variables, declared minimums, build locks, ninja);
- `known issues`: how many known-bad combinations (`doctor/rules.py`) were checked, which could not be;
  then one `rule <id>` check per finding, its status from the rule's severity (info shows as ok, with its fix),
  except a finding that restates a check above already as severe (COVERED_BY), named in that check's source;
- with a lock (`doctor/lock.py`), one `lock <package>` error per package whose installed version differs
  (and `lock python` when the interpreter differs), else one ok `lock` check.

`DoctorReport.exit_code(strict)`: 1 with an error, or with a warning under `strict`, else 0
(`core.findings.DOCTOR_EXIT` / `DOCTOR_STRICT_EXIT`). `REPORT_SCHEMA`, the JSON schema of `doctor --json`, is derived
from the dataclasses (`core.findings.json_schema`): the report, its checks and the probe's facts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import ClassVar

from hf_dist_recipes.core.findings import (
    DOCTOR_EXIT,
    DOCTOR_STRICT_EXIT,
    ExitCode,
    exit_code,
    json_schema,
    severity_rank,
    status_of_severity,
)
from hf_dist_recipes.doctor.doctor_checks import FACT_CHECKS, Check
from hf_dist_recipes.doctor.facts import EnvironmentFacts


@dataclass(frozen=True)
class DoctorReport:
    """The facts and every check on them, in `run_checks`'s order."""

    facts: EnvironmentFacts
    checks: tuple[Check, ...]
    json_extra: ClassVar[dict[str, object]] = {"exit_code": ExitCode}  # the key to_dict adds

    def exit_code(self, strict: bool = False) -> int:
        """2 when a check is an error; 1 when one is a warning and `strict`; else 0."""
        return exit_code((c.status for c in self.checks), DOCTOR_STRICT_EXIT if strict else DOCTOR_EXIT)

    def to_dict(self, strict: bool = False) -> dict:
        """{"facts": ..., "checks": [...], "exit_code": N}: the shape REPORT_SCHEMA describes."""
        return {
            "facts": self.facts.to_dict(),
            "checks": [asdict(c) for c in self.checks],
            "exit_code": self.exit_code(strict),
        }


def rule_checks(facts: EnvironmentFacts, evaluate: Callable | None = None) -> list[Check]:
    """One check per finding of the known-issues rules (`doctor.rules.evaluate` unless given). With the
    packaged rules, a first `known issues` check says how many were checked and which could not be for want of a
    fact (a GPU rule on a host without NVML), so a clean table is not read as "every rule passed"."""
    if evaluate is not None:
        return _finding_checks(evaluate(facts.rule_facts()))
    from hf_dist_recipes.doctor import rules

    rule_facts = facts.rule_facts()
    fired, unknown = rules.evaluate(rule_facts), rules.not_checkable(rule_facts)
    shown = ", ".join(unknown[:6]) + (", ..." if len(unknown) > 6 else "")
    summary = Check(
        "known issues",
        "ok",
        f"{len(rules.load_rules())} known-bad combinations checked, {len(fired)} "
        "apply" + (f"; {len(unknown)} not checkable here (a fact they need is unknown): {shown}" if unknown else ""),
        source="hf_dist_recipes/doctor/known_issues.toml",
    )
    return [summary, *_finding_checks(fired)]


def _finding_checks(findings) -> list[Check]:
    checks = []
    for f in findings:
        # The facts that matched each condition, so the user sees why the rule applies to this machine.
        evidence = "; ".join(getattr(f, "evidence", ()) or ())
        detail = f"{f.symptom} (because: {evidence})" if evidence else f.symptom
        checks.append(Check(f"rule {f.rule_id}", status_of_severity(f.severity), detail, f.fix, f.source))
    return checks


# Rules of known_issues.toml that restate one of the checks above. A finding of one is folded into that check
# (named in its source) when the check already says so at the same or a worse status; otherwise both are shown,
# so a rule whose conditions differ from the check's is never hidden.
COVERED_BY = {
    "driver-below-cuda13-floor": "driver",
    "driver-below-cuda12-floor": "driver",
    "driver-below-cuda11-floor": "driver",
    "nccl-older-than-compiled": "nccl",
    "deepspeed-stale-jit-build-lock": "build locks",
    "shm-below-512mb": "/dev/shm",
    "nccl-debug-verbose-left-on": "debug variables",
    **{
        rule: "declared minimums"
        for rule in (
            "transformers5-accelerate-below-1.1.0",
            "transformers5-deepspeed-below-0.9.3",
            "transformers-torch-below-2.6",
            "transformers-python-below-3.11",
            "accelerate-torch-below-2.6",
            "accelerate-python-below-3.11",
            "deepspeed-torch-below-2.0",
        )
    },
}


def fold_duplicates(checks: list[Check], rules: list[Check]) -> list[Check]:
    """`rules` without the findings that restate a check of `checks` already at least as severe (COVERED_BY);
    the folded rule's id is appended to that check's source. `checks` is updated in place."""
    by_name = {c.name: i for i, c in enumerate(checks)}
    kept = []
    for rule in rules:
        rule_id = rule.name.removeprefix("rule ")
        target = by_name.get(COVERED_BY.get(rule_id, ""))
        rank = severity_rank(checks[target].status) if target is not None else 0
        # The check flags it at least as loudly, or both are quiet (an info rule restating what the check measured).
        if target is not None and rank >= severity_rank(rule.status):
            checks[target] = replace(checks[target], source=f"{checks[target].source}; known_issues.toml {rule_id}")
        else:
            kept.append(rule)
    return kept


def lock_checks(
    lock, installed: Mapping[str, str] | None = None, drift: Callable | None = None, python: str | None = None
) -> list[Check]:
    """One error per package whose installed version differs from `lock` (`doctor.lock.lock_drift`, over
    `installed`, default `lock.installed_versions()`), and one when `python` differs from the lock's Python."""
    if drift is None or installed is None:
        from hf_dist_recipes.doctor import lock as lock_module

        drift = drift or lock_module.lock_drift
        installed = lock_module.installed_versions() if installed is None else installed
    where = getattr(lock, "path", None) or "the lock"
    checks = []
    locked_python = getattr(lock, "python", None)
    if locked_python and python and locked_python != python:
        checks.append(
            Check(
                "lock python",
                "error",
                f"python: locked {locked_python}, running {python}",
                f"run with Python {locked_python} (or write a new lock: hf-dist-recipes pin)",
                where,
            )
        )
    for d in drift(lock, installed):
        fix = f"pip install {d.package}=={d.locked}" if d.locked else f"pip uninstall {d.package} (not in the lock)"
        checks.append(
            Check(
                f"lock {d.package}",
                "error",
                f"{d.package}: locked {d.locked or 'nothing'}, installed {d.installed or 'nothing'}",
                fix,
                where,
            )
        )
    return checks or [Check("lock", "ok", f"the environment matches {where}", source=where)]


def run_checks(
    facts: EnvironmentFacts, lock=None, *, evaluate: Callable | None = None, installed: Mapping[str, str] | None = None
) -> DoctorReport:
    """Every check of the module docstring on `facts`; `lock` (a `doctor.lock.Lock`) adds the drift errors.
    `evaluate` / `installed` replace the rules and the installed distributions, for tests."""
    checks = [check(facts) for check in FACT_CHECKS]
    checks += fold_duplicates(checks, rule_checks(facts, evaluate))
    if lock is not None:
        checks += lock_checks(lock, installed, python=facts.python)
    return DoctorReport(facts, tuple(checks))


# JSON schema (draft 2020-12) of `hf-dist-recipes doctor --json`.
REPORT_SCHEMA: dict = json_schema(DoctorReport)
