"""The aggregate run shows in TensorBoard: a real `tensorboard` server, read through its HTTP data API (the
scalars plugin's `/data/plugin/scalars/scalars` route, what the browser fetches)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from hf_dist_recipes.core.launch import free_port
from hf_dist_recipes.logs.aggregate import summarize_logs, write_aggregate_run

TIMEOUT_S = 60


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_aggregate_run_is_served_by_tensorboard(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    values = np.array([[1.0, 2.0, 4.0], [3.0, 2.5, 0.5]])  # ranks x steps
    for r in range(2):
        w = SummaryWriter(str(tmp_path / "logs" / f"rank{r}"))
        for s in range(3):
            w.add_scalar("train/loss", values[r, s], s)
        w.close()
    out = tmp_path / "summary"
    write_aggregate_run(summarize_logs(tmp_path / "logs", workers=1), out / "aggregate")

    binary = Path(sys.executable).with_name("tensorboard")
    port = free_port()
    log = open(tmp_path / "tensorboard.log", "w+")  # a file, not a pipe: a full pipe would block the server
    proc = subprocess.Popen(
        [
            str(binary),
            "--logdir",
            str(out),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load_fast=false",
            "--reload_interval",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        query = urllib.parse.urlencode({"run": "aggregate", "tag": "train/loss/mean"})
        url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?{query}"
        deadline = time.monotonic() + TIMEOUT_S
        rows = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"tensorboard exited with {proc.returncode}: {log.read()[-2000:]}")
            try:
                rows = _get(url)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.3)  # not listening yet, or the run not loaded yet (400 until it is)
        assert rows is not None, f"no scalars from {url} within {TIMEOUT_S} s"
        # Each row: [wall_time, step, value]; expected: the mean over the two ranks, worked out by hand.
        assert [row[1] for row in rows] == [0, 1, 2]
        np.testing.assert_allclose([row[2] for row in rows], [2.0, 2.25, 2.25])
        spread = _get(url.replace("mean", "spread"))
        np.testing.assert_allclose([row[2] for row in spread], [2.0, 0.5, 3.5])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
