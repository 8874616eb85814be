"""A restarted rank meets its peers in a store of its own attempt (`comm.restarts`): against a real TCPStore playing
the agent's, rank 0 posts a free port under this attempt's key and every rank of the attempt reads the same one,
while a first attempt, a launch without torch elastic and a worker with its own store change nothing. The restart
itself (a rank killed under `--max_restarts 1`, the job finishing bitwise equal): tests/distributed/test_job_dies.py."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from hf_dist_recipes._compat import torch as compat_torch
from hf_dist_recipes.comm.restarts import PORT_KEY, fresh_rendezvous_after_restart
from hf_dist_recipes.core.launch import free_port


def _worker_env(agent_port: int, rank: int, attempt: int) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(agent_port),
        "RANK": str(rank),
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        compat_torch.AGENT_STORE_VARIABLE: "True",
    }


def test_each_restarted_attempt_gets_its_own_port_that_every_rank_reads():
    port = free_port()
    agent = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    agent.set(PORT_KEY.format(attempt=2), "1")  # a stale key of another attempt is never read
    ports = {}
    for attempt in (1, 3):
        envs = [_worker_env(port, rank, attempt) for rank in (0, 1)]
        got = [fresh_rendezvous_after_restart(env) for env in envs]  # rank 0 first, as it posts
        assert got[0] == got[1] and got[0] != port and 0 < got[0] < 2**16
        for env in envs:  # then init_process_group creates the group as without an agent store, on that port
            assert env["MASTER_PORT"] == str(got[0]) and not compat_torch.agent_store_in_use(env)
        with socket.socket() as s:  # free when posted: rank 0's new store can bind it
            s.bind(("0.0.0.0", got[0]))
        ports[attempt] = got[0]
    assert agent.get(PORT_KEY.format(attempt=1)).decode() == str(ports[1])


def test_nothing_changes_on_a_first_attempt_without_torch_elastic_or_with_an_own_store():
    first = _worker_env(1, 0, 0)
    without = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "0"}
    own = dict(_worker_env(1, 0, 1), **{compat_torch.AGENT_STORE_VARIABLE: "False"})  # c10d, store not shared
    for env in (first, without, own):
        before = dict(env)
        assert fresh_rendezvous_after_restart(env) is None and env == before


def test_restarted_ranks_of_several_machines_stop_with_the_fix():
    env = dict(_worker_env(1, 0, 1), GROUP_WORLD_SIZE="2")  # this machine's agent restarted; the other's count is 0
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        fresh_rendezvous_after_restart(env)
