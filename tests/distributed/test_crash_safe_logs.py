"""A rank that dies keeps what it logged: a real training process (RecipeTrainer, tiny model, logs every 2 steps) ends
at step 5 by SIGTERM (preemption off), SIGKILL or an exception, or saves step 6 on SIGTERM (the default); its
TensorBoard run is read back with `read_scalars`. Each logging step is flushed, so steps 2 and 4 survive even
SIGKILL; a probe scalar written (not flushed) at step 5 survives SIGTERM (the handler flushes, then the process still
dies of SIGTERM), the save on it and the exception (train() closes the writer), and is lost to SIGKILL, which no
handler sees. Then a second launch into the same directory is refused, and a refusal on one rank of a 2-rank launch
stops both; a 2-rank run that ends normally has each rank's system scalars and one run id. Five single-rank processes
(the SIGKILL run is shared) and one 2-rank launch (the normal run, then the refused one)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import pytest

from hf_dist_recipes.checkpoint.preemption import PREEMPTED_EXIT_CODE
from hf_dist_recipes.monitoring import read_scalars
from tests.distributed.workers.runs import THEN
from tests.support.launch import accelerate_launch, launched_ranks_env, python_for
from tests.support.paths import REPO

pytestmark = [pytest.mark.distributed]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "crash_log_worker.py")
DIE_AT = 5  # logs at 2 and 4 (logging_steps=2), none at 5
ZERO3 = REPO / "accelerate_configs" / "cpu_zero3_2proc.yaml"


def _run(out, mode: str) -> subprocess.CompletedProcess:
    # A CPU run on any host in the launched ranks' environment (the worker imports tests.support), forked warm: the
    # signals and the exit are the process's own either way (warm_python.py mirrors them).
    env = launched_ranks_env(os.environ)
    return subprocess.run(
        [*python_for(env), WORKER, str(out), mode, str(DIE_AT)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env=env,
    )


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The SIGKILL run, shared: its directory is read back below and (a copy) launched into again."""
    out = tmp_path_factory.mktemp("killed")
    return out, _run(out, "kill")


@pytest.mark.parametrize(
    "mode, returncode, probe_survives, logged",
    [
        ("term", -signal.SIGTERM, True, [2, 4]),
        ("kill", -signal.SIGKILL, False, [2, 4]),
        ("raise", 1, True, [2, 4]),
        # the recipe's default: the SIGTERM saves the next step (6, a logging step) and exits 75
        ("save", PREEMPTED_EXIT_CODE, True, [2, 4, 6]),
    ],
)
def test_a_dying_rank_keeps_its_flushed_steps(request, tmp_path, mode, returncode, probe_survives, logged):
    if mode == "kill":
        tmp_path, proc = request.getfixturevalue("killed")
    else:
        proc = _run(tmp_path, mode)
    assert proc.returncode == returncode, proc.stderr[-3000:]
    scalars = read_scalars(tmp_path / "tensorboard" / "rank0")
    for tag in ("train/loss", "rank/step_time_s", "train/system/rss_gib"):
        assert [step for step, _ in scalars[tag]] == logged, tag
    assert ("probe/unflushed" in scalars) is probe_survives
    if mode == "save":
        assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-6"]
    if mode == "raise":
        assert f"worker dies at step {DIE_AT}" in proc.stderr


def test_a_second_launch_into_the_dead_runs_dir_is_refused(killed, tmp_path):
    dead, first = killed
    assert first.returncode == -signal.SIGKILL
    shutil.copytree(dead, tmp_path / "dead")  # the shared run's directory stays as it died
    again = _run(tmp_path / "dead", "kill")
    assert again.returncode == 1
    assert "already holds TensorBoard event files of run " in again.stderr
    assert "Use a new output_dir / logging_dir" in again.stderr


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One 2-rank launch, two runs in the same ranks (tests/distributed/workers/runs.py): one that ends normally
    after 4 steps, then one refused on rank 1 (which stops the launch, so it goes last). Returns (the first run's
    directory, the second's, the launch)."""
    from torch.utils.tensorboard import SummaryWriter

    normal, refused = tmp_path_factory.mktemp("normal"), tmp_path_factory.mktemp("refused")
    # Only rank 1's directory holds an old run (written by SummaryWriter directly), e.g. a job relaunched with more
    # ranks into the same logging_dir.
    with SummaryWriter(str(refused / "tensorboard" / "rank1")) as w:
        w.add_scalar("train/loss", 1.0, 1)
    argv = [WORKER, str(normal), "none", "4", THEN, str(refused), "kill", "3"]
    return normal, refused, accelerate_launch(ZERO3, argv, timeout=300)


def test_a_refusal_on_one_rank_stops_every_rank(two_ranks):
    # Rank 0 alone has nothing to refuse, yet must not go on into training and wait there for rank 1: both stop
    # with the refusal naming rank 1.
    _, refused, proc = two_ranks
    assert proc.returncode != 0
    assert proc.stderr.count("ValueError: rank 1 of 2 (1 refusing): ") == 2, proc.stderr[-4000:]
    assert not (refused / "tensorboard" / "rank0").exists()


def test_two_ranks_each_record_their_system_scalars_and_one_shared_run_id(two_ranks):
    tmp_path, _, proc = two_ranks
    assert (tmp_path / "rank_summaries" / "rank1.json").exists(), proc.stderr[-4000:]  # the first run ended
    runs = [json.loads((tmp_path / "tensorboard" / f"rank{r}" / "run.json").read_text()) for r in (0, 1)]
    summaries = [json.loads((tmp_path / "rank_summaries" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["local_rank"]) for r in runs] == [(0, 0), (1, 1)]  # one host: local rank = rank
    assert runs[0]["run_id"] == runs[1]["run_id"] == summaries[0]["run_id"] == summaries[1]["run_id"]
    for rank in (0, 1):
        scalars = read_scalars(tmp_path / "tensorboard" / f"rank{rank}")
        for tag in ("train/system/rss_gib", "train/system/cpu_percent", "rank/step_time_s", "train/loss"):
            assert [step for step, _ in scalars[tag]] == [2, 4], (rank, tag)
        assert all(value > 0.05 for _, value in scalars["train/system/rss_gib"])  # a python with torch: > 50 MiB
