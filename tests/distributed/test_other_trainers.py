"""Issue 19 section 3: the recipe applied to the Trainers people use, on 2 real CPU ranks under the shipped ZeRO-3
config (accelerate_configs/cpu_zero3_2proc.yaml), in one launch: trl's `SFTTrainer` as `recipe(SFTTrainer)` on a
tiny Llama-style model, trl's `DPOTrainer` with its reference model (issue 31), then transformers'
`Seq2SeqTrainer` as `recipe(Seq2SeqTrainer)` on a tiny T5 predicting with generation (under ZeRO-3 every rank
generates, `synced_gpus`: the path a single process never takes)."""

from __future__ import annotations

import json
import math

import pytest

from hf_dist_recipes.monitoring import read_scalars
from tests.support.launch import accelerate_launch, check_launch
from tests.support.paths import REPO
from tests.support.process_state import check_process_state

pytestmark = [pytest.mark.distributed]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "other_trainers_worker.py")
CONFIG = REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml"
STEPS = 16
PEAK = 3e-3


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("other_trainers")
    check_launch(accelerate_launch(CONFIG, [WORKER, str(out), str(STEPS)]))
    ranks = [json.loads((out / "result" / f"rank{r}.json").read_text()) for r in (0, 1)]
    return out, ranks


def _expected_lrs() -> list[float]:
    """By hand, the recipe's defaults under trl's trainers: warm-up ceil(0.05 x 16) = 1 step, then one cosine (no
    restarts: trl's trainers fine-tune) over the 15 steps left, no floor: PEAK x 0.5 x (1 + cos(pi x u / 15)),
    u = steps after the warm-up."""
    return [0.0] + [PEAK * 0.5 * (1 + math.cos(math.pi * (t - 1) / (STEPS - 1))) for t in range(1, STEPS)]


def test_sft_trainer_keeps_its_classes_and_gets_the_recipe(job):
    _, ranks = job
    for rank in ranks:
        sft = rank["sft"]
        assert (sft["trainer_class"], sft["args_class"]) == ("RecipeSFTTrainer", "RecipeSFTConfig")
        assert sft["args_is_sftconfig"] and sft["args_is_recipe"]
        assert sft["max_length"] == 48 and sft["gradient_checkpointing"] is True  # the user's and trl's defaults
        assert sft["lr_scheduler_type"] == "cosine_with_restarts" and sft["lr_scheduler_kwargs"] == {"num_cycles": 1}


def test_sft_loss_falls(job):
    _, ranks = job
    losses = ranks[0]["sft"]["losses"]
    print(f"\nSFT losses: {[round(x, 3) for x in losses]}")
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.2


def test_sft_clipping_is_the_live_engines(job):
    _, ranks = job
    for rank in ranks:
        sft = rank["sft"]
        assert sft["zero_stage"] == 3
        # "auto" in the shipped JSON, filled from max_grad_norm 1.0; ZeRO-3's optimizer applies the same value.
        assert sft["gradient_clipping"] == 1.0 and sft["zero_clip_grad"] == 1.0


def test_sft_learning_rates_follow_the_recipe_schedule(job):
    from torch import nn, optim
    from transformers import get_cosine_schedule_with_warmup

    _, ranks = job
    expected = _expected_lrs()
    # The same values from transformers' own one-cycle cosine (no floor, no re-warm-up: the recipe's defaults
    # coincide with it).
    opt = optim.SGD(nn.Linear(1, 1).parameters(), lr=PEAK)
    stock = get_cosine_schedule_with_warmup(opt, 1, STEPS)
    theirs = []
    for _ in range(STEPS):
        theirs.append(opt.param_groups[0]["lr"])
        opt.step()
        stock.step()
    assert theirs == pytest.approx(expected, rel=1e-9, abs=1e-15)
    for rank in ranks:
        assert rank["sft"]["warmup_steps"] == 1
        assert rank["sft"]["lrs"] == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_sft_per_rank_tensorboard(job):
    out, _ = job
    for rank in (0, 1):
        scalars = read_scalars(out / "sft" / "tensorboard" / f"rank{rank}")
        assert len(scalars["train/loss"]) == STEPS, sorted(scalars)
        assert len(scalars["train/learning_rate"]) == STEPS


def test_the_plain_route_ends_in_the_recipe_process_state(job):
    """Issue 30 section 1: the SFTConfig, the process's first arguments, created the process group (transformers'
    post-init -> accelerate's PartialState -> DeepSpeed's init_distributed, with the stock ddp_timeout 1800 s)
    before the recipe upgraded them. At train begin every group's timeout is nevertheless the recipe's ddp_timeout,
    the recipe applied what RecipeTrainingArguments applies (tests/distributed/test_checkpoint_lifecycle.py checks
    that route against the same expectation), and the variables torch had read already are listed as too late and
    named in one warning with the fix. Before the fix: 1800 s on both ranks, nothing listed with its time."""
    _, ranks = job
    for rank, result in enumerate(ranks):
        sft = result["sft"]
        check_process_state(sft["process_state"], sft["recipe_warnings"], rank=rank, group_before_arguments=True)


