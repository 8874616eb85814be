"""Tokens per expert (monitoring.expert_load) and the DeepSeek-V3 bias update (expert_balance), in one process."""

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

from hf_dist_recipes import ExpertBiasBalancer, RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.core.model_templates import TEMPLATES, template_config
from hf_dist_recipes.demo.data import stdlib_dataset
from hf_dist_recipes.demo.model import build_tiny_deepseek
from hf_dist_recipes.moe.expert_balance import BALANCING_OFF, bias_update
from hf_dist_recipes.moe.expert_load import (
    ExpertLoadCallback,
    ExpertLoadTracker,
    RoutedLayer,
    ep_rank_tokens,
    find_routed_layers,
    load_scalars,
    max_over_mean,
)
from hf_dist_recipes.monitoring import read_scalars
from hf_dist_recipes.runtime import RecipeRuntime
from tests.support.models import SMALL

TOKENS = (4, 16)  # a batch of 4 sequences of 16 tokens
TOP_K = 2  # tiny-deepseek-v3: 8 routed experts, 2 per token, MoE in decoder layers 1 and 2


def _tiny(model_type: str = "deepseek_v3"):
    torch.manual_seed(0)
    config = (
        template_config("tiny-deepseek-v3")
        if model_type == "deepseek_v3"
        else AutoConfig.for_model(model_type, **TEMPLATES["tiny-deepseek-v3"][1])
    )
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # wider router weights than the 0.02 init, so that tokens choose differently
        for layer in find_routed_layers(model):
            layer.router.weight.normal_(0, 0.3)
    return model


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, TOKENS, generator=torch.Generator().manual_seed(seed))


