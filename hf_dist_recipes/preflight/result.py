"""The preflight report: one row per check, ok / warning / error, each with the fix, and the exit code.

Statuses, the exit-code rule and the schema come from `core/findings.py`: exit 0 when everything passed, 1 on
warnings only, 2 on any error (a check that could not run is an error: a preflight that did not look has not
passed). `REPORT_SCHEMA` is derived from the dataclasses below.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import ClassVar, Literal, get_args

from hf_dist_recipes.core.findings import (
    ERROR,
    OK,
    PREFLIGHT_EXIT,
    STATUSES,
    WARNING,
    ExitCode,
    Finding,
    Status,
    exit_code,
    json_schema,
    worst,
)

__all__ = [
    "CHECKS",
    "ERROR",
    "OK",
    "REPORT_SCHEMA",
    "STATUSES",
    "WARNING",
    "CheckName",
    "CheckResult",
    "PreflightReport",
    "worst",
]

# The seven checks in the order they run; a report names each once (a check with several findings keeps the worst).
CheckName = Literal["environment", "backend", "communication", "plan", "training", "failure_paths", "logs"]
CHECKS: tuple[CheckName, ...] = get_args(CheckName)


@dataclass(frozen=True)
class CheckResult(Finding):
    """One finding. `name`: one of CHECKS; `detail`: what was measured (numbers, the rank/host concerned);
    `fix`: what to do when not ok ("" when ok); `ranks`: the global ranks concerned (empty: all or none);
    `data`: the measured values for --json."""

    name: CheckName
    ranks: tuple[int, ...] = ()
    data: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        if self.status != OK and not self.fix:
            raise ValueError(f"check {self.name!r}: a {self.status} needs a fix")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ranks"] = list(self.ranks)
        return d


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
    # The keys to_dict adds beside the fields, for REPORT_SCHEMA.
    json_extra: ClassVar[dict[str, object]] = {
        "status": Status,
        "exit_code": ExitCode,
        "checks": dict[CheckName, Status],
    }

    @property
    def status(self) -> str:
        return worst(r.status for r in self.results)

    @property
    def exit_code(self) -> int:
        return exit_code([self.status], PREFLIGHT_EXIT)

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


REPORT_SCHEMA = json_schema(PreflightReport)
