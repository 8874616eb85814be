"""Fails when an installed upstream no longer matches what hf_dist_recipes/_compat/ relies on.

About 820 lines: one test or more per private touch in _compat/ (each workaround checked both ways), so the file
is as long as the list of what upstream may change under us; split, a touch's test would no longer sit in the one
place that lists them."""

import inspect
from importlib.metadata import version

import accelerate.utils.dataclasses as acc_dataclasses
import accelerate.utils.launch as acc_launch
import pytest
import torch
import transformers.training_args as hf_args
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from hf_dist_recipes import _compat
from hf_dist_recipes._compat import accelerate as compat_accelerate
from hf_dist_recipes._compat import deepspeed as compat_deepspeed
from hf_dist_recipes._compat import torch as compat_torch
from hf_dist_recipes._compat import transformers as compat_transformers


def test_installed_versions_are_the_proven_ones():
    """The contract tests below run against whatever is installed; a release outside PROVEN has not been read."""
    for package, spec in _compat.PROVEN.items():
        assert SpecifierSet(spec).contains(version(package), prereleases=True), (
            f"{package} {version(package)} is outside {spec}: re-read _compat/'s touches, then widen PROVEN"
        )


def test_proven_floors_are_the_declared_floors():
    declared = {Requirement(r).name: Requirement(r).specifier for r in _project_dependencies()}
    for package, spec in _compat.PROVEN.items():
        floors = {s.version for s in SpecifierSet(spec) if s.operator == ">="}
        assert floors == {s.version for s in declared[package] if s.operator == ">="}, package


def _project_dependencies() -> list[str]:
    import tomllib

    from tests.support.paths import REPO

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def test_a_workaround_is_needed_exactly_in_its_affected_releases():
    fixed_in_5_27 = _compat.Workaround("transformers", ">=5.22,<5.27", "upstream", "5.27")
    assert [fixed_in_5_27.needed(v) for v in ("5.21.1", "5.22.0", "5.26.3", "5.27.0", "6.0.0")] == [
        False,
        True,
        True,
        False,
        False,
    ]
    assert set(_compat.WORKAROUNDS) == {
        "autotp_weight_conversion",
        "evaluation_before_training",
        "moe_resume_conversion",
        "hpz_group_per_process",
        "sp_groups_once_per_process",
        "cpu_adam_resumed_step",
        "jit_build_lock_file",
    }
    for entry in _compat.WORKAROUNDS.values():
        assert entry.package in _compat.PROVEN and entry.upstream and entry.remove_when


def test_accelerate_hands_the_deepspeed_file_to_the_ranks_under_the_assumed_names():
    assert f'"{compat_accelerate.ACCELERATE_DEEPSPEED_CONFIG_FILE}"' in inspect.getsource(acc_launch)
    plugin_src = inspect.getsource(acc_dataclasses.DeepSpeedPlugin)
    assert f'os.environ.get("{compat_accelerate.ACCELERATE_DEEPSPEED_CONFIG_FILE}"' in plugin_src


def test_trainingarguments_builds_its_plugin_from_the_launcher_env():
    assert f'os.environ.get("{compat_accelerate.ACCELERATE_USE_DEEPSPEED}"' in inspect.getsource(
        hf_args.TrainingArguments
    )


def test_trainer_reads_the_tp_degree_only_from_the_arguments_config():
    """arguments.py adopts a launcher TP config into `args.deepspeed` because of this; if upstream starts reading
    the plugin's config too, the adoption can go."""
    from transformers import Trainer

    src = inspect.getsource(Trainer.get_tp_size)
    assert 'getattr(self.args, "hf_deepspeed_config", None)' in src
    assert "deepspeed_plugin" not in src


def test_accelerate_refuses_the_keys_lint_reports_beside_a_deepspeed_file():
    from hf_dist_recipes.planning.lint import IGNORED_WITH_DS_FILE

    src = inspect.getsource(acc_dataclasses.DeepSpeedPlugin)
    assert "will be ignored" in src
    for key in IGNORED_WITH_DS_FILE:
        env = (
            "ACCELERATE_"
            + ("" if key in ("mixed_precision", "gradient_accumulation_steps", "gradient_clipping") else "DEEPSPEED_")
            + key.upper()
        )
        assert f'"{env}"' in src, env


def test_from_pretrained_refuses_weight_conversions_under_training_autotp_where_the_workaround_says():
    """_compat.transformers.allow_weight_conversions_under_training_autotp hides training TP from this guard, in the
    releases WORKAROUNDS["autotp_weight_conversion"] names. When this test fails, upstream changed the guard: re-check
    whether the wrapper is still needed, and close the entry's `affected` below the release that fixed it."""
    import transformers.integrations.deepspeed as hf_ds
    from transformers import AutoModelForCausalLM
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.integrations import HfDeepSpeedConfig

    from hf_dist_recipes.core.model_templates import template_config

    compat_transformers.allow_weight_conversions_under_training_autotp()
    patched = hf_ds._apply_weight_conversions_to_state_dict
    original = getattr(patched, "__wrapped__", patched)
    assert (patched is not original) == _compat.needed("autotp_weight_conversion")
    model = AutoModelForCausalLM.from_config(template_config("tiny-deepseek-v3"))
    experts = model.model.layers[1].mlp.experts
    on_disk = {}
    for e in range(experts.gate_up_proj.shape[0]):
        gate, up = experts.gate_up_proj[e].detach().chunk(2, dim=0)
        on_disk[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] = gate.clone()
        on_disk[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] = up.clone()
    mapping = get_model_conversion_mapping(model)
    ds = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "tensor_parallel": {"autotp_size": 2}})
    try:
        try:
            stock = original(model, dict(on_disk), mapping)
            if not isinstance(stock, dict):  # 5.23 and later: a generator, the guard runs at its first step
                next(stock)
            refused = False
        except NotImplementedError as e:
            refused = "Tensor Parallelism" in str(e)
        assert refused == _compat.needed("autotp_weight_conversion"), f"the stock guard refused: {refused}"
        result = patched(model, dict(on_disk), mapping)
        converted = dict(result) if isinstance(result, dict) else {k: v for part in result for k, v in part.items()}
        assert torch.equal(converted["model.layers.1.mlp.experts.gate_up_proj"], experts.gate_up_proj.detach())
        assert hf_ds.deepspeed_config()["tensor_parallel"]["autotp_size"] == 2  # the config is left as it was
    finally:
        del ds


