"""Which plan to run: the candidates (TP, EP, offload, micro batch, accumulation) for a model on a cluster within a
target global batch, the ones that fit, and the fastest of those.

The search: for every layout (offload level, TP, EP) the micro batches that fit (memory grows with the micro batch,
so the largest is found by doubling and bisection), each at the most gradient accumulation the batch target allows:
accumulation only amortises per-step costs (optimizer offload's CPU Adam, ZeRO-1/2's parameter gather), so more is
never slower per token, and the target is what bounds it. Plans within NEAR_MARGIN of the fastest count as equally
fast; among them the pick has the least offload, then the least traffic across nodes per token trained.

Ulysses sequence parallelism (`sp_plans`: TP = EP = 1, each SP that divides the world, the sequence and the heads) is
searched only when no layout without it fits the GPU at micro batch 1: it buys activation memory with all-to-alls
and a smaller data-parallel batch, never speed. When no SP layout fits either and the plan does not recompute, the SP
layouts are tried again with activation checkpointing (their rows say "rc").

Memory of one plan: `hf_dist_recipes.planning.memory`; its traffic and step time: `hf_dist_recipes.planning.comm`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hf_dist_recipes.core.sizes import GIB
from hf_dist_recipes.core.user_values import positive_int
from hf_dist_recipes.planning.comm import Hardware, StepEstimate, describe, step_estimate
from hf_dist_recipes.planning.memory import (
    DEFAULT_DEVICE_TARGET,
    DEFAULT_ROUTING_IMBALANCE,
    USABLE_FRACTION,
    MemoryEstimate,
    estimate,
    layout_label,
    render_table,
)
from hf_dist_recipes.planning.models import ModelShape
from hf_dist_recipes.planning.plan import ParallelPlan
from hf_dist_recipes.planning.zero_buffers import hpz_partition_size, use_vocab_parallel_lm_head

# The default batch target: 4M tokens (4,194,304 = 1,024 sequences of 4,096), the Llama 3 report's initial batch
# for its 405B model (arXiv:2407.21783, section 3.4.1; later doubled to 8M and 16M). DeepSeek-V3 ramped from 3,072
# to 15,360 sequences of 4,096 (12.6M to 62.9M tokens; arXiv:2412.19437, section 4.2) on 2,048 GPUs.
DEFAULT_BATCH_TOKENS = 4 * 2**20
NEAR_MARGIN = 0.03  # plans this close in tokens/s are equally fast: the estimate is not finer than that
OFFLOAD_WARN_FRACTION = 0.5  # warn when offload takes more of the step than this
MAX_MICRO_BATCH = 64
OFFLOAD_LEVELS = ((False, False), (True, False), (True, True))  # (optimizer, parameters): cheapest first


def target_sequences(seq_len: int, *, sequences: int | None = None, tokens: int | None = None) -> int:
    """The batch target in sequences per optimizer step: `sequences`, or `tokens` / `seq_len`, or
    DEFAULT_BATCH_TOKENS / `seq_len`."""
    if sequences is not None and tokens is not None:
        raise ValueError("give the batch target once: --global-batch (sequences) or --global-batch-tokens")
    if sequences is not None:
        return positive_int(sequences, "--global-batch", 256, unit="sequences")
    tokens = DEFAULT_BATCH_TOKENS if tokens is None else tokens
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < seq_len:
        raise ValueError(
            f"--global-batch-tokens {tokens!r} is less than one sequence of {seq_len} tokens; e.g. "
            f"--global-batch-tokens {DEFAULT_BATCH_TOKENS}"
        )
    return tokens // seq_len


def candidate_plans(base: ParallelPlan, model: ModelShape) -> list[ParallelPlan]:
    """Layouts to try, cheapest first: no offload before optimizer offload before parameter offload; within each,
    the smallest TP, then the smallest EP. Invalid combinations are left out. Micro batch and accumulation are
    `base`'s (the search sets them)."""
    tps = [t for t in (1, 2, 4, 8, 16) if t <= base.procs_per_node and base.procs_per_node % t == 0]
    eps = [1] + [e for e in (2, 4, 8, 16, 32, 64, 128, 256) if model.is_moe and model.routed_experts % e == 0]
    plans = [
        replace(base, tp=tp, ep=ep, sp=1, offload_optimizer=offload[0], offload_params=offload[1])
        for offload in OFFLOAD_LEVELS
        for tp in tps
        for ep in eps
    ]
    return _valid(plans, model)


