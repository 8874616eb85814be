"""Findings, once for every command that judges something: the status words, the exit-code rule, one text table,
one JSON renderer, and JSON schemas derived from dataclasses.

- `Status` ("ok" < "warning" < "error"), the words every table and --json shows; `Severity` ("error", "warning",
  "info"), the words a known-issue rule is written with (`doctor/known_issues.toml`), and `status_of_severity`
  between them (an "info" rule shows as ok, with its fix).
- `Finding(name, status, detail, fix)`: one judged thing. The doctor's `Check` adds the source of the rule, the
  preflight's `CheckResult` the ranks and measured data, `config validate`'s finding names the file.
- `exit_code(statuses, codes)`: the exit status for the worst status, by each command's `ExitCodes`: 0 ok, 1 the
  command found problems (a warning too with --strict), 2 it could not do its job (usage, unreadable input), the
  same in every command (`strict_exit`).
- `render_table(rows, ...)`: status, name, detail, then the fix (and source) under every finding; `render_json`.
- `json_schema(cls)`: the JSON schema (draft 2020-12) of `asdict(cls instance)`, from `dataclasses.fields` and
  `typing.get_type_hints`: str, int, float, bool, None, unions (`X | None`), `list[X]` / `tuple[X, ...]` /
  `Sequence[X]`, fixed tuples, `dict[str, X]` / `Mapping[str, X]` (a `Literal` key type gives `propertyNames`),
  `Literal` (an enum), nested dataclasses and TypedDicts. A field whose JSON differs from its Python type says so in
  its metadata (`field(metadata={JSON_TYPE: list[SomeTypedDict]})`); keys a `to_dict` adds beside the fields are
  declared in a `json_extra: ClassVar[dict[str, object]]` of the class. Every dataclass or TypedDict object is
  closed (`additionalProperties: false`), so a renamed or added key fails validation instead of passing unseen.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args, get_origin

Status = Literal["ok", "warning", "error"]
OK: Status = "ok"
WARNING: Status = "warning"
ERROR: Status = "error"
STATUSES: tuple[Status, ...] = get_args(Status)  # least to most severe

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = get_args(Severity)  # most to least severe: the order rule findings are listed in
_SEVERITY_STATUS: dict[str, Status] = {"error": ERROR, "warning": WARNING, "info": OK}

# The first column of a table row: quiet when ok, loud otherwise.
MARK: dict[str, str] = {OK: "ok", WARNING: "WARNING", ERROR: "ERROR"}


def status_of_severity(severity: str) -> Status:
    """The status a known-issue rule's severity shows as: error -> error, warning -> warning, info -> ok (with its
    fix); an unknown severity shows as a warning rather than vanish."""
    return _SEVERITY_STATUS.get(severity, WARNING)


def severity_rank(status: str) -> int:
    """0 for ok, 1 for warning, 2 for error: for comparing statuses."""
    return STATUSES.index(status)


def worst(statuses: Iterable[str]) -> Status:
    """The most severe of `statuses` (OK for none)."""
    return max(statuses, key=severity_rank, default=OK)


def rank_list(ranks: Iterable[int], min_run: int = 3) -> str:
    """Ranks as the console writes them: sorted, runs of `min_run` or more as first-last ("0-7, 9, 12, 13")."""
    parts: list[str] = []
    run: list[int] = []
    for rank in sorted(set(ranks)) + [None]:
        if run and (rank is None or rank != run[-1] + 1):
            parts += [f"{run[0]}-{run[-1]}"] if len(run) >= min_run else [str(r) for r in run]
            run = []
        if rank is not None:
            run.append(rank)
    return ", ".join(parts)


def count_statuses(statuses: Iterable[str]) -> dict[str, int]:
    """How many of each status, every status present (0 when none)."""
    counts = dict.fromkeys(STATUSES, 0)
    for s in statuses:
        counts[s] += 1
    return counts


@dataclass(frozen=True)
class Finding:
    """One judged thing. `name`: what was checked; `status`: one of STATUSES; `detail`: what was found (the numbers,
    the versions, the file); `fix`: what to do about it ("" when there is nothing to do)."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"{type(self).__name__} status must be one of {STATUSES}, got {self.status!r}")


@dataclass(frozen=True)
class ExitCodes:
    """A command's exit status for each worst status of its findings."""

    ok: int
    warning: int
    error: int


# One meaning per exit status in every command (the table of `hf-dist-recipes --help`, cli/conventions.py).
EXIT_OK = 0  # done, nothing wrong found (warnings too, unless --strict)
EXIT_FOUND_PROBLEMS = 1  # the command ran and found problems: a plan that does not fit, config errors, a hang
EXIT_USAGE = 2  # the command could not do its job: a usage error, an input it cannot read
FINDINGS_EXIT = ExitCodes(ok=EXIT_OK, warning=EXIT_OK, error=EXIT_FOUND_PROBLEMS)  # a warning is advice
STRICT_EXIT = ExitCodes(ok=EXIT_OK, warning=EXIT_FOUND_PROBLEMS, error=EXIT_FOUND_PROBLEMS)  # --strict
# Every command's codes by name (tests/unit/test_findings.py writes them out by hand).
DOCTOR_EXIT = FINDINGS_EXIT
DOCTOR_STRICT_EXIT = STRICT_EXIT
PREFLIGHT_EXIT = FINDINGS_EXIT  # a check that could not run is an error
VALIDATE_EXIT = FINDINGS_EXIT  # config validate: warnings waste memory, errors stop the run
HANG_EXIT = FINDINGS_EXIT  # logs hang: 1 when it names ranks (a desync, a rank lost)
ExitCode = Literal[0, 1, 2]