def test_evaluation_before_training_builds_an_engine_that_train_destroys_where_the_workaround_says():
    """RecipeTrainer.train/evaluate work around this (transformers PR 44889) in the releases
    WORKAROUNDS["evaluation_before_training"] names. When this fails, upstream changed the evaluation-first path:
    re-check whether RecipeTrainer's override is still needed, and close the entry's `affected`."""
    from transformers import Trainer

    builds = "deepspeed_init(self, num_training_steps=0, inference=True)" in inspect.getsource(Trainer.evaluation_loop)
    destroys = "self.accelerator.free_memory()" in inspect.getsource(Trainer._inner_training_loop)
    assert (builds and destroys) == _compat.needed("evaluation_before_training"), (builds, destroys)


def test_deepspeed_still_refuses_the_consolidated_save_under_autoep():
    """The generator writes stage3_gather_16bit_weights_on_model_save=false under EP and the lint reports it
    because of this; RecipeTrainer.save_model gathers experts itself."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    src = inspect.getsource(DeepSpeedEngine._zero3_consolidated_16bit_state_dict)
    assert "_raise_if_autoep_zero3_consolidated_export" in src


def test_moe_routers_return_their_top_k_indices_where_assumed():
    """monitoring/expert_load.py counts tokens from these positions; a router that changes its output fails here."""
    import deepspeed.module_inject.auto_ep_layer as auto_ep_layer
    import deepspeed.moe.ep_router as ep_router
    from transformers import AutoModelForCausalLM

    from hf_dist_recipes.core.model_templates import template_config

    model = AutoModelForCausalLM.from_config(template_config("tiny-deepseek-v3"))
    classes = compat_deepspeed.moe_router_classes()
    router = next(m for m in model.modules() if type(m) in classes)
    hidden = torch.randn(5, model.config.hidden_size)
    indices = router(hidden)[classes[type(router)]]
    assert indices.shape == (5, model.config.num_experts_per_tok) and indices.dtype == torch.int64
    assert ep_router.TokenChoiceTopKRouter in classes and classes[ep_router.TokenChoiceTopKRouter] == 1
    src = inspect.getsource(ep_router.TokenChoiceTopKRouter.forward)
    assert "return top_scores, selected_experts_indices, num_tokens_per_expert" in src
    layer_src = inspect.getsource(auto_ep_layer.AutoEPMoELayer.__init__)
    assert "self.router = TokenChoiceTopKRouter(" in layer_src and "self.ep_size = ep_size" in layer_src


def test_deepspeed_refuses_a_second_hpz_group_in_one_process_where_the_workaround_says():
    """RecipeTrainer.call_model_init forgets this global (_compat.deepspeed.forget_zero_hpz_group) so that `train()` can
    call `model_init` again under hpZ, in the releases WORKAROUNDS["hpz_group_per_process"] names. When this fails,
    upstream changed how zero.Init keeps the hpZ group: re-check whether the reset is still needed and still enough."""
    import deepspeed.utils.groups as groups
    from deepspeed.runtime.zero.partition_parameters import Init

    refuses = (
        hasattr(groups, compat_deepspeed._HPZ_GROUP)
        and "ZeRO parameter intra parallel group is already initialized"
        in inspect.getsource(groups._create_zero_param_parallel_group)
        and "groups._create_zero_param_parallel_group(" in inspect.getsource(Init.__init__)
    )
    assert refuses == _compat.needed("hpz_group_per_process")
    before = getattr(groups, compat_deepspeed._HPZ_GROUP)
    try:
        stand_in = object()  # stands in for a process group; none exists in this process
        setattr(groups, compat_deepspeed._HPZ_GROUP, stand_in)
        compat_deepspeed.forget_zero_hpz_group()
        assert getattr(groups, compat_deepspeed._HPZ_GROUP) is (None if refuses else stand_in)
    finally:
        setattr(groups, compat_deepspeed._HPZ_GROUP, before)


def test_deepspeed_refuses_second_sp_groups_in_one_process_where_the_workaround_says():
    """RecipeTrainer.train forgets DeepSpeed's SP groups (_compat.deepspeed.forget_sequence_parallel_groups) so that the
    training prepare after an evaluation's registers Ulysses again, in the releases WORKAROUNDS names. When this fails,
    upstream changed how the SP groups are kept: re-check whether the release is still needed and still enough (the
    trained check: tests/distributed/test_sequence_parallel.py evaluates before it trains)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as state

    refuses = "sequence parallel group is already initialized" in inspect.getsource(state.initialize_sequence_parallel)
    assert refuses == _compat.needed("sp_groups_once_per_process")
    before = (state._SEQUENCE_PARALLEL_GROUP, state._SEQUENCE_DATA_PARALLEL_GROUP)
    try:
        state._SEQUENCE_PARALLEL_GROUP = state._SEQUENCE_DATA_PARALLEL_GROUP = object()  # stand-ins: no group here
        compat_deepspeed.forget_sequence_parallel_groups()
        after = (state._SEQUENCE_PARALLEL_GROUP, state._SEQUENCE_DATA_PARALLEL_GROUP)
        assert (after == (None, None)) == refuses
    finally:
        state._SEQUENCE_PARALLEL_GROUP, state._SEQUENCE_DATA_PARALLEL_GROUP = before


