"""core/findings.py: the status words, every command's exit codes, the table, and the schemas derived from
dataclasses, checked against the real probe of this machine and against values of the wrong type."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import ClassVar, Literal, TypedDict

import jsonschema
import pytest

from hf_dist_recipes.core import findings
from hf_dist_recipes.core.findings import JSON_TYPE, Finding, exit_code, json_schema, render_table, schema_of
from hf_dist_recipes.doctor.doctor import REPORT_SCHEMA, run_checks
from hf_dist_recipes.doctor.facts import EnvironmentFacts
from hf_dist_recipes.doctor.probe import probe

# Each command's exit status for the worst status of its findings, one meaning per code in every command: 0 ok
# (a warning too, unless --strict), 1 problems found; 2 (the command could not do its job) is no finding's.
EXPECTED_EXIT = {
    "doctor": {"ok": 0, "warning": 0, "error": 1},
    "doctor --strict": {"ok": 0, "warning": 1, "error": 1},
    "preflight": {"ok": 0, "warning": 0, "error": 1},
    "preflight --strict": {"ok": 0, "warning": 1, "error": 1},
    "config validate": {"ok": 0, "warning": 0, "error": 1},
    "logs hang": {"ok": 0, "warning": 0, "error": 1},
}
CODES = {
    "doctor": findings.DOCTOR_EXIT,
    "doctor --strict": findings.DOCTOR_STRICT_EXIT,
    "preflight": findings.PREFLIGHT_EXIT,
    "preflight --strict": findings.strict_exit(True),
    "config validate": findings.VALIDATE_EXIT,
    "logs hang": findings.HANG_EXIT,
}


@pytest.mark.parametrize("command", list(EXPECTED_EXIT))
def test_exit_code_of_each_status_per_command(command):
    for status, code in EXPECTED_EXIT[command].items():
        assert exit_code([status], CODES[command]) == code, (command, status)
        # The worst status decides, whatever comes with it.
        assert exit_code(["ok", status, "ok"], CODES[command]) == code
    assert exit_code([], CODES[command]) == 0  # nothing found: passed
    assert exit_code(["warning", "error", "ok"], CODES[command]) == EXPECTED_EXIT[command]["error"]


def test_status_words_and_the_rules_severities():
    assert findings.worst(["ok", "error", "warning"]) == "error" and findings.worst([]) == "ok"
    assert [findings.status_of_severity(s) for s in ("error", "warning", "info")] == ["error", "warning", "ok"]
    assert findings.status_of_severity("fatal") == "warning"  # an unknown severity is shown, not dropped
    with pytest.raises(ValueError, match=r"Finding status must be one of \('ok', 'warning', 'error'\), got 'fine'"):
        Finding("x", "fine", "detail")


def test_table_marks_aligns_and_puts_fix_and_source_under_a_finding():
    rows = [
        {"name": "a", "status": "ok", "detail": "fine", "fix": "", "source": "s"},
        {"name": "longer name", "status": "error", "detail": "broken", "fix": "do x", "source": "issue 1"},
        {"name": "b", "status": "warning", "detail": "meh", "fix": "do y"},
    ]
    expected = "\n".join(
        [
            "title",
            "  ok       a            fine",
            "  ERROR    longer name  broken",
            "                        fix: do x",
            "                        source: issue 1",
            "  WARNING  b            meh",
            "                        fix: do y",
            "end",
        ]
    )
    assert render_table(rows, title="title", summary="end") == expected
    capped = render_table(rows[:2], title=None, summary="end", max_name_width=4).splitlines()
    assert capped[0] == "  ok       a     fine" and capped[1] == "  ERROR    longer name  broken"


class _Pair(TypedDict):
    left: int
    right: str | None


@dataclass(frozen=True)
class _Inner:
    n: int
    ratio: float | None = None


@dataclass(frozen=True)
class _Outer:
    name: str
    kind: Literal["a", "b"]
    flags: tuple[bool, ...]
    inner: _Inner
    inners: list[_Inner]
    counts: dict[str, int]
    fixed: tuple[int, str] = (0, "")
    pairs: tuple[tuple[int, str], ...] = field(default=(), metadata={JSON_TYPE: list[_Pair]})
    json_extra: ClassVar[dict[str, object]] = {"total": int}


def test_schema_of_a_dataclass_written_out():
    inner = {
        "type": "object",
        "required": ["n", "ratio"],
        "additionalProperties": False,
        "properties": {"n": {"type": "integer"}, "ratio": {"type": ["number", "null"]}},
    }
    assert json_schema(_Outer) == {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["name", "kind", "flags", "inner", "inners", "counts", "fixed", "pairs", "total"],
        "additionalProperties": False,
        "properties": {
            "name": {"type": "string"},
            "kind": {"enum": ["a", "b"]},
            "flags": {"type": "array", "items": {"type": "boolean"}},
            "inner": inner,
            "inners": {"type": "array", "items": inner},
            "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
            "fixed": {
                "type": "array",
                "prefixItems": [{"type": "integer"}, {"type": "string"}],
                "items": False,
                "minItems": 2,
            },
            "pairs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["left", "right"],
                    "additionalProperties": False,
                    "properties": {"left": {"type": "integer"}, "right": {"type": ["string", "null"]}},
                },
            },
            "total": {"type": "integer"},
        },
    }
    assert schema_of(dict[Literal["x", "y"], bool]) == {
        "type": "object",
        "additionalProperties": {"type": "boolean"},
        "propertyNames": {"enum": ["x", "y"]},
    }
    with pytest.raises(TypeError, match="no JSON form known for <class 'complex'>"):
        schema_of(complex)


def _real_doctor_json() -> dict:
    # Through json, as `doctor --json` prints it (tuples become arrays).
    return json.loads(json.dumps(run_checks(probe()).to_dict()))


def test_generated_schema_validates_the_real_probe_and_rejects_wrong_types():
    data = _real_doctor_json()
    jsonschema.validate(data, REPORT_SCHEMA)
    facts_schema = json_schema(EnvironmentFacts)
    jsonschema.validate(data["facts"], facts_schema)
    wrong = [
        ("shm_bytes", "16G"),  # int | None
        ("in_container", "yes"),  # bool
        ("nic_names", "eth0"),  # list[str]
        ("torch", {**data["facts"]["torch"], "device_count": "0"}),  # nested dataclass field
        ("rule_facts", {**data["facts"]["rule_facts"], "gpu_count": 1.5}),  # TypedDict field
        ("peer_access", [{"from": 0, "to": 1}]),  # PeerPair without can_access
        ("packages", {"torch": 2}),  # Mapping[str, str | None]
        ("made_up", 1),  # a key no dataclass declares
    ]
    for key, value in wrong:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**data["facts"], key: value}, facts_schema)
    missing = {k: v for k, v in data["facts"].items() if k != "gpus"}
    with pytest.raises(jsonschema.ValidationError, match="'gpus' is a required property"):
        jsonschema.validate(missing, facts_schema)
    bad_check = {**data["checks"][0], "status": "info"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**data, "checks": [bad_check]}, REPORT_SCHEMA)
