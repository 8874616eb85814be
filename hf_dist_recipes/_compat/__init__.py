"""The only module that relies on upstream details that are not public API.

Each item names the versions it was read from and checked against; `tests/unit/test_compat.py` fails when an
installed upstream no longer behaves as assumed here. tests/unit/test_private_upstream.py fails when a private
upstream name is used anywhere else in the package. One file, longer than the others, so that every private touch
can be reviewed (and dropped) in one place.

Proven: every release from the floor to the newest of each range in pyproject.toml (`PROVEN`; .ci/run runs these
tests at both ends). The workarounds (`WORKAROUNDS`) apply only where the installed release needs them: each names
the releases that behave so, the upstream issue and when it can go, and its contract test checks both ways that the
installed release behaves as its entry says.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from dataclasses import dataclass

from hf_dist_recipes.core.jsonfile import load_deepspeed_json

# The releases these private touches were read in and tested at (tests/unit/test_compat.py runs against what is
# installed and fails outside these: re-read the touches against the new release, then widen). The lower ends are
# pyproject.toml's floors, the upper ends the newest releases tested (the development lock).
PROVEN = {
    "transformers": ">=5.23,<=5.25.0",
    "accelerate": ">=1.10,<=1.16.0",
    "deepspeed": ">=0.19.8,<=0.19.8",
    "torch": ">=2.13,<=2.14.1",
}


@dataclass(frozen=True)
class Workaround:
    """An upstream behaviour the package works around. `affected`: the releases of `package` that behave so (PEP 440;
    open above while no release fixes it); `upstream`: the issue or the place in upstream's code; `remove_when`: what
    lets the workaround go."""

    package: str
    affected: str
    upstream: str
    remove_when: str

    def needed(self, installed: str | None = None) -> bool:
        """Whether `installed` (default: the installed release of `package`) is one of the affected releases."""
        from importlib.metadata import version

        from packaging.specifiers import SpecifierSet

        return SpecifierSet(self.affected).contains(installed or version(self.package), prereleases=True)


WORKAROUNDS = {
    "autotp_weight_conversion": Workaround(
        "transformers",
        ">=5.22",
        "integrations/deepspeed.py `_apply_weight_conversions_to_state_dict` refuses any `autotp_size > 1`, though "
        "training AutoTP slices nothing before `deepspeed.initialize` (no upstream issue yet)",
        "the guard tells inference TP from training AutoTP: close `affected` below that release",
    ),
    "evaluation_before_training": Workaround(
        "transformers",
        ">=5.23",
        "huggingface/transformers#44889 (open): an evaluation before `train()` leaves an inference engine that "
        "`train()` destroys and then uses",
        "#44889 is released: close `affected` below that release",
    ),
    "moe_resume_conversion": Workaround(
        "transformers",
        ">=5.23",
        "huggingface/transformers#48805 (PR 48822, open): `Trainer._load_from_checkpoint` loads safetensors without "
        "the weight conversion, so MoE experts keep their fresh values",
        "PR 48822 is released: close `affected` below that release",
    ),
    "hpz_group_per_process": Workaround(
        "deepspeed",
        ">=0.19.8",
        "deepspeed/utils/groups.py `_create_zero_param_parallel_group` asserts the hpZ group is created once per "
        "process (no upstream issue yet)",
        "zero.Init reuses or replaces the group: close `affected` below that release",
    ),
    "jit_build_lock_file": Workaround(
        "torch",
        "<2.14",
        "torch/utils/cpp_extension.py `_jit_compile` builds behind `FileBaton(<build dir>/lock)`: every process waits "
        "while the file exists, so a build killed mid-way leaves a file that hangs every later run; torch 2.14 holds "
        "an OS-level lock on the same file instead (`FileLock`, released when its holder dies), and the file that "
        "stays after each load means nothing (doctor/op_builds.py looks for stale files only where they block)",
        "the torch floor is 2.14: the stale-lock check goes with it",
    ),
}


def needed(name: str) -> bool:
    """Whether the installed upstream needs the workaround `name` (a key of `WORKAROUNDS`)."""
    return WORKAROUNDS[name].needed()


# Upstream behaviour other modules work around (public API only, so the code lives there; the tests in
# tests/unit/test_compat.py fail when upstream changes):
# - transformers 5.24 `Trainer.get_tp_size` reads the DeepSpeed TP degree only from `args.hf_deepspeed_config`
#   -> arguments.py adopts a launcher TP config into `args.deepspeed`;
# - accelerate 1.16 `DeepSpeedPlugin` refuses mixed_precision & co. beside a deepspeed_config_file
#   -> planning/accelerate_config.py never writes them, planning/lint.py reports them.

# transformers 5.24 `TrainingArguments.__post_init__` turns these fields' declared default None into this value, so
# a plain TrainingArguments holds it whether or not the user chose it (`from_training_arguments` treats it as unset).
STOCK_POST_INIT_DEFAULTS = {"activation_checkpointing": False, "gradient_checkpointing": False}


def set_allocator_settings(settings: str) -> None:
    """Hand `settings` (PYTORCH_CUDA_ALLOC_CONF syntax) to the running process's allocator config, which torch 2.13
    may have parsed already: its caching allocator reads the variable once (`c10::CachingAllocator::
    AcceleratorAllocatorConfig::instance()`), and other torch 2.x releases parse it while libc10_cuda loads, at
    `import torch` (their `BackendStaticInitializer`), so a variable set later alone can go unread.
    `torch._C._accelerator_setAllocatorSettings` (private; `torch.cuda.memory._set_allocator_settings` is its
    deprecated alias) parses it now. Expandable segments may be switched on at any time, for allocations after it."""
    import torch

    torch._C._accelerator_setAllocatorSettings(settings)


def allocator_settings() -> str:
    """The allocator settings last parsed in this process (torch 2.13 `_accelerator_getAllocatorSettings`)."""
    import torch

    return torch._C._accelerator_getAllocatorSettings()


# accelerate 1.16 `utils/launch.py` exports the YAML's deepspeed_config_file to the ranks under these names, and
# `DeepSpeedPlugin.__post_init__` reads the file back from the second one. transformers 5.24
# `TrainingArguments.__post_init__` builds its DeepSpeed plugin from them when `deepspeed=` is not given.
ACCELERATE_USE_DEEPSPEED = "ACCELERATE_USE_DEEPSPEED"
ACCELERATE_DEEPSPEED_CONFIG_FILE = "ACCELERATE_DEEPSPEED_CONFIG_FILE"


def launcher_deepspeed_config() -> dict | None:
    """The DeepSpeed JSON that `accelerate launch` handed to this rank, or None when it handed none."""
    if os.environ.get(ACCELERATE_USE_DEEPSPEED, "false").lower() not in ("1", "true", "yes"):
        return None
    path = os.environ.get(ACCELERATE_DEEPSPEED_CONFIG_FILE)
    if not path or path == "none":
        return None
    return load_deepspeed_json(path)


# transformers 5.24 `integrations/deepspeed.py::_apply_weight_conversions_to_state_dict` (called by
# `_load_state_dict_into_zero3_model` during `from_pretrained` under ZeRO-3) raises NotImplementedError whenever the
# active DeepSpeed config has `tensor_parallel.autotp_size > 1`, before it looks at a tensor. The guard is for
# models already sliced by TP. Under training AutoTP nothing is sliced yet at that point: `from_pretrained` builds
# the full model inside zero.Init and DeepSpeed applies AutoTP later, in `deepspeed.initialize`. So the conversion
# (e.g. per-expert tensors on disk -> DeepSeek's fused experts) is exactly the one without TP. Proven by equal
# losses: tests/distributed/test_checkpoint_lifecycle.py (the job's evaluation before training equals one plain
# process's loss from the same checkpoint in every layout).
_CONVERSIONS = "_apply_weight_conversions_to_state_dict"
_UNGUARDED = "_hf_dist_recipes_unguarded"


def allow_weight_conversions_under_training_autotp() -> None:
    """Install (once) the wrapper that lets `from_pretrained` convert weights while a training AutoTP config is
    active. Covered: transformers 5.24. Inference TP (`inference.tensor_parallel`) keeps upstream's guard."""
    if not needed("autotp_weight_conversion"):
        return
    import transformers.integrations.deepspeed as hf_ds

    original = getattr(hf_ds, _CONVERSIONS)
    if getattr(original, _UNGUARDED, False):
        return

    def without_training_tp(config):
        if config is None or "tensor_parallel" not in config:
            return config
        return {k: v for k, v in config.items() if k != "tensor_parallel"}

    def convert(model, state_dict, weight_mapping):
        read_config = hf_ds.deepspeed_config
        hf_ds.deepspeed_config = lambda: without_training_tp(read_config())
        try:
            conversions = original(model, state_dict, weight_mapping)
            if isinstance(conversions, dict):  # transformers 5.22: converts at once, the guard ran in the call
                return conversions
            # transformers 5.23 and later: a generator, the guard runs at its first step; hide TP for that step only
            first = next(conversions, None)
        finally:
            hf_ds.deepspeed_config = read_config
        return _resumed(first, conversions)

    def _resumed(first, rest):
        if first is not None:
            yield first
            yield from rest

    setattr(convert, _UNGUARDED, True)
    convert.__wrapped__ = original
    setattr(hf_ds, _CONVERSIONS, convert)