def test_torch_waits_on_the_build_lock_file_where_the_workaround_says():
    """doctor/op_builds.py reports stale build locks only where torch's JIT build waits while the file exists
    (FileBaton, torch 2.13); torch 2.14 takes an OS-level lock on it and leaves the file after every load."""
    from torch.utils import cpp_extension

    from hf_dist_recipes.doctor import op_builds

    blocks = "FileBaton(" in inspect.getsource(cpp_extension._jit_compile)
    assert blocks == _compat.needed("jit_build_lock_file") == op_builds.lock_file_blocks()


def test_gradient_health_upstream_assumptions():
    """stability/gradient_health.py relies on these (transformers 5.24, accelerate 1.16, DeepSpeed 0.19.8)."""
    import accelerate.optimizer as acc_optimizer
    import accelerate.scheduler as acc_scheduler
    from accelerate.utils import deepspeed as acc_ds
    from transformers import Trainer

    loop = inspect.getsource(Trainer._run_epoch)
    # the norm, clipped or not, passes _get_grad_norm before on_pre_optimizer_step, then the scheduler guard
    clip, pre, step, guard = (
        loop.index("grad_norm = self._get_grad_norm(model, grad_norm=grad_norm)"),
        loop.index("on_pre_optimizer_step"),
        loop.index("self.optimizer.step()"),
        loop.index("if not self.accelerator.optimizer_step_was_skipped:"),
    )
    assert clip < pre < step < guard
    assert "tr_loss -= tr_loss" in inspect.getsource(Trainer._maybe_log_save_evaluate)
    assert "self._tr_loss" in loop
    # accelerate: step_was_skipped is _is_overflow, written only by the GradScaler path; the scheduler reads it
    assert "return self._is_overflow" in inspect.getsource(acc_optimizer.AcceleratedOptimizer.step_was_skipped.fget)
    assert "if opt.step_was_skipped:" in inspect.getsource(acc_scheduler.AcceleratedScheduler.step)
    # accelerate under DeepSpeed: backward runs engine.step; skipped means the engine optimizer's overflow
    backward = inspect.getsource(acc_ds.DeepSpeedEngineWrapper.backward)
    assert "self.engine.backward(loss" in backward and "self.engine.step()" in backward
    assert "self.optimizer.overflow" in inspect.getsource(acc_ds.DeepSpeedOptimizerWrapper.step_was_skipped.fget)


def test_deepspeed_zero3_skips_a_step_with_a_non_finite_norm():
    """gradient_health.py counts on ZeRO-3 refusing a step whose global norm is not finite, in bf16/fp32 too, and
    on the engine not stepping its scheduler then."""
    from deepspeed.runtime import engine
    from deepspeed.runtime.zero import stage3

    module = inspect.getsource(stage3)  # step is under an nvtx wrapper without functools.wraps: read the module
    start = module.index("    def step(self, closure=None):")
    src = module[start : module.index("\n    def ", start + 10)]
    assert "is_invalid_grad_norm(scaled_global_grad_norm)" in src and "self.overflow = True" in src
    take = inspect.getsource(engine.DeepSpeedEngine._take_model_step)
    assert "self._step_applied = not overflow" in take and "self.skipped_steps += 1" in take


def test_torch_non_persistent_buffers_are_the_ones_state_dict_leaves_out():
    """checkpoint/gather.py exports what state_dict would hold: persistent buffers only (torch 2.13)."""
    module = torch.nn.Linear(2, 2)
    module.register_buffer("kept", torch.ones(1))
    module.register_buffer("dropped", torch.zeros(1), persistent=False)
    assert compat_torch.non_persistent_buffer_names(module) == {"dropped"}
    assert set(module.state_dict()) == {"weight", "bias", "kept"}


def test_zero3_marks_partitioned_parameters_where_assumed():
    """_compat.deepspeed.zero_param_id / is_zero_partitioned read the attributes zero.Init sets (DeepSpeed 0.19.8); the
    tied weight detection in checkpoint/gather.py relies on one id per parameter, equal on every rank."""
    from deepspeed.runtime.zero.partition_parameters import Init
    from deepspeed.runtime.zero.utils import is_zero_param

    convert = inspect.getsource(Init._convert_to_deepspeed_param)
    assert "param.ds_id = Init.param_id" in convert and "Init.param_id += 1" in convert
    assert "param.ds_numel = " in convert and "param.ds_tensor = " in convert
    marked, plain = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    marked.ds_id = 7
    assert compat_deepspeed.zero_param_id(marked) == 7 and compat_deepspeed.zero_param_id(plain) is None
    assert [compat_deepspeed.is_zero_partitioned(p) for p in (marked, plain)] == [
        is_zero_param(p) for p in (marked, plain)
    ]
    marked.ds_numel, marked.ds_tensor = 10, torch.ones(5)  # a 10-element parameter, half of it on this rank
    assert compat_deepspeed.held_elements(marked) == (10, 5) and compat_deepspeed.held_elements(plain) == (1, 1)


def test_autotp_gather_context_takes_params_and_module_and_leaves_other_modules_alone():
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    assert list(inspect.signature(GatherReplacedLayerParams).parameters) == ["params", "module", "enabled"]
    assert "GatherReplacedLayerParams(" in inspect.getsource(_engine_class()._zero3_consolidated_16bit_state_dict)
    linear = torch.nn.Linear(3, 2)
    before = linear.weight.detach().clone()
    with compat_deepspeed.gather_tp_params(list(linear.parameters()), linear):
        assert torch.equal(linear.weight, before)  # not an AutoTP layer: nothing gathered, nothing changed


def _engine_class():
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine


