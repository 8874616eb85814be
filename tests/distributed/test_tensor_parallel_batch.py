"""Trap 1 (DeepSpeed issue 7298): ZeRO-3 + AutoTP 2 with `"train_batch_size": "auto"`, 2 real CPU processes."""

import json
import math

import pytest

from hf_dist_recipes.planning.memory import rank_elements
from hf_dist_recipes.planning.models import introspect
from hf_dist_recipes.planning.plan import ParallelPlan
from tests.support.launch import accelerate_launch, check_launch, write_cpu_deepspeed_yaml
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "probe_worker.py")
STEPS = 6
DS_TP2_AUTO = {
    "zero_optimization": {"stage": 3},
    "tensor_parallel": {"autotp_size": 2},
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
}


@pytest.fixture(scope="module")
def tp_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp2")
    ds = folder / "ds_tp2.json"
    ds.write_text(json.dumps(DS_TP2_AUTO))
    return write_cpu_deepspeed_yaml(folder / "tp2.yaml", ds), folder


def test_recipe_trainer_trains_with_tp2_and_auto_batch(tp_config):
    config, folder = tp_config
    out = folder / "recipe"
    check_launch(accelerate_launch(config, [WORKER, str(out), str(STEPS), "recipe", "tiny-llama"]))
    ranks = [json.loads((out / "probe" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["world_size"] == 2
        # (64, 64) split over 2 TP ranks: AutoTP really sharded it
        assert r["params"]["model.layers.0.self_attn.q_proj.weight"]["shape"] == [32, 64]
        assert "removed train_batch_size='auto'" in r["tp_batch_note"]
        # global batch = micro 4 x accumulation 1 x data-parallel 1 (2 ranks / TP 2), not x world size
        assert r["trainer_total_batch"] == 4
        # DeepSpeed's own counter still multiplies by the world size: its config object gets no TP group. It only
        # feeds DeepSpeed's samples/s print and `global_samples`; README states it. A change here means upstream
        # fixed it.
        assert r["deepspeed_counter_batch"] == 8
        assert len(r["losses"]) == STEPS and all(math.isfinite(x) for x in r["losses"])
        assert r["losses"][-1] < r["losses"][0]
        # The runtime's one rank layout is DeepSpeed's truth of group membership (deepspeed.utils.groups): both
        # ranks form the one TP group of 2 processes under TP 2, and each is its own data-parallel group.
        assert r["runtime_tp_group"] == r["deepspeed_tp_group"] == [0, 1]
        assert r["runtime_dp_group"] == [r["rank"]]
    # Per-rank model-state elements: exactly what the estimator says for this plan (from_config: zero.Init).
    plan = ParallelPlan(procs_per_node=2, device="cpu", precision="fp32", tp=2)
    expected = rank_elements(plan, introspect("tiny-llama")).params
    assert all(sum(v["local"] for v in r["params"].values()) == expected for r in ranks)
    # The ranks of one TP group must see the same samples; otherwise the real global batch is micro x world.
    assert ranks[0]["batches"] == ranks[1]["batches"]
    assert len(set(ranks[0]["batches"])) == STEPS  # and a new batch every step
    assert ranks[0]["losses"] == ranks[1]["losses"]


def test_stock_trainer_still_falls_into_the_trap(tp_config):
    """If this starts passing, upstream fixed DeepSpeed issue 7298: re-check parallel/batch.py's workaround."""
    config, folder = tp_config
    proc = accelerate_launch(config, [WORKER, str(folder / "stock"), str(STEPS), "stock", "tiny-llama"])
    assert proc.returncode != 0
    assert "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size" in proc.stderr


def test_global_batch_under_tp_with_gradient_accumulation_is_counted_from_the_samples(tp_config):
    """4 ranks, TP 2, accumulation 2: the samples the ranks really consumed per optimizer step are counted (hashes of
    each sample, gathered over all ranks) instead of trusting the Trainer's formula. Hand count: micro 4 x
    accumulation 2 x data-parallel (4 ranks / TP 2 = 2) = 16; each rank sees 4 x 2 = 8 of them, the same 8 as its TP
    partner."""
    config, folder = tp_config
    out, steps, accum = folder / "accum", 3, 2
    check_launch(
        accelerate_launch(
            config, [WORKER, str(out), str(steps), "recipe", "tiny-llama", "from_config", str(accum)], num_processes=4
        )
    )
    ranks = [json.loads((out / "probe" / f"rank{r}.json").read_text()) for r in range(4)]
    per_step = {}  # optimizer step -> rank -> samples it consumed for that step
    for r in ranks:
        # DeepSpeed's engine accepted the derived batch: its own micro batch and accumulation, and every step ran.
        assert (r["engine_micro_batch"], r["engine_grad_accum"], r["optimizer_steps"]) == (4, accum, steps)
        assert len(r["samples"]) == steps * accum  # accum micro steps per optimizer step
        for step, hashes in r["samples"]:
            per_step.setdefault(step, {}).setdefault(r["rank"], []).extend(hashes)
    assert sorted(per_step) == list(range(steps))
    for step, by_rank in per_step.items():
        assert all(len(h) == 4 * accum for h in by_rank.values()), step
        groups = {tuple(sorted(h)) for h in by_rank.values()}
        assert len(groups) == 2, f"step {step}: 4 ranks should form 2 data-parallel groups of identical samples"
        consumed = {h for hashes in by_rank.values() for h in hashes}
        assert len(consumed) == 4 * accum * (4 // 2) == 16, step
    # The Trainer's own figure agrees with the count (and is not the world-size value 4 x 2 x 4 = 32).
    assert all(r["trainer_total_batch"] == 16 for r in ranks)
