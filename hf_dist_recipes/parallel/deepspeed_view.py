"""What a DeepSpeed config dict sets, read once the way DeepSpeed reads it: `DeepSpeedView.read(config)`. The one
reader of DeepSpeed JSON in the package, for the training rank (runtime, arguments, batch) and the command line
(lint, launch config, preflight) alike.

Each section goes through DeepSpeed 0.19.8's own parser (`runtime/config.py` and the section modules it calls):
`zero_optimization` -> `DeepSpeedZeroConfig`, `tensor_parallel` -> `TPTrainingConfig`, `expert_parallel` ->
`parse_autoep_config`, `bf16` (or `bfloat16`) / `fp16` -> their precision configs, the batch numbers by their
`get_*` readers. The derived facts follow the engine's own tests: an offload is a device in {cpu, nvme}
(`zero_use_cpu_optimizer`; `"device": "none"` is none); AutoEP is on when the section's `enabled` is true
(`_configure_expert_parallel`); the TP degree is `autotp_size`, 0 or absent for none. What DeepSpeed parses and then
ignores is named in `ignored`, for `config validate` to warn about.

"auto" (a value the Trainer fills at run time): unknown here. The batch numbers, the bf16/fp16 flags and an "auto"
stage read None; other "auto" values of the ZeRO, TP and precision sections are dropped before DeepSpeed parses
them, so their typed models hold DeepSpeed's defaults there (the Trainer fills the ZeRO bucket sizes from the
model). DeepSpeed is imported on first read. A value DeepSpeed refuses raises ValueError naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepspeed.module_inject.auto_ep_config import AutoEPConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

AUTO = "auto"
OFFLOAD_DEVICES = ("cpu", "nvme")


@dataclass(frozen=True)
class DeepSpeedView:
    """A DeepSpeed config as DeepSpeed reads it (module docstring). The typed sections are DeepSpeed's own models;
    the fields below them are the facts the package uses.

    `stage`: ZeRO stage (DeepSpeed's default 0; None for "auto"). `offload_optimizer` / `offload_param`: "cpu" or
    "nvme", None for no offload. `tp`: AutoTP degree (1 without). `ep_enabled`: AutoEP on; `ep`: its degree
    (`autoep_size` when on, else 1). `train_batch` / `micro_batch` / `grad_accum`: the global batch, the per-GPU
    micro batch and the accumulation steps, None where "auto" or absent (the Trainer's, or DeepSpeed's
    derivation). `bf16` / `fp16`: the enabled flags, None for "auto". `ignored`: sentences naming settings
    DeepSpeed parses and then does not use, each with its fix.
    """

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
        from deepspeed.runtime import config as ds_config
        from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config
        from deepspeed.runtime.tensor_parallel.config import get_tensor_parallel_config
        from deepspeed.runtime.zero.config import get_zero_config

        # The AutoEP section is parsed as written: DeepSpeed takes any true `enabled` (even "auto") as on.
        known = {k: _without_auto(v) if k != "expert_parallel" else v for k, v in config.items()}
        zero = _parse("zero_optimization", get_zero_config, known)
        tensor_parallel = _parse("tensor_parallel", get_tensor_parallel_config, known)
        expert_parallel = _parse("expert_parallel", ds_config.get_expert_parallel_config, known)
        bfloat16 = _parse("bf16", get_bfloat16_config, known)
        float16 = _parse("fp16", get_float16_config, known)
        if tensor_parallel.autotp_size < 0:
            raise ValueError(
                f"tensor_parallel.autotp_size must be a positive integer, got {tensor_parallel.autotp_size}; "
                "leave it out (or 0) for no TP"
            )
        ep_enabled = bool(expert_parallel.enabled)
        ep = _count(expert_parallel.autoep_size, "expert_parallel.autoep_size", auto_allowed=False) if ep_enabled else 1
        zero_section = config.get("zero_optimization")
        return cls(
            zero=zero,
            tensor_parallel=tensor_parallel,
            expert_parallel=expert_parallel,
            bfloat16=bfloat16,
            float16=float16,
            stage=None if _is_auto(zero_section, "stage") else int(zero.stage),
            offload_optimizer=_offload_device(zero.offload_optimizer),
            offload_param=_offload_device(zero.offload_param),
            tp=max(tensor_parallel.autotp_size, 1),
            ep_enabled=ep_enabled,
            ep=ep,
            train_batch=_count(ds_config.get_train_batch_size(config), "train_batch_size"),
            micro_batch=_count(ds_config.get_train_micro_batch_size_per_gpu(config), "train_micro_batch_size_per_gpu"),
            grad_accum=_count(ds_config.get_gradient_accumulation_steps(config), "gradient_accumulation_steps"),
            # get_bfloat16_config's own lookup: "bf16", else the older "bfloat16"
            bf16=None if _is_auto(config.get("bf16", config.get("bfloat16")), "enabled") else bfloat16.enabled,
            fp16=None if _is_auto(config.get("fp16"), "enabled") else float16.enabled,
            ignored=_ignored(config),
        )

    @property
    def offload_sections(self) -> bool:
        """Whether the ZeRO section holds an offload section at all, `"device": "none"` included: DeepSpeed's AutoEP
        + AutoTP folding check refuses any (engine `_configure_expert_parallel` passes `zero_offload_optimizer() is
        not None` to `validate_folding_global`)."""
        return self.zero.offload_optimizer is not None or self.zero.offload_param is not None

    @property
    def precision(self) -> str | None:
        """The parameters' dtype the enabled flags give: "fp16" (it wins, as in the engine), "bf16" or "fp32"; None
        while a flag is "auto"."""
        if self.fp16 is None or self.bf16 is None:
            return None
        return "fp16" if self.fp16 else "bf16" if self.bf16 else "fp32"


def _without_auto(section):
    """A section without its "auto" values (DeepSpeed's defaults stand in); anything else unchanged."""
    return {k: v for k, v in section.items() if v != AUTO} if isinstance(section, dict) else section


def _is_auto(section, key: str) -> bool:
    return isinstance(section, dict) and section.get(key) == AUTO


def _parse(key: str, parse: Callable, config: dict):
    try:
        return parse(config)
    except Exception as err:  # noqa: BLE001 - pydantic's ValidationError, or a section that is no JSON object
        raise ValueError(f"DeepSpeed refuses the config: {key}: {_reason(err)}") from None


def _reason(err: Exception) -> str:
    """One line of what DeepSpeed's parser said: each field with the value it refused (pydantic), else the text."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        parts = []
        for e in errors():
            where = ".".join(str(p) for p in e.get("loc", ()))
            parts.append(f"{where}={e.get('input')!r}: {e.get('msg')}" if where else str(e.get("msg")))
        return "; ".join(parts)
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _count(value, key: str, *, auto_allowed: bool = True) -> int | None:
    """`value` as a count of at least 1; None for "auto" or absent (where `auto_allowed`); else ValueError."""
    if auto_allowed and value in (None, AUTO):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        also = ' or "auto"' if auto_allowed else ""
        raise ValueError(f"DeepSpeed {key} must be a positive integer{also}, got {value!r}")
    return value


def _offload_device(section) -> str | None:
    """The engine's offload test (`zero_use_cpu_optimizer`): the device when it is cpu or nvme, else None."""
    device = getattr(section, "device", None)
    device = getattr(device, "value", device)  # the enum, or its value (DeepSpeed's models keep enum values)
    return device if device in OFFLOAD_DEVICES else None


def _ignored(config: Mapping) -> tuple[str, ...]:
    out = []
    ep = config.get("expert_parallel")
    if isinstance(ep, dict) and ep and "enabled" not in ep:
        out.append(
            "expert_parallel without enabled: true is ignored by DeepSpeed (AutoEP off, the model's experts are not "
            'split); set "enabled": true to use AutoEP, or remove the section'
        )
    return tuple(out)