@pytest.fixture(scope="module")
def autoep_model():
    """A tiny DeepSeek-V3 whose MoE blocks DeepSpeed AutoEP replaced in this process (EP 1: no process group)."""
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import AutoEPConfig
    from transformers import AutoModelForCausalLM

    from hf_dist_recipes.core.model_templates import template_config

    model = AutoModelForCausalLM.from_config(template_config("tiny-deepseek-v3"))
    original = model.model.layers[1].mlp
    autoep = AutoEP(model, AutoEPConfig(enabled=True, autoep_size=1, preset_model="deepseek_v3"))
    autoep.replace_moe_layers(autoep.ep_parser(), ep_size=1, ep_rank=0)
    return model, original


def test_autoep_layer_parts_read_a_real_autoep_layer(autoep_model):
    """checkpoint/gather.py reads an AutoEP layer only through _compat.deepspeed.autoep_layer_parts (DeepSpeed
    0.19.8)."""
    model, original = autoep_model
    config = model.config
    layers = [m for m in model.modules() if compat_deepspeed.is_autoep_layer(m)]
    assert len(layers) == config.num_hidden_layers - config.first_k_dense_replace  # 2 of 3: the first is dense
    assert not compat_deepspeed.is_autoep_layer(original) and not compat_deepspeed.is_autoep_layer(model)
    parts = compat_deepspeed.autoep_layer_parts(layers[0])
    e, inter, hidden = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size  # 8, 32, 64
    assert parts.model_family == "deepseek_v3" and parts.num_experts == e
    assert parts.w1.shape == (e, inter, hidden) and parts.w3.shape == (e, inter, hidden)
    assert parts.w2.shape == (e, hidden, inter)
    assert isinstance(parts.router_gate, torch.nn.Linear) and parts.router_gate.weight.shape == (e, hidden)
    assert parts.router.e_score_correction_bias.shape == (e,) and parts.shared_experts is not None
    assert hasattr(layers[0], "ep_group")  # None until deepspeed.initialize sets the groups
    assert compat_deepspeed.autoep_experts_for_rank(parts.placement, 0) == list(range(e))
    # the same layer's state-dict names, as the offline export finds them in a checkpoint
    K = compat_deepspeed.ZeroCheckpointKeys
    names = set(layers[0].state_dict())
    assert {f"experts.{w}" for w in K.EXPERT_TENSORS} | {f"{K.ROUTER_GATE}.weight", K.ROUTER_SCORE_BIAS} <= names