def sp_plans(base: ParallelPlan, model: ModelShape) -> list[ParallelPlan]:
    """Ulysses SP layouts to try (TP = EP = 1, which DeepSpeed 0.19.8 requires beside SP), cheapest first: no offload
    before optimizer before parameter offload; within each, the smallest SP that `ParallelPlan.validate` takes
    (it divides the world, the sequence and the model's heads)."""
    plans = [
        replace(base, tp=1, ep=1, sp=sp, offload_optimizer=offload[0], offload_params=offload[1])
        for offload in OFFLOAD_LEVELS
        for sp in range(2, base.world_size + 1)
    ]
    return _valid(plans, model)


def _valid(plans: list[ParallelPlan], model: ModelShape) -> list[ParallelPlan]:
    """The plans `ParallelPlan.validate` takes for `model`, in order."""
    out = []
    for plan in plans:
        try:
            plan.validate(model)
        except ValueError:
            continue
        out.append(plan)
    return out


@dataclass(frozen=True)
class Candidate:
    """A plan with its memory (`hf_dist_recipes.planning.memory`) and its traffic and step time
    (`hf_dist_recipes.planning.comm`); `target_sequences`: the batch target it was sized for (None: a plan given
    as it is)."""

    memory: MemoryEstimate
    step: StepEstimate
    target_sequences: int | None = None

    @property
    def plan(self) -> ParallelPlan:
        return self.memory.plan

    @property
    def fits(self) -> bool | None:
        return self.memory.fits

    @property
    def offload_fraction(self) -> float:
        return self.step.offload_s / self.step.step_time_s

    @property
    def inter_bytes_per_token(self) -> float:
        """Bytes the whole job sends across nodes per token trained."""
        p = self.plan
        return self.step.comm_inter_bytes * p.world_size / (p.global_batch * p.seq_len)

    def as_dict(self) -> dict:
        p = self.plan
        return {
            **self.memory.as_dict(),
            "micro_batch": p.micro_batch,
            "grad_accum": p.grad_accum,
            "global_batch": p.global_batch,
            "global_batch_tokens": p.global_batch * p.seq_len,
            "target_global_batch": self.target_sequences,
            "comm_intra_bytes": self.step.comm_intra_bytes,
            "comm_inter_bytes": self.step.comm_inter_bytes,
            "step_time_s": self.step.step_time_s,
            "offload_s": self.step.offload_s,
            "offload_fraction": self.offload_fraction,
            "step": self.step.as_dict(),
        }


def evaluate(
    plan: ParallelPlan,
    model: ModelShape,
    *,
    device_gib: float | None = None,
    hardware: Hardware | str = "h100",
    target_sequences: int | None = None,
    host_gib: float | None = None,
    device_target: float = USABLE_FRACTION,
    routing_imbalance: float = DEFAULT_ROUTING_IMBALANCE,
    memory_mapped_resume: bool = True,
) -> Candidate:
    """Memory, traffic and step time of one plan; `device_gib`, `host_gib`, `device_target` as in
    `memory.estimate`."""
    memory = estimate(
        plan,
        model,
        device_gib=device_gib,
        host_gib=host_gib,
        device_target=device_target,
        routing_imbalance=routing_imbalance,
        memory_mapped_resume=memory_mapped_resume,
    )
    # The traffic of the DeepSpeed JSON `config generate` writes for this plan: hpZ and the vocabulary-parallel head
    # where planning/zero_buffers.py turns them on.
    step = step_estimate(
        plan,
        model,
        hardware,
        hpz=hpz_partition_size(plan, model),
        elements=memory.elements,
        vocab_parallel=use_vocab_parallel_lm_head(plan, model),
    )
    return Candidate(memory=memory, step=step, target_sequences=target_sequences)


