"""Restarts across two hosts (issue 41): two network namespaces on this machine, each a "node" with its own address
on its own interface (tests/support/netns.py; not 127.0.0.1, so no node reaches the other through loopback), and on
each a real torchrun as the generated torchrun script runs it (c10d rendezvous on node 0, the DeepSpeed JSON of the
generated 2-machine CPU config handed over through accelerate's variables, `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`),
with `--max-restarts 1`: one rank per node, ZeRO-3, Gloo over the veth pair. Node 1's rank SIGKILLs itself after
step 4, on its first attempt only, as a dead node's ranks would die; checkpoint-3 is the newest complete one. Node
1's agent restarts its rank, node 0's agent restarts its own when node 1 rejoins the rendezvous, and both resume
from checkpoint-3 through `auto_resume`; the job ends bitwise equal to an uninterrupted run of the same job, trained
in the same restarted processes afterwards (`then`). Faked: two hosts' hostnames (one machine's), so each agent is
told its address (`--local-addr`) and which one serves the store (`is_host`); on a cluster torch reads both from
the node's hostname. The agents and ranks are forked warm from a server started inside each namespace
(tests.support.warm_ranks; the session's servers live outside them), or start fresh where warm ranks are off.
"""

import contextlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.distributed.test_job_dies import assert_bitwise_equal
from tests.support import cpu_time
from tests.support.launch import (
    LAUNCH_TIMEOUT_S,
    _launch_env,
    cpu_only_env,
    free_port,
    python_for,
    two_machine_config,
)
from tests.support.netns import IFNAME, two_hosts
from tests.support.paths import REPO
from tests.support.warm_ranks import WarmServers

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = str(REPO / "tests" / "distributed" / "workers" / "survival_worker.py")
# Checkpoints 3 and 6: rank 1 dies after step 4, with checkpoint-3 the newest complete one, and the restarted ranks
# train steps 4-6 again and save once more.
STEPS, SAVE_STEPS, KILL_AT = 6, 3, 4


@contextlib.contextmanager
def warm_inside(hosts, env: dict[str, str], session_servers):
    """Per host, `env` with a warm server of its own started inside its namespace (one import each, against the 2
    agents and 4 ranks of this job that would import fresh); `env` as it is where the session's warm ranks are off.
    The ranks' CPU time joins the session's record (tests.support.cpu_time)."""
    if session_servers is None:
        yield [env for _ in hosts]
        return
    servers = []
    try:
        for host in hosts:
            folder = Path(tempfile.mkdtemp(prefix="hf-dist-recipes-warm-"))  # short: a socket path has 108 bytes
            servers.append(WarmServers(folder, env, count=1, inside=host.command))
        for server in servers:
            server.wait_ready()
        yield [dict(env, **server.env) for server in servers]
    finally:
        for server in servers:
            server.stop()
            cpu_time.join_ranks(server.directory, session_servers.directory)
            shutil.rmtree(server.directory, ignore_errors=True)


def test_a_node_whose_ranks_die_restarts_and_the_job_resumes_to_the_uninterrupted_weights(tmp_path, warm_ranks):
    config, _ = two_machine_config(tmp_path / "cfg")
    out, reference = tmp_path / "run", tmp_path / "reference"
    worker = [WORKER, str(out), str(STEPS), str(SAVE_STEPS), f"kill-at={KILL_AT}"]
    worker += ["then", str(reference), str(STEPS), str(SAVE_STEPS)]
    env = {k: v for k, v in cpu_only_env(_launch_env()).items() if k != "PYTHON_EXEC"}
    env |= {  # what the torchrun form of the generated script exports (planning/launch_script_args.py)
        "ACCELERATE_USE_DEEPSPEED": "true",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config.parent / "deepspeed" / "two.json"),
        "ACCELERATE_MIXED_PRECISION": "no",
        # c10d's store per rendezvous round: the recipe refuses restarts of several machines without it
        # (`comm.restarts`, pytorch/pytorch#135712).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "GLOO_SOCKET_IFNAME": IFNAME,  # the veth end in each namespace, the same name in both
    }
    port = free_port()
    with two_hosts() as hosts, warm_inside(hosts, env, warm_ranks) as host_envs:
        procs = []
        for rank, host in enumerate(hosts):
            torchrun = [*python_for(host_envs[rank]), "-m", "torch.distributed.run", "--nnodes", "2"]
            torchrun += ["--nproc-per-node", "1"]
            torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:{port}", "--rdzv-id", "job"]
            torchrun += [
                "--rdzv-conf",
                f"is_host={int(rank == 0)}",
                "--local-addr",
                host.address,
                "--max-restarts",
                "1",
            ]
            procs.append(
                subprocess.Popen(
                    host.command([*torchrun, *worker]),
                    cwd=tmp_path,
                    env=host_envs[rank],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        try:
            outputs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n=====\n".join(o[-4000:] for o in outputs)
    assert "exitcode: -9" in outputs[1]  # node 1's agent saw its rank die of SIGKILL
    assert f"auto_resume: resuming from {out / 'checkpoint-3'}" in outputs[0]
    # Node 1's rank restarted on its failure (attempt 1); node 0's when node 1 rejoined (a membership change, which
    # torch does not count as an attempt), or on its own rank's failure had that come first. Both trained steps 4-STEPS
    # again from checkpoint-3, once each.
    records = {p.name: json.loads(p.read_text()) for p in (out / "survival").glob("*.json")}
    assert len(records) == 2 and "rank1-attempt1.json" in records and {n[:5] for n in records} == {"rank0", "rank1"}
    assert all(r["first_step"] == KILL_AT and r["global_step"] == STEPS for r in records.values())
    assert_bitwise_equal(out / "final", reference / "final")