def _routers_own_choices(model, ids) -> torch.Tensor:
    """Expected counts, independently: each router called again by hand on the hidden states it received."""
    inputs = {}
    handles = [
        layer.router.register_forward_pre_hook(lambda m, a, i=i: inputs.__setitem__(i, a[0].detach()))
        for i, layer in enumerate(find_routed_layers(model))
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    rows = []
    for i, layer in enumerate(find_routed_layers(model)):
        with torch.no_grad():
            indices = layer.router(inputs[i])[layer.indices_at]
        rows.append(torch.bincount(indices.reshape(-1), minlength=layer.num_experts))
    return torch.stack(rows)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2"])
def test_counts_are_the_routers_choices(model_type):
    model = _tiny(model_type)
    layers = find_routed_layers(model)
    assert [(x.name, x.index, x.num_experts, x.top_k, x.ep_size) for x in layers] == [
        ("model.layers.1.mlp.gate", 1, 8, TOP_K, 1),
        ("model.layers.2.mlp.gate", 2, 8, TOP_K, 1),
    ]
    tracker = ExpertLoadTracker.for_model(model)
    model.train()
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    counts = tracker.step_counts(1)
    expected = _routers_own_choices(model.eval(), ids)
    assert torch.equal(counts, expected)
    assert counts.sum(1).tolist() == [ids.numel() * TOP_K] * 2  # each token goes to top_k experts
    assert max_over_mean(counts[0]) > 1.2  # not uniform, so equality above says something


def test_micro_steps_add_up_and_each_step_starts_from_zero():
    model = _tiny().train()
    tracker = ExpertLoadTracker.for_model(model)
    a, b = _ids(1), _ids(2)
    model(input_ids=a)
    model(input_ids=b)  # two micro steps of one optimizer step (gradient accumulation)
    both = tracker.step_counts(1)
    assert torch.equal(tracker.step_counts(1), both)  # asking again does not close another step
    model(input_ids=a)
    only_a = tracker.step_counts(2)
    model(input_ids=b)
    only_b = tracker.step_counts(3)
    assert torch.equal(both, only_a + only_b) and not torch.equal(only_a, only_b)
    assert ExpertLoadTracker.for_model(model) is tracker  # one set of hooks per model


@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputation_and_evaluation_are_not_counted(reentrant):
    model = _tiny()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    tracker = ExpertLoadTracker.for_model(model)
    calls = []
    for layer in find_routed_layers(model):
        layer.router.register_forward_hook(lambda *a: calls.append(1))
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 4  # 2 MoE layers x (forward + recomputation in backward): a plain hook counts twice
    assert tracker.step_counts(1).sum(1).tolist() == [ids.numel() * TOP_K] * 2
    model.eval()
    model(input_ids=ids)
    assert tracker.step_counts(2).sum().item() == 0


def _autoep(model):
    # DeepSpeed's own AutoEP replacement, as deepspeed.initialize applies it, in one process (EP 1: no collective).
    # AutoEP/AutoEPConfig are DeepSpeed 0.19.8 internals, used here only to build the layer under test.
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_presets.base import AutoEPConfig

    autoep = AutoEP(model, AutoEPConfig(enabled=True, autoep_size=1, preset_model="deepseek_v3"))
    autoep.replace_moe_layers(autoep.ep_parser(), ep_size=1, ep_rank=0)
    return model


def test_autoep_layers_are_counted_like_deepspeed_counts_them():
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    model = _autoep(_tiny()).train()
    layers = find_routed_layers(model)
    # one router per layer, although AutoEP also exposes it as `gate`
    assert [(x.name, type(x.router).__name__) for x in layers] == [
        ("model.layers.1.mlp.router", "TokenChoiceTopKRouter"),
        ("model.layers.2.mlp.router", "TokenChoiceTopKRouter"),
    ]
    tracker = ExpertLoadTracker.for_model(model)
    moe = [m for m in model.modules() if isinstance(m, AutoEPMoELayer)]
    for m in moe:
        m.tokens_per_expert.zero_()
    model(input_ids=_ids(1))
    model(input_ids=_ids(2))
    own = torch.stack([m.tokens_per_expert for m in moe]).long()  # DeepSpeed's own utilization counter
    assert torch.equal(tracker.step_counts(1), own)
    assert own.sum().item() == 2 * 2 * math.prod(TOKENS) * TOP_K


def test_autoep_router_chooses_with_the_bias_the_balancer_moves():
    """The premise of balancing under AutoEP: the replacement router adds its copy of e_score_correction_bias."""
    model = _autoep(_tiny()).train()
    tracker = ExpertLoadTracker.for_model(model)
    for layer in tracker.layers:
        layer.bias[5] = 10.0  # far above any sigmoid score difference
    model(input_ids=_ids())
    counts = tracker.step_counts(1)
    assert counts[:, 5].tolist() == [math.prod(TOKENS)] * 2  # every token chose expert 5 (and one other)


def test_spread_and_ep_rank_sums_by_hand():
    assert max_over_mean(torch.tensor([6, 2, 0, 0])) == 3.0  # max 6 / mean 2
    assert max_over_mean(torch.tensor([3, 3, 3, 3])) == 1.0
    assert math.isnan(max_over_mean(torch.tensor([0, 0])))
    counts = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    assert ep_rank_tokens(counts, 2).tolist() == [[1 + 2 + 3 + 4, 5 + 6 + 7 + 8]]
    assert ep_rank_tokens(counts, 4).tolist() == [[3, 7, 11, 15]]
    with pytest.raises(ValueError, match="evenly"):
        ep_rank_tokens(counts, 3)


def test_logged_scalars_by_hand_under_ep2():
    layers = [
        RoutedLayer(
            name=f"model.layers.{i}.mlp.router",
            index=i,
            router=torch.nn.Identity(),
            num_experts=4,
            top_k=2,
            ep_size=2,
            indices_at=1,
        )
        for i in (1, 3)
    ]
    tokens = torch.tensor([[6, 2, 0, 0], [1, 1, 1, 1]])
    out = load_scalars(tokens, layers, per_expert=True)
    assert out["experts/layer1/max_over_mean"] == 3.0 and out["experts/layer3/max_over_mean"] == 1.0
    assert out["experts/max_over_mean"] == 3.0  # the worst layer
    assert out["experts/layer1/expert0_tokens"] == 6.0 and out["experts/layer3/expert2_tokens"] == 1.0
    assert out["experts/layer1/ep_rank0_tokens"] == 8.0 and out["experts/layer1/ep_rank1_tokens"] == 0.0
    assert out["experts/layer1/ep_max_over_mean"] == 2.0  # EP ranks hold 8 and 0, mean 4
    assert out["experts/ep_max_over_mean"] == 2.0
    assert out["experts/ep_rank0_share"] == pytest.approx((8 + 2) / 12)  # all layers: ranks hold 10 and 2
    assert out["experts/ep_rank1_share"] == pytest.approx(2 / 12)
    brief = load_scalars(tokens, layers, per_expert=False)
    assert not any("_tokens" in k for k in brief) and brief["experts/ep_rank1_share"] == out["experts/ep_rank1_share"]


def test_bias_update_is_the_reports_sign_rule():
    # mean 2: expert 0 is overloaded (-gamma), expert 1 at the mean (0), experts 2 and 3 underloaded (+gamma)
    delta = bias_update(torch.tensor([[6, 2, 0, 0], [1, 1, 1, 1]]), gamma=0.5)
    assert delta.tolist() == [[-0.5, 0.0, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]
    assert delta.dtype == torch.float32


@pytest.mark.parametrize("gamma", [-0.001, float("nan"), "0.001", True, None])
def test_gamma_must_be_a_non_negative_number(gamma):
    with pytest.raises(ValueError, match="gamma must be a number >= 0"):
        ExpertBiasBalancer(gamma)


def _handed(callback):
    """`callback` with a one-process runtime, as RecipeTrainer would hand it one."""
    callback.set_runtime(RecipeRuntime())
    return callback


def test_balancer_refuses_routers_without_a_bias():
    args = SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(ValueError, match="DeepseekV2TopkRouter.*remove ExpertBiasBalancer"):
        _handed(ExpertBiasBalancer()).on_train_begin(args, None, None, model=_tiny("deepseek_v2"))
    dense = AutoModelForCausalLM.from_config(template_config("tiny-llama"))
    with pytest.raises(ValueError, match="no MoE router"):
        _handed(ExpertBiasBalancer()).on_train_begin(args, None, None, model=dense)


def test_balancer_keeps_a_float32_master_for_a_bf16_bias():
    model = _tiny().train()
    for layer in find_routed_layers(model):
        layer.router.e_score_correction_bias = layer.router.e_score_correction_bias.to(torch.bfloat16) + 0.5
    balancer = _handed(ExpertBiasBalancer(gamma=0.001))
    balancer.on_train_begin(SimpleNamespace(device=torch.device("cpu")), None, None, model=model)
    tracker = balancer.tracker
    exact = torch.full((2, 8), 0.5)  # float32
    naive = torch.full((2, 8), 0.5, dtype=torch.bfloat16)  # what adding to the bf16 buffer directly would give
    for step in range(1, 11):
        model(input_ids=_ids(step))
        balancer.on_step_end(None, SimpleNamespace(global_step=step), None)
        delta = bias_update(tracker.step_counts(step), 0.001)
        exact += delta
        naive += delta.to(torch.bfloat16)
    bias = torch.stack([x.bias for x in tracker.layers])
    assert bias.dtype == torch.bfloat16
    assert torch.equal(bias, exact.to(torch.bfloat16))
    assert not torch.equal(bias, naive)  # bf16 spacing at 0.5 is 2**-8: most 0.001 steps would be lost


def _skewed_tiny():
    """tiny-deepseek-v3 whose routers already favour some experts, and favour them more as it trains: a constant
    offset on one embedding dimension, which wide router weights turn into a per-expert preference."""
    model = AutoModelForCausalLM.from_config(template_config("tiny-deepseek-v3"))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0.1
        for layer in find_routed_layers(model):
            layer.router.weight.normal_(0, 0.3)
            layer.router.weight[:2, 0] += 0.5
    return model


class _BiasSteps(TrainerCallback):
    """Records, after the balancer, each step's bias change and the step's counts (runs after it in the list)."""

    def __init__(self):
        self.steps, self._last = [], None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        tracker = ExpertLoadTracker.for_model(model)
        bias = torch.stack([x.bias.clone() for x in tracker.layers])
        if self._last is not None:
            self.steps.append((tracker.step_counts(state.global_step, reduce=True).clone(), bias - self._last))
        self._last = bias


def _fixed_batch_spread(model) -> float:
    """max/mean tokens per expert of the worst layer on 16 fixed sequences, counted without the tracker."""
    data = stdlib_dataset(seq_len=32, max_bytes=100_000)
    ids = torch.stack([data[i]["input_ids"] % 128 for i in range(1000, 1016)]).to(model.device)
    return max(max_over_mean(c) for c in _routers_own_choices(model.eval(), ids))


def _train(tmp_path, gamma, steps=30):
    # the model's vocabulary is 128: fold the byte ids into it (the dataset's torch format hands out tensors)
    data = stdlib_dataset(seq_len=32, max_bytes=100_000).map(
        lambda batch: {key: batch[key] % 128 for key in ("input_ids", "labels")}, batched=True
    )
    args = RecipeTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        warmup_steps=1,
        logging_steps=5,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        # the trajectories below were measured in fp32 on a CPU: the same on a GPU host
        use_cpu=True,
        bf16=False,
    )
    recorder = _BiasSteps()
    trainer = RecipeTrainer(
        model_init=_skewed_tiny, args=args, train_dataset=data, callbacks=[ExpertBiasBalancer(gamma), recorder]
    )
    trainer.train()
    scalars = read_scalars(tmp_path / "tensorboard" / "rank0")
    return trainer, recorder.steps, [v for _, v in scalars["train/experts/max_over_mean"]], scalars


def test_balancer_narrows_the_spread_through_recipe_trainer(tmp_path):
    before = _fixed_batch_spread(_skewed_tiny())
    frozen, frozen_steps, frozen_log, _ = _train(tmp_path / "gamma0", gamma=0.0)
    balanced, balanced_steps, balanced_log, scalars = _train(tmp_path / "gamma", gamma=0.02)
    assert any(isinstance(c, ExpertLoadCallback) for c in balanced.callback_handler.callbacks)  # added by itself
    assert len(frozen_log) == len(balanced_log) == 6  # every 5 of 30 steps
    # Without the update, training drifts the routing further onto a few experts; with it, it evens out.
    assert frozen_log[-1] > frozen_log[0] and frozen_log[-1] > 3.0
    assert balanced_log[-1] < balanced_log[0] and balanced_log[-1] < frozen_log[-1] - 1.0
    after_frozen, after_balanced = _fixed_batch_spread(frozen.model), _fixed_batch_spread(balanced.model)
    assert after_balanced < before < after_frozen
    # each step moved every bias by the report's rule, from that step's counts
    assert len(balanced_steps) == 29
    for counts, change in balanced_steps:
        assert torch.allclose(change, bias_update(counts, 0.02), atol=1e-6)
    assert all(not change.any() for _, change in frozen_steps)
    # the per-expert counts reach TensorBoard: per step, 4 x 32 tokens x top 2 per MoE layer
    per_layer = sum(scalars[f"train/experts/layer1/expert{e}_tokens"][-1][1] for e in range(8))
    assert per_layer == pytest.approx(4 * 32 * TOP_K)  # TensorBoard keeps float32
    # ... and the Trainer's own log history, which report_to integrations read
    history = [h["experts/max_over_mean"] for h in balanced.state.log_history if "experts/max_over_mean" in h]
    assert history == pytest.approx(balanced_log)


# --- the recipe's default: RecipeTrainer balances DeepSeek-V3 routers unless expert_bias_balancing=False ---

WARNED_BY = "hf_dist_recipes.trainer"


def _default_trainer(tmp_path, model=None, callbacks=None, **fields) -> RecipeTrainer:
    args = RecipeTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        save_strategy="no",
        disable_tqdm=True,
        report_to="none",
        seed=7,
        **fields,
    )
    build = {"model": model} if model is not None else {"model_init": lambda: build_tiny_deepseek(**SMALL)}
    return RecipeTrainer(
        args=args, train_dataset=stdlib_dataset(seq_len=16, max_bytes=4_000), callbacks=callbacks, **build
    )