# MoE routers whose top-k choices monitoring/expert_load.py counts, and where their output tuple holds the top-k
# expert indices: transformers 5.24 `DeepseekV3TopkRouter` / `DeepseekV2TopkRouter` return (logits, weights,
# indices); DeepSpeed 0.19.8 AutoEP's `TokenChoiceTopKRouter` returns (scores, indices, counts). AutoEP replaces
# each MoE block with an `AutoEPMoELayer` whose `router` attribute is that router and whose `ep_size` is the EP
# degree. None of these classes is public API.
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
# `runtime/zero/partition_parameters.py Init.__init__` calls it for every model built under an hpZ config.
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


# Gradient health (stability/gradient_health.py). accelerate 1.16 `AcceleratedOptimizer`: `step_was_skipped`
# returns `self._is_overflow`, which only the GradScaler path of `step()` writes; `Accelerator.
# optimizer_step_was_skipped` (read by transformers 5.24 `Trainer._run_epoch` to leave the scheduler alone) and
# `AcceleratedScheduler.step` both read it. `scaler` is the GradScaler or None. transformers 5.24 `Trainer.
# _clip_grad_norm(model)` is called once per optimizer step, before `on_pre_optimizer_step`, and returns the pre-clip
# global norm (under DeepSpeed the engine's `get_global_grad_norm()`); RecipeTrainer overrides it to observe that
# norm. `Trainer._tr_loss` is the running loss tensor that `_maybe_log_save_evaluate` resets with
# `tr_loss -= tr_loss`, which keeps a NaN forever.
def mark_optimizer_step_skipped(optimizer, skipped: bool) -> None:
    """Make accelerate (and so the Trainer's scheduler step) see this optimizer step as skipped, or not."""
    if optimizer is not None and hasattr(optimizer, "_is_overflow"):
        optimizer._is_overflow = skipped


