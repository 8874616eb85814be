"""Known-bad version and hardware combinations: `known_issues.toml` (package data), its loader and the evaluator.

Each rule in the data file is one table of the `rule` array:

    [[rule]]
    id = "nccl-cudamemcpyasync-lt-2.18.6"   # kebab-case, stable: the doctor and `pin` name rules by it
    severity = "error"                      # "error" | "warning" | "info"
    symptom = "..."
    fix = "..."
    source = "..."                          # required: a rule without a source does not load
    [rule.when]                             # conditions that must ALL hold
    nccl = "<2.18.6"

The conditions a `when` table may hold, and how each is tested, are in `rule_conditions.py` (an unknown name makes
the loader raise, so a typo never silently stops a rule). Severities are `core.findings.SEVERITIES`; the doctor
shows a finding at `RuleFinding.status` (an "info" rule as ok, with its fix).

The facts are the flat mapping of `facts.EnvironmentFacts.rule_facts()`; a value of None (or a missing key) means
unknown. Conditions are three-valued: a rule fires when every condition holds, does not apply when one is false, and
is "not checkable" (`not_checkable`) when none is false but one needs an unknown fact.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hf_dist_recipes.core.findings import SEVERITIES, Severity, Status, severity_rank, status_of_severity
from hf_dist_recipes.doctor.rule_conditions import Condition, all3, compile_condition

RULES_FILE = "known_issues.toml"
RULE_KEYS = ("id", "severity", "symptom", "fix", "source", "when")
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9.]*(-[a-z0-9.]+)*$")


@dataclass(frozen=True)
class Rule:
    """A known-bad combination. `conditions` must all hold for the rule to fire."""

    id: str
    severity: Severity
    symptom: str
    fix: str
    source: str
    conditions: tuple[Condition, ...]

    def check(self, facts: Mapping[str, object]) -> bool | None:
        """True: fires; False: does not apply; None: no condition is false but one needs an unknown fact."""
        return all3(c.test(facts) for c in self.conditions)


@dataclass(frozen=True)
class RuleFinding:
    """A rule that fired on the facts. `evidence`: one line per condition, the facts that matched it."""

    rule_id: str
    severity: Severity
    symptom: str
    fix: str
    source: str
    evidence: tuple[str, ...] = ()

    @property
    def status(self) -> Status:
        """The status the doctor shows it at (`core.findings.status_of_severity`)."""
        return status_of_severity(self.severity)


def _parse_rule(raw: object, index: int, seen: set[str]) -> Rule:
    if not isinstance(raw, dict):
        raise ValueError(f"known-issues rule #{index}: each [[rule]] must be a table")
    rule_id = raw.get("id")
    if not isinstance(rule_id, str) or not _ID_RE.match(rule_id):
        raise ValueError(
            f"known-issues rule #{index}: id {rule_id!r} must be kebab-case (lowercase letters, digits, "
            'dots, single dashes), e.g. "nccl-cudamemcpyasync-lt-2.18.6"'
        )
    if rule_id in seen:
        raise ValueError(f"known-issues rule {rule_id!r} is defined twice; ids must be unique")
    seen.add(rule_id)
    unknown = sorted(set(raw) - set(RULE_KEYS))
    if unknown:
        raise ValueError(
            f"known-issues rule {rule_id!r}: unknown key(s) {', '.join(unknown)}; "
            f"a rule has exactly {', '.join(RULE_KEYS)}"
        )
    for key in ("symptom", "fix", "source"):
        text = raw.get(key)
        if not isinstance(text, str) or not text.strip():
            # The source is what lets a user (and a reviewer) check the rule: no source, no rule.
            raise ValueError(
                f"known-issues rule {rule_id!r} has no {key}; every rule needs a non-empty {key} string"
                + (" naming where the fact comes from (release notes, issue, PR)" if key == "source" else "")
            )
    severity = raw.get("severity")
    if severity not in SEVERITIES:
        raise ValueError(f"known-issues rule {rule_id!r}: severity {severity!r} must be one of {', '.join(SEVERITIES)}")
    when = raw.get("when")
    if not isinstance(when, dict) or not when:
        # A rule without conditions would fire on every host.
        raise ValueError(f"known-issues rule {rule_id!r} has no [rule.when] conditions; add at least one")
    conditions = tuple(compile_condition(rule_id, name, value) for name, value in when.items())
    return Rule(rule_id, severity, raw["symptom"].strip(), raw["fix"].strip(), raw["source"].strip(), conditions)


def parse_rules(data: Mapping[str, object]) -> list[Rule]:
    """Rules from the parsed TOML mapping (its `rule` array), validated; ValueError names the rule and the fix."""
    extra = sorted(set(data) - {"rule"})
    if extra:
        raise ValueError(f"known-issues file: unknown top-level key(s) {', '.join(extra)}; only [[rule]] tables")
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list):
        raise ValueError("known-issues file: write rules as [[rule]] tables")
    seen: set[str] = set()
    return [_parse_rule(raw, i, seen) for i, raw in enumerate(raw_rules)]


@functools.lru_cache(maxsize=1)
def _packaged_rules() -> tuple[Rule, ...]:
    text = importlib.resources.files("hf_dist_recipes.doctor").joinpath(RULES_FILE).read_text(encoding="utf-8")
    return tuple(parse_rules(tomllib.loads(text)))


def load_rules(path: str | Path | None = None) -> list[Rule]:
    """The rules of `path`, or of the packaged `known_issues.toml` when None (read once per process)."""
    if path is None:
        return list(_packaged_rules())
    with open(path, "rb") as fh:
        try:
            data = tomllib.load(fh)
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"known-issues file {path}: not valid TOML ({err})") from None
    return parse_rules(data)


def evaluate(facts: Mapping[str, object], rules: Sequence[Rule] | None = None) -> list[RuleFinding]:
    """The rules that fire on `facts` (probe's `rule_facts()` mapping), errors first, then warnings, then infos;
    file order within a severity."""
    rules = load_rules() if rules is None else rules
    fired = [
        RuleFinding(r.id, r.severity, r.symptom, r.fix, r.source, tuple(c.evidence(facts) for c in r.conditions))
        for r in rules
        if r.check(facts) is True
    ]
    return sorted(fired, key=lambda f: -severity_rank(f.status))


def not_checkable(facts: Mapping[str, object], rules: Sequence[Rule] | None = None) -> list[str]:
    """Ids of the rules that might fire but need a fact that is unknown (None) here, in file order."""
    rules = load_rules() if rules is None else rules
    return [r.id for r in rules if r.check(facts) is None]
