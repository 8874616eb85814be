"""Ulysses SP 2 + ZeRO-3 on real CPU ranks, trained by RecipeTrainer from a `config generate --sp 2` YAML, against one
process without SP or DeepSpeed on the same blocks from the same weights (tests/distributed/workers/sp_worker.py).

The model is DeepSeek-style (MLA: Q/K heads 24 wide, V heads 16; 8 routed experts), so the recipe's MLA shim is on
the path, and the SP runs also take the chunked loss and tiled MLPs (the reference neither); the negative twin is the
stock Trainer under the same config (in the ranks of the 2-rank launch, after the recipe's run, from the state a
fresh process holds), which stops where DeepSpeed's Ulysses checks the head sizes. Why the numbers
must agree: SP only moves where each token's attention runs, and the Trainer's loss is a token-weighted mean over the
SP group with DeepSpeed's gradient averaging corrected; the reference's blocks are taken in the order the SP x DP
run takes them (`reference_order`).
"""

import json
import os
import subprocess

import pytest

from tests.distributed.workers.sp_worker import reference_order
from tests.support.launch import accelerate_launch, check_launch, launched_ranks_env, python_for
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "sp_worker.py")
STEPS = 5
# fp32 on Gloo; measured at most 6e-7 apart (the order of the all-to-all's and ZeRO's sums differs).
TOLERANCE = 1e-5
# DeepSpeed's Ulysses shape check (deepspeed/runtime/sequence_parallel/ulysses_sp.py:299), quoted in the docs'
# long-context page as what a DeepSeek model without the recipe's shim meets.
STOCK_MLA_MESSAGE = "query input tensor does not match the required shape"


def sp_config(directory, processes: int):
    """The accelerate YAML `config generate --sp 2` writes for `processes` CPU ranks."""
    from hf_dist_recipes.cli.main import main

    name = f"cpu_zero3_sp2_{processes}proc"
    argv = ["config", "generate", "--cpu", "--gpus-per-node", str(processes), "--zero", "3", "--sp", "2"]
    argv += ["--auto", "--name", name, "--output", str(directory)]
    assert main(argv) == 0
    return directory / f"{name}.yaml"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, no SP, no DeepSpeed: micro batch 1 (for SP 2 alone) and 2 (for SP 2 x DP 2); also saves the
    initial weights every run starts from."""
    out = tmp_path_factory.mktemp("sp_reference")
    env = launched_ranks_env(os.environ)
    proc = subprocess.run(
        [*python_for(env), WORKER, str(out), str(STEPS), "single", str(out / "init"), "1", "2"],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, {dp: _records(out / f"dp{dp}")[0] for dp in (1, 2)}


def _records(out) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])


def _launch(tmp_path_factory, reference, flavour: str, processes: int):
    """The run folder of one launch of `flavour` on `processes` ranks."""
    out = tmp_path_factory.mktemp(f"sp_{flavour}_{processes}".replace("+", "_"))
    config = sp_config(out, processes)
    init = reference[0] / "init"
    check_launch(accelerate_launch(config, [WORKER, str(out / "run"), str(STEPS), flavour, str(init)]))
    assert [r["rank"] for r in _records(out / "run")] == list(range(processes))
    return out / "run"


@pytest.fixture(scope="module")
def sp2_launch(tmp_path_factory, reference):
    """One 2-rank launch: the recipe's run, then the stock twin in the same ranks (written to stock/)."""
    return _launch(tmp_path_factory, reference, "recipe+stock", 2)


@pytest.fixture(scope="module")
def sp2(sp2_launch):
    return _records(sp2_launch)


@pytest.fixture(scope="module")
def sp2_dp2(tmp_path_factory, reference):
    # The model loaded before the arguments: no zero.Init to initialise DeepSpeed's communication before the SP set-up
    return _records(_launch(tmp_path_factory, reference, "recipe-early", 4))


def _assert_matches(records: list[dict], expected: dict) -> None:
    assert len(expected["losses"]) == len(expected["grad_norms"]) == STEPS
    for record in records:
        assert "error" not in record, record.get("traceback")
        assert record["sp_size"] == 2
        assert record["losses"] == pytest.approx(expected["losses"], abs=TOLERANCE)
        assert record["grad_norms"] == pytest.approx(expected["grad_norms"], abs=TOLERANCE)
        # The config Ulysses read had the Q/K head width; the model's own is back, in memory and in the checkpoint.
        assert record["head_dim_after"] == record["head_dim_saved"] == record["head_dim_before"] == 8
        # Evaluation runs each held-out sequence whole on every rank: the reference's loss on the same weights.
        assert record["eval_loss"] == pytest.approx(expected["eval_loss"], abs=TOLERANCE)
        assert "sp_eval_max_length=16" in record["eval_refused"] and "at most 16 tokens" in record["eval_refused"]
        assert record["data_ok"] == 1.0  # the first-batch check read the loader under DeepSpeed's SP adapter
        # The loss a chunk at a time (the adapter hands shift_labels, not labels) and the tiled MLPs ran: one gated
        # MLP per layer of the tiny model (its dense first layer's, then each MoE layer's shared experts).
        assert record["chunked_loss_ran"] and record["tiled_mlps"] == 3
    # Each rank counts the tokens it processed, its 1/SP of every sequence: over the ranks, the reference's tokens
    # times the replicas (the reference took micro batch DP for them).
    assert sum(r["tokens"] for r in records) == expected["tokens"] == STEPS * 32 * len(records) // 2


def test_sp2_zero3_trains_as_one_process_without_sp(sp2, reference):
    _assert_matches(sp2, reference[1][1])
    # It evaluated before training: the training prepare registered Ulysses again (DeepSpeed's SP groups made anew,
    # the model's own attention wrapped, not the evaluation's wrapper), and the evaluation saw the initial weights.
    for record in sp2:
        assert record["eval_first_loss"] == pytest.approx(reference[1][1]["eval_first_loss"], abs=TOLERANCE)
    # The comparison can tell runs apart: the two references (other blocks per step) differ by more than it allows.
    one, two = reference[1][1]["losses"], reference[1][2]["losses"]
    assert max(abs(a - b) for a, b in zip(one, two, strict=True)) > 100 * TOLERANCE


def test_sp2_dp2_on_four_ranks_trains_as_one_process_without_sp(sp2_dp2, reference):
    _assert_matches(sp2_dp2, reference[1][2])
    # Nothing had initialised DeepSpeed's communication, which the SP set-up asserts: RecipeTrainer did, on Gloo
    assert not any(r["comm_before_trainer"] for r in sp2_dp2)


def test_stock_ulysses_stops_at_mla_with_the_message_the_docs_name(sp2_launch):
    records = _records(sp2_launch / "stock")
    assert [r["rank"] for r in records] == [0, 1]
    for record in records:
        assert record["error"].startswith("AssertionError: ") and STOCK_MLA_MESSAGE in record["error"], record
        # the head size Ulysses took is DeepSeek's head_dim (the RoPE width, 8), not the Q/K width 24
        assert "torch.Size([16, 1, 4, 8])" in record["error"] and "torch.Size([16, 1, 4, 24])" in record["error"]
    assert STOCK_MLA_MESSAGE in (REPO / "docs" / "long-context.md").read_text()


def test_reference_order_takes_each_replicas_blocks_in_turn():
    # SP 2 x DP 2: replica 0's SP group takes blocks 0 then 1, replica 1's 2 then 3 (each rank loads one block).
    assert reference_order(8, dp=2) == [0, 2, 1, 3, 4, 6, 5, 7]
    assert reference_order(5, dp=1) == [0, 1, 2, 3]
