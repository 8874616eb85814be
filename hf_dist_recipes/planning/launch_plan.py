"""The ParallelPlan an existing accelerate YAML + DeepSpeed JSON will run, for `config validate --gpu-memory`.

What the files say themselves wins: machines and processes (YAML), ZeRO stage, offload, TP and EP degrees, an
integer micro batch and accumulation (JSON). What only the plan knew (the model, the sequence length, the
precision the estimate assumed, activation checkpointing, the chunked loss) comes from the plan recorded by `config
generate` (`plan_record`); a file written by hand needs `--model` (and takes the ParallelPlan defaults for the rest).
"""

from __future__ import annotations

from dataclasses import replace

from hf_dist_recipes.parallel.plan_record import recorded_plan
from hf_dist_recipes.planning.launch_config import LaunchConfig
from hf_dist_recipes.planning.plan import ParallelPlan

LOOPBACK_PREFIXES = ("127.", "localhost", "::1")


def plan_of_launch(cfg: LaunchConfig, world: int) -> tuple[ParallelPlan, str | None]:
    """(plan, model reference or None) of a DeepSpeed launch config with `world` processes in all."""
    record, view = recorded_plan(cfg.deepspeed), cfg.view
    plan = ParallelPlan(
        nodes=cfg.num_machines,
        procs_per_node=max(1, world // cfg.num_machines),
        device="cpu" if cfg.use_cpu else "cuda",
        zero_stage=view.stage or 0,
        offload_optimizer=view.offload_optimizer is not None,
        offload_params=view.offload_param is not None,
        tp=view.tp,
        ep=view.ep,
        micro_batch=view.micro_batch or record.get("micro_batch", 1),
        grad_accum=view.grad_accum or record.get("grad_accum", 1),
        seq_len=record.get("seq_len", ParallelPlan.seq_len),
        precision=record.get("precision", "fp32" if cfg.use_cpu else "bf16"),
        activation_checkpointing=bool(record.get("activation_checkpointing", False)),
        loss_chunk_tokens=record.get("loss_chunk_tokens"),
    )
    # The gradient reduction dtype the file sets; DeepSpeed's default without it is the compute dtype.
    reduce = str((cfg.deepspeed or {}).get("communication_data_type") or plan.precision).lower()
    plan = replace(plan, grad_reduce_dtype=reduce if reduce in ("fp32", plan.precision) else plan.precision)
    return plan, record.get("model")


def is_loopback(address: str | None) -> bool:
    return bool(address) and str(address).startswith(LOOPBACK_PREFIXES)
