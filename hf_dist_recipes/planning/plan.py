"""ParallelPlan: one typed description of a distributed job, and the checks that make it launchable.

Derived sizes (one place owns each):
- world size = nodes x processes per node;
- data-parallel size = world / (TP x SP) (the ranks of a TP group, or of an SP group, see the same samples; TP and
  SP are never both above 1);
- tokens per rank = sequence length / SP (Ulysses gives each rank of an SP group one slice of every sequence);
- ZeRO's group for the weights TP splits = world / TP: DeepSpeed partitions and reduces over the SP ranks too
  (its sequence-data-parallel group, engine.py `seq_dp_world_size`);
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
MIN_DEEPSPEED_SP = "0.18.2"  # accelerate 1.16 accelerator.py:2364-2368 refuses Ulysses SP (ALST) below it
# accelerate's ParallelismConfig(sp_size, sp_backend) and the YAML keys arrived in 1.12.0 (huggingface/accelerate#3817;
# 1.11.0's parallelism_config.py has no sp_size), which the package's range (>= 1.10) reaches below.
MIN_ACCELERATE_SP = "1.12.0"
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
    arguments' `loss_chunk_tokens`), so the estimate counts one chunk's logits (None: the stock loss, all of them).
    `tiled_mlp_shards`: every gated MLP computes this many slices of its tokens at a time (`parallel.tiled_mlp`, the
    arguments' `tiled_mlp_shards`), so the estimate counts one slice's MLP intermediates (None: the whole MLP's).
    `sp`: Ulysses sequence-parallel degree (default 1: none), accelerate's `ParallelismConfig(sp_size,
    sp_backend="deepspeed")`: each rank of an SP group holds seq_len / sp tokens of the group's sequences and
    exchanges query, key, value and output by all-to-all around attention; DeepSpeed only, without TP or EP."""

    nodes: int = 1
    procs_per_node: int = 8
    device: Device = "cuda"
    zero_stage: int = 3
    offload_optimizer: bool = False
    offload_params: bool = False
    tp: int = 1
    ep: int = 1
    sp: int = 1
    micro_batch: int = 1
    grad_accum: int = 1
    seq_len: int = 4096
    precision: Precision = "bf16"
    activation_checkpointing: bool = False
    engine: Engine = "deepspeed"
    zero_init: bool = True
    grad_reduce_dtype: GradReduceDtype = "fp32"
    loss_chunk_tokens: int | None = None
    tiled_mlp_shards: int | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the ranks that see different samples (world / (TP x SP))."""
        return self.world_size // (self.tp * self.sp)

    @property
    def zero_dp_size(self) -> int:
        """Ranks ZeRO partitions the weights TP splits over: world / TP, the SP ranks included (DeepSpeed runs ZeRO
        over its sequence-data-parallel group, engine.py `seq_dp_world_size`)."""
        return self.world_size // self.tp

    @property
    def tokens_per_rank(self) -> int:
        """Tokens of one sequence each rank holds: seq_len / SP (what the activations scale with)."""
        return self.seq_len // self.sp

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
            "tokens_per_rank": self.tokens_per_rank,
            "edp_size": self.edp_size,
            "global_batch": self.global_batch,
        }

    def validate(
        self,
        model: ModelShape | None = None,
        *,
        deepspeed_version: str | None = None,
        accelerate_version: str | None = None,
    ) -> list[str]:
        """Raise ValueError for the first rule broken; return warnings. `deepspeed_version` and
        `accelerate_version` default to the installed ones (a version rule is skipped when the package is not
        installed)."""
        warnings: list[str] = []
        for name in ("nodes", "procs_per_node", "tp", "ep", "sp", "micro_batch", "grad_accum", "seq_len"):
            positive_int(getattr(self, name), name, getattr(ParallelPlan, name))  # the default as the example
        if self.loss_chunk_tokens is not None:
            note = "pass --loss-chunk-tokens N or leave it out for the stock loss"
            positive_int(self.loss_chunk_tokens, "loss_chunk_tokens", 4096, unit="tokens", note=note)
        if self.tiled_mlp_shards is not None:
            note = "pass --tiled-mlp-shards N or leave it out for whole MLPs"
            positive_int(self.tiled_mlp_shards, "tiled_mlp_shards", 4, minimum=2, unit="slices", note=note)
            if self.engine == "fsdp2":
                raise ValueError(
                    "--tiled-mlp-shards with --engine fsdp2: the slices' gradients reach the weights one backward pass "
                    "at a time, which DeepSpeed's ZeRO waits for and FSDP would reduce each time (DeepSpeed's "
                    "ulysses_sp.py TiledMLP); use --engine deepspeed or leave --tiled-mlp-shards out"
                )
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
        if self.sp > 1:
            warnings += self._validate_sp(deepspeed_version, accelerate_version)
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

    def _validate_sp(self, deepspeed_version: str | None, accelerate_version: str | None) -> list[str]:
        """The model-free rules of Ulysses SP (sp > 1); warnings for SP groups that cross nodes."""
        sp, no_sp = self.sp, "or --sp 1"
        if self.engine == "fsdp2":
            raise ValueError(
                f"--sp {sp} with --engine fsdp2: accelerate's sequence parallelism runs on DeepSpeed only "
                "(ParallelismConfig sp_backend is 'deepspeed', parallelism_config.py:320-322); use --engine "
                f"deepspeed, {no_sp}"
            )
        if self.tp > 1:
            raise ValueError(
                f"--sp {sp} with --tp {self.tp}: DeepSpeed 0.19.8's AutoTP replaces the sequence-parallel groups "
                f"(engine.py:957), so no SP group is left to train with; use --tp 1 with --sp, {no_sp}"
            )
        if self.ep > 1:
            raise ValueError(
                f'--sp {sp} with --ep {self.ep}: DeepSpeed 0.19.8 refuses it ("AutoEP does not currently support '
                'tensor model parallelism from mpu", engine.py:836: the SP mpu reports SP as its TP size); use --ep 1 '
                f"with --sp, {no_sp}"
            )
        if self.world_size % sp:
            raise ValueError(
                f"SP {sp} does not divide the world size {self.world_size} (DeepSpeed lays SP groups over consecutive "
                f"ranks); pick --sp from {_divisors(self.world_size)[1:]}"
            )
        if self.seq_len % sp:
            raise ValueError(
                f"--seq-len {self.seq_len} is not divisible by SP {sp} (Ulysses gives each rank seq_len / sp tokens, "
                f"ulysses_sp.py:706); use --seq-len {-(-self.seq_len // sp) * sp} or an SP that divides it"
            )
        deepspeed_version = deepspeed_version or installed_version("deepspeed")
        if deepspeed_version is not None and Version(deepspeed_version) < Version(MIN_DEEPSPEED_SP):
            raise ValueError(
                f"Ulysses SP needs DeepSpeed >= {MIN_DEEPSPEED_SP} (accelerate refuses it below, accelerator.py:2364), "
                f"this is {deepspeed_version}; upgrade DeepSpeed, {no_sp}"
            )
        accelerate_version = accelerate_version or installed_version("accelerate")
        if accelerate_version is not None and Version(accelerate_version) < Version(MIN_ACCELERATE_SP):
            raise ValueError(
                f"Ulysses SP needs accelerate >= {MIN_ACCELERATE_SP} (its ParallelismConfig has no sp_size before, "
                f"huggingface/accelerate#3817), this is {accelerate_version}; upgrade accelerate, {no_sp}"
            )
        if sp > self.procs_per_node or self.procs_per_node % sp:
            return [
                f"SP {sp} spans nodes ({self.procs_per_node} processes per node): its all-to-alls (4 per layer "
                "forward, 4 backward) would cross the network; keep SP within a node"
            ]
        return []

    def _validate_deepspeed_version(self, deepspeed_version: str | None) -> None:
        deepspeed_version = deepspeed_version or installed_version("deepspeed")
        if deepspeed_version is not None and Version(deepspeed_version) < Version(MIN_DEEPSPEED_ZERO3_AUTOTP):
            raise ValueError(
                f"ZeRO-3 with AutoTP needs DeepSpeed >= {MIN_DEEPSPEED_ZERO3_AUTOTP} (DeepSpeed PRs "
                f"8167, 8168), this is {deepspeed_version}; upgrade DeepSpeed or use --zero 2"
            )

    def _validate_sp_model(self, model: ModelShape) -> list[str]:
        """Ulysses' head rules (ulysses_sp.py:147-152: each SP rank computes heads / sp query heads; K/V heads split
        the same way or, fewer than SP, are replicated up to it); a warning for MLA's unequal head sizes."""
        sp, heads, kv = self.sp, model.num_heads, model.num_kv_heads
        allowed = [d for d in _divisors(heads) if (kv % d == 0 or d % kv == 0) and self.world_size % d == 0]
        if heads % sp:
            raise ValueError(
                f"SP {sp} does not divide {model.name}'s {heads} attention heads (Ulysses gives each SP rank "
                f"heads / sp of them, ulysses_sp.py:147); pick --sp from {allowed}"
            )
        if kv % sp and sp % kv:
            raise ValueError(
                f"SP {sp} and {model.name}'s {kv} KV heads: Ulysses needs one to divide the other "
                f"(ulysses_sp.py:150); pick --sp from {allowed}"
            )
        if not model.is_mla:
            return []
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        return [
            f"SP {sp} with MLA ({model.name}'s query/key heads are {qk} wide, its value heads {model.v_head_dim}): "
            "stock Ulysses asserts one head size (ulysses_sp.py:299), so the stock Trainer stops at the first "
            "forward; train with RecipeTrainer, which pads the value heads to the query/key width"
        ]

    def _validate_model(self, model: ModelShape) -> list[str]:
        warnings = self._validate_sp_model(model) if self.sp > 1 else []
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
