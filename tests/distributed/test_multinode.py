"""Two machines on one host: two `accelerate launch` processes as machine_rank 0 and 1 of a generated 2-machine
CPU config on 127.0.0.1 train together (one rank each, DeepSpeed ZeRO-3, Gloo)."""

import json

import pytest

from tests.support.launch import LAUNCH_TIMEOUT_S, launch_machine, two_machine_config
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "probe_worker.py")


def test_two_machines_train_together(tmp_path):
    config, port = two_machine_config(tmp_path)
    text = config.read_text()
    assert "num_machines: 2" in text and f"main_process_port: {port}" in text and "main_process_ip: 127.0.0.1" in text
    out = tmp_path / "run"
    args = [WORKER, str(out), "4", "recipe", "tiny-deepseek-v3"]
    procs = [launch_machine(config, rank, args, cwd=tmp_path) for rank in (0, 1)]
    try:
        outputs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    ranks = [json.loads((out / "probe" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["batches"] != ranks[1]["batches"]  # two data-parallel ranks, two shards of the data
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == 4  # one job, one logged loss
    assert all(r["trainer_total_batch"] == 4 * 2 for r in ranks)
