"""The combination the planner recommends for DeepSeek-V3 on 64 GPUs, AutoEP + ZeRO-3 + optimizer and parameter
offload, on 2 real CPU ranks (Gloo, a tiny DeepSeek-V3-style model, bf16): a rank SIGKILLed after step 3 under
`--max_restarts 1` comes back by itself from checkpoint-2 (`auto_resume`) and ends with final weights bitwise equal
to those of an uninterrupted run of the same job (in the same processes after the restart: the independent
reference, as in test_job_dies). The same runs measure what the offloaded states hold on the host after step 2,
read from the live engine's buffers (survival_worker.host_bytes), against the estimator's bytes per partitioned
element (planning.host_memory): both fp32 gradient copies, and ZeRO's own fp32 master partition, which a third run
in fp32 shows beside fp32 parameters. One launch (its restart included), about 30 s."""

import json
from dataclasses import replace

import pytest

from hf_dist_recipes.planning.host_memory import host_bytes_per_element
from hf_dist_recipes.planning.plan import ParallelPlan
from tests.distributed.test_job_dies import assert_bitwise_equal
from tests.support.launch import accelerate_launch, check_launch, write_cpu_deepspeed_yaml
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "survival_worker.py")
STEPS, SAVE_STEPS, KILL_AT = 6, 2, 3  # checkpoints 2, 4, 6; rank 1 dies after step 3, past checkpoint-2
MODEL = "model=tiny-deepseek-v3"
# The engine's buffers a bytes-per-element figure counts, as survival_worker.host_bytes names them.
KINDS = ("parameters", "master", "moments", "gradient_partitions", "subgroup_gradients")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload_autoep")
    ds = json.loads((REPO / "accelerate_configs" / "deepspeed" / "cpu_zero3_2proc.json").read_text())
    ds["zero_optimization"].update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"})
    ds["expert_parallel"] = {"enabled": True, "autoep_size": 2, "preset_model": "deepseek_v3"}
    (root / "ds.json").write_text(json.dumps(ds))
    config = write_cpu_deepspeed_yaml(root / "offload_autoep.yaml", root / "ds.json")
    killed, reference, fp32 = root / "killed", root / "reference", root / "fp32"
    launch = accelerate_launch(
        config,
        [WORKER, str(killed), str(STEPS), str(SAVE_STEPS), f"kill-at={KILL_AT}", MODEL, "bf16=1"]
        + ["then", str(reference), str(STEPS), str(SAVE_STEPS), MODEL, "bf16=1"]
        + ["then", str(fp32), "2", "100", MODEL],
        launch_args=("--max_restarts", "1"),
    )
    check_launch(launch)
    return {"killed": killed, "reference": reference, "fp32": fp32, "launch": launch}


def test_a_killed_rank_comes_back_by_itself_to_the_uninterrupted_runs_weights(runs):
    killed = runs["killed"]
    text = runs["launch"].stdout + runs["launch"].stderr
    assert "exitcode: -9" in text and "local_rank: 1" in text  # the launcher saw rank 1 die of SIGKILL
    assert f"auto_resume: resuming from {killed / 'checkpoint-2'}" in text
    # Only the restarted attempt returned from train(), and it trained from the step after checkpoint-2.
    records = sorted(p.name for p in (killed / "survival").glob("*.json"))
    assert records == ["rank0-attempt1.json", "rank1-attempt1.json"]
    for rank in (0, 1):
        after = json.loads((killed / "survival" / f"rank{rank}-attempt1.json").read_text())
        assert after["first_step"] == 3 and after["global_step"] == STEPS, after
    assert_bitwise_equal(killed / "final", runs["reference"] / "final")
    # And the reference trained: its loss fell from the untrained level.
    losses = json.loads((runs["reference"] / "survival" / "rank0-attempt1.json").read_text())["loss"]
    assert losses[str(STEPS)] < losses["1"], losses


@pytest.mark.parametrize("run, precision", [("reference", "bf16"), ("fp32", "fp32")])
def test_the_host_holds_what_the_estimator_counts_per_partitioned_element(runs, run, precision):
    """Issue 40: 22 bytes per element at bf16 (parameter 2, fp32 master 4, moments 8, the gradient partition 4 and
    each sub-group's copy 4), 24 at fp32 (the parameter 4: ZeRO's master is a copy of its own). Within 5%."""
    plan = replace(ParallelPlan(), precision=precision, offload_optimizer=True, offload_params=True, ep=2)
    for rank in (0, 1):
        held = json.loads((runs[run] / "host" / f"rank{rank}.json").read_text())
        measured = sum(held[kind] for kind in KINDS) / held["elements"]
        print(f"{run} rank {rank}: {measured:.2f} bytes per element on the host; {held}")
        assert measured == pytest.approx(host_bytes_per_element(plan), rel=0.05)
        # Both gradient copies are there, each 4 bytes per element: the second is what issue 40 found uncounted.
        assert held["subgroup_gradients"] == pytest.approx(4 * held["elements"], rel=0.05)
        assert held["gradient_partitions"] == pytest.approx(4 * held["elements"], rel=0.05)
