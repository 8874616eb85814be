"""The launch scripts `config generate --launcher` writes, run as a two-node Slurm job on this machine.

Faked, as hardware facts: the two "nodes" of the allocation are this machine twice (SLURM_JOB_NODELIST
127.0.0.1,127.0.0.1), `sbatch` is tests/support/slurm.py and `srun` / `scontrol` the stand-ins of
tests/support/slurm_standins/ (one task per node with its own SLURM_NODEID / SLURM_PROCID). Real: the generated
script, bash running it, the launcher each task starts (`accelerate launch` or `torchrun`), the rendezvous on the
first node's address, and two ranks training ZeRO-3 together over Gloo (2 nodes x 1 CPU process, `--auto` JSON).
One launch per form; every assertion reads that launch's files.
"""

import json
from pathlib import Path

import pytest

from hf_dist_recipes.cli.main import main as cli
from hf_dist_recipes.comm.nccl_defaults import NCCL_ENV_DEFAULTS
from tests.support.launch import LAUNCH_TIMEOUT_S, free_port
from tests.support.paths import REPO
from tests.support.slurm import sbatch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "launch_script_worker.py")
STEPS = 3
NODES = "127.0.0.1,127.0.0.1"


def _job(tmp_path_factory, launcher: str, job_id: int) -> dict:
    """Generate the 2-node CPU plan with `launcher`'s script, submit it with the worker, return what it left."""
    root = tmp_path_factory.mktemp(launcher)
    port = free_port()
    argv = ["config", "generate", "--cpu", "--nodes", "2", "--gpus-per-node", "1", "--auto", "--name", "job"]
    argv += ["--main-process-port", str(port), "--output", str(root / "cfg"), "--launcher", launcher]
    argv += ["--socket-ifname", "lo"]
    assert cli(argv) == 0
    (script,) = (root / "cfg").glob("*.sbatch")
    out = root / "run"
    job = sbatch(
        script,
        [WORKER, str(out), str(STEPS), "tiny-llama"],
        nodelist=NODES,
        job_id=job_id,
        cwd=root,
        timeout_s=LAUNCH_TIMEOUT_S,
    )
    log_dir = root / "cfg" / "logs"
    node_logs = {n: log_dir / f"job-{job_id}-node{n}.out" for n in (0, 1)}
    if not job.result.ok:
        tails = "\n".join(f"--- node {n}:\n{p.read_text()[-3000:]}" for n, p in node_logs.items() if p.exists())
        pytest.fail(f"the {launcher} job {job.result.describe()}:\n{job.result.stderr[-3000:]}\n{tails}")
    return {
        "job": job,
        "port": port,
        "script": script,
        "node_logs": node_logs,
        "probe": [json.loads((out / "probe" / f"rank{r}.json").read_text()) for r in (0, 1)],
        "env": [json.loads((out / "env" / f"rank{r}.json").read_text()) for r in (0, 1)],
        "seconds": job.result.seconds,
    }


@pytest.fixture(scope="module")
def slurm_job(tmp_path_factory):
    return _job(tmp_path_factory, "slurm", 4242)


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory):
    return _job(tmp_path_factory, "torchrun", 4343)


@pytest.fixture(params=["slurm", "torchrun"])
def any_job(request):
    return request.getfixturevalue(f"{request.param}_job")


def test_the_two_nodes_train_together(any_job):
    rank0, rank1 = any_job["probe"]
    print(f"job {any_job['job'].env['SLURM_JOB_ID']}: {any_job['seconds']:.0f} s, losses {rank0['losses']}")
    assert [r["world_size"] for r in (rank0, rank1)] == [2, 2] and [rank0["rank"], rank1["rank"]] == [0, 1]
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == STEPS
    # One job: the same logged (all-reduced) loss on both machines; two data-parallel ranks: different batches.
    assert rank0["losses"] == rank1["losses"] and len(rank0["losses"]) == STEPS
    assert rank0["batches"] != rank1["batches"]
    # ZeRO-3 over the two machines: each holds about half of every large parameter.
    name = next(n for n in rank0["params"] if "embed_tokens" in n)
    shape = rank0["params"][name]["shape"]
    half = -(-shape[0] * shape[1] // 2)
    assert rank0["params"][name]["local"] == rank1["params"][name]["local"] == half, rank0["params"][name]


def test_the_ranks_met_on_the_first_node_with_the_scripts_environment(any_job):
    env0, env1 = any_job["env"]
    for env in (env0, env1):
        assert env["SLURM_JOB_ID"] == any_job["job"].env["SLURM_JOB_ID"]
        # The script's NCCL settings reach the ranks; 3, not the 1 torchrun exports when unset.
        assert {k: env[k] for k in NCCL_ENV_DEFAULTS} == NCCL_ENV_DEFAULTS
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
        assert env["HF_DIST_RECIPES_USE_CPU"] == "1"
    # One task per node, each node its own launcher: node ids 0 and 1, one rank each.
    assert sorted(e["SLURM_NODEID"] for e in (env0, env1)) == ["0", "1"]
    assert sorted(e["GROUP_RANK"] for e in (env0, env1)) == ["0", "1"]


def test_accelerate_form_machine_rank_is_the_slurm_node_id(slurm_job):
    env0, env1 = slurm_job["env"]
    assert [env0["SLURM_NODEID"], env1["SLURM_NODEID"]] == [env0["GROUP_RANK"], env1["GROUP_RANK"]] == ["0", "1"]
    assert env0["MASTER_ADDR"] == env1["MASTER_ADDR"] == "127.0.0.1"  # scontrol's first host
    assert [e["MASTER_PORT"] for e in (env0, env1)] == [str(slurm_job["port"])] * 2


def test_torchrun_form_hands_the_deepspeed_json_over(torchrun_job):
    script = torchrun_job["script"]
    json_file = str(script.parent / "deepspeed" / "job.json")
    for env in torchrun_job["env"]:
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == json_file
    # The c10d rendezvous ran on the first node's address and the plan's port.
    text = torchrun_job["job"].stdout_file.read_text()
    assert f"rendezvous 127.0.0.1:{torchrun_job['port']}" in text


def test_the_logs_are_where_the_script_says(any_job):
    job = any_job["job"]
    assert job.stdout_file.parent == any_job["script"].parent / "logs"
    assert job.stdout_file.name == f"job-{job.env['SLURM_JOB_ID']}.out"
    assert f"job {job.env['SLURM_JOB_ID']}: 2 node(s) x 1 process(es)" in job.stdout_file.read_text()
    for node, log in any_job["node_logs"].items():
        assert log.is_file() and log.stat().st_size > 0, (node, log)


def test_config_validate_passes_the_scripts_it_wrote(slurm_job, torchrun_job, capsys):
    scripts = [str(slurm_job["script"]), str(torchrun_job["script"])]
    assert cli(["config", "validate", *scripts]) == 0
    assert "0 error(s), 0 warning(s)" in capsys.readouterr().out
    assert Path(scripts[1]).name == "job.torchrun.sbatch"
