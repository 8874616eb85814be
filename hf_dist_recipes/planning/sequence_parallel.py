"""Ulysses sequence parallelism (SP) in the launch files: what `config generate` says about it in a YAML's header,
how the SP degree is read back from an accelerate YAML, and the checks `config validate` makes of a DeepSpeed YAML's
`parallelism_config` block.

The route (accelerate 1.16, DeepSpeed 0.19.8, transformers 5.25): a DEEPSPEED accelerate YAML carries
`parallelism_config: {parallelism_config_sp_size, _sp_backend, _dp_shard_size, _sp_attn_implementation, ...}`;
`accelerate launch` exports them as PARALLELISM_CONFIG_* (utils/launch.py:375-398) and each rank's Accelerator builds
`ParallelismConfig()` from them, then registers `UlyssesSPAttentionHF` before `deepspeed.initialize`
(accelerator.py:2358-2415). The CLI flag `--use_parallelism_config` is refused without FSDP2 (commands/launch.py:1261),
so the YAML is the only way in for DeepSpeed. The plan's own rules (TP, EP, FSDP2, heads): `ParallelPlan.validate`.
"""

from __future__ import annotations

from hf_dist_recipes.core.findings import ERROR
from hf_dist_recipes.planning.accelerate_config import SP_ATTN_IMPLEMENTATIONS
from hf_dist_recipes.planning.plan import ParallelPlan

PREFIX = "parallelism_config_"
# The sizes of a DeepSpeed YAML's block the plan models (`sp`, and the data-parallel ranks world / sp), which
# `config validate` therefore does not report as parallelism it cannot see.
MODELLED_SIZES = (f"{PREFIX}sp_size", f"{PREFIX}dp_shard_size")
FIRST_FIXED_DEEPSPEED = "0.20.2"  # deepspeedai/DeepSpeed#8854: ZeRO-3 sums SP gradients whatever reduce_scatter says


def sp_words(plan: ParallelPlan) -> str:
    """ ", SP n" for a plan with SP (the YAML header's layout line), "" without: files without SP stay as they were."""
    return f", SP {plan.sp}" if plan.sp > 1 else ""


def sp_header_lines(plan: ParallelPlan, attn_implementation: str) -> list[str]:
    """The YAML header's lines on SP: tokens per rank, what accelerate does with the block, what the script must do."""
    return [
        f"Ulysses SP {plan.sp}: each rank holds {plan.tokens_per_rank} tokens of every {plan.seq_len}-token sequence;",
        f"accelerate passes parallelism_config (dp_shard_size {plan.world_size // plan.sp} = world / sp) to the ranks",
        f"as PARALLELISM_CONFIG_* variables. Load the model with attn_implementation={attn_implementation!r}; every",
        "batch needs position_ids.",
    ]


def yaml_sp_size(raw: dict) -> int:
    """The SP degree an accelerate YAML mapping (`LaunchConfig.raw`) launches: its `parallelism_config_sp_size`, 1
    without one. A value that is no positive integer counts as 1 here; `sp_block_findings` reports it."""
    block = raw.get("parallelism_config") or {}
    value = block.get(f"{PREFIX}sp_size", 1) if isinstance(block, dict) else 1
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def sp_block_findings(raw: dict, world: int, deepspeed: dict | None) -> list[tuple[str, str]]:
    """(level, message) for the `parallelism_config` block of a DEEPSPEED YAML launching `world` processes with the
    DeepSpeed config `deepspeed`, when it asks for SP: sizes that divide (world % sp, dp_replicate x dp_shard =
    world / sp), no TP or CP in the block, sp_backend deepspeed, an attention kernel Ulysses takes, no AutoTP or
    AutoEP in the JSON, and zero_optimization.reduce_scatter left true. Nothing for a YAML without SP."""
    block = raw.get("parallelism_config") or {}
    if not isinstance(block, dict):
        return [(ERROR, f"parallelism_config must be a mapping of {PREFIX}* keys, got {type(block).__name__}")]
    sp = block.get(f"{PREFIX}sp_size", 1)
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        return [(ERROR, f"{PREFIX}sp_size must be a positive integer, got {sp!r}; e.g. {PREFIX}sp_size: 2")]
    if sp == 1:
        return []
    return _size_findings(block, sp, world) + _kernel_findings(block, sp) + _deepspeed_findings(sp, deepspeed or {})


