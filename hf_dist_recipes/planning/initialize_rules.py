"""DeepSpeed 0.19.8 refusals that fire only inside `deepspeed.initialize` (after the model has loaded), decided here
from the config alone, for `config validate`.

`DeepSpeedConfig` (which the lint also runs) accepts every config below; DeepSpeed refuses them later, in the
engine or the ZeRO optimizer it builds, each at the file:line named in the rule (paths under `deepspeed/`).
tests/distributed/test_initialize_refusals.py runs a real `deepspeed.initialize` on one or two CPU processes for
every rule they can reach and checks DeepSpeed's own failure next to the lint's; the README's `config` section
lists them all in a table (raising line, linted, CPU test), with the refusals not linted and why.

Values the Trainer fills at run time ("auto") are unknown here: a rule that needs one is not applied, except where
the Trainer's default makes the refusal the likely outcome (then it is a warning that names the argument).

The rules are the table `RULES`: each one DeepSpeed raising line and a small function of the config's values
(`Settings`, read once) that returns a finding or None, applied in the table's order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from hf_dist_recipes.core.findings import ERROR, WARNING
from hf_dist_recipes.parallel.deepspeed_view import DeepSpeedView

# engine.py:1986 `_is_supported_optimizer`: DeepSpeed's own optimizers (config.py:63, matched lower-case) or a
# class of torch.optim (matched as written).
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")


@dataclass(frozen=True)
class Refusal:
    """One finding: `level` "error" (DeepSpeed stops) or "warning" (it stops under the Trainer's defaults);
    `where`: DeepSpeed 0.19.8's raising line; `message` names the fix."""

    level: str
    where: str
    message: str


def cpu_fp16_supported() -> bool:
    """Whether DeepSpeed's CPU accelerator takes fp16 on this host: where oneDNN has fp16 kernels (DeepSpeed 0.19.8
    `CPU_Accelerator.is_fp16_supported`, which returns None, not False, without). torch asks ideep, which wants
    oneDNN's avx512_core_fp16 level (AVX512-FP16; AMX-FP16 CPUs have it too) or, on CPUs without AVX-512,
    avx2_vnni_2 (AVX-NE-CONVERT and AVX-VNNI-INT8: Arrow Lake, Sierra Forest); ONEDNN_MAX_CPU_ISA can lower it."""
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    return bool(CPU_Accelerator().is_fp16_supported())


@dataclass(frozen=True)
class Settings:
    """The config as DeepSpeed reads it (`view`: a stage of None, "auto", matches no stage rule) and as written
    (`config`, for the top-level keys the view does not model); `world_size`, `use_cpu`, `cpu_fp16`: the launch's."""

    config: dict
    view: DeepSpeedView
    world_size: int | None
    use_cpu: bool | None
    cpu_fp16: bool | None

    def dtype(self, key: str) -> str | None:
        """`data_types.<key>` as DeepSpeed's `DtypeEnum` names it ("fp32", "bf16", ...); None if unset or unknown."""
        from deepspeed.runtime.config import DtypeEnum

        with contextlib.suppress(ValueError, AttributeError):
            return DtypeEnum(self.config.get("data_types", {}).get(key)).name
        return None

    @property
    def optimizer(self) -> str | None:
        optimizer = self.config.get("optimizer")
        return optimizer.get("type") if isinstance(optimizer, dict) else None


Finding = tuple[str, str]  # (level, message); an error's message gets DeepSpeed's raising line appended


def _hpz_with_autoep(s: Settings) -> Finding | None:
    if s.view.stage == 3 and s.view.ep_enabled and s.view.zero.zero_hpz_partition_size > 1:
        return ERROR, (
            f"zero_hpz_partition_size={s.view.zero.zero_hpz_partition_size} with ZeRO-3 + AutoEP: hpZ's secondary "
            "groups are not supported with AutoEP; remove zero_hpz_partition_size (config generate leaves it out)"
        )
    return None


def _quantized_gradients_with_autoep(s: Settings) -> Finding | None:
    if s.view.stage == 3 and s.view.ep_enabled and s.view.zero.zero_quantized_gradients:
        return ERROR, "zero_quantized_gradients with ZeRO-3 + AutoEP is not supported; set it to false"
    return None


def _nvme_without_path(key: str, who: str) -> Callable[[Settings], Finding | None]:
    def rule(s: Settings) -> Finding | None:
        if s.view.stage == 3 and getattr(s.view, key) == "nvme" and not getattr(s.view.zero, key).nvme_path:
            return ERROR, (
                f'{key}.device "nvme" without {key}.nvme_path: DeepSpeed joins None into {who}; set nvme_path '
                'to a directory on a local NVMe disk, or use device "cpu"'
            )
        return None

    return rule


def _nvme_under_zero_1_or_2(s: Settings) -> Finding | None:
    if s.view.stage in (1, 2) and s.view.offload_optimizer == "nvme":
        return WARNING, (
            f'offload_optimizer.device "nvme" under ZeRO-{s.view.stage}: ZeRO-1/2 keep the optimizer states in '
            'CPU memory, not on NVMe (only ZeRO-3 swaps to disk); say device "cpu" or use ZeRO-3'
        )
    return None


def _zero0_grad_accum_dtype(s: Settings) -> Finding | None:
    accum, precision = s.dtype("grad_accum_dtype"), s.view.precision
    if s.view.stage != 0 or accum is None:
        return None
    if precision is None:
        if accum != "fp32":
            return None
        return WARNING, (
            'ZeRO-0 with data_types.grad_accum_dtype "fp32" and bf16/fp16 "auto": when the Trainer '
            "runs with --bf16 or --fp16, DeepSpeed refuses the mix (NotImplementedError in "
            "deepspeed.initialize, runtime/engine.py:2323); use ZeRO-1 or more, or drop grad_accum_dtype"
        )
    if accum != precision:
        return ERROR, (
            f"ZeRO-0 with {precision} parameters and data_types.grad_accum_dtype {accum!r}: without ZeRO "
            "DeepSpeed accumulates gradients only in the parameters' dtype; use ZeRO stage 1 or more "
            "(it keeps fp32 gradients), or drop grad_accum_dtype"
        )
    return None


def _param_dtype(s: Settings) -> Finding | None:
    param_dtype = s.dtype("param_dtype")
    precision = s.view.precision
    if param_dtype is None or precision is None or param_dtype == precision:
        return None
    return ERROR, (
        f"data_types.param_dtype {param_dtype!r} but the enabled precision is {precision}: set the matching "
        "bf16/fp16 enabled flag, or drop param_dtype"
    )


def _reduce_scatters(s: Settings, stage: int) -> bool:
    """Whether ZeRO-`stage` reduce-scatters the gradients here (ZeRO-2 and 3 do unless told not to; ZeRO-1 never)."""
    return s.view.stage == stage and s.view.zero.reduce_scatter


def _predivide(stage: int) -> Callable[[Settings], Finding | None]:
    def rule(s: Settings) -> Finding | None:
        predivide = s.config.get("gradient_predivide_factor", 1.0)
        number = isinstance(predivide, (int, float)) and not isinstance(predivide, bool)
        if _reduce_scatters(s, stage) and number and predivide != 1.0:
            return ERROR, (
                f"gradient_predivide_factor={predivide:g} with ZeRO-{stage}'s reduce-scatter is not supported; "
                "remove it (or set zero_optimization.reduce_scatter false)"
            )
        return None

    return rule


def _prescale(stage: int) -> Callable[[Settings], Finding | None]:
    def rule(s: Settings) -> Finding | None:
        if _reduce_scatters(s, stage) and s.config.get("prescale_gradients") is True:
            return ERROR, f"prescale_gradients with ZeRO-{stage}'s reduce-scatter is not supported; remove it"
        return None

    return rule


def _no_grad_norm(s: Settings) -> bool:
    return not s.view.zero.compute_grad_norm


def _no_grad_norm_with_clipping(s: Settings) -> Finding | None:
    if s.view.stage not in (1, 2) or not _no_grad_norm(s):
        return None
    clip = s.config.get("gradient_clipping", 1.0)  # DeepSpeed's default (constants.py GRADIENT_CLIPPING_DEFAULT)
    if clip == "auto":
        return WARNING, (
            'compute_grad_norm false with gradient_clipping "auto": the Trainer fills max_grad_norm '
            "(1.0 by default) and DeepSpeed then refuses it (runtime/zero/stage_1_and_2.py:213); train "
            "with max_grad_norm=0 or drop compute_grad_norm"
        )
    if isinstance(clip, (int, float)) and clip > 0:
        return ERROR, (
            f"compute_grad_norm false needs gradient_clipping 0 (it is {clip:g}); set it to 0 or drop compute_grad_norm"
        )
    return None


def _no_grad_norm_with_offload(s: Settings) -> Finding | None:
    if s.view.stage in (1, 2) and _no_grad_norm(s) and s.view.offload_optimizer:
        return ERROR, "compute_grad_norm false with optimizer offload is not supported; drop one of them"
    return None


def _no_grad_norm_zero1_bf16(s: Settings) -> Finding | None:
    fp32_accumulation = s.dtype("grad_accum_dtype") == "fp32"
    if s.view.stage == 1 and _no_grad_norm(s) and s.view.bf16 and fp32_accumulation and not s.view.offload_optimizer:
        return ERROR, (
            "compute_grad_norm false under ZeRO-1 with bf16 parameters and fp32 gradient accumulation is not "
            "supported; drop compute_grad_norm"
        )
    return None


def _master_weights(stages: tuple[int, ...]) -> Callable[[Settings], Finding | None]:
    # base_optimizer.py _configure_master_weights calls the stage's validator: 16-bit master weights need the
    # optimizer on the CPU (DeepSpeedCPUAdam, which accelerate maps the Trainer's AdamW to under offload)
    def rule(s: Settings) -> Finding | None:
        bf16, fp16 = s.view.bfloat16, s.view.float16
        if bf16.bf16_master_weights_and_grads and not bf16.bf16_optimizer_states:
            master = "bf16.bf16_master_weights_and_grads"
        elif fp16.fp16_master_weights_and_grads:
            master = "fp16.fp16_master_weights_and_grads"
        else:
            return None
        if s.view.stage not in stages or s.view.offload_optimizer:
            return None
        return ERROR, (
            f"{master} needs optimizer offload (ZeRO-Offload with DeepSpeedCPUAdam); add "
            'zero_optimization.offload_optimizer {"device": "cpu"} or drop it'
        )

    return rule


def _odd_allgather_bucket(s: Settings) -> Finding | None:
    allgather = s.view.zero.allgather_bucket_size
    if s.view.stage in (1, 2) and allgather % 2:
        return ERROR, (
            f"allgather_bucket_size={allgather} must be even (4-byte alignment of 16-bit elements); use {allgather + 1}"
        )
    return None


def _unmanaged_accumulation_with_overlap(s: Settings) -> Finding | None:
    unmanaged = s.config.get("managed_gradient_accumulation") is False
    # the engine's test: gradients partitioned (ZeRO-2 and 3) or no overlap_comm (DeepSpeed's default below ZeRO-3)
    if unmanaged and s.view.stage in (0, 1) and s.view.zero.overlap_comm:
        return ERROR, (
            f"managed_gradient_accumulation false with overlap_comm under ZeRO-{s.view.stage}: only ZeRO-2 supports "
            "it; set overlap_comm false"
        )
    return None


def _unknown_optimizer(s: Settings) -> Finding | None:
    name = s.optimizer
    if not isinstance(name, str) or name.lower() in DEEPSPEED_OPTIMIZERS:
        return None
    import torch

    if getattr(torch.optim, name, None) is not None:
        return None
    return ERROR, (
        f"optimizer.type {name!r} is neither a DeepSpeed optimizer ({', '.join(DEEPSPEED_OPTIMIZERS)}) "
        "nor a torch.optim class; fix the name, or remove the optimizer section (the Trainer then builds "
        "its own AdamW)"
    )


def _lamb_static_loss_scale(s: Settings) -> Finding | None:
    # engine.py:1782 dynamic_loss_scale() reads fp16.loss_scale whether fp16 is enabled or not
    loss_scale = s.view.float16.loss_scale  # DeepSpeed's default 0 for "auto"
    if isinstance(s.optimizer, str) and s.optimizer.lower() == "lamb" and loss_scale != 0:
        return (
            ERROR,
            f"the LAMB optimizer needs dynamic loss scaling, but fp16.loss_scale is {loss_scale:g}; set it to 0",
        )
    return None


def _fp16_on_cpu(s: Settings) -> Finding | None:
    if not (s.use_cpu and s.view.fp16 is True):
        return None
    # A host fact, not a constant: DeepSpeed's CPU accelerator refuses fp16 only on CPUs without fp16 kernels.
    supported = cpu_fp16_supported() if s.cpu_fp16 is None else s.cpu_fp16
    if supported:
        return WARNING, (
            "fp16 enabled on a use_cpu launch: this host's CPU has oneDNN fp16 kernels (AVX512-FP16, "
            "AMX-FP16 or AVX-NE-CONVERT) and DeepSpeed accepts it here, but refuses it on CPUs without "
            "them (runtime/engine.py:2004); use bf16 or fp32 to run anywhere"
        )
    return ERROR, (
        "fp16 enabled on a use_cpu launch: DeepSpeed's CPU accelerator has no fp16 on CPUs without "
        "oneDNN fp16 kernels (AVX512-FP16, AMX-FP16 or AVX-NE-CONVERT), such as this host's; use bf16 or "
        "fp32"
    )


def _inner_tp_size(s: Settings) -> Finding | None:
    inner, tp = s.view.tensor_parallel.tensor_parallel.tp_size, s.view.tp
    if tp > 1 and inner not in (1, tp):
        return ERROR, (
            f"tensor_parallel.tp.tp_size={inner} differs from tensor_parallel.autotp_size={tp}; drop tp.tp_size"
        )
    return None


def _vocab_parallel_backend(s: Settings) -> Finding | None:
    backend = s.view.tensor_parallel.vocab_parallel_ce_backend
    if s.view.tp > 1 and backend != "torch" and not s.view.tensor_parallel.vocab_parallel_lm_head:
        return ERROR, (
            f"vocab_parallel_ce_backend={backend!r} needs vocab_parallel_lm_head true (a vocabulary-parallel "
            "LM head); set it, or drop the backend"
        )
    return None


def _hpz_not_dividing_world(s: Settings) -> Finding | None:
    world, hpz = s.world_size, s.view.zero.zero_hpz_partition_size
    if s.view.stage == 3 and world is not None and hpz > 1 and world % min(hpz, world):
        return ERROR, (
            f"zero_hpz_partition_size={hpz} does not divide the {world} processes; use the GPUs per node (a "
            f"divisor of {world})"
        )
    return None


@dataclass(frozen=True)
class Rule:
    """One refusal: DeepSpeed 0.19.8's raising line and the test that returns (level, message) or None."""

    where: str
    check: Callable[[Settings], Finding | None]


# The rules in the order their findings are reported; the table in docs/commands/config.md lists them all.
RULES: tuple[Rule, ...] = (
    Rule("runtime/engine.py:2226", _hpz_with_autoep),
    Rule("runtime/engine.py:2223", _quantized_gradients_with_autoep),
    # stage3.py:840 `os.path.join(offload_optimizer_config.nvme_path, ...)` -> TypeError on None
    Rule("runtime/zero/stage3.py:840", _nvme_without_path("offload_optimizer", "the optimizer states' swap folder")),
    Rule("runtime/zero/stage_1_and_2.py:220", _nvme_under_zero_1_or_2),
    # partition_parameters.py:1229 asserts (zero.Init: at from_pretrained, or inside initialize)
    Rule(
        "runtime/zero/partition_parameters.py:1229", _nvme_without_path("offload_param", "the parameters' swap folder")
    ),
    Rule("runtime/engine.py:2323", _zero0_grad_accum_dtype),
    Rule("runtime/engine.py:1827", _param_dtype),
    Rule("runtime/zero/stage3.py:395", _predivide(3)),
    Rule("runtime/zero/stage3.py:396", _prescale(3)),
    Rule("runtime/zero/stage_1_and_2.py:350", _predivide(2)),
    Rule("runtime/zero/stage_1_and_2.py:351", _prescale(2)),
    Rule("runtime/zero/stage_1_and_2.py:213", _no_grad_norm_with_clipping),
    Rule("runtime/zero/stage_1_and_2.py:218", _no_grad_norm_with_offload),
    Rule("runtime/engine.py:2308", _no_grad_norm_zero1_bf16),
    Rule("runtime/zero/stage3.py:300", _master_weights((3,))),
    Rule("runtime/zero/stage_1_and_2.py:332", _master_weights((1, 2))),
    Rule("runtime/zero/stage_1_and_2.py:390", _odd_allgather_bucket),
    Rule("runtime/engine.py:2031", _unmanaged_accumulation_with_overlap),
    Rule("runtime/engine.py:2018", _unknown_optimizer),
    Rule("runtime/engine.py:2022", _lamb_static_loss_scale),
    Rule("runtime/engine.py:2004", _fp16_on_cpu),
    Rule("runtime/engine.py:1021", _inner_tp_size),
    Rule("runtime/engine.py:1076", _vocab_parallel_backend),
    Rule("utils/groups.py:71", _hpz_not_dividing_world),
)


def initialize_refusals(
    config: dict, *, world_size: int | None = None, use_cpu: bool | None = None, cpu_fp16: bool | None = None
) -> list[Refusal]:
    """The refusals of the module docstring for a DeepSpeed config dict. `world_size` (all processes) and
    `use_cpu` (the accelerate YAML's) enable the rules that need them. `cpu_fp16`: whether the CPUs that will run
    a `use_cpu` launch have fp16 kernels (None: ask this host, `cpu_fp16_supported`)."""
    settings = Settings(config, DeepSpeedView.read(config), world_size, use_cpu, cpu_fp16)
    out = []
    for rule in RULES:
        found = rule.check(settings)
        if found is None:
            continue
        level, message = found
        if level == ERROR:
            message = f"{message} (DeepSpeed refuses it in deepspeed.initialize, {rule.where})"
        out.append(Refusal(level, rule.where, message))
    return out
