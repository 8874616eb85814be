"""Gradient health (hf_dist_recipes.stability.gradient_health): the spike detector, the policies, the report, and real
single-process training runs without DeepSpeed (the plain optimizer path): a NaN at step k is skipped -- weights,
Adam state and learning rate unchanged across step k -- or halts with a saved, loadable checkpoint; clipping at
max_grad_norm is what the optimizer really applies."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

from hf_dist_recipes import RecipeTrainer, RecipeTrainingArguments
from hf_dist_recipes.monitoring.summary_callback import RankSummaryCallback
from hf_dist_recipes.runtime import RecipeRuntime
from hf_dist_recipes.stability.gradient_health import GradientHealthCallback
from hf_dist_recipes.stability.nonfinite import NonFiniteHalt, NonFiniteReport, next_action, validate_nonfinite_policy
from hf_dist_recipes.stability.spikes import SpikeDetector, highest_rank, robust_z, validate_spike_settings

SEQ, SAMPLES, VOCAB = 8, 32, 64


# ---- spike detector, by hand --------------------------------------------------------------------------------


def test_robust_z_by_hand():
    # window 1..5: median 3, |deviations| 2,1,0,1,2 -> MAD 1, scale 1.4826; (10 - 3) / 1.4826 = 4.7214
    assert robust_z(10.0, [1, 2, 3, 4, 5]) == pytest.approx(7 / 1.4826)


def test_flat_window_floors_the_mad():
    # MAD 0: the scale is 1e-3 x |median| = 0.002, so 2.001 is z 0.5, not infinite.
    assert robust_z(2.001, [2.0] * 5) == pytest.approx(0.5)


def test_spike_detector_waits_for_a_full_window_and_only_flags_values_above():
    d = SpikeDetector(window=5, threshold=4.0)
    assert [d.check(v) for v in (1, 2, 3, 4)] == [None] * 4  # not full yet, even for a "spike"
    assert d.check(100.0) is None  # 4 values in the window: still not full
    # window now 1,2,3,4,100: median 3, MAD 1 -> 3 + 4 x 1.4826 = 8.93 is the edge
    assert d.check(8.9) is None
    assert d.values == [2, 3, 4, 100, 8.9]  # window of 5, the oldest dropped
    # window 2,3,4,100,8.9: median 4, |dev| 2,1,0,96,4.9 -> MAD 2; 4 + 4 x 2.9652 = 15.86
    assert d.check(16.0) == pytest.approx((16 - 4) / (1.4826 * 2))
    assert d.check(-1e6) is None  # far below is no spike
    assert d.check(math.nan) is None and d.check(math.inf) is None
    assert len(d.values) == 5 and all(math.isfinite(v) for v in d.values)


def test_a_spike_names_the_rank_with_the_highest_own_value():
    # 4 ranks' losses: rank 2's is the highest; the median of 4 values is the mean of the middle two, (4 + 5) / 2.
    assert highest_rank([4.0, 5.0, 480.0, 3.0], "loss") == "highest loss on rank 2: 480 (median of 4 ranks 4.5)"
    # Equal values (tensor-parallel ranks share their loss): the lowest rank; a NaN is never named.
    assert highest_rank([2.0, 2.0, math.nan], "local gradient norm").startswith("highest local gradient norm on rank 0")
    assert highest_rank([7.0], "loss") == "on rank 0"  # one process: its rank, nothing to compare
    assert highest_rank([math.nan, math.nan], "loss") == "loss of no rank known"


@pytest.mark.parametrize("window,threshold", [(2, 6.0), (True, 6.0), (50, 0), (50, math.inf), (50, "6")])
def test_spike_settings_are_checked(window, threshold):
    with pytest.raises(ValueError, match="use"):
        validate_spike_settings(window, threshold)


# ---- policies and the report --------------------------------------------------------------------------------


def test_skip_until_more_than_max_consecutive():
    assert [next_action("skip", n, 3) for n in (1, 2, 3, 4)] == ["skip", "skip", "skip", "halt"]
    assert next_action("skip", 1, 0) == "halt"
    assert next_action("halt", 1, 3) == "halt"


def test_policy_names_are_checked():
    with pytest.raises(ValueError, match="'skip'"):
        validate_nonfinite_policy("ignore")
    with pytest.raises(ValueError, match="nonfinite_policy"):
        RecipeTrainingArguments(output_dir="/tmp/x", nonfinite_policy="warn", report_to="none")
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        RecipeTrainingArguments(output_dir="/tmp/x", max_consecutive_skips=-1, report_to="none")


def test_report_names_the_first_rank_the_step_and_the_parameters():
    r = NonFiniteReport(step=7, ranks=[3, 1], loss_ranks=[3], parameters={1: ["a.weight"], 3: ["b.bias", "c"]})
    text = r.message()
    assert text.startswith("step 7: non-finite value first on rank 1 (rank(s) 3, 1)")
    assert "loss non-finite on rank(s) 3" in text
    assert "rank 1: a.weight; rank 3: b.bias, c" in text
    assert r.to_dict()["first_rank"] == 1


def test_state_round_trips_through_exportable_state():
    cb = GradientHealthCallback(nonfinite_policy="halt", max_consecutive_skips=5, spike_window=7, spike_threshold=3)
    cb.skipped_steps, cb.consecutive_skips, cb.loss_window = 2, 1, [1.0, 2.0]
    again = GradientHealthCallback.from_state(json.loads(json.dumps(cb.state())))
    assert (again.nonfinite_policy, again.max_consecutive_skips, again.spike_window) == ("halt", 5, 7)
    assert (again.skipped_steps, again.consecutive_skips, again.loss_window) == (2, 1, [1.0, 2.0])


# ---- real single-process runs (no DeepSpeed) ----------------------------------------------------------------


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_model(initializer_range: float = 0.02) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            initializer_range=initializer_range,
        )
    )


class Inject(TrainerCallback):
    """At optimizer step `step` (1-based), makes the model's own loss NaN (a forward hook on the model) or one
    parameter's gradient NaN (a tensor hook), and records weights, Adam state and learning rate at every step."""

    def __init__(self, model, step: int, what: str):
        self.model, self.step, self.what = model, step, what
        self.snapshots: dict[int, dict] = {}
        self.lrs: dict[int, float] = {}
        self.active = False
        target = dict(model.named_parameters())["model.layers.0.mlp.up_proj.weight"]
        target.register_hook(lambda g: g * math.nan if self.what == "grad" and self.active else g)
        model.register_forward_hook(self._poison_loss)

    def _poison_loss(self, module, inputs, output):
        if self.what in ("loss", "spike") and self.active and module.training:
            output.loss = output.loss * (math.nan if self.what == "loss" else 100.0)
        return output

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.active = state.global_step + 1 == self.step
        self.snapshots[state.global_step] = self._snapshot(optimizer)

    def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        self.snapshots[state.global_step] = self._snapshot(optimizer)
        self.lrs[state.global_step] = optimizer.param_groups[0]["lr"]

    def _snapshot(self, optimizer):
        inner = getattr(optimizer, "optimizer", optimizer)
        return {
            "weights": {n: p.detach().clone() for n, p in self.model.named_parameters()},
            "adam_steps": sorted({float(s["step"]) for s in inner.state.values()}) if inner else [],
        }


