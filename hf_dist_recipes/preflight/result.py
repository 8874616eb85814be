"""The preflight report: one row per check, ok / warning / error, each with the fix, and the exit code.

Exit codes follow `doctor`: 0 when everything passed, 1 on warnings only, 2 on any error (a check that could not run
is an error: a preflight that did not look has not passed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

OK, WARNING, ERROR = "ok", "warning", "error"
STATUSES = (OK, WARNING, ERROR)
EXIT_CODES = {OK: 0, WARNING: 1, ERROR: 2}

# The seven checks in the order they run; a report names each once (a check with several findings keeps the worst).
CHECKS = ("environment", "backend", "communication", "plan", "training", "failure_paths", "logs")


@dataclass(frozen=True)
class CheckResult:
    """One finding. `name`: one of CHECKS; `detail`: what was measured (numbers, the rank/host concerned);
    `fix`: what to do when not ok ("" when ok); `ranks`: the global ranks concerned (empty: all or none);
    `data`: the measured values for --json."""

    name: str
    status: str
    detail: str
    fix: str = ""
    ranks: tuple[int, ...] = ()
    data: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if self.status != OK and not self.fix:
            raise ValueError(f"check {self.name!r}: a {self.status} needs a fix")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ranks"] = list(self.ranks)
        return d


def worst(statuses) -> str:
    """The most severe of `statuses` (OK for none)."""
    return max(statuses, key=STATUSES.index, default=OK)


@dataclass
class PreflightReport:
    """Everything the preflight found. `config_file`, `world_size`, `hosts` (one per rank) describe the launch;
    `elapsed_s`: wall seconds from the launch's start (`launch.run_preflight`; the plan check before it is not
    counted) to the report."""

    config_file: str
    world_size: int = 0
    hosts: list[str] = field(default_factory=list)
    results: list[CheckResult] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def status(self) -> str:
        return worst(r.status for r in self.results)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]

    def by_check(self) -> dict[str, str]:
        """Each check's worst status; a check with no result at all is missing from the map."""
        out: dict[str, str] = {}
        for r in self.results:
            out[r.name] = worst([out.get(r.name, OK), r.status])
        return out

    def to_dict(self) -> dict:
        return {
            "config_file": self.config_file,
            "world_size": self.world_size,
            "hosts": list(self.hosts),
            "status": self.status,
            "exit_code": self.exit_code,
            "elapsed_s": round(self.elapsed_s, 3),
            "checks": self.by_check(),
            "results": [r.to_dict() for r in self.results],
        }


REPORT_SCHEMA = {
    "type": "object",
    "required": ["config_file", "world_size", "hosts", "status", "exit_code", "elapsed_s", "checks", "results"],
    "properties": {
        "config_file": {"type": "string"},
        "world_size": {"type": "integer", "minimum": 0},
        "hosts": {"type": "array", "items": {"type": "string"}},
        "status": {"enum": list(STATUSES)},
        "exit_code": {"enum": [0, 1, 2]},
        "elapsed_s": {"type": "number", "minimum": 0},
        "checks": {
            "type": "object",
            "propertyNames": {"enum": list(CHECKS)},
            "additionalProperties": {"enum": list(STATUSES)},
        },
        "results": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "status", "detail", "fix", "ranks", "data"],
                "properties": {
                    "name": {"enum": list(CHECKS)},
                    "status": {"enum": list(STATUSES)},
                    "detail": {"type": "string"},
                    "fix": {"type": "string"},
                    "ranks": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    "data": {"type": "object"},
                },
            },
        },
    },
}
