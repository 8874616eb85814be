"""ZeRO-3 gradient reduction in the dtype the generated JSON names (`communication_data_type`), on 2 real CPU ranks
training tiny-llama in bf16: the shipped JSON (fp32) makes DeepSpeed reduce-scatter fp32 tensors, twice the bytes of
the same run with `--grad-reduce-dtype bf16`, as `planning/comm.py` counts them; both train, in one launch. The bf16 run
also trains the run again with the chunked loss (`loss_chunk_tokens`): under ZeRO-3, every tensor partitioned, the LM
head is gathered for each chunk and the losses are the stock loss's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hf_dist_recipes.planning.deepspeed_config import deepspeed_config
from hf_dist_recipes.planning.plan import ParallelPlan
from tests.distributed.workers.runs import THEN
from tests.support.launch import accelerate_launch, check_launch, write_cpu_deepspeed_yaml
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "grad_reduce_worker.py")
STEPS = 3


CHUNK = 16  # tokens per loss chunk: micro batch 2 x 32 tokens in 4 chunks


def _deepspeed_json(tmp_path, reduce: str) -> Path:
    plan = ParallelPlan(procs_per_node=2, device="cpu", precision="bf16", grad_reduce_dtype=reduce)
    ds = deepspeed_config(plan, auto=True)
    assert ds["communication_data_type"] == reduce
    # tiny-llama's tensors are below the persistence threshold (1e5 elements): partition every one.
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    ds_json = tmp_path / f"{reduce}.json"
    ds_json.write_text(json.dumps(ds))
    return ds_json


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """One launch, the fp32 run then the bf16 run (and its chunked-loss run) in the same ranks
    (tests/distributed/workers/runs.py), each with its own DeepSpeed JSON."""
    tmp_path = tmp_path_factory.mktemp("reduce")
    fp32, bf16 = _deepspeed_json(tmp_path, "fp32"), _deepspeed_json(tmp_path, "bf16")
    yaml = write_cpu_deepspeed_yaml(tmp_path / "launch.yaml", fp32)
    argv = [str(fp32), str(tmp_path / "fp32"), str(STEPS), THEN, str(bf16), str(tmp_path / "bf16"), str(STEPS)]
    check_launch(accelerate_launch(yaml, [WORKER, *argv, str(CHUNK)]))
    return {
        reduce: [json.loads((tmp_path / reduce / "reduce" / f"rank{r}.json").read_text()) for r in (0, 1)]
        for reduce in ("fp32", "bf16")
    }


def test_gradients_are_reduce_scattered_in_the_configured_dtype(runs):
    fp32, bf16 = runs["fp32"], runs["bf16"]
    for rank in fp32:
        assert rank["communication_data_type"] == "torch.float32"
        assert set(rank["reduce_scatter_bytes_by_dtype"]) == {"torch.float32"}
    for rank in bf16:
        assert rank["communication_data_type"] == "torch.bfloat16"
        assert set(rank["reduce_scatter_bytes_by_dtype"]) == {"torch.bfloat16"}
    # The same gradients (3 steps x 2 micro steps), 4 bytes per element against 2.
    assert (
        fp32[0]["reduce_scatter_bytes_by_dtype"]["torch.float32"]
        == 2 * (bf16[0]["reduce_scatter_bytes_by_dtype"]["torch.bfloat16"])
    )
    for run in (fp32, bf16):
        assert len(run[0]["losses"]) == STEPS and all(math.isfinite(x) for x in run[0]["losses"])


def test_the_chunked_loss_trains_to_the_stock_losses_under_zero3(runs):
    """The LM head's weight is partitioned and reached through its module (ZeRO-3 gathers it for the model's own
    last-position call, each chunk, and each chunk's recomputation), never on more than a chunk of tokens; the losses
    and gradient norms are the stock run's on both ranks, within bf16's rounding of the head's gradient, which the
    chunks sum in bf16 (one rounding per chunk)."""
    for rank in runs["bf16"]:
        chunked = rank["chunked"]
        assert chunked["lm_head_partitioned"] and chunked["lm_head_max_tokens"] == CHUNK
        # micro steps x (the model's own call + 4 chunks + their recomputation), + the first call's check
        assert chunked["lm_head_calls"] == STEPS * 2 * (1 + 2 * 4) + 1
        # Measured: losses within 5e-7 for two steps; gradient norms within 3e-4 (relative). From the third step the
        # weights carry two updates from the head's bf16-rounded gradient, whose rounding depends on the host's bf16
        # kernels (3e-5 on a host without AMX, 4.4e-4 on one with AMX-BF16): within bf16's unit roundoff, 2**-9.
        assert chunked["losses"][:2] == pytest.approx(rank["losses"][:2], abs=1e-4)
        assert chunked["losses"][2:] == pytest.approx(rank["losses"][2:], rel=2**-9)
        assert chunked["grad_norms"] == pytest.approx(rank["grad_norms"], rel=1e-3)