def _train(tmp_path, what: str, step: int, steps: int = 5, **fields):
    warnings.filterwarnings("ignore", category=FutureWarning)
    args = RecipeTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        per_rank_tensorboard=fields.pop("per_rank_tensorboard", False),
        seed_check="off",
        use_cpu=True,  # weights are compared bit for bit, some with a checkpoint loaded on the CPU: on a GPU host too
        lr_scheduler_type="linear",
        warmup_steps=0,
        **fields,
    )
    model = tiny_model()
    injector = Inject(model, step, what)
    trainer = RecipeTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=[injector])
    return trainer, injector


def _events(trainer, key: str) -> dict[int, str]:
    """The texts `key` carried by the logs, by step: the rank summary keeps them (text stays out of log_history)."""
    summary = next(c for c in trainer.callback_handler.callbacks if isinstance(c, RankSummaryCallback))
    assert not [e for e in trainer.state.log_history if key in e]
    return {e["step"]: e["text"] for e in summary.events if e["key"] == key}


@pytest.mark.parametrize("what", ["loss", "grad"])
def test_single_process_skip_leaves_weights_optimizer_and_schedule_unchanged(tmp_path, what, caplog):
    trainer, inj = _train(tmp_path, what, step=3)
    with caplog.at_level("WARNING", logger="hf_dist_recipes.stability.gradient_health"):
        trainer.train()
    before, after = inj.snapshots[2], inj.snapshots[3]
    for name, w in before["weights"].items():
        assert torch.equal(w, after["weights"][name]), name  # bit for bit: nothing was applied at step 3
    assert after["adam_steps"] == before["adam_steps"] == [2.0]
    # Linear decay over 5 steps from 1e-2: after step 2 the rate is 1e-2 x 3/5; step 3 skipped keeps it there.
    assert inj.lrs[2] == pytest.approx(6e-3) and inj.lrs[3] == pytest.approx(6e-3)
    assert inj.lrs[4] == pytest.approx(4e-3)  # and the schedule resumes with the next applied step
    for name, w in inj.snapshots[4]["weights"].items():  # the steps around it did apply
        assert not torch.equal(w, after["weights"][name]) or "embed" in name or "norm" in name
    assert all(torch.isfinite(w).all() for w in inj.snapshots[5]["weights"].values())
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["skipped_steps"] for e in logs] == [0, 0, 1, 1, 1]
    # A NaN loss is shown in its log, not averaged away, and does not stick to the logs after it.
    assert math.isnan(logs[2]["loss"]) == (what == "loss") and all(math.isfinite(e["loss"]) for e in logs[3:])
    events = _events(trainer, "nonfinite_event")
    assert list(events) == [3]
    event = events[3]
    assert event.startswith("step 3: non-finite value first on rank 0")
    if what == "grad":
        assert "model.layers.0.mlp.up_proj.weight" in event and "loss non-finite" not in event
    else:
        assert "loss non-finite on rank(s) 0" in event
    assert any("step 3:" in r.getMessage() for r in caplog.records)


