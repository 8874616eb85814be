"""The plans `--suggest` could as well have picked: those within the step model's stated error of the pick, and the
measurement that would decide between them.

The estimate's step time is a sum of terms, each inversely proportional to one rate of `planning.comm.Hardware`
(`rate_seconds`): compute (compute_efficiency), exposed collectives inside and across nodes (intra_node_gbps,
inter_node_gbps), offload copies (pcie_gbps) and CPU Adam (cpu_adam_params_per_s). Each rate may be off by a factor
of 1 + its error (`calibration.ASSUMED_ERROR` for a preset's value, `MEASURED_ERROR` for one a profile measured or a
flag gave). A plan is a runner-up when, with every rate moved within its error in the direction that favours it,
its time per token trained comes within NEAR_MARGIN (the model's own resolution) of the pick's: the pick would not
survive that error. Moving a rate by a factor changes a term by the same factor, first order: which of compute and
the ZeRO collectives is exposed is taken as estimated.

The measurement that decides is the rate whose term differs most between the two plans per token, weighted by its
error: a large difference in a measured rate is already known, one in an assumed rate is not.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_dist_recipes.planning.calibration import ASSUMED_ERROR, FIELD_KEYS, RATE_KINDS, RateSource
from hf_dist_recipes.planning.comm import GB, StepEstimate
from hf_dist_recipes.planning.suggest import NEAR_MARGIN, Candidate, best_rows, label

RATE_FIELDS = tuple(FIELD_KEYS)  # the Hardware fields the step time depends on
MAX_LISTED = 5


def rate_seconds(step: StepEstimate) -> dict[str, float]:
    """Seconds of the step that scale with 1 / each rate of RATE_FIELDS; they sum to the step time (the ZeRO
    collectives count only when they, not compute, are the longer: the step takes the larger of the two)."""
    hw, out = step.hardware, dict.fromkeys(RATE_FIELDS, 0.0)
    zero = step.seconds_by_kind.get("zero", 0.0)
    kinds = ["tp", "ep"]
    if zero > step.compute_s:
        kinds.append("zero")
    else:
        out["compute_efficiency"] = step.compute_s
    for kind in kinds:
        out["intra_node_gbps"] += step.bytes_by_kind["intra"].get(kind, 0.0) / (hw.intra_node_gbps * GB)
        out["inter_node_gbps"] += step.bytes_by_kind["inter"].get(kind, 0.0) / (hw.inter_node_gbps * GB)
    parts = step.offload_parts
    out["pcie_gbps"] = parts.get("gradient copies", 0.0) + parts.get("parameter copies", 0.0)
    out["cpu_adam_params_per_s"] = parts.get("CPU Adam", 0.0)
    return out


def _per_token(c: Candidate) -> dict[str, float]:
    tokens = c.plan.global_batch * c.plan.seq_len
    return {k: v / tokens for k, v in rate_seconds(c.step).items()}


@dataclass(frozen=True)
class RunnerUp:
    """A plan within the error of the pick: `slower` (fraction, negative when the estimate has it faster),
    `decider` (the Hardware field whose measurement decides), `seconds` ({field: (pick's, its own) seconds per
    step}) for the decider, and whether that rate is assumed."""

    candidate: Candidate
    slower: float
    decider: str
    seconds: tuple[float, float]
    assumed: bool

    def as_dict(self) -> dict:
        p = self.candidate.plan
        return {
            "layout": label(p),
            "micro_batch": p.micro_batch,
            "grad_accum": p.grad_accum,
            "tp": p.tp,
            "ep": p.ep,
            "offload_optimizer": p.offload_optimizer,
            "offload_params": p.offload_params,
            "tokens_per_s": self.candidate.step.tokens_per_s,
            "slower_than_pick": self.slower,
            "decided_by": self.decider,
            "term": RATE_KINDS[FIELD_KEYS[self.decider]].term,
            "measurement": RATE_KINDS[FIELD_KEYS[self.decider]].measurement,
            "term_seconds_pick_vs_this": list(self.seconds),
            "rate_assumed": self.assumed,
        }

    def line(self) -> str:
        p, kind = self.candidate.plan, RATE_KINDS[FIELD_KEYS[self.decider]]
        than = f"{self.slower:.1%} slower" if self.slower >= 0 else f"{-self.slower:.1%} faster"
        state = "assumed" if self.assumed else "measured"
        return (
            f"{label(p)} at micro batch {p.micro_batch} x accumulation {p.grad_accum}: "
            f"{self.candidate.step.tokens_per_s:,.0f} tokens/s ({than}); differs most in {kind.term} "
            f"(seconds of the step that scale with its rate: the pick {self.seconds[0]:.2f}, this "
            f"{self.seconds[1]:.2f}; rate {state}): "
            f"decided by {kind.measurement}"
        )


def errors_of(sources: dict[str, RateSource] | None) -> dict[str, float]:
    """The relative error of each rate: its source's (`RateSource.error`), ASSUMED_ERROR without sources."""
    return {f: sources[f].error if sources and f in sources else ASSUMED_ERROR for f in RATE_FIELDS}


def runners_up(
    chosen: Candidate, candidates: list[Candidate], sources: dict[str, RateSource] | None = None
) -> list[RunnerUp]:
    """The plans (one per layout: `best_rows`) that fit and could be as fast as `chosen` within the stated error
    (module docstring), fastest first, at most MAX_LISTED."""
    errors = errors_of(sources)
    mine = _per_token(chosen)
    total = sum(mine.values())
    found = []
    for c in best_rows(candidates, chosen):
        if not c.fits or c is chosen or c.plan == chosen.plan:
            continue
        theirs = _per_token(c)
        # Each rate moved by its error in the direction that favours `c`: a term where c takes longer shrinks by
        # 1 + error, a term where the pick takes longer grows by it.
        best_case = sum(
            (theirs[f] - mine[f]) / (1 + errors[f]) if theirs[f] > mine[f] else (theirs[f] - mine[f]) * (1 + errors[f])
            for f in RATE_FIELDS
        )
        if best_case > NEAR_MARGIN * total:
            continue
        decider = max(RATE_FIELDS, key=lambda f: abs(theirs[f] - mine[f]) * errors[f])
        per_step = (rate_seconds(chosen.step)[decider], rate_seconds(c.step)[decider])
        slower = 1 - c.step.tokens_per_s / chosen.step.tokens_per_s
        assumed = sources is None or sources[decider].source == "assumed"
        found.append(RunnerUp(c, slower, decider, per_step, assumed))
    found.sort(key=lambda r: r.slower)
    return found[:MAX_LISTED]


def stated_error(sources: dict[str, RateSource] | None) -> str:
    """The error the runners-up are within, in words."""
    errors = errors_of(sources)
    assumed = [f for f in RATE_FIELDS if sources is None or sources[f].source == "assumed"]
    measured = [f for f in RATE_FIELDS if f not in assumed]
    text = f"within the model's {NEAR_MARGIN:.0%} when each assumed rate may be off by {ASSUMED_ERROR:.0%}"
    if measured:
        text += f" ({', '.join(assumed) or 'none'}) and each measured or given one by {errors[measured[0]]:.0%}"
        text += f" ({', '.join(measured)})"
    return text