def has_grad_scaler(optimizer) -> bool:
    return getattr(optimizer, "scaler", None) is not None


def reset_nonfinite_running_loss(trainer) -> None:
    """Zero the Trainer's running loss when it is not finite (after the log that showed the NaN)."""
    import torch  # here: the CLI imports this module and must not pay for torch

    running = getattr(trainer, "_tr_loss", None)
    if isinstance(running, torch.Tensor) and not bool(running.isfinite().all()):
        running.zero_()


# Gradient health under ZeRO-3 without a hook per parameter tensor. DeepSpeed 0.19.8 `runtime/zero/stage3.py`
# `DeepSpeedZeroOptimizer_Stage3`: every gradient of a backward goes into `self.ipg_buckets[comm_dtype]` (an
# `IPGBucketZ3`, its `params` in order) and leaves it through the name-mangled
# `__reduce_and_partition_ipg_grads(comm_dtype)`, called by `reduce_independent_p_g_buckets_and_remove_grads`
# when the bucket is full and by `independent_gradient_partition_epilogue` at the end of each backward. That call
# is the last place where a rank's own gradients exist (`p.grad` of each bucket parameter, full size): it
# reduce-scatters them (a NaN on one rank reaches every rank's partition) and frees them. With
# `contiguous_gradients` and `bucket.elements <= reduce_bucket_size` (the defaults), `__add_grad_to_ipg_bucket`
# copied each gradient into the bucket's flat `buffer`, end to end in the order of `params`. The wrapper is an
# instance attribute, which the class's own `self.__reduce...` call finds first.
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


