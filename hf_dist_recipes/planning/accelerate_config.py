"""accelerate YAML for a ParallelPlan: the DeepSpeed route (any device) and the FSDP2 + TP route (GPUs only)."""

from __future__ import annotations

import yaml

from hf_dist_recipes.planning.plan import ParallelPlan

DEFAULT_PORT = 29500
MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}
# The attention kernels Ulysses SP takes (accelerate 1.16 utils/dataclasses.py:2174-2190 refuses eager and
# flex_attention; hub-hosted flash kernels are taken too, but not offered here); sdpa is accelerate's default.
SP_ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "flash_attention_3")
DEFAULT_SP_ATTN_IMPLEMENTATION = "sdpa"


def accelerate_config(
    plan: ParallelPlan,
    *,
    deepspeed_file: str | None = None,
    main_process_ip: str = "127.0.0.1",
    main_process_port: int = DEFAULT_PORT,
    machine_rank: int = 0,
    sp_attn_implementation: str = DEFAULT_SP_ATTN_IMPLEMENTATION,
) -> dict:
    """The accelerate config dict. DeepSpeed route: `deepspeed_file` is the JSON's path as written in the YAML
    (relative paths resolve against the directory `accelerate launch` runs in); with `plan.sp` > 1 its
    `parallelism_config` block (`sp_parallelism_config`, attention kernel `sp_attn_implementation`)."""
    config: dict = {"compute_environment": "LOCAL_MACHINE"}
    if plan.engine == "deepspeed":
        if not deepspeed_file:
            raise ValueError("the DeepSpeed route needs the DeepSpeed JSON's path")
        config["distributed_type"] = "DEEPSPEED"
        config["deepspeed_config"] = {
            "deepspeed_config_file": deepspeed_file,
            "deepspeed_multinode_launcher": "standard",
            # No zero3_init_flag: with the Trainer it changes nothing (the arguments register the ZeRO-3 config, so
            # from_pretrained partitions while loading either way; see hf_dist_recipes.parallel.construction).
        }
        # No mixed_precision key: with a deepspeed_config_file accelerate 1.16 refuses it at launch ("will be
        # ignored"); the JSON's bf16/fp16 sections decide precision.
        if plan.sp > 1:
            config["parallelism_config"] = sp_parallelism_config(plan, sp_attn_implementation)
    else:
        config["distributed_type"] = "FSDP"
        config["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_reshard_after_forward": True,
            "fsdp_offload_params": plan.offload_params,
            "fsdp_activation_checkpointing": plan.activation_checkpointing,
        }
        config["mixed_precision"] = MIXED_PRECISION[plan.precision]
        config["parallelism_config"] = {
            "parallelism_config_dp_replicate_size": 1,
            "parallelism_config_dp_shard_size": plan.dp_size,
            "parallelism_config_tp_size": plan.tp,
            "parallelism_config_cp_size": 1,
        }
    config.update(
        {
            "machine_rank": machine_rank,
            "main_training_function": "main",
            "num_machines": plan.nodes,
            "num_processes": plan.world_size,
            "rdzv_backend": "static",
            "same_network": True,
            "use_cpu": plan.device == "cpu",
        }
    )
    if plan.nodes > 1:
        config["main_process_ip"] = main_process_ip
        config["main_process_port"] = main_process_port
    return config


def sp_parallelism_config(plan: ParallelPlan, attn_implementation: str = DEFAULT_SP_ATTN_IMPLEMENTATION) -> dict:
    """The `parallelism_config` block of a DeepSpeed YAML for Ulysses SP, in the keys `accelerate launch` reads
    (commands/launch.py copies each onto its argument of the same name; utils/launch.py:375-398 exports them as
    PARALLELISM_CONFIG_* for the ranks' `ParallelismConfig`). `dp_shard_size` = world / sp: accelerate sets
    DeepSpeed's train_batch_size to micro x accumulation x dp_replicate x dp_shard (accelerator.py:2322-2328), and
    DeepSpeed asserts it against its own data-parallel world, world / sp (runtime/config.py:602-605). Variable
    sequence lengths: the default, so that no `sp_seq_length` is needed."""
    if attn_implementation not in SP_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"Ulysses SP runs attention as {', '.join(SP_ATTN_IMPLEMENTATIONS)} (accelerate refuses eager and "
            f"flex_attention), got {attn_implementation!r}; use --sp-attn-implementation sdpa"
        )
    return {
        "parallelism_config_dp_shard_size": plan.world_size // plan.sp,
        "parallelism_config_sp_size": plan.sp,
        "parallelism_config_sp_backend": "deepspeed",
        "parallelism_config_sp_seq_length_is_variable": True,
        "parallelism_config_sp_attn_implementation": attn_implementation,
    }


def render_yaml(config: dict, header: str = "") -> str:
    """YAML text with `header` as leading comment lines (keys in the order given)."""
    comments = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    return comments + yaml.safe_dump(config, sort_keys=False)
