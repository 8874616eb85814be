"""`hf_dist_recipes.runtime`: the job's facts read once, the events, and the log sink's three channels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_dist_recipes.runtime import JobFacts, LogRecord, RecipeCallback, RecipeRuntime


def _args(world=4, rank=1):
    return SimpleNamespace(world_size=world, process_index=rank, launch_plan={"tp": 2})


def test_facts_read_the_layout_and_the_zero_stage_as_deepspeed_reads_them():
    config = {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
        "tensor_parallel": {"autotp_size": 2},
        "expert_parallel": {"enabled": True, "autoep_size": 2},
    }
    facts = JobFacts.read(_args(), config)
    assert (facts.layout.world, facts.layout.tp, facts.layout.ep, facts.rank) == (4, 2, 2, 1)
    assert facts.layout.tp_group(1) == [0, 1] and facts.layout.dp_group(1) == [1, 3]
    assert facts.zero_stage == 3
    config["zero_optimization"]["stage"] = 1  # a snapshot: later edits of the engine's dict do not reach it
    assert facts.zero_stage == 3 and facts.launch_plan == {"tp": 2}
    assert JobFacts.read(_args(), None).zero_stage == 0
    # an expert_parallel section without `enabled` is AutoEP off for DeepSpeed (parallel/deepspeed_view.py)
    assert JobFacts.read(_args(), {"expert_parallel": {"autoep_size": 2}}).layout.ep == 1
    with pytest.raises(ValueError, match="autotp_size"):  # a TP degree that does not divide the world
        JobFacts.read(_args(world=3), {"tensor_parallel": {"autotp_size": 2}})


def test_the_channels_reach_the_next_log_once_and_standing_numbers_every_log():
    runtime = RecipeRuntime()
    logs = runtime.logs
    logs.standing({"skipped_steps": 0})
    logs.history({"rank_check/ok": 1.0})
    logs.job({"straggler/slowest_rank": 1.0})
    logs.rank({"spike_event": "step 3: loss"})
    logs.rank({"spike_event": "step 3: grad_norm", "system/rss_gib": 0.5})
    first = logs.take()
    assert first == LogRecord(
        history={"skipped_steps": 0, "rank_check/ok": 1.0},
        job={"straggler/slowest_rank": 1.0},
        rank={"spike_event": "step 3: loss | step 3: grad_norm", "system/rss_gib": 0.5},
    )
    assert logs.last is first
    logs.standing({"skipped_steps": 1})
    assert logs.take() == LogRecord(history={"skipped_steps": 1})  # the rest once; the counter in every log
    with pytest.raises(ValueError, match="takes numbers"):
        logs.job({"straggler_event": "text"})  # texts would reach integrations that expect numbers
    with pytest.raises(ValueError, match="takes numbers"):
        logs.history({"flag": True})


def test_a_recipe_callback_without_a_runtime_stops_at_train_begin_with_the_fix():
    """A recipe callback under a plain Trainer: nothing handed it a runtime; one line at train begin names the fix."""
    from transformers import TrainerControl, TrainerState

    class Mine(RecipeCallback):
        pass

    callback = Mine()
    with pytest.raises(ValueError, match=r"Mine has no runtime.*recipe\(YourTrainer\)"):
        callback.on_train_begin(None, TrainerState(), TrainerControl())
    runtime = RecipeRuntime()
    callback.set_runtime(runtime)
    callback.on_train_begin(None, TrainerState(), TrainerControl())
    assert callback.runtime is runtime and runtime.facts.layout.world == 1  # no facts: a one-process job


def test_the_trainer_feed_is_required_and_counts_tokens():
    runtime = RecipeRuntime()
    with pytest.raises(ValueError, match="must call super"):
        runtime.require_fed("micro_step", "RankSummaryCallback", "each micro step")
    runtime.micro_step(torch.tensor(2.0), {"input_ids": torch.zeros(2, 8, dtype=torch.long)})
    runtime.require_fed("micro_step", "x", "y")  # fed now: no error
    assert runtime.rank_metrics.tokens == 16
    with pytest.raises(ValueError, match="must call super"):
        runtime.require_fed("loss", "GradientHealthCallback", "each loss")
