"""Which plan to run: the candidates (TP, EP, offload) for a model on a cluster, the ones that fit, and the pick.

See `hf_dist_recipes.parallel.memory` for the memory of one plan.
"""

from __future__ import annotations

from dataclasses import replace

from hf_dist_recipes.parallel.memory import MemoryEstimate, estimate
from hf_dist_recipes.parallel.models import ModelShape
from hf_dist_recipes.parallel.plan import ParallelPlan


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


def suggest(base: ParallelPlan, model: ModelShape, device_gib: float) -> tuple[MemoryEstimate | None, list[MemoryEstimate]]:
    """The first plan of `candidate_plans` that fits `device_gib` per GPU (None if none does), and every
    candidate's estimate for the table."""
    estimates = [estimate(p, model, device_gib=device_gib) for p in candidate_plans(base, model)]
    chosen = next((e for e in estimates if e.fits), None)
    return chosen, estimates


def compact_rows(estimates: list[MemoryEstimate], chosen: MemoryEstimate | None = None) -> list[MemoryEstimate]:
    """For each offload level and TP degree: the EP-1 row and the EP with the least device memory (the smallest
    such EP), plus `chosen`; in the original order."""
    keep = {id(chosen)} if chosen is not None else set()
    groups: dict[tuple, list[MemoryEstimate]] = {}
    for e in estimates:
        groups.setdefault((e.plan.offload_optimizer, e.plan.offload_params, e.plan.tp), []).append(e)
    for rows in groups.values():
        keep.add(id(rows[0]))
        keep.add(id(min(rows, key=lambda e: (e.device_total, e.plan.ep))))
    return [e for e in estimates if id(e) in keep]