def test_autoep_placement_hands_each_ep_rank_its_block_of_experts():
    from deepspeed.checkpoint.autoep_affine import legacy_uniform_autoep_placement_descriptor

    placement = legacy_uniform_autoep_placement_descriptor(8, 4, 2)  # 8 experts, 4 per rank, EP 2
    assert [compat_deepspeed.autoep_experts_for_rank(placement, r) for r in (0, 1)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    K = compat_deepspeed.ZeroCheckpointKeys  # the offline export reads this descriptor from a checkpoint by these keys
    assert [(p[K.PLACEMENT_RANK], p[K.PLACEMENT_EXPERTS]) for p in placement[K.PLACEMENT_RANKS]] == [
        (0, [0, 1, 2, 3]),
        (1, [4, 5, 6, 7]),
    ]


def test_autoep_preset_names_the_replaced_blocks_modules(autoep_model):
    model, original = autoep_model
    preset = compat_deepspeed.autoep_preset("deepseek_v3")
    inter = model.config.moe_intermediate_size
    experts = original.get_submodule(preset.experts)
    assert isinstance(original.get_submodule(preset.router), torch.nn.Module)
    assert preset.expert_w3 is None and getattr(experts, preset.expert_w1).shape[1] == 2 * inter  # fused gate/up
    assert getattr(experts, preset.expert_w2).shape[2] == inter
    assert isinstance(original.get_submodule(preset.shared_experts), torch.nn.Module)
    assert compat_deepspeed.autoep_preset("no_such_model_type") is None


def test_transformers_reverts_fused_experts_to_the_layout_save_pretrained_writes():
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import PreTrainedModel

    from hf_dist_recipes.core.model_templates import template_config

    assert list(inspect.signature(revert_weight_conversion).parameters) == ["model", "state_dict"]
    assert "revert_weight_conversion(model_to_save, shard_state_dict)" in inspect.getsource(
        PreTrainedModel.save_pretrained
    )
    model = AutoModelForCausalLM.from_config(template_config("tiny-deepseek-v3"))
    fused = model.model.layers[1].mlp.experts.gate_up_proj.detach()  # [E, 2I, H]: gate rows, then up rows
    inter = model.config.moe_intermediate_size
    disk = compat_transformers.to_disk_layout(model, {"model.layers.1.mlp.experts.gate_up_proj": fused})
    for e in range(model.config.n_routed_experts):
        assert torch.equal(disk[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"], fused[e, :inter])
        assert torch.equal(disk[f"model.layers.1.mlp.experts.{e}.up_proj.weight"], fused[e, inter:])


def test_zero_checkpoint_file_names_are_deepspeeds():
    from types import SimpleNamespace

    engine = _engine_class()
    fake = SimpleNamespace(
        _get_zero_ckpt_prefix=lambda dp_rank, bf16_mode: engine._get_zero_ckpt_prefix(None, dp_rank, bf16_mode),
        checkpoint_mp_rank=1,
        zero_optimization_partition_weights=lambda: True,
    )
    optim = engine._get_rank_zero_ckpt_name(fake, "ckpt", "global_step5", mp_rank=1, dp_rank=3, bf16_mode=True)
    model = engine._get_ckpt_name(fake, "ckpt", "global_step5", pp_placeholder=3)
    for path, kind in ((optim, "optim"), (model, "model")):
        m = compat_deepspeed.ZERO_RANK_FILE.match(path.rsplit("/", 1)[1])
        assert m is not None and (int(m.group(2)), int(m.group(3)), m.group(4)) == (3, 1, kind), path


def test_zero_checkpoint_keys_are_deepspeeds():
    """The offline export (checkpoint/zero_files.py) reads a training checkpoint by these keys (DeepSpeed 0.19.8)."""
    from deepspeed.checkpoint import constants as c
    from deepspeed.runtime.zero import stage3

    K = compat_deepspeed.ZeroCheckpointKeys
    named = {
        K.OPTIMIZER_STATE: c.OPTIMIZER_STATE_DICT,
        K.FP32_FLAT_GROUPS: c.FP32_FLAT_GROUPS,
        K.PARTITION_COUNT: c.PARTITION_COUNT,
        K.PARAM_SHAPES: c.PARAM_SHAPES,
        K.BUFFER_NAMES: c.BUFFER_NAMES,
        K.UNIVERSAL_INFO: c.UNIVERSAL_CHECKPOINT_INFO,
        K.TP_REPLICATED: c.TP_REPLICATED_PARAMETER_PATTERNS,
        K.ROW_PARALLEL: c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
        K.VOCABULARY: c.VOCABULARY_PARAMETER_PATTERNS,
        K.ORIGINAL_VOCAB_SIZE: c.ORIGINAL_VOCAB_SIZE,
        K.AUTOEP_LAYERS: c.AUTOEP_LAYERS_KEY,
        K.EXPERT_KEY_PREFIX: c.AUTOEP_EXPERT_KEY_PREFIX,
        K.NUM_EXPERTS: c.AUTOEP_NUM_EXPERTS,
        K.EXPERT_PLACEMENT: c.AUTOEP_EXPERT_PLACEMENT,
        K.PLACEMENT_RANKS: c.AUTOEP_PLACEMENT_RANKS,
        K.PLACEMENT_RANK: c.AUTOEP_PLACEMENT_RANK,
        K.PLACEMENT_EXPERTS: c.AUTOEP_PLACEMENT_EXPERTS,
    }
    assert {ours: theirs for ours, theirs in named.items() if ours != theirs} == {}
    engine = _engine_class()
    common = inspect.getsource(engine._common_checkpoint_state)
    assert f"{K.MODULE}=module_state_dict" in common and f"{K.SHARED_PARAMS}=" in common
    moe = inspect.getsource(engine._save_moe_checkpoint)
    for key in (K.MODULE_PATH, K.EP_RANK, K.AUTOEP_LAYERS):
        assert f"'{key}'" in moe, key
    assert f"{K.OPTIMIZER_STATE}=self.optimizer.state_dict()" in inspect.getsource(engine._save_zero_checkpoint)
    opt = stage3.DeepSpeedZeroOptimizer_Stage3
    assert f"state_dict['{K.PARTITION_GROUPS}']" in inspect.getsource(opt._rigid_state_dict)
    groups = inspect.getsource(opt._zero3_partition_group_metadata)
    for key in (K.GROUP_COUNT, K.GROUP_RANK, K.GROUP_RANKS):
        assert f'"{key}":' in groups, key


def test_resume_loads_go_through_the_engines_checkpoint_engine():
    """checkpoint/resume_loading.py (DeepSpeed 0.19.8, transformers 5.25, accelerate 1.16): the engine keeps its
    checkpoint engine as `checkpoint_engine` and reads every file of a resume through its `load`, the default one a
    plain torch.load; ZeRO hands the loaded optimizer state to the torch optimizer it holds as `.optimizer`; the
    Trainer calls `create_scheduler` after building the engine and before loading the checkpoint into it; accelerate
    holds that engine as `deepspeed_engine_wrapped.engine`."""
    import accelerate
    from deepspeed.runtime.checkpoint_engine import torch_checkpoint_engine
    from deepspeed.runtime.zero import stage3
    from transformers import Trainer

    engine = _engine_class()
    assert "self.checkpoint_engine = create_checkpoint_engine(" in inspect.getsource(engine._configure_checkpointing)
    assert "checkpoint_engine=self.checkpoint_engine" in inspect.getsource(engine._load_checkpoint)
    zero_files = inspect.getsource(engine._get_all_zero_checkpoint_state_dicts)
    assert "_state = self.checkpoint_engine.load(" in zero_files
    load = inspect.getsource(torch_checkpoint_engine.TorchCheckpointEngine.load)
    assert "torch.load(path, map_location=map_location, weights_only=False)" in load
    rigid = inspect.getsource(stage3.DeepSpeedZeroOptimizer_Stage3._rigid_load_state_dict)
    assert "self.optimizer.load_state_dict(state_dict[OPTIMIZER_STATE_DICT])" in rigid
    assert "self.optimizer = init_optimizer" in inspect.getsource(stage3.DeepSpeedZeroOptimizer_Stage3.__init__)
    prepare = inspect.getsource(Trainer._prepare_for_training)
    built = prepare.index("self.accelerator.prepare(")
    hook = prepare.index("self.create_scheduler(", built)
    assert prepare.index("deepspeed_load_checkpoint(", hook) > hook
    wrapped = inspect.getsource(accelerate.Accelerator._prepare_deepspeed)
    assert "self.deepspeed_engine_wrapped = DeepSpeedEngineWrapper(engine)" in wrapped


def _method_source(module_source: str, name: str) -> str:
    start = module_source.index(f"    def {name}(")
    return module_source[start : module_source.index("\n    def ", start + 10)]


def test_deepspeed_zero3_gradient_buckets_as_watch_zero3_gradients_reads_them():
    """_compat.deepspeed.watch_zero3_gradients (DeepSpeed 0.19.8): every gradient leaves through the name-mangled bucket
    reduction, called when a bucket is full and at the end of each backward; the bucket names its parameters in
    `params`, whose `.grad` is still this rank's own gradient then; within reduce_bucket_size the gradients lie
    end to end in `buffer`, in the order of `params`."""
    import dataclasses

    from deepspeed.runtime.zero import stage3

    assert hasattr(stage3.DeepSpeedZeroOptimizer_Stage3, compat_deepspeed._ZERO3_REDUCE)
    assert {f.name for f in dataclasses.fields(stage3.IPGBucketZ3)} >= {"buffer", "params", "elements"}
    module = inspect.getsource(stage3)
    reduce = _method_source(module, "reduce_independent_p_g_buckets_and_remove_grads")
    assert reduce.count("self.__reduce_and_partition_ipg_grads(comm_dtype)") == 2
    assert "self.__reduce_and_partition_ipg_grads(comm_dtype)" in _method_source(
        module, "independent_gradient_partition_epilogue"
    )
    add = _method_source(module, "__add_grad_to_ipg_bucket")
    assert "bucket.elements + param.grad.numel() <= self.reduce_bucket_size" in add  # then copied into buffer
    assert "bucket.buffer.narrow(0, bucket.elements, param.grad.numel())" in add
    assert "bucket.params.append(param)" in add
    # the reduction reads each parameter's .grad (the bucket buffer or its own tensor) and only then frees them
    reduce_ipg = _method_source(module, "__reduce_and_partition_ipg_grads")
    assert "params_in_bucket = bucket.params" in reduce_ipg
    assert reduce_ipg.index("self.partition_grads(params_in_bucket") < reduce_ipg.index("params_in_bucket.clear()")
    # the only caller of reduce_independent_p_g_buckets_and_remove_grads skips nothing (the flag is never set)
    assert module.count("self._coalesce_grad_reduction = True") == 0
    assert not compat_deepspeed.watch_zero3_gradients(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]), print)


def test_deepspeed_zero3_norm_stays_invalid_when_one_group_is():
    """gradient_health.py takes ZeRO-3's global norm as 'some gradient was non-finite': DeepSpeed 0.19.8 marks a
    group's inf/NaN norm -1 (get_grad_norm_direct) and combine_grad_norm_groups keeps that invalid (inf)."""
    from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm

    assert combine_grad_norm_groups([torch.tensor(3.0), torch.tensor(4.0)]).item() == 5.0  # sqrt(9 + 16)
    for bad in (-1.0, float("nan"), float("inf")):
        combined = combine_grad_norm_groups([torch.tensor(bad), torch.tensor(2.0)])
        assert combined.item() == float("inf") and is_invalid_grad_norm(combined)


def test_tensor_norms_by_hand_keep_a_non_finite_value_in_its_own_norm():
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([float("nan"), 1.0]), torch.tensor([[float("inf")]])]
    norms = compat_torch.tensor_norms(tensors + [torch.tensor([6.0, 8.0], dtype=torch.bfloat16)])
    assert norms.dtype == torch.float32 and norms.shape == (4,)
    assert norms[0].item() == 5.0 and norms[1].isnan() and norms[2].item() == float("inf")  # 5 = sqrt(9 + 16)
    assert norms[3].item() == 10.0