def exit_code(statuses: Iterable[str], codes: ExitCodes) -> int:
    """The exit status of a command whose findings have `statuses`: `codes` of the worst one (ok for none)."""
    return getattr(codes, worst(statuses))


def strict_exit(strict: bool) -> ExitCodes:
    """The codes of a command with `--strict`: a warning exits 1 with it, 0 without."""
    return STRICT_EXIT if strict else FINDINGS_EXIT


def render_table(
    rows: Iterable[Mapping[str, object]], *, title: str | None, summary: str, max_name_width: int | None = None
) -> str:
    """The text table: `title`, then per row (a mapping with name, status, detail, fix and optionally source and
    mark, which replaces the status's word) its mark, name and detail, with `fix:` and `source:` lines under every
    row that has a fix, then `summary`. The name column is as wide as the longest name, at most `max_name_width` (a
    longer name overflows its row alone)."""
    rows = list(rows)
    width = max((len(str(r["name"])) for r in rows), default=0)
    if max_name_width is not None:
        width = min(width, max_name_width)
    pad = f"  {'':<7}  {'':<{width}}  "
    lines = [title] if title is not None else []
    for r in rows:
        mark = r.get("mark") or MARK[str(r["status"])]  # a row may say more than its status (doctor: "notice")
        lines.append(f"  {mark:<7}  {r['name']!s:<{width}}  {r['detail']}")
        if r.get("fix"):  # an "info" rule shows as ok with its advice, so the fix is shown whatever the status
            lines.append(f"{pad}fix: {r['fix']}")
            if r.get("source"):
                lines.append(f"{pad}source: {r['source']}")
    lines.append(summary)
    return "\n".join(lines)


def render_json(data: object) -> str:
    """The --json output of every command: `data` (JSON-able: the command's `to_dict()`), indented by 2."""
    return json.dumps(data, indent=2)


JSON_TYPE = "json_type"  # dataclass field metadata key: the type the field has in JSON when not its Python type
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
_SEQUENCES = (list, tuple, Sequence, typing.Sequence, set, frozenset)
_MAPPINGS = (dict, Mapping, typing.Mapping)


def json_schema(cls: type) -> dict:
    """The JSON schema of a dataclass (or TypedDict) `cls`'s JSON form, with the draft named (see the module
    docstring for the types understood). TypeError names a type it cannot describe."""
    return {"$schema": SCHEMA_DIALECT, **schema_of(cls)}


def schema_of(tp: object) -> dict:
    """The schema of one Python type (no `$schema` key), for nesting."""
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    if tp is typing.Any or tp is object:
        return {}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _object_schema(tp, _dataclass_properties(tp), required=None)
    if typing.is_typeddict(tp):
        hints = typing.get_type_hints(tp)
        return _object_schema(tp, {k: schema_of(v) for k, v in hints.items()}, required=list(tp.__required_keys__))
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return _union_schema([schema_of(a) for a in args])
    if tp in _SEQUENCES or origin in _SEQUENCES:
        return _sequence_schema(origin or tp, args)
    if tp in _MAPPINGS or origin in _MAPPINGS:
        return _mapping_schema(args)
    raise TypeError(f"json_schema: no JSON form known for {tp!r}; give the field a {JSON_TYPE!r} metadata type")


def _dataclass_properties(cls: type) -> dict[str, dict]:
    hints = typing.get_type_hints(cls)
    props = {f.name: schema_of(f.metadata.get(JSON_TYPE, hints[f.name])) for f in dataclasses.fields(cls)}
    for key, tp in getattr(cls, "json_extra", {}).items():
        props[key] = schema_of(tp)
    return props


def _object_schema(cls: type, props: dict[str, dict], required: list[str] | None) -> dict:
    order = list(props)
    return {
        "type": "object",
        "required": order if required is None else [k for k in order if k in required],
        "additionalProperties": False,
        "properties": props,
    }


def _union_schema(members: list[dict]) -> dict:
    # Plain types merge into one "type" list ({"type": ["string", "null"]}); anything else stays an anyOf.
    if all(set(m) == {"type"} and isinstance(m["type"], str) for m in members):
        return {"type": [m["type"] for m in members]}
    return {"anyOf": members}


def _sequence_schema(origin: object, args: tuple) -> dict:
    if origin is tuple and args and args[-1] is not Ellipsis:  # tuple[int, int, bool]: fixed length
        items = [schema_of(a) for a in args]
        return {"type": "array", "prefixItems": items, "items": False, "minItems": len(items)}
    return {"type": "array", "items": schema_of(args[0])} if args else {"type": "array"}


def _mapping_schema(args: tuple) -> dict:
    if not args:
        return {"type": "object"}
    key, value = args
    schema: dict = {"type": "object", "additionalProperties": schema_of(value)}
    if get_origin(key) is Literal:
        schema["propertyNames"] = {"enum": list(get_args(key))}
    elif key is not str:
        raise TypeError(f"json_schema: JSON object keys are strings, not {key!r}")
    return schema
