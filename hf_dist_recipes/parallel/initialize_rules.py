"""DeepSpeed 0.19.8 refusals that fire only inside `deepspeed.initialize` (after the model has loaded), decided here
from the config alone, for `config validate`.

`DeepSpeedConfig` (which the lint also runs) accepts every config below; DeepSpeed refuses them later, in the
engine or the ZeRO optimizer it builds, each at the file:line named in the rule (paths under `deepspeed/`).
tests/distributed/test_initialize_refusals.py runs a real `deepspeed.initialize` on one or two CPU processes for
every rule they can reach and checks DeepSpeed's own failure next to the lint's; the README's `config` section
lists them all in a table (raising line, linted, CPU test), with the refusals not linted and why.

Values the Trainer fills at run time ("auto") are unknown here: a rule that needs one is not applied, except where
the Trainer's default makes the refusal the likely outcome (then it is a warning that names the argument).
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_dist_recipes.core.findings import ERROR, WARNING

# engine.py:1986 `_is_supported_optimizer`: DeepSpeed's own optimizers (config.py:63, matched lower-case) or a
# class of torch.optim (matched as written).
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
_DTYPES = {"fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16"}
_DTYPES |= {"bf16": "bf16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Refusal:
    """One finding: `level` "error" (DeepSpeed stops) or "warning" (it stops under the Trainer's defaults);
    `where`: DeepSpeed 0.19.8's raising line; `message` names the fix."""

    level: str
    where: str
    message: str


def _integer(value, default=None):
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _enabled(section) -> bool | None:
    """A `{"enabled": ...}` section's flag: True / False, None for "auto" (the Trainer decides)."""
    if not isinstance(section, dict):
        return False
    value = section.get("enabled", False)
    return None if value == "auto" else bool(value)


def cpu_fp16_supported() -> bool:
    """Whether DeepSpeed's CPU accelerator takes fp16 on this host: where oneDNN has fp16 kernels (DeepSpeed 0.19.8
    `CPU_Accelerator.is_fp16_supported`, which returns None, not False, without). torch asks ideep, which wants
    oneDNN's avx512_core_fp16 level (AVX512-FP16; AMX-FP16 CPUs have it too) or, on CPUs without AVX-512,
    avx2_vnni_2 (AVX-NE-CONVERT and AVX-VNNI-INT8: Arrow Lake, Sierra Forest); ONEDNN_MAX_CPU_ISA can lower it."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    return bool(CPU_Accelerator().is_fp16_supported())


def initialize_refusals(
    config: dict, *, world_size: int | None = None, use_cpu: bool | None = None, cpu_fp16: bool | None = None
) -> list[Refusal]:
    """The refusals of the module docstring for a DeepSpeed config dict. `world_size` (all processes) and
    `use_cpu` (the accelerate YAML's) enable the rules that need them. `cpu_fp16`: whether the CPUs that will run
    a `use_cpu` launch have fp16 kernels (None: ask this host, `cpu_fp16_supported`)."""
    out: list[Refusal] = []

    def add(level: str, where: str, message: str) -> None:
        out.append(Refusal(level, where, f"{message} (DeepSpeed refuses it in deepspeed.initialize, {where})"))

    zero = config.get("zero_optimization") or {}
    zero = zero if isinstance(zero, dict) else {}
    # DeepSpeed's default stage is 0; a non-integer ("auto") leaves every stage rule unapplied (None matches none)
    stage = _integer(zero.get("stage", 0))
    ep = config.get("expert_parallel") or {}
    tp_cfg = config.get("tensor_parallel") or {}
    # AutoEP replaces the MoE layers whenever the section is enabled, autoep_size 1 included (seen on CPU).
    autoep = isinstance(ep, dict) and ep.get("enabled") is True
    tp = _integer(tp_cfg.get("autotp_size"), 1) if isinstance(tp_cfg, dict) else 1

    if stage == 3 and autoep:
        hpz = _integer(zero.get("zero_hpz_partition_size"), 1)
        if hpz > 1:
            add(
                ERROR,
                "runtime/engine.py:2226",
                f"zero_hpz_partition_size={hpz} with ZeRO-3 + AutoEP: hpZ's secondary groups are not supported "
                "with AutoEP; remove zero_hpz_partition_size (config generate leaves it out under EP)",
            )
        if zero.get("zero_quantized_gradients") is True:
            add(
                ERROR,
                "runtime/engine.py:2223",
                "zero_quantized_gradients with ZeRO-3 + AutoEP is not supported; set it to false",
            )

    etp = _integer(ep.get("expert_tensor_parallel_size"), 1) if autoep else 1
    if etp != 1 and world_size is None:
        # With a world size the lint runs DeepSpeed's own validate_autoep_config, which raises this itself.
        add(
            ERROR,
            "module_inject/auto_ep_folding.py:215",
            f"expert_parallel.expert_tensor_parallel_size={etp}: AutoEP does not support expert tensor "
            "parallelism yet (ZeRO-3's own refusal, engine.py:2231, is never reached); remove it",
        )

    for key, where, who in (
        # stage3.py:840 `os.path.join(offload_optimizer_config.nvme_path, ...)` -> TypeError on None
        ("offload_optimizer", "runtime/zero/stage3.py:840", "the optimizer states' swap folder"),
        # partition_parameters.py:1229 asserts (zero.Init: at from_pretrained, or inside initialize)
        ("offload_param", "runtime/zero/partition_parameters.py:1229", "the parameters' swap folder"),
    ):
        section = zero.get(key)
        if not isinstance(section, dict) or str(section.get("device", "")).lower() != "nvme":
            continue
        if stage == 3 and not section.get("nvme_path"):
            add(
                ERROR,
                where,
                f'{key}.device "nvme" without {key}.nvme_path: DeepSpeed joins None into {who}; set nvme_path '
                'to a directory on a local NVMe disk, or use device "cpu"',
            )
        elif stage in (1, 2) and key == "offload_optimizer":
            out.append(
                Refusal(
                    WARNING,
                    "runtime/zero/stage_1_and_2.py:220",
                    f'offload_optimizer.device "nvme" under ZeRO-{stage}: ZeRO-1/2 keep the optimizer states in '
                    'CPU memory, not on NVMe (only ZeRO-3 swaps to disk); say device "cpu" or use ZeRO-3',
                )
            )

    fp16, bf16 = _enabled(config.get("fp16")), _enabled(config.get("bf16"))
    data_types = config.get("data_types") or {}
    data_types = data_types if isinstance(data_types, dict) else {}
    accum = _DTYPES.get(str(data_types.get("grad_accum_dtype", "")).lower())
    if stage == 0 and accum is not None:
        if fp16 is None or bf16 is None:
            if accum == "fp32":
                out.append(
                    Refusal(
                        WARNING,
                        "runtime/engine.py:2323",
                        'ZeRO-0 with data_types.grad_accum_dtype "fp32" and bf16/fp16 "auto": when the Trainer '
                        "runs with --bf16 or --fp16, DeepSpeed refuses the mix (NotImplementedError in "
                        "deepspeed.initialize, runtime/engine.py:2323); use ZeRO-1 or more, or drop grad_accum_dtype",
                    )
                )
        else:
            model = "fp16" if fp16 else "bf16" if bf16 else "fp32"
            if accum != model:
                add(
                    ERROR,
                    "runtime/engine.py:2323",
                    f"ZeRO-0 with {model} parameters and data_types.grad_accum_dtype {accum!r}: without ZeRO "
                    "DeepSpeed accumulates gradients only in the parameters' dtype; use ZeRO stage 1 or more "
                    "(it keeps fp32 gradients), or drop grad_accum_dtype",
                )
    param_dtype = _DTYPES.get(str(data_types.get("param_dtype", "")).lower())
    if param_dtype is not None and fp16 is not None and bf16 is not None:
        model = "fp16" if fp16 else "bf16" if bf16 else "fp32"
        if param_dtype != model:
            add(
                ERROR,
                "runtime/engine.py:1827",
                f"data_types.param_dtype {param_dtype!r} but the enabled precision is {model}: set the matching "
                "bf16/fp16 enabled flag, or drop param_dtype",
            )

    if stage in (2, 3) and zero.get("reduce_scatter", True) is not False:
        # ZeRO-3: stage3.py:395/396; ZeRO-2: stage_1_and_2.py:350/351 (ZeRO-1 does not reduce-scatter gradients)
        file = "runtime/zero/stage3.py" if stage == 3 else "runtime/zero/stage_1_and_2.py"
        lines = (395, 396) if stage == 3 else (350, 351)
        predivide = config.get("gradient_predivide_factor", 1.0)
        if isinstance(predivide, (int, float)) and not isinstance(predivide, bool) and predivide != 1.0:
            add(
                ERROR,
                f"{file}:{lines[0]}",
                f"gradient_predivide_factor={predivide:g} with ZeRO-{stage}'s reduce-scatter is not supported; "
                "remove it (or set zero_optimization.reduce_scatter false)",
            )
        if config.get("prescale_gradients") is True:
            add(
                ERROR,
                f"{file}:{lines[1]}",
                f"prescale_gradients with ZeRO-{stage}'s reduce-scatter is not supported; remove it",
            )

    if stage in (1, 2) and zero.get("compute_grad_norm") is False:
        clip = config.get("gradient_clipping", 1.0)  # DeepSpeed's default (constants.py GRADIENT_CLIPPING_DEFAULT)
        if clip == "auto":
            out.append(
                Refusal(
                    WARNING,
                    "runtime/zero/stage_1_and_2.py:213",
                    'compute_grad_norm false with gradient_clipping "auto": the Trainer fills max_grad_norm '
                    "(1.0 by default) and DeepSpeed then refuses it (runtime/zero/stage_1_and_2.py:213); train "
                    "with max_grad_norm=0 or drop compute_grad_norm",
                )
            )
        elif isinstance(clip, (int, float)) and clip > 0:
            add(
                ERROR,
                "runtime/zero/stage_1_and_2.py:213",
                f"compute_grad_norm false needs gradient_clipping 0 (it is {clip:g}); set it to 0 or drop "
                "compute_grad_norm",
            )
        offload = zero.get("offload_optimizer")
        if isinstance(offload, dict) and str(offload.get("device", "none")).lower() != "none":
            add(
                ERROR,
                "runtime/zero/stage_1_and_2.py:218",
                "compute_grad_norm false with optimizer offload is not supported; drop one of them",
            )

    offload_opt = zero.get("offload_optimizer")
    offloads = isinstance(offload_opt, dict) and str(offload_opt.get("device", "none")).lower() != "none"
    if stage == 1 and zero.get("compute_grad_norm") is False and bf16 and accum == "fp32" and not offloads:
        add(
            ERROR,
            "runtime/engine.py:2308",
            "compute_grad_norm false under ZeRO-1 with bf16 parameters and fp32 gradient accumulation is not "
            "supported; drop compute_grad_norm",
        )
    bf16_section = config.get("bf16") if isinstance(config.get("bf16"), dict) else {}
    fp16_section = config.get("fp16") if isinstance(config.get("fp16"), dict) else {}
    master = (
        "bf16.bf16_master_weights_and_grads"
        if bf16_section.get("bf16_master_weights_and_grads") is True and not bf16_section.get("bf16_optimizer_states")
        else "fp16.fp16_master_weights_and_grads"
        if fp16_section.get("fp16_master_weights_and_grads") is True
        else None
    )
    if master and stage in (1, 2, 3) and not offloads:
        # base_optimizer.py _configure_master_weights calls the stage's validator: 16-bit master weights need the
        # optimizer on the CPU (DeepSpeedCPUAdam, which accelerate maps the Trainer's AdamW to under offload)
        add(
            ERROR,
            "runtime/zero/stage3.py:300" if stage == 3 else "runtime/zero/stage_1_and_2.py:332",
            f"{master} needs optimizer offload (ZeRO-Offload with DeepSpeedCPUAdam); add "
            'zero_optimization.offload_optimizer {"device": "cpu"} or drop it',
        )

    if stage in (1, 2):
        allgather = _integer(zero.get("allgather_bucket_size"))
        if allgather is not None and allgather % 2:
            add(
                ERROR,
                "runtime/zero/stage_1_and_2.py:390",
                f"allgather_bucket_size={allgather} must be even (4-byte alignment of 16-bit elements); use "
                f"{allgather + 1}",
            )

    if config.get("managed_gradient_accumulation") is False and stage in (0, 1, 3) and zero.get("overlap_comm") is True:
        add(
            ERROR,
            "runtime/engine.py:2031",
            f"managed_gradient_accumulation false with overlap_comm under ZeRO-{stage}: only ZeRO-2 supports "
            "it; set overlap_comm false",
        )

    optimizer = config.get("optimizer")
    name = optimizer.get("type") if isinstance(optimizer, dict) else None
    if isinstance(name, str) and name.lower() not in DEEPSPEED_OPTIMIZERS:
        import torch

        if getattr(torch.optim, name, None) is None:
            add(
                ERROR,
                "runtime/engine.py:2018",
                f"optimizer.type {name!r} is neither a DeepSpeed optimizer ({', '.join(DEEPSPEED_OPTIMIZERS)}) "
                "nor a torch.optim class; fix the name, or remove the optimizer section (the Trainer then builds "
                "its own AdamW)",
            )

    loss_scale = (config.get("fp16") or {}).get("loss_scale", 0) if isinstance(config.get("fp16"), dict) else 0
    if isinstance(name, str) and name.lower() == "lamb" and loss_scale not in (0, "auto"):
        # engine.py:1782 dynamic_loss_scale() reads fp16.loss_scale whether fp16 is enabled or not
        add(
            ERROR,
            "runtime/engine.py:2022",
            f"the LAMB optimizer needs dynamic loss scaling, but fp16.loss_scale is {loss_scale}; set it to 0",
        )

    if use_cpu and fp16 is True:
        # A host fact, not a constant: DeepSpeed's CPU accelerator refuses fp16 only on CPUs without fp16 kernels.
        if cpu_fp16 is None:
            cpu_fp16 = cpu_fp16_supported()
        if cpu_fp16:
            out.append(
                Refusal(
                    WARNING,
                    "runtime/engine.py:2004",
                    "fp16 enabled on a use_cpu launch: this host's CPU has oneDNN fp16 kernels (AVX512-FP16, "
                    "AMX-FP16 or AVX-NE-CONVERT) and DeepSpeed accepts it here, but refuses it on CPUs without "
                    "them (runtime/engine.py:2004); use bf16 or fp32 to run anywhere",
                )
            )
        else:
            add(
                ERROR,
                "runtime/engine.py:2004",
                "fp16 enabled on a use_cpu launch: DeepSpeed's CPU accelerator has no fp16 on CPUs without "
                "oneDNN fp16 kernels (AVX512-FP16, AMX-FP16 or AVX-NE-CONVERT), such as this host's; use bf16 or "
                "fp32",
            )

    if tp > 1 and isinstance(tp_cfg, dict):
        inner = _integer((tp_cfg.get("tp") or {}).get("tp_size") if isinstance(tp_cfg.get("tp"), dict) else None)
        if inner is not None and inner not in (1, tp):
            add(
                ERROR,
                "runtime/engine.py:1021",
                f"tensor_parallel.tp.tp_size={inner} differs from tensor_parallel.autotp_size={tp}; drop tp.tp_size",
            )
        backend = tp_cfg.get("vocab_parallel_ce_backend", "torch")
        if backend != "torch" and not tp_cfg.get("vocab_parallel_lm_head"):
            add(
                ERROR,
                "runtime/engine.py:1076",
                f"vocab_parallel_ce_backend={backend!r} needs vocab_parallel_lm_head true (a vocabulary-parallel "
                "LM head); set it, or drop the backend",
            )

    hpz = _integer(zero.get("zero_hpz_partition_size"), 1)
    if stage == 3 and world_size is not None and hpz > 1 and world_size % min(hpz, world_size):
        add(
            ERROR,
            "utils/groups.py:71",
            f"zero_hpz_partition_size={hpz} does not divide the {world_size} processes; use the GPUs per node (a "
            f"divisor of {world_size})",
        )
    return out