def _balancers(trainer) -> list:
    return [c for c in trainer.callback_handler.callbacks if isinstance(c, ExpertBiasBalancer)]


def _biases(trainer) -> torch.Tensor:
    return torch.stack([layer.bias.detach().clone() for layer in find_routed_layers(trainer.model)])


def test_recipe_trainer_balances_deepseek_v3_routers_by_default(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=WARNED_BY):
        trainer = _default_trainer(tmp_path)
    (balancer,) = _balancers(trainer)
    assert balancer is trainer.recipe_callbacks.expert_balance and balancer.gamma == 0.001  # DeepSeek-V3's value
    assert not _biases(trainer).any()  # transformers builds the bias at 0
    trainer.train()
    bias = _biases(trainer)
    # Moved by the sign rule: each step +-gamma or 0 per expert, so at most 3 x gamma after 3 steps.
    assert bias.any() and bias.abs().max().item() <= 3 * 0.001 + 1e-7
    assert torch.allclose(bias / 0.001, (bias / 0.001).round(), atol=1e-4)
    assert BALANCING_OFF not in caplog.text


def test_expert_bias_balancing_false_freezes_the_bias_and_names_the_memory_risk_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger=WARNED_BY):
        trainer = _default_trainer(tmp_path, expert_bias_balancing=False)
    assert _balancers(trainer) == [] and trainer.recipe_callbacks.expert_balance is None
    warned = [r.getMessage() for r in caplog.records if "expert_bias_balancing=False" in r.getMessage()]
    assert warned == [BALANCING_OFF]
    assert "Memory risk" in BALANCING_OFF and "even routing" in BALANCING_OFF
    caplog.clear()
    trainer.train()
    assert not _biases(trainer).any()  # frozen at 0, as transformers trains it
    assert "expert_bias_balancing" not in caplog.text  # said once, at construction


@pytest.mark.parametrize("flag", [True, False])
def test_a_registered_balancer_takes_the_default_ones_place(tmp_path, caplog, flag):
    mine = ExpertBiasBalancer(gamma=0.02)
    with caplog.at_level(logging.WARNING, logger=WARNED_BY):
        trainer = _default_trainer(tmp_path, callbacks=[mine], expert_bias_balancing=flag)
    assert _balancers(trainer) == [mine] and trainer.recipe_callbacks.expert_balance is None
    assert "expert_bias_balancing" not in caplog.text  # the load is balanced: no risk to name


@pytest.mark.parametrize("model", ["deepseek_v2", "tiny-llama"])
@pytest.mark.parametrize("flag", [True, False])
def test_models_without_bias_routers_are_unchanged_and_not_warned_about(tmp_path, caplog, model, flag):
    built = _tiny(model) if model == "deepseek_v2" else AutoModelForCausalLM.from_config(template_config(model))
    with caplog.at_level(logging.WARNING, logger=WARNED_BY):
        trainer = _default_trainer(tmp_path, model=built, expert_bias_balancing=flag)
    assert _balancers(trainer) == [] and "expert_bias_balancing" not in caplog.text
