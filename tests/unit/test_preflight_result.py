"""The preflight report's statuses, exit codes and JSON schema."""

import jsonschema
import pytest

from hf_dist_recipes.preflight.result import REPORT_SCHEMA, CheckResult, PreflightReport


def _report(*statuses):
    results = [CheckResult("training", s, "d", "" if s == "ok" else "do x") for s in statuses]
    return PreflightReport("c.yaml", world_size=2, hosts=["a", "a"], results=results)


@pytest.mark.parametrize(
    ("statuses", "code"), [((), 0), (("ok", "ok"), 0), (("ok", "warning"), 0), (("warning", "error", "ok"), 1)]
)
def test_exit_code_is_the_worst_status(statuses, code):
    # every command's convention (the CLI reference's exit table): 0 passed or warnings only, 1 any error; 2 is for
    # a preflight that could not run.
    assert _report(*statuses).exit_code == code


def test_a_finding_without_a_fix_is_refused():
    with pytest.raises(ValueError, match="needs a fix"):
        CheckResult("plan", "error", "TP 3 does not divide 2 processes")
    with pytest.raises(ValueError, match="status must be"):
        CheckResult("plan", "bad", "x", "y")


def test_json_validates_and_the_schema_can_fail():
    data = _report("ok", "warning").to_dict()
    jsonschema.validate(data, REPORT_SCHEMA)
    assert data["checks"] == {"training": "warning"}
    bad = dict(data, checks={"made_up_check": "ok"})
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, REPORT_SCHEMA)
