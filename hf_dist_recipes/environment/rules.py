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

Condition vocabulary of `when` (an unknown name makes the loader raise, so a typo never silently stops a rule):
- a version fact (`python`, `torch`, `cuda`, `nccl`, `nccl_compiled`, `deepspeed`, `transformers`, `accelerate`,
  `datasets`, `driver`, `driver_cuda`, `nvcc_cuda`) = a `packaging` specifier string: the fact is in it;
- `installed = ["deepspeed", ...]`: those version facts are present (here None means "not installed", not unknown);
- `below = {driver_cuda = "cuda"}`: the first fact's version is lower than the second's;
- `major_differs = ["nvcc_cuda", "cuda"]`: the two versions have different major numbers;
- `arch = "aarch64"`: `platform.machine()` equals it;
- `in_container`, `ib_active`, `nvlink`, `peer_access` = true | false: the boolean fact equals it;
- `gpu_count_min = 2`: at least that many GPUs;
- `gpu_name_matches = "RTX 40"`, `nic_name_matches = "^enx"`: a regular expression found (`re.search`) in the name of
  at least one GPU / network interface;
- `compute_capability = "<7.5"`: a specifier that at least one GPU's compute capability is in;
- `shm_bytes_below = 536870912`: /dev/shm is smaller than that many bytes;
- `env_set = {CUDA_LAUNCH_BLOCKING = "1"}`: each variable is set to exactly that value;
- `env_matches = {NCCL_DEBUG = "(?i)INFO|TRACE"}`: each variable is set and its value matches (`re.fullmatch`);
- `env_unset = ["NCCL_CUMEM_ENABLE"]`: none of them is set (how a rule stops firing once its workaround is applied).
  Variables must start with a prefix the probe collects (NCCL_, TORCH_, CUDA_): any other name is never in the facts,
  so the loader refuses it.

