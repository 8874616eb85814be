"""Tokens per expert and the bias balancer under ZeRO-3 + DeepSpeed AutoEP (EP 2) on 2 real CPU processes, with a
config written by `hf-dist-recipes config generate`. The expected counts come from DeepSpeed's own per-layer
utilization counter and from the batch arithmetic, never from the code under test."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from hf_dist_recipes.cli.main import main as cli_main
from hf_dist_recipes.logs.events import read_scalars
from hf_dist_recipes.moe.expert_balance import bias_update
from hf_dist_recipes.monitoring.tensorboard import rank_log_dir
from tests.distributed.workers.expert_load_worker import GRAD_ACCUM, MICRO_BATCH, SEQ_LEN
from tests.support.launch import accelerate_launch, check_launch
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "expert_load_worker.py")
STEPS, GAMMA, RANKS, EXPERTS, TOP_K, MOE_LAYERS = 4, 0.01, 2, 8, 2, (1, 2)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_load")
    assert (
        cli_main(
            [
                "config",
                "generate",
                "--cpu",
                "--model",
                "tiny-deepseek-v3",
                "--gpus-per-node",
                str(RANKS),
                "--zero",
                "3",
                "--ep",
                "2",
                "--auto",
                "--name",
                "ep2",
                "--output",
                str(root / "cfg"),
            ]
        )
        == 0
    )
    out = root / "run"
    check_launch(accelerate_launch(root / "cfg" / "ep2.yaml", [WORKER, str(out), str(STEPS), str(GAMMA)]))
    ranks = sorted(
        (json.loads(p.read_text()) for p in (out / "expert_load").glob("rank*.json")), key=lambda r: r["rank"]
    )
    scalars = [read_scalars(rank_log_dir(out / "tensorboard", r)) for r in range(RANKS)]
    return out, ranks, scalars


def _tokens(scalars, layer: int) -> torch.Tensor:
    """Logged tokens per expert, (steps x experts)."""
    return torch.tensor(
        [[v for _, v in scalars[f"train/experts/layer{layer}/expert{e}_tokens"]] for e in range(EXPERTS)]
    ).T


def test_every_rank_logs_the_same_global_counts(job):
    _, ranks, scalars = job
    assert [r["rank"] for r in ranks] == list(range(RANKS))
    expert_keys = {k for k in scalars[0] if k.startswith("train/experts/")}
    # per layer: max_over_mean, 8 experts' tokens, ep_max_over_mean, 2 EP ranks' tokens; then the 2 worst-layer
    # values and the 2 EP ranks' shares
    assert len(expert_keys) == len(MOE_LAYERS) * (1 + EXPERTS + 1 + 2) + 2 + 2
    for key in expert_keys:
        assert scalars[1][key] == scalars[0][key], key  # same steps, same values
    per_step_tokens = RANKS * GRAD_ACCUM * MICRO_BATCH * SEQ_LEN  # both data-parallel ranks, all micro steps
    total = sum(_tokens(scalars[0], layer) for layer in MOE_LAYERS)
    assert total.shape == (STEPS, EXPERTS)
    assert total.sum(1).tolist() == [per_step_tokens * TOP_K * len(MOE_LAYERS)] * STEPS


def test_counts_equal_deepspeeds_own_counter_summed_over_ranks(job):
    _, ranks, scalars = job
    for layer in MOE_LAYERS:
        name = f"model.layers.{layer}.mlp"
        assert all(r["routed"] == [f"model.layers.{i}.mlp.router" for i in MOE_LAYERS] for r in ranks)
        own = sum(torch.tensor(r["layers"][name]["deepspeed_tokens_per_expert"]) for r in ranks)
        assert own.sum().item() == STEPS * RANKS * GRAD_ACCUM * MICRO_BATCH * SEQ_LEN * TOP_K
        logged = _tokens(scalars[0], layer)
        assert logged.sum(0).long().tolist() == own.tolist()
        assert max(own.tolist()) > 1.1 * own.float().mean().item()  # uneven, so equality is not by symmetry


def test_ep_rank_tokens_are_the_contiguous_experts_each_rank_holds(job):
    _, ranks, scalars = job
    for r in ranks:
        layer = r["layers"]["model.layers.1.mlp"]
        assert (layer["ep_size"], layer["ep_rank"], layer["num_local_experts"]) == (2, r["rank"], EXPERTS // 2)
        # The runtime's one layout is DeepSpeed's truth of EP group membership (the layer's own group)
        assert layer["runtime_ep_group"] == layer["deepspeed_ep_group"] == [0, 1]
    s = scalars[0]
    held = {0: range(0, 4), 1: range(4, 8)}  # AutoEP: rank r holds experts [4r, 4r + 4)
    shares = []
    for ep_rank, experts in held.items():
        for layer in MOE_LAYERS:
            tokens = _tokens(s, layer)[:, list(experts)].sum(1)
            logged = [v for _, v in s[f"train/experts/layer{layer}/ep_rank{ep_rank}_tokens"]]
            assert logged == tokens.tolist()
        shares.append([v for _, v in s[f"train/experts/ep_rank{ep_rank}_share"]])
    assert [a + b for a, b in zip(*shares, strict=True)] == pytest.approx([1.0] * STEPS)


def test_balancer_moves_the_autoep_routers_bias_identically_on_every_rank(job):
    out, ranks, scalars = job
    saved = {k: v for f in (out / "final").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    for layer in MOE_LAYERS:
        name = f"model.layers.{layer}.mlp"
        bias = [torch.tensor(r["layers"][name]["bias"]) for r in ranks]
        assert torch.equal(bias[0], bias[1])
        # expected: the report's rule applied to each step's logged (global) counts, starting from zero
        expected = sum(bias_update(step, GAMMA) for step in _tokens(scalars[0], layer))
        assert expected.abs().max() > 0 and torch.allclose(bias[0], expected, atol=1e-6)
        # save_model writes the balanced bias where from_pretrained reads it
        assert torch.allclose(saved[f"{name}.gate.e_score_correction_bias"], bias[0])
    assert math.isfinite(scalars[0]["train/experts/max_over_mean"][-1][1])


@pytest.mark.slow
def test_tensor_parallel_peers_are_counted_once(tmp_path):
    """ZeRO-3 + TP 2 + EP 2 on 4 ranks (the shipped config): the two ranks of a TP group route the same tokens, so
    DeepSpeed's own counters sum to twice the data-parallel load; the logged counts are the data-parallel load."""
    out = tmp_path / "run"
    check_launch(
        accelerate_launch(
            REPO / "accelerate_configs" / "cpu_zero3_tp2_ep2_4proc.yaml", [WORKER, str(out), "2", str(GAMMA)]
        )
    )
    ranks = [json.loads((out / "expert_load" / f"rank{r}.json").read_text()) for r in range(4)]
    scalars = [read_scalars(rank_log_dir(out / "tensorboard", r)) for r in range(4)]
    data_parallel = 2
    for layer in MOE_LAYERS:
        logged = _tokens(scalars[0], layer)
        assert all(torch.equal(_tokens(s, layer), logged) for s in scalars[1:])
        assert logged.sum(1).tolist() == [data_parallel * GRAD_ACCUM * MICRO_BATCH * SEQ_LEN * TOP_K] * 2
        own = sum(torch.tensor(r["layers"][f"model.layers.{layer}.mlp"]["deepspeed_tokens_per_expert"]) for r in ranks)
        assert (logged.sum(0) * 2).long().tolist() == own.tolist()  # each TP pair counted its tokens twice
        biases = [r["layers"][f"model.layers.{layer}.mlp"]["bias"] for r in ranks]
        assert all(b == biases[0] for b in biases) and any(biases[0])