def test_single_process_halt_saves_the_last_good_state_and_stops(tmp_path):
    trainer, inj = _train(tmp_path, "loss", step=3, nonfinite_policy="halt")
    with pytest.raises(NonFiniteHalt, match=r"step 3: non-finite value first on rank 0.*checkpoint-3"):
        trainer.train()
    report = json.loads((tmp_path / "nonfinite_report.json").read_text())
    assert (report["step"], report["first_rank"], report["action"]) == (3, 0, "halt")
    saved = LlamaForCausalLM.from_pretrained(tmp_path / "checkpoint-3")
    for name, w in saved.named_parameters():  # the weights after step 2: the last applied one
        assert torch.equal(w, inj.snapshots[2]["weights"][name]), name
    state = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["GradientHealthCallback"]["attributes"]["skipped_steps"] == 1


def test_too_many_consecutive_skips_halt(tmp_path):
    trainer, inj = _train(tmp_path, "grad", step=2, max_consecutive_skips=0)
    with pytest.raises(NonFiniteHalt, match="1 consecutive skips > max_consecutive_skips=0"):
        trainer.train()


def test_off_applies_the_nan_as_stock_transformers_does(tmp_path):
    # The reason the checks exist: without them a plain optimizer writes the NaN into the weights.
    trainer, inj = _train(tmp_path, "grad", step=3, nonfinite_policy="off")
    trainer.train()
    assert not torch.isfinite(inj.snapshots[3]["weights"]["model.layers.0.mlp.up_proj.weight"]).all()


class ClipProbe(TrainerCallback):
    """The gradient the optimizer will apply, read in on_pre_optimizer_step (after the Trainer's clip call)."""

    def __init__(self):
        self.applied_norms: list[float] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        self.applied_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


