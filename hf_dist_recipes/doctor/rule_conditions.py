"""The conditions of a known-issues rule (`[rule.when]` in known_issues.toml): each name's parser, test and evidence.

Condition vocabulary (an unknown name makes the loader raise, so a typo never silently stops a rule):
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

The facts are the flat mapping of `facts.EnvironmentFacts.rule_facts()`; a value of None (or a missing key) means
unknown. Tests are three-valued: True, False, or None when a fact they need is unknown.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

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
# Conditions on a number: name -> (the fact, whether the fact must be at least / below the value).
_NUMBER_CONDITIONS = {"gpu_count_min": ("gpu_count", "at least"), "shm_bytes_below": ("shm_bytes", "below")}
_NAME_CONDITIONS = {"gpu_name_matches": "gpu_names", "nic_name_matches": "nic_names"}

Facts = Mapping[str, object]


@dataclass(frozen=True)
class Condition:
    """One `when` entry: its name, the value as written in the file, and the compiled test. `test(facts)` returns
    True / False, or None when a fact it needs is unknown; `evidence(facts)` says what matched, for the finding."""

    name: str
    value: object
    test: Callable[[Facts], bool | None] = field(repr=False, compare=False)
    evidence: Callable[[Facts], str] = field(repr=False, compare=False)


def version_of(facts: Facts, key: str) -> Version | None:
    """The version fact `key`, None when unknown or unreadable (an unreadable version is never a match)."""
    value = facts.get(key)
    if value is None:
        return None
    try:
        # Local tags ("2.13.0+cpu") say how it was built, not which release it is.
        return Version(str(value).split("+")[0])
    except InvalidVersion:
        return None


def all3(results: Iterable[bool | None]) -> bool | None:
    """Three-valued AND: False if any is False, else None if any is None, else True."""
    results = list(results)
    if any(r is False for r in results):
        return False
    return None if any(r is None for r in results) else True


def _where(rule_id: str, name: str) -> str:
    return f"known-issues rule {rule_id!r}, condition {name!r}"


def _need(cond: bool, rule_id: str, name: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{_where(rule_id, name)}: {what}")


def _version_key(rule_id: str, name: str, key: object) -> str:
    _need(key in VERSION_FACTS, rule_id, name, f"{key!r} is not a version fact; use one of {', '.join(VERSION_FACTS)}")
    return str(key)


def _specifier(rule_id: str, name: str, value: object, how: str, example: str) -> SpecifierSet:
    _need(isinstance(value, str), rule_id, name, how)
    try:
        return SpecifierSet(str(value))
    except InvalidSpecifier:
        raise ValueError(f"{_where(rule_id, name)}: {value!r} is not a packaging specifier{example}") from None


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


def _env(facts: Facts) -> Mapping[str, str] | None:
    env = facts.get("env")
    return env if isinstance(env, Mapping) else None


def _version_range(rule_id: str, name: str, value: object) -> Condition:
    how = 'write the version range as a specifier string, e.g. "<2.18.6"'
    spec = _specifier(rule_id, name, value, how, ' (e.g. ">=2.19,<2.20")')

    def test(f):
        v = version_of(f, name)
        # prereleases=True: a nightly "2.14.0.dev" torch is still a 2.14 for these ranges
        return None if v is None else spec.contains(v, prereleases=True)

    return Condition(name, value, test, lambda f: f"{name} {f.get(name)} ({spec})")


def _installed(rule_id: str, name: str, value: object) -> Condition:
    _need(isinstance(value, list) and value, rule_id, name, 'write a non-empty list, e.g. ["deepspeed"]')
    keys = [_version_key(rule_id, name, k) for k in value]
    return Condition(
        name,
        value,
        lambda f: all(f.get(k) is not None for k in keys),
        lambda f: ", ".join(f"{k} {f.get(k)}" for k in keys),
    )


def _below(rule_id: str, name: str, value: object) -> Condition:
    _need(isinstance(value, dict) and value, rule_id, name, 'write a table, e.g. {driver_cuda = "cuda"}')
    pairs = [(_version_key(rule_id, name, a), _version_key(rule_id, name, b)) for a, b in value.items()]

    def below(f):
        versions = [(version_of(f, a), version_of(f, b)) for a, b in pairs]
        return all3(None if va is None or vb is None else va < vb for va, vb in versions)

    return Condition(name, value, below, lambda f: ", ".join(f"{a} {f.get(a)} < {b} {f.get(b)}" for a, b in pairs))


def _major_differs(rule_id: str, name: str, value: object) -> Condition:
    how = 'write two version facts, e.g. ["nvcc_cuda", "cuda"]'
    _need(isinstance(value, list) and len(value) == 2, rule_id, name, how)
    a, b = (_version_key(rule_id, name, k) for k in value)

    def majors(f):
        va, vb = version_of(f, a), version_of(f, b)
        return None if va is None or vb is None else va.major != vb.major

    return Condition(name, value, majors, lambda f: f"{a} {f.get(a)} vs {b} {f.get(b)}")


def _arch(rule_id: str, name: str, value: object) -> Condition:
    _need(isinstance(value, str), rule_id, name, 'write the machine name as a string, e.g. "aarch64"')
    return Condition(
        name,
        value,
        lambda f: None if f.get("arch") is None else f.get("arch") == value,
        lambda f: f"arch {f.get('arch')}",
    )


def _boolean(rule_id: str, name: str, value: object) -> Condition:
    _need(isinstance(value, bool), rule_id, name, "write true or false")
    return Condition(
        name,
        value,
        lambda f: None if f.get(name) is None else bool(f.get(name)) is value,
        lambda f: f"{name} {f.get(name)}",
    )


def _number(rule_id: str, name: str, value: object) -> Condition:
    _need(
        isinstance(value, int) and not isinstance(value, bool) and value >= 0,
        rule_id,
        name,
        "write a non-negative integer",
    )
    key, how = _NUMBER_CONDITIONS[name]

    def number(f):
        n = f.get(key)
        if n is None:
            return None
        return n >= value if how == "at least" else n < value

    return Condition(name, value, number, lambda f: f"{key} {f.get(key)}")


def _name_matches(rule_id: str, name: str, value: object) -> Condition:
    pattern, key = _regex(rule_id, name, value), _NAME_CONDITIONS[name]

    def any_name(f):
        names = f.get(key)
        return None if names is None else any(pattern.search(str(n)) for n in names)

    return Condition(
        name, value, any_name, lambda f: f"{key} " + ", ".join(n for n in f.get(key) or () if pattern.search(n))
    )


def _compute_capability(rule_id: str, name: str, value: object) -> Condition:
    spec = _specifier(rule_id, name, value, 'write a specifier string, e.g. "<7.5"', "")

    def any_cc(f):
        ccs = f.get("compute_capabilities")
        return None if ccs is None else any(spec.contains(str(c), prereleases=True) for c in ccs)

    return Condition(name, value, any_cc, lambda f: f"compute capabilities {f.get('compute_capabilities')}")


def _env_values(rule_id: str, name: str, value: object) -> Condition:
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


def _env_unset(rule_id: str, name: str, value: object) -> Condition:
    _need(isinstance(value, list) and value, rule_id, name, 'write a non-empty list, e.g. ["NCCL_CUMEM_ENABLE"]')
    names = [_env_name(rule_id, name, k) for k in value]

    def unset(f):
        env = _env(f)
        return None if env is None else not any(k in env for k in names)

    return Condition(name, value, unset, lambda f: f"not set: {', '.join(names)}")


# Condition name -> its parser, in the order of the module docstring.
_COMPILERS: dict[str, Callable[[str, str, object], Condition]] = {
    **dict.fromkeys(VERSION_FACTS, _version_range),
    "installed": _installed,
    "below": _below,
    "major_differs": _major_differs,
    "arch": _arch,
    **dict.fromkeys(BOOL_FACTS, _boolean),
    **dict.fromkeys(_NUMBER_CONDITIONS, _number),
    **dict.fromkeys(_NAME_CONDITIONS, _name_matches),
    "compute_capability": _compute_capability,
    "env_set": _env_values,
    "env_matches": _env_values,
    "env_unset": _env_unset,
}
CONDITION_NAMES = tuple(_COMPILERS)


def compile_condition(rule_id: str, name: str, value: object) -> Condition:
    """Parse one `when` entry; ValueError names the rule, the condition and the fix."""
    compiler = _COMPILERS.get(name)
    if compiler is None:
        close = difflib.get_close_matches(name, CONDITION_NAMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{_where(rule_id, name)}: unknown condition{hint} Known: {', '.join(CONDITION_NAMES)}")
    return compiler(rule_id, name, value)
