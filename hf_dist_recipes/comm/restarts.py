"""Ranks restarted by the launcher (`accelerate launch --max_restarts N`, torchrun's) meet in a fresh store.

torch elastic restarts every worker of a node when one dies, and the new workers rendezvous through the store the
agent already hosts (`TORCHELASTIC_USE_AGENT_STORE=True`: static rendezvous, accelerate's default, always; c10d
unless `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`). That store still holds the first attempt's keys, and the new
workers' group set-up reads them: a rank gets a dead peer's address ("Gloo connectFullMesh failed ... Connection
refused", seen here on CPU) or, under NCCL, the previous attempt's unique id (pytorch/pytorch#135712). DeepSpeed's
CPU shared-memory all-reduce names its segments by MASTER_PORT, so a restart on the same port opens the dead
rank's segment and hangs (seen here: ten minutes, until killed).

`fresh_rendezvous_after_restart`, run before the process group exists (`RecipeTrainingArguments`), gives each
attempt after the first its own rendezvous: rank 0 picks a free port and posts it in the agent's store under a key
of this attempt, every rank reads it, and the group is then created as without an agent store (rank 0 hosts a new
TCPStore on that port). Nothing changes on the first attempt, nor without a torch elastic launcher.

The attempt number is TORCHELASTIC_RESTART_COUNT, which each node's agent counts for itself
(pytorch/pytorch#108158): on one machine every rank agrees on it, across machines not, so there a restarted rank
that would use the agent's store stops with the fix instead (ValueError): c10d rendezvous with
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, where each round gets its own store and port (the torchrun form of the
generated script).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from datetime import timedelta

from hf_dist_recipes._compat import torch as compat_torch
from hf_dist_recipes.core.launch import free_port

PORT_KEY = "hf_dist_recipes/restart_{attempt}/port"
STORE_TIMEOUT = timedelta(minutes=10)  # how long the ranks wait for rank 0's port: rank 0 starts with them


def fresh_rendezvous_after_restart(environ: MutableMapping[str, str] = os.environ) -> int | None:
    """When this process is a restarted worker that would rendezvous through the agent's store: post (rank 0) or
    read the port of this attempt's own store, set MASTER_PORT to it and stop using the agent's store; returns the
    port. None (nothing changed) on a first attempt, without torch elastic, or with a store of its own already."""
    attempt = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or not compat_torch.agent_store_in_use(environ):
        return None
    if environ.get("GROUP_WORLD_SIZE", "1") != "1":
        # Each machine's agent counts its own restarts (pytorch/pytorch#108158): the ranks of two machines could
        # look for two different keys, and wait for each other for ever.
        raise ValueError(
            f"restarted ranks of {environ['GROUP_WORLD_SIZE']} machines would meet in the first attempt's "
            "rendezvous store, which still holds its keys (pytorch/pytorch#135712): launch with c10d rendezvous and "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment, as the torchrun form of `hf-dist-recipes "
            "config generate --launcher torchrun` does"
        )
    from torch.distributed import TCPStore

    rank = int(environ["RANK"])
    agent = TCPStore(
        environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), is_master=False, timeout=STORE_TIMEOUT, use_libuv=True
    )
    key = PORT_KEY.format(attempt=attempt)
    if rank == 0:
        agent.set(key, str(free_port("0.0.0.0")))
    port = int(agent.get(key).decode())
    environ["MASTER_PORT"] = str(port)
    compat_torch.stop_using_agent_store(environ)
    return port