The facts are the flat mapping of `probe.EnvironmentFacts.rule_facts()`; a value of None (or a missing key) means
unknown. Conditions are three-valued: a rule fires when every condition holds, does not apply when one is false, and
is "not checkable" (`not_checkable`) when none is false but one needs an unknown fact.
"""

from __future__ import annotations

import difflib
import functools
import importlib.resources
import re
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

RULES_FILE = "known_issues.toml"
SEVERITIES = ("error", "warning", "info")  # also the order findings are returned in
VERSION_FACTS = (
    "python",
    "torch",
    "cuda",
    "nccl",
    "nccl_compiled",
    "deepspeed",
    "transformers",
    "accelerate",
    "datasets",
    "driver",
    "driver_cuda",
    "nvcc_cuda",
)
BOOL_FACTS = ("in_container", "ib_active", "nvlink", "peer_access")
# The environment variables probe.py collects (its ENV_PREFIXES); a condition on any other name could never see it.
COLLECTED_ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_")
RULE_KEYS = ("id", "severity", "symptom", "fix", "source", "when")
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9.]*(-[a-z0-9.]+)*$")


@dataclass(frozen=True)
class Condition:
    """One `when` entry: its name, the value as written in the file, and the compiled test. `test(facts)` returns
    True / False, or None when a fact it needs is unknown; `evidence(facts)` says what matched, for the finding."""

    name: str
    value: object
    test: Callable[[Mapping[str, object]], bool | None] = field(repr=False, compare=False)
    evidence: Callable[[Mapping[str, object]], str] = field(repr=False, compare=False)


@dataclass(frozen=True)
class Rule:
    """A known-bad combination. `conditions` must all hold for the rule to fire."""

    id: str
    severity: str
    symptom: str
    fix: str
    source: str
    conditions: tuple[Condition, ...]

    def check(self, facts: Mapping[str, object]) -> bool | None:
        """True: fires; False: does not apply; None: no condition is false but one needs an unknown fact."""
        results = [c.test(facts) for c in self.conditions]
        if any(r is False for r in results):
            return False
        if any(r is None for r in results):
            return None
        return True


@dataclass(frozen=True)
class Finding:
    """A rule that fired on the facts. `evidence`: one line per condition, the facts that matched it."""

    rule_id: str
    severity: str
    symptom: str
    fix: str
    source: str
    evidence: tuple[str, ...] = ()


def _version(facts: Mapping[str, object], key: str) -> Version | None:
    value = facts.get(key)
    if value is None:
        return None
    try:
        # Local tags ("2.13.0+cpu") say how it was built, not which release it is.
        return Version(str(value).split("+")[0])
    except InvalidVersion:
        return None  # an unreadable version is an unknown one, never a match


def _where(rule_id: str, name: str) -> str:
    return f"known-issues rule {rule_id!r}, condition {name!r}"


def _need(cond: bool, rule_id: str, name: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{_where(rule_id, name)}: {what}")


def _version_key(rule_id: str, name: str, key: object) -> str:
    _need(key in VERSION_FACTS, rule_id, name, f"{key!r} is not a version fact; use one of {', '.join(VERSION_FACTS)}")
    return str(key)


def _regex(rule_id: str, name: str, pattern: object) -> re.Pattern:
    _need(isinstance(pattern, str), rule_id, name, "write the regular expression as a string")
    try:
        return re.compile(str(pattern))
    except re.error as err:
        raise ValueError(f"{_where(rule_id, name)}: invalid regular expression {pattern!r} ({err})") from None


def _env_name(rule_id: str, name: str, var: object) -> str:
    _need(
        isinstance(var, str) and var.startswith(COLLECTED_ENV_PREFIXES),
        rule_id,
        name,
        f"{var!r}: the probe only collects variables starting with {', '.join(COLLECTED_ENV_PREFIXES)}, so a "
        "condition on any other name would never see it; drop the condition or extend probe.ENV_PREFIXES",
    )
    return str(var)


def _env(facts: Mapping[str, object]) -> Mapping[str, str] | None:
    env = facts.get("env")
    return env if isinstance(env, Mapping) else None


def _compile(rule_id: str, name: str, value: object) -> Condition:
    """Parse one `when` entry; ValueError names the rule, the condition and the fix."""
    if name in VERSION_FACTS:
        _need(isinstance(value, str), rule_id, name, 'write the version range as a specifier string, e.g. "<2.18.6"')
        try:
            spec = SpecifierSet(str(value))
        except InvalidSpecifier:
            raise ValueError(
                f'{_where(rule_id, name)}: {value!r} is not a packaging specifier (e.g. ">=2.19,<2.20")'
            ) from None

        def test(f, key=name, spec=spec):
            v = _version(f, key)
            # prereleases=True: a nightly "2.14.0.dev" torch is still a 2.14 for these ranges
            return None if v is None else spec.contains(v, prereleases=True)

        return Condition(name, value, test, lambda f, key=name, spec=spec: f"{key} {f.get(key)} ({spec})")

    if name == "installed":
        _need(isinstance(value, list) and value, rule_id, name, 'write a non-empty list, e.g. ["deepspeed"]')
        keys = [_version_key(rule_id, name, k) for k in value]
        return Condition(
            name,
            value,
            lambda f: all(f.get(k) is not None for k in keys),
            lambda f: ", ".join(f"{k} {f.get(k)}" for k in keys),
        )

    if name == "below":
        _need(isinstance(value, dict) and value, rule_id, name, 'write a table, e.g. {driver_cuda = "cuda"}')
        pairs = [(_version_key(rule_id, name, a), _version_key(rule_id, name, b)) for a, b in value.items()]

        def below(f):
            results = []
            for a, b in pairs:
                va, vb = _version(f, a), _version(f, b)
                results.append(None if va is None or vb is None else va < vb)
            return _all3(results)

        return Condition(name, value, below, lambda f: ", ".join(f"{a} {f.get(a)} < {b} {f.get(b)}" for a, b in pairs))

    if name == "major_differs":
        _need(
            isinstance(value, list) and len(value) == 2,
            rule_id,
            name,
            'write two version facts, e.g. ["nvcc_cuda", "cuda"]',
        )
        a, b = (_version_key(rule_id, name, k) for k in value)

        def majors(f):
            va, vb = _version(f, a), _version(f, b)
            return None if va is None or vb is None else va.major != vb.major

        return Condition(name, value, majors, lambda f: f"{a} {f.get(a)} vs {b} {f.get(b)}")

    if name == "arch":
        _need(isinstance(value, str), rule_id, name, 'write the machine name as a string, e.g. "aarch64"')
        return Condition(
            name,
            value,
            lambda f: None if f.get("arch") is None else f.get("arch") == value,
            lambda f: f"arch {f.get('arch')}",
        )

    if name in BOOL_FACTS:
        _need(isinstance(value, bool), rule_id, name, "write true or false")
        return Condition(
            name,
            value,
            lambda f, key=name: None if f.get(key) is None else bool(f.get(key)) is value,
            lambda f, key=name: f"{key} {f.get(key)}",
        )

    if name in ("gpu_count_min", "shm_bytes_below"):
        _need(
            isinstance(value, int) and not isinstance(value, bool) and value >= 0,
            rule_id,
            name,
            "write a non-negative integer",
        )
        key = "gpu_count" if name == "gpu_count_min" else "shm_bytes"

        def number(f, key=key):
            n = f.get(key)
            if n is None:
                return None
            return n >= value if key == "gpu_count" else n < value

        return Condition(name, value, number, lambda f, key=key: f"{key} {f.get(key)}")

    if name in ("gpu_name_matches", "nic_name_matches"):
        pattern = _regex(rule_id, name, value)
        key = "gpu_names" if name == "gpu_name_matches" else "nic_names"

        def any_name(f, key=key):
            names = f.get(key)
            return None if names is None else any(pattern.search(str(n)) for n in names)

        return Condition(
            name,
            value,
            any_name,
            lambda f, key=key: f"{key} " + ", ".join(n for n in f.get(key) or () if pattern.search(n)),
        )

    if name == "compute_capability":
        _need(isinstance(value, str), rule_id, name, 'write a specifier string, e.g. "<7.5"')
        try:
            spec = SpecifierSet(str(value))
        except InvalidSpecifier:
            raise ValueError(f"{_where(rule_id, name)}: {value!r} is not a packaging specifier") from None

        def any_cc(f):
            ccs = f.get("compute_capabilities")
            return None if ccs is None else any(spec.contains(str(c), prereleases=True) for c in ccs)

        return Condition(name, value, any_cc, lambda f: f"compute capabilities {f.get('compute_capabilities')}")

    if name in ("env_set", "env_matches"):
        _need(isinstance(value, dict) and value, rule_id, name, 'write a table, e.g. {CUDA_LAUNCH_BLOCKING = "1"}')
        wanted = {_env_name(rule_id, name, k): v for k, v in value.items()}
        for v in wanted.values():
            _need(isinstance(v, str), rule_id, name, "write each value as a string")
        patterns = {k: _regex(rule_id, name, v) for k, v in wanted.items()} if name == "env_matches" else None

        def env_test(f):
            env = _env(f)
            if env is None:
                return None
            if patterns is not None:
                return all(k in env and p.fullmatch(env[k]) is not None for k, p in patterns.items())
            return all(env.get(k) == v for k, v in wanted.items())

        return Condition(name, value, env_test, lambda f: ", ".join(f"{k}={(_env(f) or {}).get(k)}" for k in wanted))

    if name == "env_unset":
        _need(isinstance(value, list) and value, rule_id, name, 'write a non-empty list, e.g. ["NCCL_CUMEM_ENABLE"]')
        names = [_env_name(rule_id, name, k) for k in value]

        def unset(f):
            env = _env(f)
            return None if env is None else not any(k in env for k in names)

        return Condition(name, value, unset, lambda f: f"not set: {', '.join(names)}")

    close = difflib.get_close_matches(name, CONDITION_NAMES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"{_where(rule_id, name)}: unknown condition{hint} Known: {', '.join(CONDITION_NAMES)}")


CONDITION_NAMES = (
    *VERSION_FACTS,
    "installed",
    "below",
    "major_differs",
    "arch",
    *BOOL_FACTS,
    "gpu_count_min",
    "shm_bytes_below",
    "gpu_name_matches",
    "nic_name_matches",
    "compute_capability",
    "env_set",
    "env_matches",
    "env_unset",
)


def _all3(results: Iterable[bool | None]) -> bool | None:
    results = list(results)
    if any(r is False for r in results):
        return False
    return None if any(r is None for r in results) else True


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
    conditions = tuple(_compile(rule_id, name, value) for name, value in when.items())
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
    text = importlib.resources.files("hf_dist_recipes.environment").joinpath(RULES_FILE).read_text(encoding="utf-8")
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


def evaluate(facts: Mapping[str, object], rules: Sequence[Rule] | None = None) -> list[Finding]:
    """The rules that fire on `facts` (probe's `rule_facts()` mapping), errors first, then warnings, then infos;
    file order within a severity."""
    rules = load_rules() if rules is None else rules
    fired = [
        Finding(r.id, r.severity, r.symptom, r.fix, r.source, tuple(c.evidence(facts) for c in r.conditions))
        for r in rules
        if r.check(facts) is True
    ]
    return sorted(fired, key=lambda f: SEVERITIES.index(f.severity))


def not_checkable(facts: Mapping[str, object], rules: Sequence[Rule] | None = None) -> list[str]:
    """Ids of the rules that might fire but need a fact that is unknown (None) here, in file order."""
    rules = load_rules() if rules is None else rules
    return [r.id for r in rules if r.check(facts) is None]
