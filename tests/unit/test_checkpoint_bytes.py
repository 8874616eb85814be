"""Checkpoint bytes per save, the save's timeout bound, and the preflight's free-space finding, against numbers
computed by hand in the tests."""

import math

import pytest

from hf_dist_recipes.parallel.checkpoint_bytes import hf_share_bytes, save_bytes, save_timeout_s
from hf_dist_recipes.planning.elements import plan_save_bytes
from hf_dist_recipes.planning.models import introspect
from hf_dist_recipes.planning.plan import ParallelPlan
from hf_dist_recipes.preflight.plan_checks import checkpoint_space_result

GIB = 1024**3


def test_deepseek_v3_on_64_ranks_by_hand():
    """671e9 parameters, bf16, 64 ranks (the issue's figures: ~8 TB of optimizer files, 1.34 TB of HF weights)."""
    b = save_bytes(671_000_000_000, 64, precision="bf16")
    per_rank_elements = 10_484_375_000  # 671e9 / 64, exact
    assert b.engine_per_rank == per_rank_elements * 12 == 125_812_500_000  # fp32 master + two Adam moments
    assert b.engine_total == 8_052_000_000_000
    assert b.hf_total == 1_342_000_000_000  # 2 bytes per parameter
    # 1.342e12 / 5e9 (save_shard_size "5GB") = 268.4 -> 269 shards; ceil(269 / 64) = 5 shards on the busiest rank
    assert b.hf_per_rank == 5 * 5 * 10**9
    assert b.checkpoint_per_rank() == b.engine_per_rank and b.checkpoint_total(hf_copy=True) == 9_394_000_000_000
    # The bound during a save_steps save: 600 s + 125.8 GB at 100 MiB/s = 600 + 1199.8 s
    assert save_timeout_s(b.checkpoint_per_rank(), 600) == pytest.approx(600 + 125_812_500_000 / 104_857_600)
    assert 1799 < save_timeout_s(b.checkpoint_per_rank(), 600) < 1800


def test_hf_share_is_whole_shards_round_robin():
    assert hf_share_bytes(10 * GIB, 1, 5 * GIB) == 10 * GIB  # one writer: everything
    assert hf_share_bytes(10 * GIB, 2, 5 * GIB) == 5 * GIB  # two shards, one each
    assert hf_share_bytes(11 * GIB, 2, 5 * GIB) == 10 * GIB  # three shards: the busiest writes two
    assert hf_share_bytes(3 * GIB, 4, 5 * GIB) == 3 * GIB  # one small shard: never more than the whole


def test_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match="need >= 1 rank"):
        save_bytes(10, 0)
    with pytest.raises(ValueError, match="precision"):
        save_bytes(10, 1, precision="int4")
    with pytest.raises(ValueError, match="positive bandwidth"):
        save_timeout_s(1, 600, write_bytes_per_s=0)


def test_a_zero3_plan_splits_the_engine_bytes_evenly():
    """ZeRO-3, 4 ranks, no TP/EP: every tensor partitioned over the 4 ranks, so the busiest rank holds P / 4
    elements plus at most one padding element per tensor; 12 bytes each."""
    shape = introspect("tiny-llama")
    params, tensors = shape.total_params, len(shape.parameters)
    b = plan_save_bytes(ParallelPlan(procs_per_node=4, device="cpu", precision="fp32"), shape)
    assert 12 * math.ceil(params / 4) <= b.engine_per_rank <= 12 * (params / 4 + tensors)
    assert b.hf_total == 4 * params


def test_preflight_warns_when_fewer_than_two_checkpoints_fit():
    plan = ParallelPlan(procs_per_node=4, device="cpu", precision="fp32")
    shape = introspect("tiny-llama")
    params, tensors = shape.total_params, len(shape.parameters)
    # one checkpoint: 12 bytes per parameter over all ranks, plus at most 4 x 12 bytes of padding per tensor
    low, high = 12 * params, 12 * (params + 4 * tensors)
    short = checkpoint_space_result(plan, shape, 2 * low - 1, "/x")
    assert (
        short.status == "warning" and "fewer than 2 checkpoints fit" in short.detail and "save_total_limit" in short.fix
    )
    roomy = checkpoint_space_result(plan, shape, 2 * high, "/x")
    assert roomy.status == "ok" and "2 checkpoints fit" in roomy.detail
    assert roomy.data["save_bytes"]["engine_total"] == roomy.data["save_bytes"]["checkpoint_total"]


def test_config_estimate_reports_checkpoint_bytes(capsys):
    """`config estimate` (JSON and text) carries the bytes per save of the estimated plan: DeepSeek-V3 on 64 ranks,
    12 bytes per partitioned element in the engine's files, 2 per parameter in the bf16 HF copy."""
    import json

    from hf_dist_recipes.cli.main import main as cli_main

    args = ["config", "estimate", "--model", "deepseek-v3", "--nodes", "8", "--gpus-per-node", "8", "--ep", "8"]
    assert cli_main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    params, b = out["total_params"], out["checkpoint_bytes"]
    assert b["world_size"] == 64 and b["hf_total"] == 2 * params
    # Every element once, except the routers: EP 8 partitions them within the expert-data-parallel group of 8, so
    # each of the 8 groups holds a copy: 7 extra copies of 58 MoE layers x 256 experts x 7168 (hidden).
    router = 58 * 256 * 7168
    assert b["engine_total"] == 12 * (params + 7 * router)
    assert b["checkpoint_per_rank"] == b["engine_per_rank"] and b["engine_total"] > 8e12  # the issue's ~8 TB
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert f"checkpoint per save: {b['engine_per_rank'] / 1e9:,.1f} GB per rank" in text
    # The save's time at 100 MiB/s per rank (126 GB: 1,200 s), and what each kept checkpoint takes on disk.
    minutes = round(b["engine_per_rank"] / (100 * 2**20) / 60)
    assert f"a save takes about {minutes} min at an assumed 100 MiB/s per rank" in text and minutes == 20
    assert f"each checkpoint kept takes {b['engine_total'] / 1e9:,.1f} GB: set save_total_limit" in text
