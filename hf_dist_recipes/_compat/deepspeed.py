"""DeepSpeed's details that are not public API (proven: `PROVEN["deepspeed"]`): MoE routers and AutoEP layers,
ZeRO++ hpZ's group, ZeRO-3's gradient buckets, partitioned parameters, AutoTP's gather, the checkpoint files, the
checkpoint engine and ZeRO-3's optimizer state for a resume in another layout. Each says when it can go. DeepSpeed
is imported only inside the functions (it takes seconds); a dense model on CPU needs none of this."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from hf_dist_recipes._compat import needed

# MoE routers whose top-k choices monitoring/expert_load.py counts, and where their output tuple holds the top-k
# expert indices: transformers 5.24 `DeepseekV3TopkRouter` / `DeepseekV2TopkRouter` return (logits, weights,
# indices); DeepSpeed 0.19.8 AutoEP's `TokenChoiceTopKRouter` returns (scores, indices, counts). AutoEP replaces
# each MoE block with an `AutoEPMoELayer` whose `router` attribute is that router and whose `ep_size` is the EP
# degree. None of these classes is public API. Goes when transformers and DeepSpeed expose the routers' top-k
# choices publicly (a hook or an output field).
_MOE_ROUTERS = (
    ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter", 2),
    ("transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2TopkRouter", 2),
    ("deepspeed.moe.ep_router", "TokenChoiceTopKRouter", 1),
)
_AUTOEP_LAYER = ("deepspeed.module_inject.auto_ep_layer", "AutoEPMoELayer")


def _loaded(module: str, name: str) -> type | None:
    """A class of a module that is already imported, else None: a model holding one of its instances has imported
    it, so nothing is imported here (DeepSpeed takes seconds to import, and a dense model needs none of this)."""
    return getattr(sys.modules.get(module), name, None)


def moe_router_classes() -> dict[type, int]:
    """Router class -> position of the top-k expert indices in its forward output, for the classes imported."""
    return {cls: at for module, name, at in _MOE_ROUTERS if (cls := _loaded(module, name)) is not None}


def autoep_ep_sizes(model) -> dict[int, int]:
    """id(router) -> EP degree, for the routers inside DeepSpeed AutoEP layers of `model`."""
    layer_class = _loaded(*_AUTOEP_LAYER)
    if layer_class is None:
        return {}
    return {id(m.router): int(m.ep_size) for m in model.modules() if isinstance(m, layer_class)}


# DeepSpeed 0.19.8 keeps ZeRO++ hpZ's intra-node group in the module global `utils/groups.py
# _ZERO_PARAM_INTRA_PARALLEL_GROUP`; `_create_zero_param_parallel_group` asserts it is None, and
# `runtime/zero/partition_parameters.py Init.__init__` calls it for every model built under an hpZ config. Gate and
# when it goes: `WORKAROUNDS["hpz_group_per_process"]`.
_HPZ_GROUPS_MODULE = "deepspeed.utils.groups"
_HPZ_GROUP = "_ZERO_PARAM_INTRA_PARALLEL_GROUP"


def forget_zero_hpz_group() -> None:
    """Let the next `zero.Init` under an hpZ config (`zero_hpz_partition_size` > 1) create its own group.

    DeepSpeed 0.19.8 `deepspeed/utils/groups.py::_create_zero_param_parallel_group` asserts "ZeRO parameter intra
    parallel group is already initialized", so a second model built in one process under the same config (the
    Trainer's `model_init`, called in `__init__` and again by `train()`) stops there. Forgetting the global is
    safe: the first model's parameters keep their own reference to the old group object, and the second
    `zero.Init` creates a new one with `dist.new_group`, a collective all ranks reach together because every rank
    calls `model_init`. The old group is not destroyed (the first model may still use it); it costs one idle
    process group. Does nothing when DeepSpeed is not imported or no group exists."""
    groups = sys.modules.get(_HPZ_GROUPS_MODULE)
    if groups is not None and getattr(groups, _HPZ_GROUP, None) is not None and needed("hpz_group_per_process"):
        setattr(groups, _HPZ_GROUP, None)


_SP_STATE_MODULE = "deepspeed.runtime.sequence_parallel.parallel_state_sp"
_SP_GROUP = "_SEQUENCE_PARALLEL_GROUP"
_SP_RELEASE = "_release_sequence_parallel_groups"


def forget_sequence_parallel_groups() -> None:
    """Let the next Ulysses registration (accelerate's, in every DeepSpeed `prepare`) make its own SP groups.

    DeepSpeed 0.19.8 `parallel_state_sp.initialize_sequence_parallel` asserts "sequence parallel group is already
    initialized", so the training prepare after an evaluation's (or a second `train()`) stops there. Its own
    `_release_sequence_parallel_groups` (written for a teardown) drops the references; the next registration creates
    new groups with `dist.new_group`, a collective every rank reaches together (every rank prepares). The old groups
    are not destroyed (an earlier engine may hold them): idle process groups. Does nothing when DeepSpeed's SP state
    is not imported or holds no group."""
    state = sys.modules.get(_SP_STATE_MODULE)
    if state is not None and getattr(state, _SP_GROUP, None) is not None and needed("sp_groups_once_per_process"):
        getattr(state, _SP_RELEASE)()


# Gradient health under ZeRO-3 without a hook per parameter tensor. DeepSpeed 0.19.8 `runtime/zero/stage3.py`
# `DeepSpeedZeroOptimizer_Stage3`: every gradient of a backward goes into `self.ipg_buckets[comm_dtype]` (an
# `IPGBucketZ3`, its `params` in order) and leaves it through the name-mangled
# `__reduce_and_partition_ipg_grads(comm_dtype)`, called by `reduce_independent_p_g_buckets_and_remove_grads`
# when the bucket is full and by `independent_gradient_partition_epilogue` at the end of each backward. That call
# is the last place where a rank's own gradients exist (`p.grad` of each bucket parameter, full size): it
# reduce-scatters them (a NaN on one rank reaches every rank's partition) and frees them. With
# `contiguous_gradients` and `bucket.elements <= reduce_bucket_size` (the defaults), `__add_grad_to_ipg_bucket`
# copied each gradient into the bucket's flat `buffer`, end to end in the order of `params`. The wrapper is an
# instance attribute, which the class's own `self.__reduce...` call finds first. Goes when DeepSpeed offers a public
# hook on a rank's own gradients before the reduce-scatter.
_ZERO3_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"


def watch_zero3_gradients(optimizer, observe) -> bool:
    """Call `observe(params, flat)` with each bucket of parameters whose `.grad` is this rank's own gradient, just
    before DeepSpeed ZeRO-3 reduce-scatters them; `flat` is those gradients end to end (one 1-D view of the bucket
    buffer), or None when they are not contiguous. Returns False, doing nothing, when `optimizer` (or the optimizer
    it wraps) is not DeepSpeed 0.19's ZeRO-3 optimizer. Covered: deepspeed 0.19.8."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's DeepSpeedOptimizerWrapper holds it here
    stage3 = sys.modules.get("deepspeed.runtime.zero.stage3")
    cls = getattr(stage3, "DeepSpeedZeroOptimizer_Stage3", None)
    if cls is None or not isinstance(inner, cls) or not hasattr(inner, _ZERO3_REDUCE):
        return False
    original = getattr(cls, _ZERO3_REDUCE).__get__(inner)  # the class's method: re-watching does not stack

    def reduce_and_partition(communication_data_type):
        bucket = inner.ipg_buckets[communication_data_type]
        if bucket.params:
            contiguous = (
                inner.contiguous_gradients and bucket.buffer is not None and bucket.elements <= inner.reduce_bucket_size
            )
            observe(list(bucket.params), bucket.buffer.narrow(0, 0, bucket.elements) if contiguous else None)
        return original(communication_data_type)

    setattr(inner, _ZERO3_REDUCE, reduce_and_partition)
    return True


def unwatch_zero3_gradients(optimizer) -> None:
    inner = getattr(optimizer, "optimizer", optimizer)
    if _ZERO3_REDUCE in getattr(inner, "__dict__", {}):
        delattr(inner, _ZERO3_REDUCE)


# Checkpoints (checkpoint/gather.py, checkpoint/export.py, checkpoint/zero_files.py). Where public API exists it is
# used there directly: `deepspeed.zero.GatheredParameters` (documented, zero3.rst), `engine.save_checkpoint`.
# What follows is not public, each item with the upstream file:line it was read from and when it can go.


# DeepSpeed 0.19.8 `runtime/zero/partition_parameters.py Init._convert_to_deepspeed_param` (:1279-1320) marks each
# parameter it partitions with `ds_id` (one id per parameter, equal on every rank: `Init.param_id`) and `ds_numel`
# (the full element count); `ds_tensor` is this rank's partition (:1846). The docs show `ds_tensor` and
# `deepspeed.runtime.zero.utils.is_zero_param` (= `hasattr(p, "ds_id")`, runtime/zero/utils.py:150) only inside
# examples (zero3.rst "Modifying Partitioned States"), not as API reference; these go when DeepSpeed documents
# them. Reading them here needs no `import deepspeed` (seconds), which `is_zero_param` would.
def zero_param_id(param) -> int | None:
    """The id ZeRO-3's `zero.Init` gave `param` (the same for tied weights), or None when it is not partitioned."""
    return getattr(param, "ds_id", None)


def is_zero_partitioned(param) -> bool:
    """True for a parameter partitioned by ZeRO-3 (`zero.Init`): its `.data` is an empty placeholder."""
    return zero_param_id(param) is not None


def zero_full_shape(param) -> tuple[int, ...]:
    """The shape of the whole parameter (`ds_shape` under ZeRO-3: the TP/EP-local shape, all ZeRO partitions)."""
    return tuple(getattr(param, "ds_shape", param.shape))


def held_elements(param) -> tuple[int, int]:
    """(elements of the whole parameter, elements this rank holds): `ds_numel` and `ds_tensor`'s under ZeRO-3."""
    if hasattr(param, "ds_numel"):
        return int(param.ds_numel), param.ds_tensor.numel()
    return param.numel(), param.numel()


# DeepSpeed 0.19.8 AutoTP: `module_inject/layers.py:816 GatherReplacedLayerParams(params, module, enabled)` gathers
# the TP shards of a replaced layer's parameters for the duration of the context (a no-op for any other module);
# the engine's own 16-bit save uses it (runtime/engine.py:5586). Not documented. Goes when the engine's
# consolidated save covers AutoEP too (then RecipeTrainer.save_model can use the stock path), or when DeepSpeed
# documents the context.
def gather_tp_params(params, module):
    """Context: AutoTP-sharded `params` of `module` whole inside it (every TP rank must enter)."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    return GatherReplacedLayerParams(params, module, enabled=True)


# DeepSpeed 0.19.8 AutoEP: `module_inject/auto_ep_layer.py:507 AutoEPMoELayer` replaces each HF MoE block. Its class
# attribute `_is_autoep_layer = True` (:510, "Marker for AutoTP skip handshake") marks it; `model_family` (:528),
# `num_experts` (:543, every EP rank's experts), `expert_placement_descriptor` (:545), `ep_group` (:803), `router`
# (:587, a `moe/ep_router.py TokenChoiceTopKRouter`: `gate` nn.Linear :65, `e_score_correction_bias` :76),
# `experts` (:632, `moe/ep_experts.py:423 GroupedExperts` w1/w2/w3 [E_local, I, H] / [E_local, H, I] /
# [E_local, I, H]) and `shared_experts` (:666) are what the export reads. The expert ids each EP rank holds come
# from `checkpoint/autoep_affine.py:93 autoep_experts_for_rank`; the HF names of the replaced block from the
# preset registry (`module_inject/auto_ep_presets/registry.py:70 get_preset`, :86 `preset_name_for_hf_model_type`;
# fields in `auto_ep_presets/base.py:30-45`). None of this is documented. It all goes when DeepSpeed's consolidated
# 16-bit save stops refusing AutoEP (`_raise_if_autoep_zero3_consolidated_export`, see test_compat.py) or
# documents a gathered state dict in the HF layout.
def is_autoep_layer(module) -> bool:
    return bool(getattr(module, "_is_autoep_layer", False))


@dataclass(frozen=True)
class AutoEPLayerParts:
    """What the export reads of one AutoEP layer (see the comment above)."""

    model_family: str  # the HF model_type (or AutoEP preset name) the layer was built for
    num_experts: int  # routed experts over every EP rank
    ep_group: object  # the expert-parallel process group (one whole copy of the experts)
    placement: dict  # the expert placement descriptor: which experts each EP rank holds
    router: object  # nn.Module: its own tensors are the score correction bias, when the block had one
    router_gate: object  # nn.Linear: the router's weight (and bias)
    w1: object  # nn.Parameter [E_local, I, H]: gate projections
    w2: object  # nn.Parameter [E_local, H, I]: down projections
    w3: object  # nn.Parameter [E_local, I, H]: up projections
    shared_experts: object  # nn.Module or None


def autoep_layer_parts(layer) -> AutoEPLayerParts:
    experts = layer.experts
    return AutoEPLayerParts(
        model_family=layer.model_family,
        num_experts=int(layer.num_experts),
        ep_group=layer.ep_group,
        placement=layer.expert_placement_descriptor,
        router=layer.router,
        router_gate=layer.router.gate,
        w1=experts.w1,
        w2=experts.w2,
        w3=experts.w3,
        shared_experts=layer.shared_experts,
    )


def autoep_experts_for_rank(placement: dict, ep_rank: int) -> list[int]:
    """Global expert ids held by EP rank `ep_rank`, in its local order."""
    from deepspeed.checkpoint.autoep_affine import autoep_experts_for_rank as experts_for_rank

    return list(experts_for_rank(placement, ep_rank))


@dataclass(frozen=True)
class AutoEPPreset:
    """The HF names, relative to the MoE block, that an AutoEP layer replaced."""

    router: str  # the router module ("gate": its weight is "gate.weight")
    experts: str  # the experts module ("experts")
    expert_w1: str  # the fused gate/up tensor ("gate_up_proj"), or the gate tensor when expert_w3 is set
    expert_w2: str  # the down tensor ("down_proj")
    expert_w3: str | None  # the up tensor when gate and up are stored apart, else None
    shared_experts: str  # the shared experts module ("shared_experts"), "" when none


def autoep_preset(model_type: str) -> AutoEPPreset | None:
    """DeepSpeed's AutoEP preset for an HF `model_type` (or a preset's own name), None when it has none."""
    from deepspeed.module_inject.auto_ep_presets.registry import get_preset, preset_name_for_hf_model_type

    try:
        preset = get_preset(preset_name_for_hf_model_type(model_type) or model_type)
    except ValueError:  # "Unknown preset_model"
        return None
    return AutoEPPreset(
        router=preset.router_pattern,
        experts=preset.experts_pattern,
        expert_w1=preset.expert_w1,
        expert_w2=preset.expert_w2,
        expert_w3=preset.expert_w3,
        shared_experts=preset.shared_experts_pattern,
    )


# DeepSpeed 0.19.8 ZeRO-3 training checkpoint files, as checkpoint/zero_files.py reads them (`hf-dist-recipes
# checkpoint export`). File names: runtime/engine.py:4319-4358 (`_get_zero_ckpt_prefix`, `_get_rank_zero_ckpt_name`,
# `_get_ckpt_name`). Model states: engine.py:5017 `_common_checkpoint_state` and :5324-5328; AutoEP entries
# :5173; optimizer states: runtime/zero/stage3.py:3431 `_rigid_state_dict` (partition groups :3423), wrapped by the
# engine under `optimizer_state_dict`. deepspeed/checkpoint/constants.py names most keys. DeepSpeed's documented
# reader, `deepspeed.utils.zero_to_fp32`, merges ZeRO-3 alone (it refuses AutoTP and AutoEP); this goes when it or
# `ds_to_universal` reads the three layouts, and the offline export calls that instead.
ZERO_RANK_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_(model|optim)_states\.pt$")


class ZeroCheckpointKeys:
    """Keys of the per-rank files (see the comment above). `*_model_states.pt`: MODULE (state dict: persistent
    buffers whole, parameters as empty placeholders of the training dtype), BUFFER_NAMES, PARAM_SHAPES (per
    optimizer sub-group, name -> TP/EP-local shape in flat order), SHARED_PARAMS (tied name -> name),
    UNIVERSAL_INFO (AutoTP's patterns), AUTOEP_LAYERS (one entry per AutoEP layer). `*_optim_states.pt`:
    OPTIMIZER_STATE -> FP32_FLAT_GROUPS (per sub-group, this rank's slice), PARTITION_COUNT, PARTITION_GROUPS
    (AutoEP only: per sub-group GROUP_COUNT, GROUP_RANK, GROUP_RANKS)."""

    MODULE = "module"
    BUFFER_NAMES = "buffer_names"
    PARAM_SHAPES = "param_shapes"
    SHARED_PARAMS = "shared_params"
    UNIVERSAL_INFO = "universal_checkpoint_info"
    TP_REPLICATED = "tp_replicated_parameter_patterns"
    ROW_PARALLEL = "parameter_with_row_parallelism_patterns"
    VOCABULARY = "vocabulary_parameter_patterns"
    ORIGINAL_VOCAB_SIZE = "original_vocab_size"
    AUTOEP_LAYERS = "ds_autoep_layers"
    EXPERT_KEY_PREFIX = "expert_key_prefix"  # "<module_path>.experts": the parameter names' owner
    MODULE_PATH = "module_path"  # the replaced MoE block's name
    EP_RANK = "ep_rank"
    NUM_EXPERTS = "num_experts"
    EXPERT_PLACEMENT = "expert_placement"  # {"ranks": [{"rank": r, "experts": [ids]}]}
    PLACEMENT_RANKS = "ranks"
    PLACEMENT_RANK = "rank"
    PLACEMENT_EXPERTS = "experts"
    # an AutoEP layer's state-dict names (AutoEPLayerParts): expert tensors under EXPERT_KEY_PREFIX (gate, down, up),
    # the router under MODULE_PATH
    EXPERT_TENSORS = ("w1", "w2", "w3")
    ROUTER_GATE = "router.gate"
    ROUTER_SCORE_BIAS = "router.e_score_correction_bias"
    OPTIMIZER_STATE = "optimizer_state_dict"
    FP32_FLAT_GROUPS = "fp32_flat_groups"
    TORCH_OPTIMIZER = "optimizer_state_dict"  # inside OPTIMIZER_STATE: the torch optimizer's own state dict
    STATE = "state"  # per sub-group index: "step" and the moments, each flat like FP32_FLAT_GROUPS' entry
    PARAM_GROUPS = "param_groups"
    PARTITION_COUNT = "partition_count"
    PARTITION_GROUPS = "ds_zero_partition_groups"
    GROUP_COUNT = "partition_count"
    GROUP_RANK = "partition_rank"
    GROUP_RANKS = "partition_ranks"


# Resume loads (checkpoint/resume_loading.py). DeepSpeed 0.19.8 `runtime/engine.py`: `_configure_checkpointing`
# (:1899) sets `engine.checkpoint_engine` (`checkpoint_engine/utils.py create_checkpoint_engine`: a
# `TorchCheckpointEngine` unless the config names a writer or DataStates), and a resume reads every file through its
# `load(path, map_location)`: the model states in `_load_checkpoint` (`SDLoaderFactory.get_sd_loader(ckpt_list,
# checkpoint_engine=self.checkpoint_engine)`), each rank's `*_optim_states.pt` in
# `_get_all_zero_checkpoint_state_dicts` (`map_location='cpu'`), expert files in `load_moe_state_dict`.
# `TorchCheckpointEngine.load` is a plain `torch.load(path, map_location=..., weights_only=False)`. The engine's
# `optimizer` (ZeRO's wrapper) steps the torch optimizer it holds as `.optimizer` (stage3.py `self.optimizer =
# init_optimizer`; DeepSpeedCPUAdam under offload); `_rigid_load_state_dict` hands that one the loaded state, and
# `torch.optim.Optimizer.load_state_dict` keeps the loaded tensors themselves (same device and dtype: `.to` copies
# nothing). None of these attributes is documented. transformers 5.25 `Trainer._prepare_for_training` builds the
# engine in `accelerator.prepare`, then calls `self.create_scheduler(...)`, then `deepspeed_load_checkpoint(
# self.model_wrapped, ...)`: `create_scheduler` is the last public method before the resume reads the files, and
# accelerate 1.16 holds the engine by then as `accelerator.deepspeed_engine_wrapped.engine`. Goes when DeepSpeed
# loads memory-mapped itself or `deepspeed.initialize` takes a checkpoint engine
# (tests/unit/test_compat.py::test_resume_loads_go_through_the_engines_checkpoint_engine).


def checkpoint_engine(engine):
    """The checkpoint engine `engine` saves and loads its files through."""
    return engine.checkpoint_engine


def set_checkpoint_engine(engine, checkpoint_engine) -> None:
    engine.checkpoint_engine = checkpoint_engine


def loads_with_plain_torch_load(checkpoint_engine) -> bool:
    """Whether `checkpoint_engine`'s load is DeepSpeed's plain `torch.load` (which a memory-mapped load may
    replace); False for the writer and DataStates engines, which read in their own ways."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    return type(checkpoint_engine) is TorchCheckpointEngine


def engine_optimizers(engine) -> list:
    """The torch optimizers whose `state` a resume of `engine` fills: the one ZeRO's wrapper steps, or the engine's
    own optimizer without ZeRO."""
    import torch

    outer = engine.optimizer
    return [o for o in (outer, getattr(outer, "optimizer", None)) if isinstance(o, torch.optim.Optimizer)]


# Resume in another layout (checkpoint/relayout.py). DeepSpeed 0.19.8 ZeRO-3 (`runtime/zero/stage3.py`): the public
# setters `deepspeed.utils.safe_set_full_fp32_param` / `safe_set_full_optimizer_state` (utils/tensor_fragment.py:154,
# :190) call `set_full_hp_param` (:3183), which writes this rank's slice of the full (TP/EP-local) value into
# `fp32_partitioned_groups_flat[sub_group]` or into the torch optimizer's `state[that flat][key]`. What they leave out,
# done here as DeepSpeed's own `_rigid_load_state_dict` (:3540) and universal load (:3653) do: (1) the moments exist
# only after the first step (torch's Adam creates them lazily), so `state[flat]` is filled with zeros and the step
# first; (2) the module's own partitions (`fp16_partitioned_groups_flat`, which `param.ds_tensor` views) are copied
# from the fp32 masters after the set (stage3.py :3575-3588); (3) `set_full_hp_param` slices
# `value.flatten().narrow(0, part * rank, part)`, which runs past the end on the last rank of a parameter whose size
# the partition count does not divide (the partition is padded): such a parameter is written here with the padding
# left zero. The engine's step counters (`global_steps`, `global_samples`, engine.py `_load_checkpoint` restores them
# from the client state) are plain attributes. AutoTP's patterns of the running model: the module attribute named by
# `deepspeed.checkpoint.constants.UNIVERSAL_CHECKPOINT_INFO` (engine.py:1079, the same dict the files hold). Goes
# when DeepSpeed loads a ZeRO-3 checkpoint into another TP/EP/DP layout itself (`ds_to_universal` refuses AutoTP +
# AutoEP in 0.19.8) (tests/distributed/test_resume_other_layout.py).
def zero3_optimizer(engine):
    """ZeRO-3's optimizer wrapper of `engine`; ValueError when the engine is not ZeRO stage 3."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if not isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3):
        raise ValueError(
            f"the running engine's optimizer is {type(engine.optimizer).__name__}, not ZeRO stage 3: a checkpoint "
            "converts only into a ZeRO-3 run (set zero_optimization.stage to 3)"
        )
    return engine.optimizer


def create_zero3_optimizer_states(engine, step, keys) -> None:
    """Give every ZeRO-3 sub-group's fp32 flat its optimizer state: `keys` (moment names) as zeros, `step` (the
    checkpoint's step tensor) copied, replacing whatever was there."""
    import torch

    zero = zero3_optimizer(engine)
    for flat in zero.fp32_partitioned_groups_flat:
        zero.optimizer.state[flat] = {"step": step.clone(), **{k: torch.zeros_like(flat) for k in keys}}


def optimizer_param_groups(engine) -> list[dict]:
    """The torch optimizer's parameter groups under ZeRO-3 (their `lr` is what the next step uses)."""
    return zero3_optimizer(engine).optimizer.param_groups


def set_zero3_partition_padded(param, value, key: str | None) -> None:
    """`set_full_hp_param` for a parameter whose partition is padded (see above): this rank's part of `value`, the
    padding zero. `key`: None for the fp32 master, else the optimizer state's name."""
    zero = param._z3_optimizer
    part, _ = zero._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    flat = value.flatten().to(part.dtype)
    start = part.numel() * zero._get_param_partition_rank(param)
    n = max(0, min(part.numel(), flat.numel() - start))
    part.data[:n].copy_(flat[start : start + n])
    part.data[n:].zero_()


def zero3_partition_padded(param) -> bool:
    """Whether `param`'s ZeRO-3 partitions are padded (its size not a multiple of its partition count)."""
    zero = param._z3_optimizer
    return param.ds_numel % zero._get_param_partition_world_size(param) != 0


def refresh_zero3_module_partitions(engine) -> None:
    """Copy the fp32 masters into the module's own partitions (what the forward reads), as a DeepSpeed load does."""
    zero = zero3_optimizer(engine)
    for i, fp32 in enumerate(zero.fp32_partitioned_groups_flat):
        if fp32.numel() > 0:
            zero.fp16_partitioned_groups_flat[i].data.copy_(fp32.data)
        for partitioned, q in zip(
            zero.fp16_partitioned_groups[i],
            zero.unflatten(zero.fp16_partitioned_groups_flat[i], zero.fp16_partitioned_groups[i]),
            strict=True,
        ):
            partitioned.data = q.data


def set_engine_step(engine, step: int, samples: int) -> None:
    """The engine's own counters, as its load sets them from a checkpoint."""
    engine.global_steps = step
    engine.global_samples = samples


def autotp_patterns(module) -> dict:
    """AutoTP's universal-checkpoint patterns of the running `module` ({} without AutoTP)."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    return dict(getattr(module, UNIVERSAL_CHECKPOINT_INFO, None) or {})


def replay_cpu_adam_steps(optimizer) -> int:
    """After a resume loaded DeepSpeed's checkpoint: replay CPU Adam's step increments 1..t on a one-element scratch
    tensor (WORKAROUNDS["cpu_adam_resumed_step"]), so that its C++ state multiplies at step t + 1 as the uninterrupted
    run's did; the parameters are untouched. `optimizer`: the engine's ZeRO optimizer. Returns t (0: not CPU Adam, or
    no step yet). 0.19.8 `DeepSpeedCPUAdam.step` calls `ds_opt_adam.adam_update` with these arguments. Without it the
    loss of the second step after a resume differed in the 6th digit (tests/distributed/test_offload_autoep.py)."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from hf_dist_recipes._compat import needed

    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, DeepSpeedCPUAdam) or not needed("cpu_adam_resumed_step"):
        return 0
    last = max((int(state["step"]) for state in inner.state.values() if "step" in state), default=0)
    group, scratch = inner.param_groups[0], [torch.zeros(1) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq
    betas, eps, correct = group["betas"], group["eps"], group["bias_correction"]
    for step in range(1, last + 1):
        inner.ds_opt_adam.adam_update(inner.opt_id, step, 0.0, *betas, eps, 0.0, correct, *scratch)
    return last