@pytest.mark.filterwarnings(
    "ignore:Detected call of:UserWarning"
)  # lr_scheduler.step() on a skipped step: the case under test
def test_mark_optimizer_step_skipped_makes_accelerate_skip_the_scheduler():
    from accelerate import Accelerator

    model = torch.nn.Linear(2, 2)
    acc = Accelerator(cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    model, opt, sched = acc.prepare(model, opt, sched)
    assert not compat_accelerate.has_grad_scaler(opt)
    compat_accelerate.mark_optimizer_step_skipped(opt, True)
    assert acc.optimizer_step_was_skipped
    sched.step()
    assert opt.param_groups[0]["lr"] == 1.0  # not stepped
    compat_accelerate.mark_optimizer_step_skipped(opt, False)
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5


def test_the_private_trainer_methods_the_recipe_overrides():
    """_compat.transformers.TrainerPrivateOverrides (transformers 5.24): each private method still exists with the
    signature the override has and is called where it assumes; and no other private Trainer method is overridden
    anywhere else."""
    from transformers import Trainer

    from hf_dist_recipes.trainer import RecipeTrainer, RecipeTrainerMixin

    overrides = {
        n for n in vars(compat_transformers.TrainerPrivateOverrides) if n.startswith("_") and not n.startswith("__")
    }
    assert overrides == {
        "_get_grad_norm",
        "_load_from_checkpoint",
        "_load_callback_state",
        "_save_checkpoint",
        "_load_optimizer_and_scheduler",
    }
    for name in overrides:
        ours, theirs = (
            inspect.signature(getattr(compat_transformers.TrainerPrivateOverrides, name)),
            inspect.signature(getattr(Trainer, name)),
        )
        assert list(ours.parameters) == list(theirs.parameters), name
        assert [p.default for p in ours.parameters.values()] == [p.default for p in theirs.parameters.values()]
        # the ones in use
        assert getattr(RecipeTrainer, name) is getattr(compat_transformers.TrainerPrivateOverrides, name)
    # Called where the overrides assume: both branches (clipped or not, max_grad_norm == 0) reach _get_grad_norm,
    # whose value is the step's grad norm; train() resumes through _load_from_checkpoint.
    loop = inspect.getsource(Trainer._run_epoch)
    clipped = "if self.args.max_grad_norm > 0:\n                        grad_norm = self._clip_grad_norm(model)\n"
    assert clipped + "                    grad_norm = self._get_grad_norm(model, grad_norm=grad_norm)" in loop
    assert "self._load_from_checkpoint(resume_from_checkpoint)" in inspect.getsource(Trainer.train)
    # A DeepSpeed resume: the engine's checkpoint first, then _load_optimizer_and_scheduler (CPU Adam's replay).
    prepare = inspect.getsource(Trainer._prepare_for_training)
    loaded = prepare.index("deepspeed_load_checkpoint(")
    assert prepare.index("self._load_optimizer_and_scheduler(resume_from_checkpoint)", loaded) > loaded
    # A save: the checkpoint folder and the rotation by the arguments' limit inside `_save_checkpoint`, then on_save.
    save = inspect.getsource(Trainer._save_checkpoint)
    assert 'checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"' in save
    assert "run_dir = self._get_output_dir(trial=trial)" in save
    assert "save_total_limit=self.args.save_total_limit" in save.split("rotate_checkpoints(")[1]
    assert save.count("self.args.save_total_limit") == 1  # nothing else in it reads the limit the override sets to None
    assert (
        "self._save_checkpoint(model, trial)\n            self.control = self.callback_handler.on_save("
        in inspect.getsource(Trainer._maybe_log_save_evaluate)
    )
    # A restored callback is a new instance built from its saved arguments alone, then put into the handler.
    restore = inspect.getsource(Trainer._load_callback_state)
    assert "new_callback = type(callback)(**args)" in restore and "self.callback_handler.add_callback" in restore
    # The mixin itself overrides no other private Trainer method: they all live in _compat.
    private = {n for n in vars(RecipeTrainerMixin) if n.startswith("_") and not n.startswith("__")}
    assert not {n for n in private if hasattr(Trainer, n)}, (
        "move the override into _compat.transformers.TrainerPrivateOverrides"
    )


def test_transformers_gives_a_use_cpu_group_no_timeout(monkeypatch, tmp_path):
    """Why the recipe sets ddp_timeout on the group itself (_compat.torch.collective_timeout's note): transformers 5.24
    `_setup_devices` hands accelerate's PartialState `timeout=ddp_timeout` on the GPU branch but none with use_cpu,
    where accelerate then creates the Gloo group with torch's 30 minutes. When this fails, transformers passes it:
    the recipe route's group is then created with ddp_timeout (comm/process_setup.py records BEFORE_GROUP)."""
    from datetime import timedelta

    from accelerate.utils import DistributedType

    seen: list[dict] = []

    class Recording:  # PartialState's constructor arguments, no process group
        def __init__(self, cpu=False, **kwargs):
            seen.append({"cpu": cpu, **kwargs})
            self.device, self.distributed_type = torch.device("cpu"), DistributedType.NO

    monkeypatch.setattr(hf_args, "PartialState", Recording)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    hf_args.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, ddp_timeout=7200)
    hf_args.TrainingArguments(output_dir=str(tmp_path), ddp_timeout=7200)
    assert seen[0]["cpu"] is True and "timeout" not in seen[0]
    assert seen[1]["timeout"] == timedelta(seconds=7200)