def _layout_rows(
    layout: ParallelPlan, model: ModelShape, device_gib: float, hardware: Hardware | str, target: int, limits: dict
) -> list[Candidate]:
    """Candidates of one layout, by micro batch, each at the most accumulation `target` allows: the micro batches
    that fit among the divisors of target / DP (where the batch meets the target exactly) and the largest that
    fits, plus the smallest found not to fit (what bounds it); micro batch 1 alone when even that does not fit."""
    per_rank = target // layout.dp_size
    top = min(MAX_MICRO_BATCH, per_rank)
    seen: dict[int, Candidate] = {}

    def at(mb: int) -> Candidate:
        if mb not in seen:
            plan = replace(layout, micro_batch=mb, grad_accum=per_rank // mb)
            seen[mb] = evaluate(
                plan, model, device_gib=device_gib, hardware=hardware, target_sequences=target, **limits
            )
        return seen[mb]

    if not at(1).fits:
        return [seen[1]]
    fit, over, mb = 1, None, 2
    while mb <= top and over is None:  # memory grows with the micro batch: double, then bisect
        fit, over = (mb, None) if at(mb).fits else (fit, mb)
        mb *= 2
    if over is None and fit < top:
        fit, over = (top, None) if at(top).fits else (fit, top)
    while over is not None and over - fit > 1:
        mid = (fit + over) // 2
        fit, over = (mid, over) if at(mid).fits else (fit, mid)
    for d in range(1, fit + 1):
        if per_rank % d == 0:
            at(d)
    return [seen[k] for k in sorted(seen) if k <= fit or k == over]


def suggest(
    base: ParallelPlan,
    model: ModelShape,
    device_gib: float,
    hardware: Hardware | str = "h100",
    *,
    target: int | None = None,
    host_gib: float | None = None,
    device_target: float = DEFAULT_DEVICE_TARGET,
    routing_imbalance: float = DEFAULT_ROUTING_IMBALANCE,
    memory_mapped_resume: bool = True,
) -> tuple[Candidate | None, list[Candidate]]:
    """The plan to run (`pick` among the candidates that fit: at most `device_target` of `device_gib` per GPU and,
    given `host_gib` per node, a resume peak within it; None if none does) and every candidate evaluated.
    `target`: the most sequences per optimizer step (default DEFAULT_BATCH_TOKENS / seq_len); micro batch and
    accumulation are searched within it, `base`'s are ignored."""
    target = target_sequences(base.seq_len) if target is None else target_sequences(base.seq_len, sequences=target)
    layouts = [p for p in candidate_plans(base, model) if p.dp_size <= target]
    if not layouts:
        least = min(p.dp_size for p in candidate_plans(base, model))
        raise ValueError(
            f"a batch of {target} sequences is smaller than the data-parallel size of every plan (at least "
            f"{least}: one sequence per data-parallel rank); raise --global-batch to {least} or more"
        )
    limits = {
        "host_gib": host_gib,
        "device_target": device_target,
        "routing_imbalance": routing_imbalance,
        "memory_mapped_resume": memory_mapped_resume,
    }

    def rows_of(plans: list[ParallelPlan]) -> list[Candidate]:
        plans = [p for p in plans if p.dp_size <= target]
        return [c for p in plans for c in _layout_rows(p, model, device_gib, hardware, target, limits)]

    rows = rows_of(layouts)
    # SP only buys memory (its all-to-alls and smaller data-parallel batch cost speed): tried when the sequence fits
    # no GPU without it, then with recomputation turned on when that does not do either.
    if not any(c.memory.device_fits for c in rows):
        rows += rows_of(sp_plans(base, model))
    if not any(c.memory.device_fits for c in rows) and not base.activation_checkpointing:
        rows += rows_of(sp_plans(replace(base, activation_checkpointing=True), model))
    chosen, _ = pick(rows)
    return chosen, rows


def pick(candidates: list[Candidate]) -> tuple[Candidate | None, Candidate | None]:
    """(the pick, the fastest) among the candidates that fit: every plan within NEAR_MARGIN of the most tokens per
    second for the whole job counts as fast; of those, the least offload (parameters, then optimizer), then the
    fewest bytes across nodes per token (with EP = world size no expert is gathered at all), then the least TP."""
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        return None, None
    fastest = max(fitting, key=lambda c: c.step.tokens_per_s)
    near = [c for c in fitting if c.step.tokens_per_s >= (1 - NEAR_MARGIN) * fastest.step.tokens_per_s]
    return min(near, key=_preference), fastest


def _preference(c: Candidate) -> tuple:
    p = c.plan
    return p.offload_params, p.offload_optimizer, c.inter_bytes_per_token, p.tp, -c.step.tokens_per_s


def _speed_order(c: Candidate) -> tuple:
    p = c.plan
    return -round(c.step.tokens_per_s, 3), p.offload_params, p.offload_optimizer, p.tp, p.ep


def label(plan: ParallelPlan) -> str:
    return layout_label(plan)


def _same_layout(a: ParallelPlan, b: ParallelPlan) -> bool:
    return replace(a, micro_batch=1, grad_accum=1) == replace(b, micro_batch=1, grad_accum=1)


def offload_warning(c: Candidate) -> str | None:
    """A warning when offload takes more than OFFLOAD_WARN_FRACTION of the step, with the fixes (None otherwise)."""
    if c.offload_fraction <= OFFLOAD_WARN_FRACTION:
        return None
    parts = ", ".join(f"{k} {v:.1f} s" for k, v in c.step.offload_parts.items() if v)
    return (
        f"offload takes {c.offload_fraction:.0%} of the step ({c.step.offload_s:.1f} of {c.step.step_time_s:.1f} s: "
        f"{parts}): accumulate more micro steps per optimizer step (--grad-accum; with --suggest a larger "
        "--global-batch) so that CPU Adam is amortised, measure and set --cpu-adam-rate and --pcie-gbps, or add "
        "nodes until the optimizer states fit without offload"
    )


def reasons(chosen: Candidate, candidates: list[Candidate]) -> list[str]:
    """Why `chosen` was picked: its batch and step time, what bounds it (memory, the batch target, offload), how it
    compares with the fastest (the margin) or the runner-up, and the first plan that fits (what a memory-only choice
    would run)."""
    p = chosen.plan
    batch = f"micro batch {p.micro_batch} x accumulation {p.grad_accum} x {p.dp_size} DP = {p.global_batch}"
    lines = [f"{label(p)}, {batch} sequences: {describe(chosen.step)}"]
    lines += _bounds(chosen, candidates)
    _, fastest = pick(candidates)
    if fastest is not None and fastest is not chosen:
        faster = fastest.step.tokens_per_s / chosen.step.tokens_per_s - 1
        f = fastest.plan
        if f.offload_params and not p.offload_params:
            why = "without parameter offload"
        elif f.offload_optimizer and not p.offload_optimizer:
            why = "without optimizer offload"
        else:
            less = 1 - chosen.inter_bytes_per_token / fastest.inter_bytes_per_token
            why = f"with {less:.0%} fewer bytes across nodes per token"
            if p.ep == p.world_size:
                why += " (EP = world size keeps every expert on one rank: no expert gathers)"
        lines.append(
            f"picked within {NEAR_MARGIN:.0%} of the fastest, {label(f)} at micro batch {f.micro_batch} "
            f"({fastest.step.tokens_per_s:,.0f} tokens/s, {faster:.1%} more), {why}"
        )
    else:
        others = sorted((c for c in candidates if c.fits and not _same_layout(c.plan, p)), key=_speed_order)
        if others:
            runner = others[0]
            slower = 1 - runner.step.tokens_per_s / chosen.step.tokens_per_s
            lines.append(
                f"next fastest that fits: {label(runner.plan)} at micro batch {runner.plan.micro_batch}, "
                f"{runner.step.tokens_per_s:,.0f} tokens/s ({slower:.1%} slower; "
                f"{runner.step.comm_inter_bytes / 1e9:.1f} GB across nodes per rank)"
            )
    first = next((c for c in candidates if c.fits), None)
    if first is not None and not _same_layout(first.plan, p):
        lines.append(f"the smallest plan that fits, {label(first.plan)}, would take {describe(first.step)}")
    return lines


def _bounds(chosen: Candidate, candidates: list[Candidate]) -> list[str]:
    p, target = chosen.plan, chosen.target_sequences
    out = []
    if target is not None:
        out.append(
            f"batch: {p.global_batch} of the {target}-sequence target ({p.global_batch * p.seq_len / 1e6:.1f}M "
            f"tokens); accumulation {p.grad_accum} is the most it allows at micro batch {p.micro_batch}"
        )
    layout = [c for c in candidates if _same_layout(c.plan, p)]
    larger_fits = [c for c in layout if c.fits and c.plan.micro_batch > p.micro_batch]
    over = min((c for c in layout if not c.fits), key=lambda c: c.plan.micro_batch, default=None)
    if larger_fits:
        best = max(larger_fits, key=lambda c: c.plan.micro_batch)
        out.append(
            f"micro batch {best.plan.micro_batch} fits too, but at accumulation {best.plan.grad_accum} its batch is "
            f"{best.plan.global_batch} sequences: {best.step.tokens_per_s:,.0f} tokens/s"
        )
    elif over is not None and over.memory.device_fits is False:
        m = over.memory
        out.append(
            f"memory: micro batch {over.plan.micro_batch} needs {m.device_total / GIB:.1f} GiB per GPU, more than "
            + (
                f"{m.device_bytes * m.device_target / GIB:.1f} ({m.device_target:.0%} of {m.device_bytes / GIB:g})"
                if m.device_target < 1
                else f"{m.device_bytes / GIB:g}"
            )
        )
    elif target is not None and (p.micro_batch + 1) * p.dp_size > target:
        out.append(f"micro batch {p.micro_batch + 1} x {p.dp_size} DP ranks would pass the batch target")
    m = chosen.memory
    if m.host_steady_per_node:
        resume = (
            " and at a memory-mapped resume"
            if m.host_resume_peak_per_node == m.host_steady_per_node
            else f", {m.host_resume_peak_per_node / GIB:,.0f} GiB at the peak of a stock resume"
        )
        out.append(
            f"host memory per node: {m.host_steady_per_node / GIB:,.0f} GiB while training{resume}"
            + (
                f", of {m.host_bytes / GIB:,.0f} GiB"
                if m.host_bytes
                else " (not checked against the nodes: pass --host-memory GIB)"
            )
        )
        host_bound = host_bound_rows(candidates)
        if host_bound:
            fastest = max(host_bound, key=lambda c: c.step.tokens_per_s)
            out.append(
                f"host: {len(host_bound)} plan(s) that fit the GPU need more host memory at a resume, the fastest "
                f"{label(fastest.plan)} at micro batch {fastest.plan.micro_batch} "
                f"({fastest.memory.host_resume_peak_per_node / GIB:,.0f} GiB per node)"
            )
    if chosen.step.offload_s:
        out.append(
            f"offload: {chosen.step.offload_s:.1f} s of the {chosen.step.step_time_s:.1f} s step "
            f"({chosen.offload_fraction:.0%}); CPU Adam runs once per step, the fp32 gradient partition crosses PCIe "
            f"2 x {p.grad_accum} + 1 times"
        )
    return out


def host_bound_rows(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates that fit the GPU but not the host: what a host limit alone ruled out."""
    return [c for c in candidates if c.memory.device_fits and c.memory.host_fits is False]


def best_rows(candidates: list[Candidate], chosen: Candidate | None = None) -> list[Candidate]:
    """One candidate per layout, in the original order: `chosen` for its layout, else the fastest micro batch that
    fits, else the first evaluated (micro batch 1)."""
    out: list[Candidate] = []
    for c in candidates:
        if out and _same_layout(out[-1].plan, c.plan):
            group_best = out[-1]
            if chosen is not None and group_best is chosen:
                continue
            if c is chosen or (c.fits and (not group_best.fits or _speed_order(c) < _speed_order(group_best))):
                out[-1] = c
        else:
            out.append(c)
    return out


def compact_rows(candidates: list[Candidate], chosen: Candidate | None = None) -> list[Candidate]:
    """One row per layout (`best_rows`), then for each offload level, TP degree and SP layout: the EP-1 row, the
    smallest EP that fits (else the one with the least device memory) and the fastest EP that fits, plus `chosen`;
    in the original order."""
    rows = best_rows(candidates, chosen)
    keep = {id(chosen)} if chosen is not None else set()
    groups: dict[tuple, list[Candidate]] = {}
    for c in rows:
        p = c.plan
        groups.setdefault((p.offload_optimizer, p.offload_params, p.tp, p.sp, p.activation_checkpointing), []).append(c)
    for group in groups.values():
        keep.add(id(group[0]))
        fitting = [c for c in group if c.fits]
        if fitting:
            keep.add(id(fitting[0]))
            keep.add(id(min(fitting, key=_speed_order)))
        else:
            keep.add(id(min(group, key=lambda c: (c.memory.device_total, c.plan.ep))))
    return [c for c in rows if id(c) in keep]


def render_candidates(candidates: list[Candidate], *, chosen: Candidate | None = None) -> str:
    """The memory table (GiB per rank, host RAM per node) with micro batch, accumulation and global batch
    (sequences), traffic per rank per step (GB across nodes, GB inside the node), the estimated step time and its
    offload part (s) and the job's tokens per second appended."""
    lines = render_table([c.memory for c in candidates]).splitlines()
    extra = (
        f" {'mb':>3} {'accum':>5} {'batch':>6} {'inter GB':>9} {'intra GB':>9} {'step s':>8} {'offload':>8} "
        f"{'tokens/s':>10}"
    )
    out = [lines[0] + extra, lines[1] + "-" * len(extra)]
    for line, c in zip(lines[2:], candidates, strict=True):
        mark = " <" if chosen is not None and c is chosen else ""
        p = c.plan
        out.append(
            f"{line} {p.micro_batch:3d} {p.grad_accum:5d} {p.global_batch:6d} {c.step.comm_inter_bytes / 1e9:9.1f} "
            f"{c.step.comm_intra_bytes / 1e9:9.1f} {c.step.step_time_s:8.2f} {c.step.offload_s:8.2f} "
            f"{c.step.tokens_per_s:10,.0f}{mark}"
        )
    return "\n".join(out)