def test_single_process_clips_at_max_grad_norm(tmp_path):
    warnings.filterwarnings("ignore", category=FutureWarning)
    args = RecipeTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        per_rank_tensorboard=False,
        seed_check="off",
    )
    assert args.max_grad_norm == 1.0  # the recipe default, not set here
    probe = ClipProbe()
    trainer = RecipeTrainer(
        model=tiny_model(initializer_range=0.5), args=args, train_dataset=Tokens(), callbacks=[probe]
    )
    trainer.train()
    logged = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    assert all(n > 2 for n in logged)  # the raw norm of large random weights: well above the clip
    for raw, applied in zip(logged, probe.applied_norms, strict=True):
        assert applied == pytest.approx(1.0, rel=1e-5)  # clipped to max_grad_norm, by torch's clip_grad_norm_
        assert applied < raw


@pytest.mark.parametrize(
    "clipping", [{}, {"max_grad_norm": 0.0, "allow_unclipped_gradients": True}], ids=["clipped", "unclipped"]
)
def test_a_loss_and_grad_norm_spike_is_an_event_naming_the_step(tmp_path, caplog, clipping):
    # The loss x 100 at step 6 (gradients x 100 too) against a window of the 4 steps before (loss ~4.1, norm ~1.1).
    # Unclipped, transformers skips the clip call and computes the norm on its own: the spike is heard all the same.
    trainer, inj = _train(tmp_path, "spike", step=6, steps=6, spike_window=4, spike_threshold=6.0, **clipping)
    with caplog.at_level("WARNING", logger="hf_dist_recipes.stability.gradient_health"):
        trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["loss_spikes"] for e in logs] == [0, 0, 0, 0, 0, 1]
    assert [e["grad_norm_spikes"] for e in logs] == [0, 0, 0, 0, 0, 1]
    assert [e["skipped_steps"] for e in logs] == [0] * 6  # a spike is finite: applied, only reported
    events = _events(trainer, "spike_event")
    assert list(events) == [6]
    event = events[6]
    assert event.startswith("step 6: loss spike") and " | step 6: grad_norm spike" in event
    assert event.count("; on rank 0") == 2  # each spike names its rank: here the only one
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Spike: step 6:")]
    assert len(said) == 2 and said[0].startswith("Spike: step 6: loss spike")  # once each


@pytest.mark.parametrize("fp16", [False, True])
def test_fp16_loss_scaler_overflows_are_not_counted_as_non_finite_steps(fp16):
    # fp16 training needs CUDA (or a CPU with fp16 kernels), which a test host may lack: the callback is driven
    # directly with args.fp16 set, the way the Trainer calls it, on an inf gradient under a finite loss (what a
    # loss-scaler overflow looks like).
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    model = torch.nn.Linear(3, 1)
    cb = GradientHealthCallback()
    args = SimpleNamespace(fp16=fp16, device=torch.device("cpu"))
    state, control = TrainerState(), TrainerControl()
    cb.set_runtime(RecipeRuntime())
    cb.on_train_begin(args, state, control, model=model)
    cb.runtime.fed.add("loss")  # what RecipeTrainer.compute_loss marks before it calls the event
    loss = cb.on_micro_batch_loss(args, state, control, loss=(model(torch.ones(1, 3)) * 0).sum() + 1.0)  # finite
    loss.backward()
    model.weight.grad.fill_(math.inf)  # the hook already summed the finite gradient: poison the sum it saw
    cb._sum_values[-1] = torch.tensor(math.inf)
    cb.on_pre_optimizer_step(args, state, control, optimizer=None, model=model)
    assert (cb.skipped_steps, cb.loss_scale_overflows) == ((0, 1) if fp16 else (1, 0))


def test_the_skip_event_reaches_every_rank_tensorboard_as_text(tmp_path):
    from hf_dist_recipes.logs.events import read_scalars, read_texts

    trainer, _ = _train(tmp_path, "loss", step=3, per_rank_tensorboard=True)
    trainer.train()
    run = tmp_path / "tensorboard" / "rank0"
    texts = read_texts(run)["train/nonfinite_event/text_summary"]
    assert [step for step, _ in texts] == [3] and texts[0][1].startswith("step 3: non-finite value first on rank 0")
    # one per step's log, and the end-of-training log (train_runtime, ...) carries the count too
    assert [v for _, v in read_scalars(run)["train/skipped_steps"]] == [0, 0, 1, 1, 1, 1]
