"""Which plan to run: the candidates (TP, EP, offload) for a model on a cluster, the ones that fit, and the
fastest of those.

Memory of one plan: `hf_dist_recipes.parallel.memory`; its traffic and step time: `hf_dist_recipes.parallel.comm`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hf_dist_recipes.parallel.comm import Hardware, StepEstimate, describe, step_estimate
from hf_dist_recipes.parallel.memory import MemoryEstimate, estimate, render_table
from hf_dist_recipes.parallel.models import ModelShape
from hf_dist_recipes.parallel.plan import ParallelPlan
from hf_dist_recipes.parallel.zero_buffers import hpz_partition_size, use_vocab_parallel_lm_head


def candidate_plans(base: ParallelPlan, model: ModelShape) -> list[ParallelPlan]:
    """Plans to try, cheapest first: no offload before optimizer offload before parameter offload; within each,
    the smallest TP, then the smallest EP. Invalid combinations are left out."""
    tps = [t for t in (1, 2, 4, 8, 16) if t <= base.procs_per_node and base.procs_per_node % t == 0]
    eps = [1] + [e for e in (2, 4, 8, 16, 32, 64, 128, 256) if model.is_moe and model.routed_experts % e == 0]
    out = []
    for offload in ((False, False), (True, False), (True, True)):
        for tp in tps:
            for ep in eps:
                plan = replace(base, tp=tp, ep=ep, offload_optimizer=offload[0], offload_params=offload[1])
                try:
                    plan.validate(model)
                except ValueError:
                    continue
                out.append(plan)
    return out


@dataclass(frozen=True)
class Candidate:
    """A plan with its memory (`hf_dist_recipes.parallel.memory`) and its traffic and step time
    (`hf_dist_recipes.parallel.comm`)."""

    memory: MemoryEstimate
    step: StepEstimate

    @property
    def plan(self) -> ParallelPlan:
        return self.memory.plan

    @property
    def fits(self) -> bool | None:
        return self.memory.fits

    def as_dict(self) -> dict:
        return {
            **self.memory.as_dict(),
            "comm_intra_bytes": self.step.comm_intra_bytes,
            "comm_inter_bytes": self.step.comm_inter_bytes,
            "step_time_s": self.step.step_time_s,
            "step": self.step.as_dict(),
        }


def evaluate(
    plan: ParallelPlan, model: ModelShape, *, device_gib: float | None = None, hardware: Hardware | str = "h100"
) -> Candidate:
    """Memory, traffic and step time of one plan."""
    memory = estimate(plan, model, device_gib=device_gib)
    # The traffic of the DeepSpeed JSON `config generate` writes for this plan: hpZ and the vocabulary-parallel head
    # where parallel/zero_buffers.py turns them on.
    step = step_estimate(
        plan,
        model,
        hardware,
        hpz=hpz_partition_size(plan, model),
        elements=memory.elements,
        vocab_parallel=use_vocab_parallel_lm_head(plan, model),
    )
    return Candidate(memory=memory, step=step)


def suggest(
    base: ParallelPlan, model: ModelShape, device_gib: float, hardware: Hardware | str = "h100"
) -> tuple[Candidate | None, list[Candidate]]:
    """The fastest candidate (most tokens per second for the whole job; equal speeds: less offload, then less model
    parallelism) that fits `device_gib` per GPU (None if none does), and every candidate for the table. The smallest
    plan that fits is often the slowest: for a
    mixture-of-experts model it gathers every expert through ZeRO-3 three times per micro step."""
    candidates = [evaluate(p, model, device_gib=device_gib, hardware=hardware) for p in candidate_plans(base, model)]
    fitting = [c for c in candidates if c.fits]
    # Equal times: the plan with less offload, then fewer model-parallel ranks (simpler to run and to debug).
    chosen = min(fitting, key=_speed_order) if fitting else None
    return chosen, candidates


def _speed_order(c: Candidate) -> tuple:
    p = c.plan
    return -round(c.step.tokens_per_s, 3), p.offload_params, p.offload_optimizer, p.tp, p.ep


def label(plan: ParallelPlan) -> str:
    off = "+".join(k for k, on in (("opt", plan.offload_optimizer), ("param", plan.offload_params)) if on) or "-"
    return f"Z{plan.zero_stage} TP{plan.tp} EP{plan.ep} off:{off}"


def reasons(chosen: Candidate, candidates: list[Candidate]) -> list[str]:
    """Why `chosen` was picked: its step time and where it goes, the runner-up, and the first plan that fits (what
    a memory-only choice would run)."""
    lines = [f"{label(chosen.plan)}: {describe(chosen.step)}"]
    fitting = sorted((c for c in candidates if c.fits and c is not chosen), key=_speed_order)
    if fitting:
        runner = fitting[0]
        lines.append(
            f"next fastest that fits: {label(runner.plan)}, {runner.step.tokens_per_s:,.0f} tokens/s "
            f"({runner.step.comm_inter_bytes / 1e9:.1f} GB across nodes per rank)"
        )
    first = next((c for c in candidates if c.fits), None)
    if first is not None and first is not chosen:
        lines.append(f"the smallest plan that fits, {label(first.plan)}, would take {describe(first.step)}")
    return lines


def compact_rows(candidates: list[Candidate], chosen: Candidate | None = None) -> list[Candidate]:
    """For each offload level and TP degree: the EP-1 row, the EP with the least device memory (the smallest
    such EP) and the fastest EP that fits, plus `chosen`; in the original order."""
    keep = {id(chosen)} if chosen is not None else set()
    groups: dict[tuple, list[Candidate]] = {}
    for c in candidates:
        groups.setdefault((c.plan.offload_optimizer, c.plan.offload_params, c.plan.tp), []).append(c)
    for rows in groups.values():
        keep.add(id(rows[0]))
        keep.add(id(min(rows, key=lambda c: (c.memory.device_total, c.plan.ep))))
        fitting = [c for c in rows if c.fits]
        if fitting:
            keep.add(id(min(fitting, key=_speed_order)))
    return [c for c in candidates if id(c) in keep]


def render_candidates(candidates: list[Candidate], *, chosen: Candidate | None = None) -> str:
    """The memory table (GiB per rank, host RAM per node) with traffic per rank per step (GB across nodes,
    GB inside the node), the estimated step time (s) and the job's tokens per second appended."""
    lines = render_table([c.memory for c in candidates]).splitlines()
    extra = f" {'inter GB':>9} {'intra GB':>9} {'step s':>8} {'tokens/s':>10}"
    out = [lines[0] + extra, lines[1] + "-" * len(extra)]
    for line, c in zip(lines[2:], candidates, strict=True):
        mark = " <" if chosen is not None and c is chosen else ""
        out.append(
            f"{line} {c.step.comm_inter_bytes / 1e9:9.1f} {c.step.comm_intra_bytes / 1e9:9.1f} "
            f"{c.step.step_time_s:8.2f} {c.step.tokens_per_s:10,.0f}{mark}"
        )
    return "\n".join(out)