def tensor_norms(tensors: list):
    """The 2-norm of each tensor, float32, from one fused call (torch 2.13 `torch._foreach_norm`, the kernel
    `clip_grad_norm_` uses; on CPU it loops in C++). NaN and Inf survive; so does a float32 overflow."""
    import torch

    return torch.stack(torch._foreach_norm(tensors)).float()


# Checkpoints (checkpoint/gather.py, checkpoint/export.py, checkpoint/zero_files.py). Where public API exists it is
# used there directly: `deepspeed.zero.GatheredParameters` (documented, zero3.rst), `engine.save_checkpoint`.
# What follows is not public, each item with the upstream file:line it was read from and when it can go.


# torch 2.13 `nn.Module._non_persistent_buffers_set` (torch/nn/modules/module.py:458, filled by `register_buffer(...,
# persistent=False)` at :590): the buffers `state_dict` leaves out, so an export must too. Goes when torch exposes
# buffer persistence publicly (today only `state_dict()` shows it, which under ZeRO-3 holds empty placeholders).
def non_persistent_buffer_names(module) -> set[str]:
    """Names of `module`'s own buffers registered with persistent=False."""
    return set(module._non_persistent_buffers_set)


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


# transformers 5.24 `core_model_loading.py:2024 revert_weight_conversion(model, state_dict)`: the reverse of the
# conversions `from_pretrained` applied (e.g. fused experts -> one tensor per expert), the layout on disk;
# `save_pretrained` calls it on each shard (modeling_utils.py:3612). Public name, undocumented module (the "Dynamic
# weight loading" guide documents WeightConverter, not this). Goes when transformers documents it or a public
# equivalent (the layout `save_pretrained` writes for a given state dict).
def to_disk_layout(model, tensors: dict) -> dict:
    """`tensors` (in-memory names of `model`) renamed and reshaped to the layout `save_pretrained` writes."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, tensors)


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
def training_engine(trainer):
    """The DeepSpeed engine `trainer`'s accelerator built for training, or None (not built yet, or no DeepSpeed)."""
    wrapped = getattr(trainer.accelerator, "deepspeed_engine_wrapped", None)
    return None if wrapped is None else wrapped.engine


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


# No silent hangs (comm/watchdog.py). torch 2.13 `distributed_c10d._get_default_store()` returns the store
# `init_process_group` rendezvoused through (a PrefixStore over the launcher's TCPStore); the heartbeats go there, so
# they need no port or address of their own. `_set_pg_timeout(timeout, group)` calls `_set_default_timeout` on the
# group's Gloo and NCCL backends: later collectives of that group use the new timeout (Gloo raises when it passes;
# ProcessGroupNCCL's watchdog aborts, and with TORCH_NCCL_ASYNC_ERROR_HANDLING tears the process down). A group made
# by `new_group` (DeepSpeed's ZeRO/TP/EP groups) keeps the timeout it was created with, so every group in
# `_world.pg_map` is changed. Covered: torch 2.13 and 2.14 (PROVEN).
# torch elastic tells its workers to rendezvous through the agent's own store with TORCHELASTIC_USE_AGENT_STORE="True"
# (torch 2.13 distributed/rendezvous.py `_torchelastic_use_agent_store`); after a restart that store still holds the
# first attempt's keys (`comm.restarts`, pytorch/pytorch#135712).
AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"


def agent_store_in_use(environ) -> bool:
    return environ.get(AGENT_STORE_VARIABLE) == str(True)


def stop_using_agent_store(environ) -> None:
    """The group is then created as without an agent: rank 0 hosts its store at MASTER_ADDR:MASTER_PORT."""
    environ[AGENT_STORE_VARIABLE] = str(False)


