"""The preflight's training and failure-path decisions (hf_dist_recipes.preflight.training.verdicts) on hand-written
facts (`RunFacts`, as the ranks report them):
each row passing, and failing with the rank and the fix, where the real runs cannot be made to fail on demand
(a DeepSpeed JSON clipping at another value on one rank, a scheduler section, a NaN step applied, a resume that
lands on another state). The real runs: tests/distributed/test_preflight_training.py."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hf_dist_recipes.preflight.training import run_training_checks
from hf_dist_recipes.preflight.training.checks import MIN_STEPS
from hf_dist_recipes.preflight.training.facts import (
    AgreementMismatch,
    ExpectedSettings,
    NonFiniteSkip,
    RunFacts,
    StepFacts,
)
from hf_dist_recipes.preflight.training.verdicts import (
    clip_result,
    expected_learning_rates,
    loss_result,
    nan_result,
    quarter_means,
    resume_result,
    schedule_result,
    training_results,
)

EXPECTED = ExpectedSettings(
    clip=1.0,
    peak_lr=1e-3,
    scheduler_type="cosine_with_restarts",
    warmup_steps=2,
    total_steps=8,
    num_cycles=1,
    min_lr_ratio=0.0,
    restart_warmup_steps=0,
    ds_scheduler=False,
    tp=1,
    deepspeed=True,
)


def _rank(lrs=None, clip=1.0, applied=None, losses=None, expected=EXPECTED, **extra) -> RunFacts:
    lrs = lrs or expected_learning_rates(EXPECTED, [True] * 8)
    applied = applied or [True] * len(lrs)
    steps = {
        s: StepFacts(lr=lr, applied=a, clip=clip, zero_clip=clip)
        for s, (lr, a) in enumerate(zip(lrs, applied, strict=True), start=1)
    }
    losses = losses or [4.8, 4.6, 4.3, 4.1, 3.9, 3.8, 3.6, 3.5]
    facts = dict(
        steps=steps,
        loss=dict(enumerate(losses, start=1)),
        grad_norm={1: 1.5, 2: 0.5},
        batches={s: f"b{s}" for s in steps},
        rank_check={"rank_check/seed_ok": 1.0},
        expected=expected,
    )
    facts.update(extra)
    return RunFacts(**facts)


def test_learning_rates_by_hand():
    # warm-up 2 of 8 steps, one cosine cycle over the other 6: step s applies multiplier(s - 1).
    by_hand = [0.0, 0.5e-3, 1e-3, 1e-3 * 0.5 * (1 + math.cos(math.pi / 6)), 1e-3 * 0.5 * (1 + math.cos(math.pi / 3))]
    assert expected_learning_rates(EXPECTED, [True] * 5) == pytest.approx(by_hand, abs=1e-15)
    # Step 2 skipped: the engine does not advance the schedule, step 3 applies step 2's rate again.
    assert expected_learning_rates(EXPECTED, [True, False, True])[2] == pytest.approx(0.5e-3)


def test_all_rows_ok_on_a_clean_run():
    rows = training_results([_rank(), _rank()], steps=8)
    assert [r.status for r in rows] == ["ok"] * 4
    assert [r.detail.split(":")[0] for r in rows] == ["loss", "clipping", "schedule", "agreement"]


def test_loss_quarters():
    assert quarter_means([4.8, 4.6, 4.3, 4.1, 3.9, 3.8, 3.6, 3.5]) == (pytest.approx(4.7), pytest.approx(3.55))
    row = loss_result(_rank(), 8)
    assert row.status == "ok" and row.data["drop"] == pytest.approx(1.15)
    flat = loss_result(_rank(losses=[4.0, 4.1, 4.0, 4.2, 4.1, 4.0, 4.1, 4.2]), 8)
    assert flat.status == "error" and "is not below" in flat.detail and flat.fix
    nan = loss_result(_rank(losses=[4.0, math.nan, 4.0, 4.2, 4.1, 4.0, 4.1, 4.2]), 8)
    assert nan.status == "error" and "step(s) [2]" in nan.detail


def test_clipping_at_another_value_on_one_rank_is_named():
    row = clip_result([_rank(), _rank(clip=0.5)])
    assert row.status == "error" and row.ranks == (1,) and "rank 1: [0.5]" in row.detail
    assert '"auto"' in row.fix
    assert clip_result([_rank(), _rank()]).data["steps_above_clip"] == 1  # pre-clip norms 1.5 and 0.5
    off = _rank(expected=replace(EXPECTED, clip=0.0))
    assert clip_result([off]).status == "error"


def test_a_deepspeed_scheduler_section_is_named():
    constant = _rank(lrs=[1e-3] * 8, expected=replace(EXPECTED, ds_scheduler=True))
    row = schedule_result([constant])
    assert row.status == "error" and row.data["mismatched_steps"] == [1, 2, 4, 5, 6, 7, 8]
    assert "step 1 applied lr 0.001" in row.detail and "scheduler` section" in row.fix


def test_agreement_names_the_odd_rank():
    message = "rank(s) 1 disagree with ranks [0, 1] on the seed at train begin (rank 0: 0, rank 1: 1); fix it"
    facts = [
        _rank(mismatches=[AgreementMismatch(None, "the seed", (1,), message, "pass the same seed= on every rank")])
    ] * 2
    row = training_results(facts, 8)[3]
    assert row.status == "error" and row.ranks == (1,) and row.detail == f"agreement: {message}"


def _nan_rank(applied_at_bad: bool = False, flagged=(1,), loss_ranks=(1,), event=True, tp=1) -> RunFacts:
    weights = ["w0", "w1", "w1" if not applied_at_bad else "w2", "w3"]
    steps = {s: StepFacts(applied=not (s == 2 and not applied_at_bad), weights=weights[s]) for s in (1, 2, 3)}
    return RunFacts(
        steps=steps,
        skipped_steps=1,
        skips=[NonFiniteSkip(2, tuple(flagged), tuple(loss_ranks))],
        expected=replace(EXPECTED, tp=tp),
        events={2: "step 2: non-finite value first on rank 1 (rank(s) 1); loss non-finite on rank(s) 1; x"}
        if event
        else {},
    )


def test_nan_skip_checked_on_every_rank():
    assert nan_result([_nan_rank(), _nan_rank()], 2).status == "ok"
    row = nan_result([_nan_rank(), _nan_rank(applied_at_bad=True)], 2)
    assert row.status == "error" and row.ranks == (1,) and "weights changed at step 2" in row.detail
    outside = nan_result([_nan_rank(flagged=(0, 1)), _nan_rank(flagged=(0, 1))], 2)  # TP 1: rank 0 is not a partner
    assert outside.status == "error"
    # TP 2: ranks 0 and 1 form one TP group (consecutive ranks), so the partner may be flagged too.
    partner = nan_result([_nan_rank(flagged=(0, 1), tp=2), _nan_rank(flagged=(0, 1), tp=2)], 2)
    assert partner.status == "ok" and partner.data["tp_group"] == [0, 1]
    # The report must name the bad rank's loss, and the event must have been logged at that step.
    other_loss = nan_result([_nan_rank(loss_ranks=(0,)), _nan_rank(loss_ranks=(0,))], 2)
    assert other_loss.status == "error" and "no nonfinite_event naming step 2" in other_loss.detail
    unlogged = nan_result([_nan_rank(), _nan_rank(event=False)], 2)
    assert unlogged.status == "error" and unlogged.ranks == (1,)


def test_resume_must_reproduce_loss_batch_and_rate():
    main = [_rank(), _rank()]
    same = [_rank(steps={5: main[0].steps[5]}, loss={5: main[0].loss[5]}, batches={5: "b5"})] * 2
    assert resume_result(main, same, 4).status == "ok"
    off = [same[0], _rank(steps={5: main[0].steps[5]}, loss={5: main[0].loss[5] * (1 + 1e-3)}, batches={5: "b6"})]
    row = resume_result(main, off, 4)
    assert row.status == "error" and row.ranks == (1,) and "another batch" in row.detail and "loss" in row.detail
    failed = resume_result(main, [RunFacts.failed("RuntimeError: x")] * 2, 4)
    assert failed.status == "error" and failed.ranks == (0, 1) and "RuntimeError: x" in failed.detail


def test_bad_steps_refused_before_anything_runs(tmp_path):
    from hf_dist_recipes.core.model_templates import template_config

    with pytest.raises(ValueError, match=f"steps must be a whole number >= {MIN_STEPS}"):
        run_training_checks(template_config("tiny-llama"), steps=3, output_dir=tmp_path)
    with pytest.raises(ValueError, match="give a tiny config of the same family"):
        run_training_checks(_big(), steps=20, output_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def _big():
    from hf_dist_recipes.core.model_templates import TEMPLATES, template_config

    name = next(n for n in TEMPLATES if not n.startswith(("tiny", "demo")))
    return template_config(name)


def test_a_config_without_a_causal_lm_is_named():
    from transformers import ViTConfig

    from hf_dist_recipes.preflight.training.run import build_model

    with pytest.raises(ValueError, match="no causal LM for model_type 'vit'"):  # an image encoder
        build_model(ViTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64))


def test_an_output_dir_holding_earlier_runs_is_refused(tmp_path):
    from hf_dist_recipes.core.model_templates import template_config

    (tmp_path / "tensorboard" / "rank0").mkdir(parents=True)  # an earlier launch's per-rank run
    with pytest.raises(
        ValueError,
        match=r"tensorboard already written by an earlier run; give the preflight a new "
        r"--output-dir",
    ):
        run_training_checks(template_config("tiny-llama"), output_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["tensorboard"]  # nothing deleted, nothing written
