"""Through RecipeTrainer on 2 real ZeRO-3 CPU ranks with a generated config: a model built whole on every rank is
stopped with the fix, one built after the arguments is not, and the plan's activation checkpointing is switched on;
a model that will not recompute under that plan (refused by the user, or a class without support) stops with the fix,
or under allow_no_recompute trains without it and warns. The config is generated without --auto: the JSON's micro
batch, accumulation and clipping are "auto" all the same, so arguments other than the plan's train, and rank 0 warns
once when the micro batch exceeds the plan's."""

import json

import pytest

from hf_dist_recipes.cli.main import main as cli_main
from tests.support.launch import accelerate_launch, check_launch
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "setup_worker.py")


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    configs = tmp_path_factory.mktemp("configs")
    # In this process, as test_checkpoint_lifecycle generates its config: a fresh interpreter cost 5.6 s of one core.
    generate = ["config", "generate", "--cpu", "--gpus-per-node", "2", "--model", "tiny-llama", "--zero", "3"]
    generate += ["--activation-checkpointing", "--seq-len", "32", "--name", "ac", "--output", str(configs)]
    assert cli_main(generate) == 0
    out = tmp_path_factory.mktemp("setup")
    proc = accelerate_launch(configs / "ac.yaml", [WORKER, str(out)])
    check_launch(proc)
    ranks = [json.loads((out / "setup" / f"rank{r}.json").read_text()) for r in (0, 1)]
    return ranks, json.loads((configs / "deepspeed" / "ac.json").read_text()), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def ranks(launch):
    return launch[0]


def test_a_model_built_before_the_arguments_is_stopped_with_the_fix(ranks):
    for r in ranks:
        # tiny-llama's parameters by hand: embeddings and head 2 x 256 x 64, per layer 4 x 64 x 64 attention +
        # 3 x 64 x 128 MLP + 2 x 64 norms, 2 layers, final norm 64; fp32.
        params = 2 * 256 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
        assert r["before_args_bytes"] == params * 4
        assert "built without ZeRO-3 partitioning" in r["before_args"]["error"]
        assert "after RecipeTrainingArguments" in r["before_args"]["error"]


def test_a_model_built_after_the_arguments_is_partitioned_and_accepted(ranks):
    for r in ranks:
        assert r["after_args"] == {"error": None, "unpartitioned_bytes": 0}


def test_a_model_built_by_calling_its_class_is_stopped(ranks):
    for r in ranks:
        assert "built without ZeRO-3 partitioning" in r["direct_class"]["error"]


def test_the_plans_activation_checkpointing_is_switched_on(ranks):
    for r in ranks:
        assert r["planned"]["activation_checkpointing"] is True
        assert r["planned"]["model_recomputes"] is True
        assert r["planned"]["warnings"] == []
        assert r["planned"]["bf16"] is False  # a CPU host: fp32


def test_refusing_the_plans_activation_checkpointing_stops_with_the_fix(ranks):
    for r in ranks:
        error = r["refused"]["error"]
        assert "activation_checkpointing=False" in error and "leave activation_checkpointing unset" in error
        assert "allow_no_recompute=True" in error


def test_a_model_that_cannot_recompute_stops_with_the_fix(ranks):
    for r in ranks:
        error = r["cannot"]["error"]
        assert "NoRecomputeLlama cannot recompute" in error and "--activation-checkpointing" in error


def test_allow_no_recompute_trains_without_recomputation_and_warns(ranks):
    for r in ranks:
        for case, why in (
            ("refused_allowed", "activation_checkpointing=False"),
            ("cannot_allowed", "cannot recompute"),
        ):
            got = r[case]
            assert got["steps"] == 1 and got["model_recomputes"] is False
            assert len(got["warnings"]) == 1 and why in got["warnings"][0]
            assert got["activation_checkpointing"] is False  # the plan's True turned off for the class without it


def test_arguments_other_than_the_plans_batch_train_and_a_larger_micro_batch_warns_on_rank_0(launch):
    ranks, ds, output = launch
    assert [ds[k] for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")] == ["auto", "auto"]
    assert ds["gradient_clipping"] == "auto" and ds["hf_dist_recipes"]["generated_for"]["micro_batch"] == 1
    for r in ranks:  # the plan's micro batch at twice its accumulation: trained, nothing to say
        assert r["accumulated"]["steps"] == 1 and r["accumulated"]["engine_batch"] == [1, 2]
        assert r["accumulated"]["batch_warning"] is None
    warning = ranks[0]["planned"]["batch_warning"]  # micro batch 2 against the plan's 1
    assert "per_device_train_batch_size 2 exceeds the micro batch 1" in warning
    assert "config generate --micro-batch 2" in warning
    assert ranks[1]["planned"]["batch_warning"] is None  # rank 0 alone
    assert "per_device_train_batch_size 2 exceeds the micro batch 1" in output