def test_trl_users_are_told_once_which_defaults_the_recipe_replaced_and_how_to_keep_them(job):
    """Issue 31 section 6, issue 42: the SFTConfig and the DPOConfig leave four stock fields at transformers' defaults
    (trl does not re-declare them), which the recipe declares otherwise (docs/practices/6-schedule.md,
    5-gradients.md, 2-nccl.md). On both routes (the SFT run's plain SFTConfig, upgraded; the DPO run's
    recipe_arguments(DPOConfig), the route the docs give) rank 0 says so in one line naming each, the schedule's one
    cycle, the seeding and the seed check, and the way to keep trl's; rank 1 says nothing."""
    _, ranks = job
    for run, config in (("sft", "SFTConfig"), ("dpo", "DPOConfig")):
        lines = [[w for w in r[run]["recipe_warnings"] if "the recipe's defaults in place of" in w] for r in ranks]
        assert lines[1] == [] and len(lines[0]) == 1, (run, lines)
        (line,) = lines[0]
        for change in (
            "lr_scheduler_type 'linear' -> 'cosine_with_restarts' (num_cycles=1)",
            "warmup_steps 0 -> 0.05",
            "logging_nan_inf_filter True -> False",
            "ddp_timeout 1800 -> 7200",
            "log_level_replica 'warning' -> 'error'",
            "every rank seeded with seed=7",
            "seed_check='error'",
        ):
            assert change in line, line
        assert line.startswith(f"Recipe{config[:3]}Trainer: the recipe's defaults in place of {config}'s"), line
        assert f"hf_dist_recipes.recipe_arguments({config})(..., ddp_timeout=1800, " in line, line
        assert "learning_rate" not in line and "max_length" not in line  # trl's own and the user's values stay
    for rank in ranks:
        assert rank["dpo"]["lr_scheduler_kwargs"] == {"num_cycles": 1}


def test_dpo_trains_under_zero3_against_an_untouched_reference_model(job):
    """Issue 31 section 6: a real DPO run, 2 ranks, ZeRO-3, the reference model a ZeRO-3 inference engine of its own.
    Policy and reference start equal, so the first loss is -log(sigmoid(0)) = log 2 whatever the data; it falls as
    the policy learns to prefer the true continuation; the reference, gathered after training, holds its initial
    weights bit for bit while the policy moved."""
    _, ranks = job
    for rank in ranks:
        dpo = rank["dpo"]
        assert (dpo["trainer_class"], dpo["args_class"]) == ("RecipeDPOTrainer", "RecipeDPOConfig")
        assert dpo["zero_stage"] == 3 and dpo["ref_zero_stage"] == 3 and dpo["ref_is_engine"] == "DeepSpeedEngine"
        assert dpo["lr_scheduler_type"] == "cosine_with_restarts"
        assert dpo["ref_partitioned"]  # the reference is sharded too, so "untouched" is read from its gathered weights
        assert dpo["starts_equal"] and dpo["ref_unchanged"]
        assert dpo["policy_changed"], "the policy did not move: the reference check proves nothing"
    losses = ranks[0]["dpo"]["losses"]
    print(f"\nDPO losses: {[round(x, 4) for x in losses]}")
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)
    assert sum(losses[-4:]) / 4 < math.log(2) - 0.1


def test_seq2seq_predicts_with_generation_capped_at_generation_max_length(job):
    _, ranks = job
    for rank in ranks:
        s2s = rank["seq2seq"]
        assert (s2s["trainer_class"], s2s["args_class"]) == ("RecipeSeq2SeqTrainer", "RecipeSeq2SeqTrainingArguments")
        assert s2s["predict_with_generate"] is True and s2s["generation_max_length"] == 7
        assert s2s["model_generation_max_length"] == 20  # the model's own cap, which did not apply
        # transformers 5.24 pads generated ids to the model's generation_config.max_length (20) with the pad id.
        assert s2s["predictions_shape"] == [s2s["eval_samples"], 20] and s2s["predictions_dtype"] == "int64"
        pad = s2s["pad_token_id"]
        for row in s2s["predictions"]:
            # Generated: the decoder start (pad, T5's convention), then up to 6 tokens; the pad id is suppressed in
            # generation, so a row stops at EOS or at 7 tokens: nothing after position 6.
            assert row[0] == pad and row[1] != pad
            assert all(t == pad for t in row[7:])
        # Without EOS a row reaches the cap: at least one row has a token at position 6.
        assert any(row[6] != pad for row in s2s["predictions"])
        assert math.isfinite(s2s["eval_loss"]) and math.isfinite(s2s["test_loss"])
    assert ranks[0]["seq2seq"]["predictions"] == ranks[1]["seq2seq"]["predictions"]  # gathered: the same on both
