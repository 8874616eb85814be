"""The ParallelPlan an existing accelerate YAML + DeepSpeed JSON will run, for `config validate --gpu-memory`.

What the files say themselves wins: machines and processes and the SP degree (YAML, its `parallelism_config`), ZeRO
stage, offload, TP and EP degrees, an integer micro batch and accumulation (JSON). What only the plan knew (the model,
the sequence length, the precision the estimate assumed, activation checkpointing, the chunked loss) comes from the
plan recorded by `config generate` (`plan_record`); a file written by hand needs `--model` (and takes the ParallelPlan
defaults for the rest).
`unplanned`: what the files say that the plan does not hold, which `config validate` reports.
"""

from __future__ import annotations

from dataclasses import replace

from hf_dist_recipes.core.findings import ERROR, WARNING
from hf_dist_recipes.parallel.plan_record import recorded_plan
from hf_dist_recipes.planning.launch_config import LaunchConfig
from hf_dist_recipes.planning.plan import ParallelPlan
from hf_dist_recipes.planning.sequence_parallel import MODELLED_SIZES, yaml_sp_size

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
        sp=yaml_sp_size(cfg.raw),
        micro_batch=view.micro_batch or record.get("micro_batch", 1),
        grad_accum=view.grad_accum or record.get("grad_accum", 1),
        seq_len=record.get("seq_len", ParallelPlan.seq_len),
        precision=record.get("precision", "fp32" if cfg.use_cpu else "bf16"),
        activation_checkpointing=bool(record.get("activation_checkpointing", False)),
        loss_chunk_tokens=record.get("loss_chunk_tokens"),
        tiled_mlp_shards=record.get("tiled_mlp_shards"),
    )
    # The gradient reduction dtype the file sets; DeepSpeed's default without it is the compute dtype.
    reduce = str((cfg.deepspeed or {}).get("communication_data_type") or plan.precision).lower()
    plan = replace(plan, grad_reduce_dtype=reduce if reduce in ("fp32", plan.precision) else plan.precision)
    return plan, record.get("model")


def is_loopback(address: str | None) -> bool:
    return bool(address) and str(address).startswith(LOOPBACK_PREFIXES)


def unplanned(cfg: LaunchConfig, world: int, *, memory_checked: bool) -> list[tuple[str, str]]:
    """(level, message) for what a DeepSpeed launch of `world` processes holds beyond its recorded plan: another
    machine or process count than the plan's (its memory, batch and timeouts are another job's: an error),
    sequence or context parallelism the plan does not model (DeepSpeed's own `sequence_parallel_size`, accelerate's
    `parallelism_config` sizes but those of its Ulysses SP block: `sequence_parallel.MODELLED_SIZES`), and a GPU plan
    with a model whose memory was not checked (`memory_checked` False)."""
    record, out = recorded_plan(cfg.deepspeed), []
    nodes, per_node = record.get("nodes"), record.get("procs_per_node")
    if isinstance(nodes, int) and isinstance(per_node, int) and (nodes, nodes * per_node) != (cfg.num_machines, world):
        regenerate = f"--nodes {cfg.num_machines} --gpus-per-node {max(1, world // cfg.num_machines)}"
        other_job = (
            f"the DeepSpeed JSON was generated for {nodes} machine(s) x {per_node} processes; this launch has "
            f"{cfg.num_machines} machine(s) and {world} processes in all, so its memory, batch and timeouts are "
            f"another job's: set num_machines / num_processes to the plan's, or regenerate with config generate "
            f"{regenerate}"
        )
        out.append((ERROR, other_job))
    sizes = {"sequence_parallel_size": (cfg.deepspeed or {}).get("sequence_parallel_size")}
    block = cfg.raw.get("parallelism_config") or {}
    sizes.update((k, v) for k, v in block.items() if k.endswith("_size") and k not in MODELLED_SIZES)
    if beyond := [f"{k}={v}" for k, v in sizes.items() if isinstance(v, int) and v > 1]:
        not_modelled = (
            f"{', '.join(beyond)}: parallelism the plan does not model (the memory per rank, the batch and the TP/EP "
            "groups checked here assume none); check the job itself with hf-dist-recipes preflight"
        )
        out.append((WARNING, not_modelled))
    if not memory_checked and not cfg.use_cpu and record.get("model"):
        unchecked = f"memory not checked: {record['model']} was planned for GPUs; pass --gpu-memory GIB (and "
        out.append((WARNING, unchecked + "--host-memory GIB with offload) to hold the plan to them"))
    return out