def default_store():
    """The default process group's store (torch 2.13 `_get_default_store`)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def set_collective_timeout(seconds: float) -> int:
    """Set the timeout of every process group this rank belongs to; returns how many groups were changed."""
    from datetime import timedelta

    import torch.distributed as torch_distributed
    from torch.distributed import distributed_c10d

    changed = 0
    for group in list(distributed_c10d._world.pg_map):
        if distributed_c10d._rank_not_in_group(group):
            continue
        # torch 2.14 makes it public as `set_timeout` (the private name warns there); 2.13 has the private one only.
        set_timeout = getattr(torch_distributed, "set_timeout", None) or distributed_c10d._set_pg_timeout
        set_timeout(timedelta(seconds=seconds), group)
        changed += 1
    return changed


# The start-up timeout (comm/process_setup.py). Where the process group is created, with what timeout, read in
# transformers 5.24, accelerate 1.16, deepspeed 0.19.8 and torch 2.13, and measured on 2 CPU ranks
# (tests/distributed/test_other_trainers.py, test_checkpoint_lifecycle.py):
# - `TrainingArguments.__post_init__` (training_args.py:1661) reads `self.device` -> `_setup_devices`, which gives
#   accelerate's `PartialState` `timeout=ddp_timeout` on the DeepSpeed and GPU branches (training_args.py:1888,
#   1891) but none with `use_cpu` (training_args.py:1876-1879, which the recipe sets on every CPU host). There
#   accelerate's MULTI_CPU branch calls `init_process_group(backend="gloo", rank=, world_size=)` (accelerate
#   state.py:282) and the group gets torch's default, 30 minutes (distributed_c10d.py:849 `_get_default_timeout`).
# - Without `use_cpu`, under a DeepSpeed launch (ACCELERATE_USE_DEEPSPEED, also a CPU one: accelerate's DeepSpeed
#   launcher does not pass use_cpu on) `PartialState` calls `deepspeed.comm.init_distributed(timeout=ddp_timeout)`
#   (accelerate state.py:212 -> deepspeed comm/comm.py:910 -> comm/torch.py:282 `init_process_group`); that is the
#   NCCL path, and the plain route's (a script's own TrainingArguments, with the stock ddp_timeout, 1800 s).
# - `new_group` without a timeout (DeepSpeed's groups: `utils/groups.py` `_clone_world_group` and the TP/EP
#   groups, made when the engine is built) takes `_get_default_timeout` too: 30 minutes on Gloo, 10 on NCCL.
# `collective_timeout` reads a group's timeout back from its backend's options (private); `set_collective_timeout`
# above changes it on every existing group. Remove the reading when torch exposes a group's timeout; the recipe
# route's change (not the plain route's) when transformers passes ddp_timeout with use_cpu too
# (tests/unit/test_compat.py::test_transformers_gives_a_use_cpu_group_no_timeout fails then).
def collective_timeout(group=None) -> float | None:
    """The collective timeout in seconds of `group` (default: the default group), from its NCCL backend where it has
    one, else its Gloo backend; None without a process group or without either backend."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.group.WORLD if group is None else group
    devices = group._device_types
    for device in (torch.device("cuda"), torch.device("cpu")):
        if device in devices:
            return group._get_backend(device).options._timeout.total_seconds()
    return None


