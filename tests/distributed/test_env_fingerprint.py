"""Cross-rank environment check through RecipeTrainer on 2 real CPU ranks (accelerate_configs/cpu_zero3_2proc.yaml):
a rank whose importlib.metadata reports another datasets stops the launch before step 1, naming the rank and the
package with both versions; the same launch without the difference trains."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from tests.support.launch import accelerate_launch, check_launch
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "env_fingerprint_worker.py")
YAML = REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml"
STEPS = 2


def test_rank_with_another_datasets_stops_before_step_1_named(tmp_path):
    proc = accelerate_launch(YAML, [WORKER, str(tmp_path), str(STEPS), "--odd-rank", "1"])
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-3000:]
    real = importlib.metadata.version("datasets")  # what rank 0 (and this process) sees
    assert "the ranks' environments differ" in text
    assert "rank 1 on host " in text and f"datasets 9.9.9 (the other ranks: {real})" in text
    assert "rank 0 on host" not in text  # rank 0 is the majority's value on a tie: only rank 1 is named
    assert not (tmp_path / "steps").exists()  # no rank finished a step


def test_same_environment_trains(tmp_path):
    check_launch(accelerate_launch(YAML, [WORKER, str(tmp_path), str(STEPS)]))
    ranks = [json.loads((tmp_path / "fingerprint" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["steps"] for r in ranks] == [STEPS, STEPS]
    assert (
        ranks[0]["fingerprint"]["datasets"]
        == ranks[1]["fingerprint"]["datasets"]
        == importlib.metadata.version("datasets")
    )
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == [
        f"rank{r}-step{s}" for r in (0, 1) for s in range(1, STEPS + 1)
    ]
