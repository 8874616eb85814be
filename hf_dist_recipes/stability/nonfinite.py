"""Practice 5: what a non-finite loss or gradient does (`nonfinite_policy`), and the report that names where.

Policies: "skip" (the default) skips that optimizer step on every rank, counted and logged; "off" checks nothing.
Halting (`nonfinite_policy="halt"`, or more than `max_consecutive_skips` skips in a row, default 3): the bad step is
skipped as under "skip" (so the weights are the last good ones), a checkpoint `checkpoint-<step>` is saved through the
Trainer's own save (`control.should_save`; weights after the last applied step, optimizer, scheduler, this
callback's state), the report is written to `<output_dir>/nonfinite_report.json` and every rank raises
`NonFiniteHalt` from `on_save`, so the launch exits non-zero. The report names the first rank (lowest) with a
non-finite value, all such ranks, the step, whether the loss was non-finite, and the parameters whose gradients
went bad, per rank.

The callback that finds the values and applies the policy: `stability.gradient_health`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, get_args

from hf_dist_recipes.core.user_values import positive_int

NonFinitePolicy = Literal["skip", "halt", "off"]
POLICIES: tuple[str, ...] = get_args(NonFinitePolicy)
DEFAULT_MAX_CONSECUTIVE_SKIPS = 3
REPORT_NAME = "nonfinite_report.json"


def validate_nonfinite_policy(policy: object) -> str:
    if policy not in POLICIES:
        raise ValueError(f"nonfinite_policy must be one of {POLICIES}, got {policy!r}; use 'skip' (the default)")
    return policy


def validate_max_consecutive_skips(n: object) -> int:
    return positive_int(n, "max_consecutive_skips", DEFAULT_MAX_CONSECUTIVE_SKIPS, minimum=0, note="the default")


def next_action(policy: str, consecutive_skips: int, max_consecutive_skips: int) -> str:
    """'skip' or 'halt' for a step with a non-finite value, `consecutive_skips` counting this one."""
    if policy == "halt" or consecutive_skips > max_consecutive_skips:
        return "halt"
    return "skip"


@dataclass
class NonFiniteReport:
    step: int
    ranks: list[int]
    loss_ranks: list[int]
    parameters: dict[int, list[str]]  # rank -> names of parameters whose local gradient was non-finite
    action: Literal["skip", "halt"] = "skip"
    reason: str = ""

    @property
    def first_rank(self) -> int | None:
        return min(self.ranks) if self.ranks else None

    def message(self) -> str:
        if not self.ranks:
            where = (
                "the engine found a non-finite gradient norm after the reduction (no rank's own loss or gradient was)"
            )
        else:
            where = f"non-finite value first on rank {self.first_rank} (rank(s) {', '.join(map(str, self.ranks))})"
            if self.loss_ranks:
                where += f"; loss non-finite on rank(s) {', '.join(map(str, self.loss_ranks))}"
            bad = {r: names for r, names in self.parameters.items() if names}
            if bad:
                where += "; gradients non-finite: " + "; ".join(
                    f"rank {r}: {_short(names)}" for r, names in sorted(bad.items())
                )
        verb = "optimizer step skipped on every rank" if self.action == "skip" else "training halted"
        return f"step {self.step}: {where}; {verb}{': ' + self.reason if self.reason else ''}"

    def to_dict(self) -> dict:
        parameters = {str(r): n for r, n in self.parameters.items()}
        return {**asdict(self), "first_rank": self.first_rank, "parameters": parameters, "message": self.message()}


def _short(names: list[str], limit: int = 8) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class NonFiniteHalt(RuntimeError):
    """Raised on every rank after the last good state was saved; the message is the report."""