def _size_findings(block: dict, sp: int, world: int) -> list[tuple[str, str]]:
    if world % sp:
        divisors = [d for d in range(2, world + 1) if world % d == 0]
        fix = f"pick sp_size from {divisors} or regenerate with config generate --sp"
        return [
            (
                ERROR,
                f"{PREFIX}sp_size {sp} does not divide num_processes {world} (DeepSpeed lays SP groups over "
                f"consecutive ranks); {fix}",
            )
        ]
    out = []
    beside = {k: block.get(f"{PREFIX}{k}_size", 1) for k in ("tp", "cp")}
    if given := [f"{PREFIX}{k}_size {v}" for k, v in beside.items() if v != 1]:
        out.append(
            (
                ERROR,
                f"{', '.join(given)} beside sp_size {sp}: accelerate refuses CP with SP "
                "(parallelism_config.py:324-330) and DeepSpeed takes no TP next to SP; set them to 1",
            )
        )
    replicate, shard = block.get(f"{PREFIX}dp_replicate_size", 1), block.get(f"{PREFIX}dp_shard_size", 1)
    if not (isinstance(replicate, int) and isinstance(shard, int)) or replicate * shard != world // sp:
        out.append(
            (
                ERROR,
                f"{PREFIX}dp_replicate_size x dp_shard_size is {replicate!r} x {shard!r} with sp_size "
                f"{sp} on {world} processes: accelerate sets DeepSpeed's train_batch_size from it and DeepSpeed "
                f"asserts it against world / sp (runtime/config.py:602); set {PREFIX}dp_shard_size: "
                f"{world // sp} (dp_replicate_size 1)",
            )
        )
    return out


def _kernel_findings(block: dict, sp: int) -> list[tuple[str, str]]:
    backend = block.get(f"{PREFIX}sp_backend", "deepspeed")
    attn = block.get(f"{PREFIX}sp_attn_implementation", "sdpa")
    hub_kernel = isinstance(attn, str) and "/" in attn and "flash-attn" in attn  # accelerate takes these too
    rules = [
        (
            backend != "deepspeed",
            f"{PREFIX}sp_backend is {backend!r}: accelerate's SP runs on DeepSpeed only (accelerator.py:2359); set "
            f"{PREFIX}sp_backend: deepspeed",
        ),
        (
            attn not in SP_ATTN_IMPLEMENTATIONS and not hub_kernel,
            f"{PREFIX}sp_attn_implementation {attn!r} with SP {sp}: Ulysses takes {', '.join(SP_ATTN_IMPLEMENTATIONS)} "
            "or a hub flash kernel, accelerate refuses eager and flex_attention (utils/dataclasses.py:2174); set "
            f"{PREFIX}sp_attn_implementation: sdpa",
        ),
    ]
    return [(ERROR, message) for broken, message in rules if broken]


def _deepspeed_findings(sp: int, deepspeed: dict) -> list[tuple[str, str]]:
    tp = (deepspeed.get("tensor_parallel") or {}).get("autotp_size", 1)
    ep_section = deepspeed.get("expert_parallel") or {}
    ep = ep_section.get("autoep_size", 1) if ep_section.get("enabled") else 1
    zero = deepspeed.get("zero_optimization") or {}
    split = zero.get("reduce_scatter", True) is False and zero.get("contiguous_gradients", True)
    rules = [
        (
            isinstance(tp, int) and tp > 1,
            f"tensor_parallel.autotp_size {tp} beside SP {sp}: DeepSpeed 0.19.8's AutoTP replaces the SP groups "
            "(engine.py:957); remove tensor_parallel or the SP block",
        ),
        (
            isinstance(ep, int) and ep > 1,
            f'expert_parallel.autoep_size {ep} beside SP {sp}: DeepSpeed 0.19.8 refuses it ("AutoEP does not '
            'currently support tensor model parallelism from mpu", engine.py:836); remove expert_parallel or the SP '
            "block",
        ),
        (
            zero.get("stage") == 3 and bool(split) and _before_fix(),
            f"zero_optimization.reduce_scatter false with contiguous_gradients and SP {sp}: transformers refuses it "
            f"on deepspeed < {FIRST_FIXED_DEEPSPEED} (some gradients stay scaled by sp, trainer.py:1823-1843); set "
            "reduce_scatter: true",
        ),
    ]
    return [(ERROR, message) for broken, message in rules if broken]


def _before_fix() -> bool:
    """Whether the installed DeepSpeed predates FIRST_FIXED_DEEPSPEED (True where none is installed: the launch
    host's is unknown, and 0.19.8 is the lock's)."""
    from packaging.version import Version

    from hf_dist_recipes.environment.fingerprint import installed_version

    version = installed_version("deepspeed")
    return version is None or Version(version) < Version(FIRST_FIXED_DEEPSPEED)