# The flight recorder (comm/flight_recorder.py). torch 2.13 keeps one recorder per event type: the CPU one
# (`FlightRecorder<c10::Event>`, every Gloo collective, on by default: `TORCH_FR_BUFFER_SIZE`, older name
# `TORCH_NCCL_TRACE_BUFFER_SIZE`, default 2000 entries, read once when the recorder is first used) and NCCL's
# (`FlightRecorder<at::cuda::CUDAEvent>`, CUDA builds only). `torch._C._distributed_c10d._dump_fr_trace()` and
# `_dump_nccl_trace()` return the pickle (format "version" 2.10: "entries" with "collective_seq_id",
# "profiling_name" such as "gloo:all_reduce", "input_sizes", "state", "frames" (the Python call site) and
# "process_group", plus "pg_config" and "pg_status") that NCCL's dump on timeout writes and
# `torch.distributed.flight_recorder.fr_trace` reads. Neither is public API. Covered: torch 2.13 and 2.14 (PROVEN).
def flight_recorder_trace() -> bytes | None:
    """This process's flight recorder as torch's pickle: NCCL's where the default group is NCCL, else the CPU
    (Gloo) one; None when torch has no such dump or the recorder is off (no entries and no groups)."""
    import pickle

    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    dump = c10d._dump_fr_trace
    if dist.is_initialized() and dist.get_backend() == "nccl" and hasattr(c10d, "_dump_nccl_trace"):
        dump = c10d._dump_nccl_trace
    raw = dump()
    content = pickle.loads(raw)
    return raw if content.get("entries") or content.get("pg_config") else None


# The private `Trainer` methods the recipe overrides, all here: `RecipeTrainerMixin` inherits this class, so its
# overrides run before the Trainer's and call it through super(). Covered: transformers 5.24 (signatures and call
# sites checked by tests/unit/test_compat.py::test_the_private_trainer_methods_the_recipe_overrides).
class TrainerPrivateOverrides:
    """Mixin of `RecipeTrainerMixin`: the overrides of private `Trainer` methods, each with when it can go."""

    def _clip_grad_norm(self, model):
        """transformers 5.24 `Trainer._clip_grad_norm(model)`: called once per optimizer step by `_run_epoch`, before
        `on_pre_optimizer_step`; returns the pre-clip global gradient norm (under DeepSpeed the engine's). That norm
        goes to `self.observe_grad_norm` (the gradient-health spike detector). Can go when a public hook receives
        the pre-clip norm (in 5.24 `on_pre_optimizer_step` gets none; `on_optimizer_step` neither)."""
        norm = super()._clip_grad_norm(model)
        self.runtime.grad_norm(norm)
        return norm

    def _load_callback_state(self):
        """transformers 5.24 `Trainer._load_callback_state()`: on a resume with
        `restore_callback_states_from_checkpoint`, it rebuilds each stateful callback as `type(cb)(**saved_args)`
        and appends the new one; a recipe callback rebuilt so holds a runtime of its own that nothing feeds. The run's
        runtime is handed to it (`RecipeRuntime.adopt`). Can go when the Trainer restores a callback's state into
        the instance it holds (or calls a public hook after restoring)."""
        super()._load_callback_state()
        self.recipe_callbacks = self.recipe_callbacks.replaced_by(self.runtime.adopt(self.callback_handler.callbacks))

    def _save_checkpoint(self, model, trial):
        """transformers 5.25 `Trainer._save_checkpoint(model, trial)`, which `_maybe_log_save_evaluate` calls before
        `on_save`: it writes checkpoint-N and then rotates (`rotate_checkpoints` with `args.save_total_limit`), so
        at `save_total_limit=1` the last complete checkpoint is gone before the new one is, and a half-written one
        counts. The stock rotation is turned off for the call (the limit is None only meanwhile, so the checkpoint's
        training_args.bin records None); then `finish_checkpoint` makes it complete (fsync, barrier, the manifest)
        and rotates complete checkpoints only (`hf_dist_recipes.checkpoint.manifest`). Can go when the Trainer
        offers a hook after a checkpoint's files and before its rotation, or rotation by a callable."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        self.finish_checkpoint(
            os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        )

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """transformers 5.24 `Trainer._load_from_checkpoint(resume_from_checkpoint, model=None)`, which `train()`
        calls on resume: without DeepSpeed it restores MoE experts too, through `from_pretrained`'s conversion
        (`resume_needs_conversion`, below). Can go when transformers PR 48822 (issue 48805) is released and the
        minimum transformers includes it (equal losses after resume: tests/unit/test_moe_resume.py)."""
        target = self.model if model is None else model
        if needed("moe_resume_conversion") and resume_needs_conversion(self, resume_from_checkpoint, target):
            load_converted_checkpoint(target, resume_from_checkpoint)
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)


# Evaluation before training under DeepSpeed. transformers 5.24 (PR huggingface/transformers#44889, open; #30205 for
# ZeRO-2): an evaluation before training builds an inference-only engine and keeps it as `model_wrapped`; `train()`
# then destroys it (`accelerator.free_memory()`), sees a model that looks wrapped, skips preparing it and stops in
# `accelerator.backward` ('NoneType' object has no attribute 'backward'). The evaluation also finalized the DeepSpeed
# config, which accelerate and the Trainer share as one dict (`deepspeed_plugin.hf_ds_config.config`), for zero
# steps and dropped its `optimizer` block. And AutoTP/AutoEP would rewrite the model in place for that engine
# (DeepSpeed 0.19.8 cannot rewrite it a second time: "AutoEP: no MoE layers detected" when train() builds its engine).
# Covered: transformers 5.24, accelerate 1.16, deepspeed 0.19.8; can go when #44889 is released and the evaluation
# engine no longer shares the training config (equal losses: tests/distributed/test_checkpoint_lifecycle.py).
def restore_deepspeed_config(trainer, config: dict) -> None:
    """Put `config` (the snapshot taken when the trainer was built) back into the dict accelerate shares."""
    import copy

    shared = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config
    shared.clear()
    shared.update(copy.deepcopy(config))


def forget_evaluation_engine(trainer, config: dict) -> None:
    """Before `train()`: drop an engine an earlier evaluation built, and restore the training config."""
    if not needed("evaluation_before_training"):
        return
    if trainer.is_deepspeed_enabled and trainer.model_wrapped is not trainer.model:
        restore_deepspeed_config(trainer, config)
        trainer.model_wrapped, trainer.deepspeed = trainer.model, None


@contextlib.contextmanager
def evaluation_without_model_parallelism(trainer, config: dict):
    """Before training, build the evaluation engine as plain ZeRO-3 (no AutoTP/AutoEP sections), so the training
    engine applies TP and EP to the untouched model; the evaluation's numbers are the same (TP/EP only split work)."""
    if not needed("evaluation_before_training") or not trainer.is_deepspeed_enabled or trainer.deepspeed is not None:
        yield
        return
    shared = trainer.accelerator.state.deepspeed_plugin.hf_ds_config.config
    for key in ("tensor_parallel", "expert_parallel"):
        shared.pop(key, None)
    try:
        yield
    finally:
        restore_deepspeed_config(trainer, config)


