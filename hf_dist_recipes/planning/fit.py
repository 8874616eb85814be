"""Whether a plan fits its GPUs by our memory estimate (`memory.estimate`), in words that state what the estimate
assumed: the sequence length, the micro batch and activation recomputation (the activations depend on them, the
model states do not), where each value came from, and how to change it.

Used by `config generate` (a plan that does not fit is refused unless `--force`), `config validate --gpu-memory`
(a warning) and the header of `config estimate`.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, replace

from hf_dist_recipes.core.sizes import GIB
from hf_dist_recipes.parallel.models import ModelShape
from hf_dist_recipes.parallel.plan import ParallelPlan

# Where a value of the plan came from, for the verdict's words; a key missing here reads "default".
SOURCES = ("seq_len", "micro_batch", "activation_checkpointing")


def assumptions(plan: ParallelPlan, sources: dict[str, str] | None = None) -> str:
    """'sequence length 4096 tokens (default), micro batch 1 sequence per GPU (the file), activations stored
    for the backward pass, no recomputation (default)': the activation-side assumptions of an estimate.
    `sources`: where each of SOURCES came from (e.g. "the file", "recorded by config generate", "--seq-len");
    missing ones read "default"."""
    sources = sources or {}

    def src(key: str) -> str:
        return f" ({sources.get(key, 'default')})"

    recompute = (
        "activation checkpointing (each layer recomputed in the backward pass)"
        if plan.activation_checkpointing
        else "activations stored for the backward pass, no recomputation"
    )
    return (
        f"sequence length {plan.seq_len} tokens{src('seq_len')}, micro batch {plan.micro_batch} "
        f"sequence{'s' if plan.micro_batch != 1 else ''} per GPU{src('micro_batch')}, "
        f"{recompute}{src('activation_checkpointing')}"
    )


def plan_flags(plan: ParallelPlan) -> list[str]:
    """The `config estimate` / `config generate` flags that reproduce `plan` (defaults left out)."""
    default = ParallelPlan()
    flags = ["--nodes", str(plan.nodes), "--gpus-per-node", str(plan.procs_per_node)]
    if plan.zero_stage != default.zero_stage:
        flags += ["--zero", str(plan.zero_stage)]
    for name, flag in (("micro_batch", "--micro-batch"), ("seq_len", "--seq-len"), ("grad_accum", "--grad-accum")):
        if getattr(plan, name) != getattr(default, name):
            flags += [flag, str(getattr(plan, name))]
    if plan.precision != default.precision:
        flags += ["--precision", plan.precision]
    if plan.grad_reduce_dtype != default.grad_reduce_dtype:
        flags += ["--grad-reduce-dtype", plan.grad_reduce_dtype]
    if plan.activation_checkpointing:
        flags.append("--activation-checkpointing")
    if plan.loss_chunk_tokens:
        flags += ["--loss-chunk-tokens", str(plan.loss_chunk_tokens)]
    return flags


@dataclass(frozen=True)
class FitVerdict:
    """The estimate of `plan` against `gpu_gib` GiB per GPU (`gpu_source` says where that figure came from).
    `need_gib`: our estimate per GPU; `with_recompute_gib`: the same plan with activation checkpointing (None when
    the plan already recomputes)."""

    plan: ParallelPlan
    model_ref: str
    gpu_gib: float
    gpu_source: str
    need_gib: float
    with_recompute_gib: float | None
    sources: dict[str, str] = field(default_factory=dict)
    hardware: str | None = None

    @property
    def fits(self) -> bool:
        return self.need_gib <= self.gpu_gib

    def suggest_command(self) -> str:
        """`config estimate --suggest` for the same model, machines and activation assumptions."""
        # one decimal, rounded down: the suggestion must fit the GPU, not a tenth of a GiB more
        gib = math.floor(self.gpu_gib * 10) / 10
        args = ["--model", self.model_ref, *plan_flags(self.plan), "--gpu-memory", f"{gib:g}", "--suggest"]
        args += ["--hardware", self.hardware] if self.hardware else []
        return "hf-dist-recipes config estimate " + shlex.join(args)

    def message(self, *, change: str) -> str:
        """The verdict in words. `change`: how the caller's user changes the assumptions (its flags)."""
        p = self.plan
        text = (
            f"by our estimate {self.model_ref} needs {self.need_gib:.1f} GiB per GPU with this plan (ZeRO-"
            f"{p.zero_stage}, TP {p.tp}, EP {p.ep}"
            + (", optimizer offload" if p.offload_optimizer else "")
            + (", parameter offload" if p.offload_params else "")
            + f"; allowance for the CUDA context, NCCL and fragmentation included), more than the {self.gpu_gib:.1f} "
            f"GiB of {self.gpu_source}. It assumes {assumptions(p, self.sources)}; {change}."
        )
        if self.with_recompute_gib is not None:
            text += f" With activation checkpointing it needs {self.with_recompute_gib:.1f} GiB."
        return text + f" Find a plan that fits with: {self.suggest_command()}"


def check_fit(
    plan: ParallelPlan,
    model: ModelShape,
    model_ref: str,
    gpu_gib: float,
    gpu_source: str,
    sources: dict[str, str] | None = None,
    hardware: str | None = None,
) -> FitVerdict:
    """Estimate `plan` for `model` against `gpu_gib` GiB per GPU (a CUDA plan; CPU plans have no GPU limit).
    `hardware`: the `comm.HARDWARE` key the memory came from, passed on to the suggest command."""
    from hf_dist_recipes.parallel.memory import estimate

    need = estimate(plan, model).device_total / GIB
    with_recompute = None
    if not plan.activation_checkpointing and need > gpu_gib:
        with_recompute = estimate(replace(plan, activation_checkpointing=True), model).device_total / GIB
    return FitVerdict(
        plan=plan,
        model_ref=model_ref,
        gpu_gib=gpu_gib,
        gpu_source=gpu_source,
        need_gib=need,
        with_recompute_gib=with_recompute,
        sources=dict(sources or {}),
        hardware=hardware,
    )