def test_collective_timeout_reads_the_groups_backend(tmp_path):
    """_compat.torch.collective_timeout: torch 2.13 keeps a group's timeout in its backend's options (`_get_backend`,
    `options._timeout`, both private); fails when they move."""
    from datetime import timedelta

    import torch.distributed as dist

    assert compat_torch.collective_timeout() is None  # no group
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=123)
    )
    try:
        assert compat_torch.collective_timeout() == 123
        assert (
            compat_torch.collective_timeout(dist.new_group([0])) == 1800
        )  # new_group: torch's default, not the group's
    finally:
        dist.destroy_process_group()


def test_the_gloo_flight_recorder_dumps_what_the_hang_report_reads(monkeypatch):
    """_compat.torch.flight_recorder_trace: torch 2.13's CPU recorder records Gloo collectives by default (2000 entries,
    `TORCH_FR_BUFFER_SIZE`) and `_dump_fr_trace` pickles them in format 2.10 with the fields `logs hang` reads."""
    import pickle
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    from tests.support.launch import free_port

    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/FlightRecorder.hpp"
    assert '{"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000' in header.read_text()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        dist.all_gather([torch.zeros(5)], torch.ones(5))
        trace = pickle.loads(compat_torch.flight_recorder_trace())
    finally:
        dist.destroy_process_group()
    assert trace["version"] == "2.10" and {"pg_config", "pg_status", "entries"} <= set(trace)
    entry = trace["entries"][-1]
    assert entry["profiling_name"] == "gloo:all_gather" and entry["input_sizes"] == [[5]]
    assert entry["output_sizes"] == [[1, 5]] and entry["collective_seq_id"] >= 1
    assert {"state", "process_group", "frames", "time_created_ns", "timeout_ms"} <= set(entry)
    # The Python call site, innermost FIRST (the stack files of comm/flight_recorder.py are innermost last): how the
    # report finds the user's line of a collective
    assert entry["frames"][0]["name"] == "all_gather"
    assert any(f["filename"] == __file__ and f["name"].startswith("test_the_gloo") for f in entry["frames"])


def test_the_zero3_relayout_touches_are_there():
    """The relayout helpers (checkpoint/relayout.py): DeepSpeed 0.19.8's public ZeRO-3 setters go through
    `set_full_hp_param`, which still slices `value.flatten().narrow(0, part * rank, part)` (the padded last partition
    runs past the end: `set_zero3_partition_padded`) and reads the moments from `optimizer.state[flat]` (which must
    exist first: `create_zero3_optimizer_states`); the module partitions, the unflatten and the AutoTP patterns'
    attribute are where _compat/deepspeed.py reads them."""
    from deepspeed.checkpoint import constants
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    assert "set_full_hp_param(value, param)" in inspect.getsource(safe_set_full_fp32_param)
    assert "set_full_hp_param(value, param, optim_state_key)" in inspect.getsource(safe_set_full_optimizer_state)
    setter = inspect.getsource(Stage3.set_full_hp_param)
    assert "fp32_opt_state_partition.numel() * my_rank" in setter and "_get_fp32_opt_state_partition" in setter
    partition = inspect.getsource(Stage3._get_fp32_opt_state_partition)
    assert "self.optimizer.state[fp32_param][optim_state_key]" in partition
    load = inspect.getsource(Stage3._rigid_load_state_dict)
    assert "fp16_partitioned_groups_flat[sub_group_id]" in load and "self.unflatten(" in load
    for name in ("_get_param_partition_rank", "_get_param_partition_world_size"):
        assert callable(getattr(Stage3, name))
    assert constants.UNIVERSAL_CHECKPOINT_INFO == "universal_checkpoint_info"