# Resume of a model whose checkpoint layout differs from its parameters (MoE experts). transformers 5.24
# `Trainer._load_from_checkpoint` (and `_load_best_model`), without DeepSpeed or FSDP, reads the checkpoint's
# safetensors and calls `model.load_state_dict(state_dict, False)`: no weight conversion. `save_pretrained` writes
# the hub layout (one tensor per expert, `experts.<i>.gate_proj.weight`), the model holds fused experts
# (`experts.gate_up_proj`), so the experts keep their fresh values and only a warning says so (transformers issue
# 48805; PR 48822, open). `from_pretrained` applies the conversion: a checkpoint whose tensor names are not the
# model's is loaded through it and copied in, all names checked. Covered: transformers 5.24.
def checkpoint_tensor_names(checkpoint_dir: str) -> set[str] | None:
    """Tensor names of the safetensors weights in `checkpoint_dir` (single file or sharded index); None if none."""
    import json

    from safetensors import safe_open

    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return set(json.load(f)["weight_map"])
    single = os.path.join(checkpoint_dir, "model.safetensors")
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return set(f.keys())
    return None


def resume_needs_conversion(trainer, checkpoint_dir: str, model) -> bool:
    """True when the stock resume would load `checkpoint_dir` into `model` by names that do not match."""
    from transformers import PreTrainedModel

    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled or not isinstance(model, PreTrainedModel):
        return False
    names = checkpoint_tensor_names(checkpoint_dir)
    return names is not None and names != set(model.state_dict())


