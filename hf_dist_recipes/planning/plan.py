"""ParallelPlan: one typed description of a distributed job, and the checks that make it launchable.

Derived sizes (one place owns each):
- world size = nodes x processes per node;
- data-parallel size = world / TP (the ranks of a TP group see the same samples);
- expert-data-parallel size = world / EP (DeepSpeed AutoEP lays EP groups over consecutive ranks across TP lanes);
- global batch = micro batch x gradient accumulation x data-parallel size.

`validate` raises ValueError naming the fix for anything DeepSpeed or accelerate would refuse (or silently get
wrong) and returns warnings for what runs but wastes GPUs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, get_args

from packaging.version import Version

from hf_dist_recipes.core.user_values import positive_int
from hf_dist_recipes.environment.fingerprint import installed_version
from hf_dist_recipes.planning.models import ModelShape

# The closed sets, typed (the tuples are what `validate` and the CLI's choices read: one source).
Device = Literal["cuda", "cpu"]
Precision = Literal["bf16", "fp16", "fp32"]
# Gradient reduction dtype (DeepSpeed's `communication_data_type`): fp32 by default, as torchtitan's FSDP
# `mixed_precision_reduce = "float32"` and Megatron-LM's fp32 gradient reduction; the compute dtype as an option.
GradReduceDtype = Literal["fp32", "bf16", "fp16"]
Engine = Literal["deepspeed", "fsdp2"]
DEVICES: tuple[str, ...] = get_args(Device)
PRECISIONS: tuple[str, ...] = get_args(Precision)
GRAD_REDUCE_DTYPES: tuple[str, ...] = get_args(GradReduceDtype)
ENGINES: tuple[str, ...] = get_args(Engine)
MIN_DEEPSPEED_ZERO3_AUTOTP = "0.19.4"  # DeepSpeed PRs 8167/8168: AutoTP training with ZeRO-3
# DeepSpeed AutoEP presets (deepspeed/module_inject/auto_ep_presets) by transformers model_type.
EP_PRESETS = {
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
}


@dataclass(frozen=True)
class ParallelPlan:
    """A distributed training job. Sizes are process counts; `seq_len` in tokens; `micro_batch` in sequences per
    rank per micro step. Defaults: one node of 8 GPUs, ZeRO-3, no TP/EP, bf16. `zero_init`: the model is built
    under `deepspeed.zero.Init`, as `from_pretrained` / `from_config` do under ZeRO-3 (False: constructed
    directly, e.g. `DeepseekV3ForCausalLM(config)`); it decides how weights that TP keeps whole are partitioned.
    `grad_reduce_dtype`: the dtype gradients are reduced in across ranks (DeepSpeed `communication_data_type`):
    "fp32" (default) or the compute dtype ("bf16" under bf16, "fp16" under fp16), which halves those bytes.
    `loss_chunk_tokens`: the training loss is computed this many tokens at a time (`parallel.chunked_loss`, the
    arguments' `loss_chunk_tokens`), so the estimate counts one chunk's logits (None: the stock loss, all of them)."""

    nodes: int = 1
    procs_per_node: int = 8
    device: Device = "cuda"
    zero_stage: int = 3
    offload_optimizer: bool = False
    offload_params: bool = False
    tp: int = 1
    ep: int = 1
    micro_batch: int = 1
    grad_accum: int = 1
    seq_len: int = 4096
    precision: Precision = "bf16"
    activation_checkpointing: bool = False
    engine: Engine = "deepspeed"
    zero_init: bool = True
    grad_reduce_dtype: GradReduceDtype = "fp32"
    loss_chunk_tokens: int | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp

    @property
    def edp_size(self) -> int:
        return self.world_size // self.ep

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp_size

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "world_size": self.world_size,
            "dp_size": self.dp_size,
            "edp_size": self.edp_size,
            "global_batch": self.global_batch,
        }

    def validate(self, model: ModelShape | None = None, *, deepspeed_version: str | None = None) -> list[str]:
        """Raise ValueError for the first rule broken; return warnings. `deepspeed_version` defaults to the
        installed one (the rule on ZeRO-3 + AutoTP is skipped when DeepSpeed is not installed)."""
        warnings: list[str] = []
        for name in ("nodes", "procs_per_node", "tp", "ep", "micro_batch", "grad_accum", "seq_len"):
            positive_int(getattr(self, name), name, getattr(ParallelPlan, name))  # the default as the example
        if self.loss_chunk_tokens is not None:
            note = "pass --loss-chunk-tokens N or leave it out for the stock loss"
            positive_int(self.loss_chunk_tokens, "loss_chunk_tokens", 4096, unit="tokens", note=note)
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
            raise ValueError(f"grad_reduce_dtype must be one of {GRAD_REDUCE_DTYPES}, got {self.grad_reduce_dtype!r}")
        if self.grad_reduce_dtype not in ("fp32", self.precision):
            fix = "fp32" if self.precision == "fp32" else f"fp32 or {self.precision}"
            raise ValueError(
                f"reducing {self.precision} gradients in {self.grad_reduce_dtype} would round them to another "
                f"format; use --grad-reduce-dtype {fix}"
            )
        if self.device == "cpu" and self.precision == "fp16":
            # Not a constant of CPUs: some have fp16 kernels. A plan describes machines it cannot ask (the lint of a
            # launch asks its host: initialize_rules.cpu_fp16_supported), so it keeps to what runs on every CPU.
            raise ValueError(
                "fp16 on CPU runs only where the CPUs have oneDNN fp16 kernels (AVX512-FP16, AMX-FP16 or "
                "AVX-NE-CONVERT), and DeepSpeed refuses it on the others (runtime/engine.py:2004); use --precision "
                "bf16 or fp32 on CPU"
            )
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("optimizer offload needs ZeRO stage 1 or more; use --zero 3")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("parameter offload needs ZeRO stage 3; use --zero 3")
        if self.engine == "deepspeed" and self.zero_stage == 0 and self.precision != "fp32":
            # The generated JSON accumulates gradients in fp32; without ZeRO DeepSpeed 0.19.8 refuses that next to
            # 16-bit parameters in deepspeed.initialize (engine.py:2323 "unsupported mix of model_dtype ...").
            raise ValueError(
                f"ZeRO-0 with {self.precision}: DeepSpeed accumulates gradients in fp32 only under ZeRO stage 1 or "
                "more (it refuses the mix without ZeRO); use --zero 1 (parameters stay whole on every GPU, as with "
                "ZeRO-0) or --precision fp32"
            )
        if self.world_size % self.tp:
            raise ValueError(
                f"world size {self.world_size} ({self.nodes} x {self.procs_per_node}) is not divisible "
                f"by TP {self.tp}; pick a TP that divides {self.world_size}"
            )
        if self.tp > self.procs_per_node or self.procs_per_node % self.tp:
            warnings.append(
                f"TP {self.tp} spans nodes ({self.procs_per_node} processes per node): its per-layer "
                "all-reduces would cross the network; keep TP within a node"
            )
        if self.world_size % self.ep:
            raise ValueError(
                f"EP {self.ep} must divide the world size {self.world_size} (DeepSpeed lays expert "
                f"groups over consecutive ranks); pick EP from {_divisors(self.world_size)}"
            )
        if self.engine == "fsdp2":
            self._validate_fsdp2()
        elif self.tp > 1 and self.zero_stage == 3:
            self._validate_deepspeed_version(deepspeed_version)
        if self.tp > 1 and self.ep > 1 and (self.offload_optimizer or self.offload_params):
            raise ValueError(
                "DeepSpeed refuses ZeRO offload together with AutoEP + AutoTP; drop --offload-* or use "
                "--tp 1 (EP with ZeRO-3 alone can offload)"
            )
        if model is not None:
            warnings += self._validate_model(model)
        return warnings

    def _validate_fsdp2(self) -> None:
        if self.device == "cpu":
            raise ValueError(
                "accelerate refuses ParallelismConfig (FSDP2 + TP) on CPU (use_cpu makes the run "
                "MULTI_CPU); generate it for GPU hosts, or use --engine deepspeed on CPU"
            )
        if self.ep > 1:
            raise ValueError("accelerate's ParallelismConfig has no expert parallelism; use --engine deepspeed for EP")
        if self.offload_optimizer:
            raise ValueError(
                "FSDP2 offloads parameters and optimizer together; use --offload-params, not "
                "--offload-optimizer, with --engine fsdp2"
            )

    def _validate_deepspeed_version(self, deepspeed_version: str | None) -> None:
        deepspeed_version = deepspeed_version or installed_version("deepspeed")
        if deepspeed_version is not None and Version(deepspeed_version) < Version(MIN_DEEPSPEED_ZERO3_AUTOTP):
            raise ValueError(
                f"ZeRO-3 with AutoTP needs DeepSpeed >= {MIN_DEEPSPEED_ZERO3_AUTOTP} (DeepSpeed PRs "
                f"8167, 8168), this is {deepspeed_version}; upgrade DeepSpeed or use --zero 2"
            )

    def _validate_model(self, model: ModelShape) -> list[str]:
        warnings = []
        if model.num_heads % self.tp:
            raise ValueError(
                f"TP {self.tp} does not divide {model.name}'s {model.num_heads} attention heads; pick "
                f"TP from {[d for d in _divisors(model.num_heads) if d <= self.world_size]}"
            )
        if self.tp > model.num_kv_heads:
            warnings.append(
                f"TP {self.tp} exceeds {model.name}'s {model.num_kv_heads} KV heads: K/V projections "
                "cannot be split further, so TP ranks past the KV head count hold copies (idle work)"
            )
        if self.ep > 1:
            if not model.is_moe:
                raise ValueError(f"{model.name} has no routed experts; use --ep 1")
            if model.routed_experts % self.ep:
                raise ValueError(
                    f"EP {self.ep} does not divide {model.name}'s {model.routed_experts} routed experts; "
                    f"pick EP from {[d for d in _divisors(model.routed_experts) if self.world_size % d == 0]}"
                )
            if self.engine == "deepspeed" and model.model_type not in EP_PRESETS:
                raise ValueError(f"DeepSpeed AutoEP has no preset for model_type {model.model_type!r}; use --ep 1")
        if model.is_moe and self.tp > 1 and self.ep == 1 and self.engine == "deepspeed":
            raise ValueError(
                f"TP {self.tp} without EP keeps every routed expert of {model.name} whole on each TP "
                f"rank (DeepSpeed's AutoEP + AutoTP also refuses it); add --ep (e.g. --ep {self.tp})"
            )
        return warnings


def grad_reduce_bytes(plan: ParallelPlan) -> int:
    """Bytes per gradient element in the reduce-scatter / all-reduce: `plan.grad_reduce_dtype` (the JSON's
    `communication_data_type`), 4 under fp32 compute whatever it says."""
    return 4 if plan.precision == "fp32" or plan.grad_reduce_dtype == "fp32" else 2


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