def test_a_padded_zero3_partition_is_set_with_its_padding_zero():
    """_compat.deepspeed.set_zero3_partition_padded: 5 elements over 2 partitions of 3; the last rank gets [3, 4] and a
    zero (where DeepSpeed's `set_full_hp_param` would narrow past the end). A stand-in optimizer, no process group."""
    from types import SimpleNamespace

    for rank, expected in ((0, [0.0, 1.0, 2.0]), (1, [3.0, 4.0, 0.0])):
        part = torch.full((3,), 9.0)
        zero = SimpleNamespace(
            _get_fp32_opt_state_partition=lambda param, release_swap_buffers, optim_state_key, part=part: (part, 0),
            _get_param_partition_rank=lambda param, rank=rank: rank,
            _get_param_partition_world_size=lambda param: 2,
        )
        param = SimpleNamespace(_z3_optimizer=zero, ds_numel=5)
        assert compat_deepspeed.zero3_partition_padded(param)
        compat_deepspeed.set_zero3_partition_padded(param, torch.arange(5.0), "exp_avg")
        assert part.tolist() == expected


def test_torch_elastic_workers_use_the_agent_store_by_the_variable_comm_restarts_sets(monkeypatch):
    import importlib

    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # the module; the package's name is a function
    for value, expected in (("True", True), ("False", False)):
        monkeypatch.setenv(compat_torch.AGENT_STORE_VARIABLE, value)
        assert rendezvous._torchelastic_use_agent_store() is expected
        assert compat_torch.agent_store_in_use({compat_torch.AGENT_STORE_VARIABLE: value}) is expected
    environ = {compat_torch.AGENT_STORE_VARIABLE: "True"}
    compat_torch.stop_using_agent_store(environ)
    monkeypatch.setenv(compat_torch.AGENT_STORE_VARIABLE, environ[compat_torch.AGENT_STORE_VARIABLE])
    assert rendezvous._torchelastic_use_agent_store() is False


def test_the_stock_log_appends_a_copy_of_its_logs_to_the_history(tmp_path):
    """_compat.transformers.log_outside_history: the real `Trainer.log` appends one entry per call to
    `state.log_history`, a copy of the `logs` every integration's `on_log` receives, before on_log; so a key dropped
    from that entry afterwards reached the integrations and stays out of the history. Fails when upstream appends
    `logs` itself, appends after on_log, elsewhere or more than once."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    seen = []

    class Integration(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append((logs, dict(logs), state.log_history[-1] if state.log_history else None))

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = Trainer(model=torch.nn.Linear(2, 2), args=args, callbacks=[Integration()])
    logs = {"loss": 1.0, "job/slowest_rank": 3.0}
    trainer.log(logs)
    history = trainer.state.log_history
    assert len(history) == 1 and history[0] is not logs and history[0] == {**logs, "step": 0}
    assert seen[0][0] is logs and seen[0][2] is history[0]  # on_log gets `logs` itself, after the append

    compat_transformers.log_outside_history(trainer, trainer.log, {"loss": 2.0, "job/x": 5.0}, {"job/x": 5.0})
    assert len(history) == 2 and history[1]["loss"] == 2.0 and "job/x" not in history[1]
    assert seen[1][1]["job/x"] == 5.0 and history[0]["job/slowest_rank"] == 3.0  # the integrations got it


def test_cpu_adam_started_at_a_later_step_updates_otherwise_and_the_replay_makes_it_the_same(monkeypatch):
    """Why `_compat.deepspeed.replay_cpu_adam_steps` (WORKAROUNDS["cpu_adam_resumed_step"]): DeepSpeed's CPU Adam
    that steps 1..t and one that starts at step t (a resume: the state loaded, the optimizer new) update alike only
    after the replay. When the first assertion fails, upstream computes the powers alike: close the gate."""
    import cpuinfo
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from tests.support.warm_ranks import asked_once

    # Each DeepSpeedCPUAdam asks py-cpuinfo, which answers from a new interpreter (7 s of one core for the 5 below):
    # this host's answer, asked once, as the warm rank servers give it.
    monkeypatch.setattr(cpuinfo, "get_cpu_info", asked_once(cpuinfo.get_cpu_info))

    from hf_dist_recipes._compat.deepspeed import replay_cpu_adam_steps

    torch.manual_seed(0)
    grads = [torch.randn(64) for _ in range(8)]

    def run(resume_at: int | None, replay: bool) -> torch.Tensor:
        param = torch.nn.Parameter(torch.ones(64))
        opt = DeepSpeedCPUAdam([param], lr=1e-2)
        for step, grad in enumerate(grads, 1):
            if step == resume_at:  # a new optimizer holding the saved state, as a resume builds it
                saved = opt.state_dict()
                opt = DeepSpeedCPUAdam([param], lr=1e-2)
                opt.load_state_dict(saved)
                if replay:
                    assert replay_cpu_adam_steps(type("Zero", (), {"optimizer": opt})()) == step - 1
            param.grad = grad.clone()
            opt.step()
        return param.detach().clone()

    # Resumed at step 3, which differs in 0.19.8 (the float products against the power; seen at 3, 6, 12, 14 and
    # 16-39 of 2-39). Each CPU Adam loads the op, about 2 s here, so one step only.
    straight = run(None, False)
    assert _compat.needed("cpu_adam_resumed_step") == (not torch.equal(straight, run(3, False)))
    assert torch.equal(straight, run(3, True))
