"""Whether a plan fits its GPUs by our memory estimate (`memory.estimate`), in words that state what the estimate
assumed: the sequence length, the micro batch and activation recomputation (the activations depend on them, the
model states do not), where each value came from, and how to change it.

Used by `config generate` (a plan over `--memory-target` of the GPU, or whose resume peak exceeds `--host-memory`,
is refused unless `--force`) and `config validate --gpu-memory` (over the GPU: an error; over the target: a
warning).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field, replace

from hf_dist_recipes.core.sizes import GIB
from hf_dist_recipes.planning.memory import DEFAULT_DEVICE_TARGET, DEFAULT_ROUTING_IMBALANCE
from hf_dist_recipes.planning.models import ModelShape
from hf_dist_recipes.planning.plan import ParallelPlan

# Where a value of the plan came from, for the verdict's words; a key missing here reads "default".
SOURCES = ("seq_len", "micro_batch", "activation_checkpointing")
FLAGS = {k: "--" + k.replace("_", "-") for k in (*SOURCES, "sp")}  # the flag of each: --seq-len, --micro-batch, ...


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
    per_rank = f" ({plan.tokens_per_rank} per rank with SP {plan.sp})" if plan.sp > 1 else ""
    return (
        f"sequence length {plan.seq_len} tokens{per_rank}{src('seq_len')}, micro batch {plan.micro_batch} "
        f"sequence{'s' if plan.micro_batch != 1 else ''} per GPU{src('micro_batch')}, "
        f"{recompute}{src('activation_checkpointing')}"
    )


def plan_flags(plan: ParallelPlan) -> list[str]:
    """The `config estimate` / `config generate` flags that reproduce `plan` (defaults left out)."""
    default = ParallelPlan()
    flags = ["--nodes", str(plan.nodes), "--gpus-per-node", str(plan.procs_per_node)]
    if plan.zero_stage != default.zero_stage:
        flags += ["--zero", str(plan.zero_stage)]
    if plan.sp > 1:
        flags += ["--sp", str(plan.sp)]
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
    if plan.tiled_mlp_shards:
        flags += ["--tiled-mlp-shards", str(plan.tiled_mlp_shards)]
    return flags


@dataclass(frozen=True)
class FitVerdict:
    """The estimate of `plan` against `gpu_gib` GiB per GPU (`gpu_source` says where that figure came from).
    `need_gib`: our estimate per GPU; `with_recompute_gib`: the same plan with activation checkpointing (None when
    the plan already recomputes); `device_target`: the fraction of `gpu_gib` the plan may fill; `host_gib`: host
    memory per node (None: not checked) from `host_source`, against `host_peak_gib`, the resume peak per node
    (`host_steady_gib` while training)."""

    plan: ParallelPlan
    model_ref: str
    gpu_gib: float
    gpu_source: str
    need_gib: float
    with_recompute_gib: float | None
    sources: dict[str, str] = field(default_factory=dict)
    hardware: str | None = None
    device_target: float = 1.0
    host_gib: float | None = None
    host_source: str = "--host-memory"
    host_steady_gib: float = 0.0
    host_peak_gib: float = 0.0

    @property
    def device_fits(self) -> bool:
        return self.need_gib <= self.gpu_gib * self.device_target

    @property
    def host_fits(self) -> bool | None:
        return None if self.host_gib is None else self.host_peak_gib <= self.host_gib

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits is not False

    def suggest_command(self) -> str:
        """`config estimate --suggest` for the same model, machines and activation assumptions."""
        # one decimal, rounded down: the suggestion must fit the GPU, not a tenth of a GiB more
        gib = f"{math.floor(self.gpu_gib * 10) / 10:g}" if math.isfinite(self.gpu_gib) else "GIB"
        args = ["--model", self.model_ref, *plan_flags(self.plan), "--gpu-memory", gib, "--suggest"]
        args += ["--hardware", self.hardware] if self.hardware else []
        args += ["--host-memory", f"{self.host_gib:g}"] if self.host_gib is not None else []
        # A stricter target the user chose carries over; validate's own limit (the whole GPU: above it is an error)
        # does not: the suggestion aims at the default headroom, as --suggest does.
        args += ["--memory-target", f"{self.device_target:g}"] if self.device_target < DEFAULT_DEVICE_TARGET else []
        return "hf-dist-recipes config estimate " + shlex.join(args)

    def host_message(self) -> str:
        """The host verdict in words (the resume peak against the node's memory)."""
        peak = (
            f"{self.host_peak_gib:,.0f} GiB at the peak of a resume ({self.host_steady_gib:,.0f} GiB of offloaded "
            "states and processes while training, plus the optimizer files a stock resume loads)"
            if self.host_peak_gib > self.host_steady_gib
            else f"{self.host_peak_gib:,.0f} GiB (offloaded states and the ranks' processes, while training and at a "
            "memory-mapped resume)"
        )
        return (
            f"by our estimate a node needs {peak} of host memory, more than the {self.host_gib:,.0f} GiB of "
            f"{self.host_source}: offload less (more nodes, or no parameter offload), or find a plan that fits with: "
            f"{self.suggest_command()}"
        )

    def message(self, *, change: str) -> str:
        """The verdict in words (the device's when it does not fit, else the host's). `change`: how the caller's
        user changes the assumptions (its flags)."""
        if self.device_fits:
            return self.host_message()
        p = self.plan
        limit = (
            f"{self.gpu_gib * self.device_target:.1f} GiB, {self.device_target:.0%} of the {self.gpu_gib:.1f} GiB"
            if self.device_target < 1
            else f"{self.gpu_gib:.1f} GiB"
        )
        text = (
            f"by our estimate {self.model_ref} needs {self.need_gib:.1f} GiB per GPU with this plan (ZeRO-"
            f"{p.zero_stage}, TP {p.tp}, EP {p.ep}"
            + (f", SP {p.sp}" if p.sp > 1 else "")
            + (", optimizer offload" if p.offload_optimizer else "")
            + (", parameter offload" if p.offload_params else "")
            + f"; allowance for the CUDA context, NCCL and fragmentation included), more than the {limit} "
            f"of {self.gpu_source}. It assumes {assumptions(p, self.sources)}; {change}."
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
    *,
    device_target: float = 1.0,
    host_gib: float | None = None,
    host_source: str = "--host-memory",
    routing_imbalance: float = DEFAULT_ROUTING_IMBALANCE,
    memory_mapped_resume: bool = True,
) -> FitVerdict:
    """Estimate `plan` for `model` against `device_target` of `gpu_gib` GiB per GPU (a CUDA plan; CPU plans have no
    GPU limit) and, given `host_gib` per node, its resume peak against the host. `hardware`: the `comm.HARDWARE`
    key the memory came from, passed on to the suggest command."""
    from hf_dist_recipes.planning.memory import estimate

    est = estimate(plan, model, routing_imbalance=routing_imbalance, memory_mapped_resume=memory_mapped_resume)
    need = est.device_total / GIB
    with_recompute = None
    if not plan.activation_checkpointing and need > gpu_gib * device_target:
        recompute = replace(plan, activation_checkpointing=True)
        with_recompute = estimate(recompute, model, routing_imbalance=routing_imbalance).device_total / GIB
    return FitVerdict(
        plan=plan,
        model_ref=model_ref,
        gpu_gib=gpu_gib,
        gpu_source=gpu_source,
        need_gib=need,
        with_recompute_gib=with_recompute,
        sources=dict(sources or {}),
        hardware=hardware,
        device_target=device_target,
        host_gib=host_gib,
        host_source=host_source,
        host_steady_gib=est.host_steady_per_node / GIB,
        host_peak_gib=est.host_resume_peak_per_node / GIB,
    )
