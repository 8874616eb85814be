"""A DeepSpeed config dict as DeepSpeed reads it, `DeepSpeedView.read(config)`: the package's one reader of DeepSpeed
JSON, for the rank and the command line alike. Each section goes through DeepSpeed 0.19.8's own parser
(`get_zero_config`, `get_tensor_parallel_config`, `parse_autoep_config`, the bf16/fp16 configs, the batch `get_*`
readers); the facts follow the engine's tests: an offload is a device in {cpu, nvme} (`zero_use_cpu_optimizer`),
AutoEP is on when `enabled` is true (`_configure_expert_parallel`; a section without it is in `ignored`).

"auto" (the Trainer fills it at run time) is unknown: the batch numbers, the bf16/fp16 flags and the stage read None;
other "auto" values of the ZeRO, TP and precision sections are dropped before DeepSpeed parses them (its defaults
stand in). DeepSpeed is imported on first read; a value it refuses raises ValueError naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepspeed.module_inject.auto_ep_config import AutoEPConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

AUTO, AUTO_TOO = "auto", ' or "auto"'


@dataclass(frozen=True)
class DeepSpeedView:
    """The typed sections are DeepSpeed's own models. `stage`: ZeRO stage (0 by default). `offload_*`: "cpu", "nvme"
    or None. `tp`: AutoTP degree (1 without). `ep_enabled`, `ep`: AutoEP on, and its degree (1 when off). `train_batch`
    / `micro_batch` / `grad_accum`: global batch, per-GPU micro batch, accumulation steps (None: "auto" or absent).
    `bf16` / `fp16`: the enabled flags. `ignored`: warnings, each with its fix."""

    zero: DeepSpeedZeroConfig
    tensor_parallel: TPTrainingConfig
    expert_parallel: AutoEPConfig
    bfloat16: DeepSpeedBF16Config
    float16: DeepSpeedFP16Config
    stage: int | None
    offload_optimizer: str | None
    offload_param: str | None
    tp: int
    ep_enabled: bool
    ep: int
    train_batch: int | None
    micro_batch: int | None
    grad_accum: int | None
    bf16: bool | None
    fp16: bool | None
    ignored: tuple[str, ...] = ()

    @classmethod
    def read(cls, config: Mapping) -> DeepSpeedView:
        """The view of a DeepSpeed config dict (the JSON, or the engine's config after the Trainer filled it)."""
        from deepspeed.runtime import config as ds  # the section readers DeepSpeedConfig itself calls

        # AutoEP's section as written: DeepSpeed takes any true `enabled` (even "auto") as on
        known = {
            k: {n: x for n, x in v.items() if x != AUTO} if isinstance(v, dict) and k != "expert_parallel" else v
            for k, v in config.items()
        }
        zero = _parse("zero_optimization", ds.get_zero_config, known)
        tensor_parallel = _parse("tensor_parallel", ds.get_tensor_parallel_config, known)
        expert_parallel = _parse("expert_parallel", ds.get_expert_parallel_config, known)
        bfloat16, float16 = _parse("bf16", ds.get_bfloat16_config, known), _parse("fp16", ds.get_float16_config, known)
        ep, ep_section = bool(expert_parallel.enabled), config.get("expert_parallel")
        opt, par = zero.offload_optimizer, zero.offload_param  # offload: device cpu or nvme (zero_use_cpu_optimizer)
        return cls(
            zero=zero,
            tensor_parallel=tensor_parallel,
            expert_parallel=expert_parallel,
            bfloat16=bfloat16,
            float16=float16,
            stage=None if _auto(config.get("zero_optimization"), "stage") else int(zero.stage),
            offload_optimizer=opt.device if opt is not None and opt.device != "none" else None,
            offload_param=par.device if par is not None and par.device != "none" else None,
            tp=_count(tensor_parallel.autotp_size or 1, "tensor_parallel.autotp_size", auto=False),
            ep_enabled=ep,
            ep=_count(expert_parallel.autoep_size, "expert_parallel.autoep_size", auto=False) if ep else 1,
            train_batch=_count(ds.get_train_batch_size(config), "train_batch_size"),
            micro_batch=_count(ds.get_train_micro_batch_size_per_gpu(config), "train_micro_batch_size_per_gpu"),
            grad_accum=_count(ds.get_gradient_accumulation_steps(config), "gradient_accumulation_steps"),
            # get_bfloat16_config's own lookup: "bf16", else the older "bfloat16"
            bf16=None if _auto(config.get("bf16", config.get("bfloat16")), "enabled") else bfloat16.enabled,
            fp16=None if _auto(config.get("fp16"), "enabled") else float16.enabled,
            ignored=(_EP_IGNORED,) if ep_section and "enabled" not in ep_section else (),  # parsed: a dict
        )

    @property
    def precision(self) -> str | None:
        """The parameters' dtype: "fp16" (it wins, as in the engine), "bf16" or "fp32"; None while a flag is "auto"."""
        return None if None in (self.fp16, self.bf16) else "fp16" if self.fp16 else "bf16" if self.bf16 else "fp32"


_EP_IGNORED = 'expert_parallel without enabled: true is ignored by DeepSpeed (AutoEP off); set "enabled": true'


def _auto(section, key: str) -> bool:
    return isinstance(section, dict) and section.get(key) == AUTO


def _parse(key: str, parse, config: dict):
    try:
        return parse(config)
    except Exception as err:  # noqa: BLE001 - pydantic's ValidationError (its field and value in 3 lines), or else
        reason = " ".join(line.strip() for line in str(err).strip().splitlines()[:3]) or type(err).__name__
        raise ValueError(f"DeepSpeed refuses the config: {key}: {reason}") from None


def _count(value, key: str, *, auto: bool = True) -> int | None:
    """`value` as a count of at least 1; None for "auto" or absent (where `auto`); else ValueError."""
    if auto and value in (None, AUTO):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DeepSpeed {key} must be a positive integer{AUTO_TOO if auto else ''}, got {value!r}")
    return value
