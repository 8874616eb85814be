"""The heartbeat watchdog's logic with a fake clock and a real in-process store (torch's HashStore): a peer that
stops beating is named with its host and last step once the bound passes; peers that keep beating never are."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hf_dist_recipes.arguments import RecipeTrainingArguments
from hf_dist_recipes.comm.watchdog import (
    DONE,
    LOST_KEY,
    Beat,
    HeartbeatWatchdog,
    PeerWatch,
    looks_like_lost_peer,
    validate_hang_settings,
    watched_peers,
)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _ranks(store, clock, world=3, timeout=20.0):
    return [
        HeartbeatWatchdog(store, r, world, timeout, clock=clock, host=f"host{r}", on_lost=pytest.fail)
        for r in range(world)
    ]


def test_a_peer_that_stops_beating_is_named_after_the_bound_with_its_host_and_last_step():
    store, clock = dist.HashStore(), Clock()
    ranks = _ranks(store, clock)
    for step in (1, 2, 3):
        for r in ranks:
            r.set_step(step)
    assert all(r.check_once() is None for r in ranks)
    # rank 2 dies after step 3; the others go on beating (they wait in a collective, their threads still run)
    for _ in range(10):
        clock.now += 2.0  # 20 s in all: exactly the bound, not past it
        for r in ranks[:2]:
            r.beat_once()
        assert ranks[0].check_once() is None and ranks[1].check_once() is None
    clock.now += 2.0  # 22 s > 20 s
    ranks[0].beat_once()
    message = ranks[1].check_once()  # rank 1 watches ranks 2 and 0
    assert message is not None
    assert "lost rank 2 (host host2)" in message and "its last step was 3" in message and "rank 1" in message
    assert "22 s" in message
    # rank 0 watches 1 and 2 too, but it learns it from the store even if its own view were fresh
    assert store.get(LOST_KEY).decode() == message
    assert ranks[0].check_once().startswith(message)


def test_peers_that_all_beat_are_never_stale_even_when_this_rank_was_paused():
    store, clock = dist.HashStore(), Clock()
    ranks = _ranks(store, clock)
    for _ in range(50):
        clock.now += 2.0
        for r in ranks:
            r.beat_once()
        assert [r.check_once() for r in ranks] == [None, None, None]
    # this rank's own thread paused for 60 s (a loaded machine) while the peers beat: they are fresh, not lost
    clock.now += 60.0
    for r in ranks[1:]:
        r.beat_once()
    assert ranks[0].check_once() is None


def test_a_peer_that_never_beats_gets_the_bound_from_start_and_a_finished_one_is_never_lost():
    watch = PeerWatch([1, 2], timeout_s=10.0, start=0.0)
    assert watch.stale(10.0) == []
    assert watch.stale(10.5) == [1, 2]
    watch.observe(1, Beat(seq=7, step=4, host="h1", state=DONE), now=10.5)
    watch.observe(2, Beat(seq=1, step=0, host="h2"), now=10.5)
    assert watch.stale(100.0) == [2]


def test_store_failure_ends_only_after_the_bound():
    class Broken:
        def set(self, *a):
            raise RuntimeError("Connection refused")

    clock = Clock()
    dog = HeartbeatWatchdog(Broken(), 0, 2, 20.0, clock=clock, host="h0", on_lost=pytest.fail)
    assert dog._round() is None
    clock.now += 20.0
    assert dog._round() is None
    clock.now += 1.0
    assert "store has been unreachable for 21 s" in dog._round()


def test_each_rank_watches_a_few_peers_and_every_rank_is_watched():
    assert watched_peers(0, 2) == [1] and watched_peers(1, 2) == [0]
    world = 100
    watchers = {r: 0 for r in range(world)}
    for r in range(world):
        peers = watched_peers(r, world)
        assert r not in peers and len(peers) == 8
        for p in peers:
            watchers[p] += 1
    assert set(watchers.values()) == {8}


def test_lost_peer_errors_are_told_apart_from_other_errors():
    assert looks_like_lost_peer(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]"))
    assert looks_like_lost_peer(dist.DistBackendError("NCCL error"))
    assert not looks_like_lost_peer(ValueError("bad batch"))
    assert not looks_like_lost_peer(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


@pytest.mark.parametrize("peer_timeout, step_timeout, fix", [(2, 600, "at least 5 seconds"), (120, -1, "seconds > 0")])
def test_bad_hang_settings_name_the_fix(peer_timeout, step_timeout, fix):
    with pytest.raises(ValueError, match=fix):
        validate_hang_settings(peer_timeout, step_timeout)
    with pytest.raises(ValueError, match=fix):
        RecipeTrainingArguments(output_dir="unused", peer_timeout=peer_timeout, step_timeout=step_timeout)


def test_off_is_allowed():
    validate_hang_settings(0, 0)


def test_compat_store_and_collective_timeout_on_a_real_gloo_group(tmp_path):
    """torch 2.13 private API used by the watchdog (_compat.torch.default_store, _compat.torch.set_collective_timeout):
    fails when upstream moves `_get_default_store`, `_world.pg_map` or `_set_pg_timeout`, or when the timeout no longer
    reaches every group's Gloo backend (read back through the backend's options, also private)."""
    from datetime import timedelta

    import torch

    from hf_dist_recipes._compat import torch as compat_torch

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=7200)
    )
    try:
        sub = dist.new_group([0])
        store = compat_torch.default_store()
        store.set("hf_dist_recipes/probe", b"1")
        assert store.get("hf_dist_recipes/probe") == b"1"

        def timeouts():
            return [g._get_backend(torch.device("cpu")).options._timeout for g in (dist.group.WORLD, sub)]

        # new_group without a timeout takes torch's 30-minute default, not the default group's: DeepSpeed's groups
        # do not follow ddp_timeout, which is why every group is changed
        assert timeouts() == [timedelta(seconds=7200), timedelta(seconds=1800)]
        assert compat_torch.set_collective_timeout(600) == 2
        assert timeouts() == [timedelta(seconds=600)] * 2
        dist.all_reduce(torch.ones(1))  # the group still works with its new timeout
    finally:
        dist.destroy_process_group()