def load_converted_checkpoint(model, checkpoint_dir: str) -> None:
    """Load `checkpoint_dir`'s weights into `model` through `from_pretrained`'s conversions (strict: every
    parameter and buffer must come from the checkpoint)."""
    dtype = next(model.parameters()).dtype
    loaded = type(model).from_pretrained(checkpoint_dir, config=model.config, dtype=dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded


# torch's flight-recorder analyser, used as a library by comm/hang_report.py. torch 2.13 ships it as
# `torch.distributed.flight_recorder` (the `fr_trace` script; its `components` modules are not documented API):
# `build_groups_memberships(pg_config)` -> the groups and their ranks, `align_trace_from_beginning(entries)` -> every
# rank's entries from the first record all ranks still hold, `build_collectives(entries, ...)` -> one `Collective`
# per matched or unmatched collective, matched by (group, collective_seq_id) with `Op.match` (op, input/output sizes,
# all_gather's world-size rule, dtypes, state); the first mismatch of a group has `pass_check` False and either
# `missing_ranks` (members with no entry at that sequence id) or `mismatch_collectives` {rank: Collective whose
# `type_of_mismatch` is a `MatchInfo` (`.state.name`, `.culprit` text)}. It logs its findings on the "Flight
# Recorder" logger (silenced here: the report says them) and assumes NCCL's `pg_config`; Gloo's names its groups ""
# with no ranks (seen on torch 2.13), so the caller passes the groups it rebuilt from the entries. Covered: torch
# 2.13 and 2.14 (tests/unit/test_hang_report.py::test_compat_*).
FR_COLLECTIVE_FIELDS = (
    "pass_check",
    "collective_seq_id",
    "group_id",
    "pg_desc",
    "collective_name",
    "missing_ranks",
    "mismatch_collectives",
    "type_of_mismatch",
)
FR_LOGGER = "Flight Recorder"


def fr_match_collectives(
    entries: dict[int, list[dict]], groups: dict[str, tuple[str, list[int]]], version: str, mismatch_cap: int = 10
) -> list:
    """torch's `Collective` records for every rank's flight-recorder `entries` ({global rank: torch's entries}),
    `groups` {process-group name: (description, member ranks)} (every group named in an entry), `version`: the
    dump's "version". The entry lists are copied (torch's builder consumes them)."""
    import logging

    logging.getLogger(FR_LOGGER).disabled = True  # torch's analyser prints its findings; the report says them
    from torch.distributed.flight_recorder.components.builder import build_collectives, build_groups_memberships
    from torch.distributed.flight_recorder.components.utils import align_trace_from_beginning

    config = {name: {"desc": desc, "ranks": str(sorted(ranks))} for name, (desc, ranks) in groups.items()}
    _, by_guid, _, memberships, pg_guids = build_groups_memberships({rank: config for rank in entries})
    aligned = align_trace_from_beginning({rank: list(rank_entries) for rank, rank_entries in entries.items()})
    _, collectives, _ = build_collectives(aligned, by_guid, memberships, pg_guids, version, mismatch_cap)
    return collectives


# ---- argparse (the standard library) ---------------------------------------------------------------------------
# argparse has no public walk over a parser's arguments and subcommands, nor a way to give a defined flag another
# spelling; `hf-dist-recipes`' shared conventions (cli/conventions.py: accelerate's flag spellings, --output) need
# both. Read in CPython 3.10 to 3.13's argparse.py: `_actions` (every argument, in order), `_SubParsersAction`
# (`choices`: name -> parser), `_option_string_actions` (spelling -> action, shared with the argument groups).
# tests/cli/test_conventions.py parses both spellings of every aliased flag.


def parser_actions(parser) -> list:
    """Every argparse action of `parser`, in the order added (subcommand actions included)."""
    return list(parser._actions)


def subcommand_parsers(parser) -> list:
    """(name, parser) of every subcommand `parser` has, in the order added."""
    import argparse

    return [
        (name, sub)
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items()
    ]


def add_option_string(parser, action, option: str, *, first: bool = False) -> bool:
    """Make `option` another spelling of `action` of `parser` (first in its help when `first`); False, changing
    nothing, when `parser` already has that spelling."""
    if option in parser._option_string_actions:
        return False
    if first:
        action.option_strings.insert(0, option)
    else:
        action.option_strings.append(option)
    parser._option_string_actions[option] = action
    return True
