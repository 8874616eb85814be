"""The shared rank mechanisms in one process: `core.layout.RankLayout` (groups written out by hand, as DeepSpeed
AutoTP forms them: consecutive ranks) and `core.gather` without a process group. Across real ranks they run in
tests/distributed (test_seed_agreement.py, test_env_fingerprint.py, test_expert_load_ranks.py)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hf_dist_recipes.core.gather import distributed, gather_floats, gather_objects
from hf_dist_recipes.core.layout import RankLayout
from hf_dist_recipes.parallel.batch import data_parallel_size


def test_world_8_tp_2_groups_and_replicas():
    layout = RankLayout(8, 2)
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.dp == 4
    # rank r is replica r // 2: 0 0 1 1 2 2 3 3
    assert [layout.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layout.tp_group(5) == [4, 5] and layout.tp_group(4) == [4, 5] and layout.tp_group(0) == [0, 1]


def test_world_8_tp_2_data_parallel_groups_and_global_ranks():
    layout = RankLayout(8, 2)
    # TP rank 0 of every replica holds one shard, TP rank 1 the other: ZeRO partitions over 0 2 4 6 and 1 3 5 7.
    assert layout.dp_group(0) == [0, 2, 4, 6] and layout.dp_group(6) == [0, 2, 4, 6]
    assert layout.dp_group(3) == [1, 3, 5, 7]
    # (replica, TP rank) -> global rank: (0, 0) 0, (0, 1) 1, (2, 1) 5, (3, 0) 6
    assert [layout.rank(d, t) for d, t in ((0, 0), (0, 1), (2, 1), (3, 0))] == [0, 1, 5, 6]
    assert RankLayout(3).dp_group(1) == [0, 1, 2]


def test_world_8_tp_4_and_no_tp():
    layout = RankLayout(8, 4)
    assert layout.tp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.dp == 2 and [layout.dp_rank(r) for r in (0, 3, 4, 7)] == [0, 0, 1, 1]
    plain = RankLayout(3)
    assert plain.tp_groups() == [[0], [1], [2]] and plain.dp == 3 and plain.dp_rank(2) == 2
    assert RankLayout(1).tp_groups() == [[0]]


@pytest.mark.parametrize(
    "world,tp,ep,match",
    [
        (6, 4, 1, r"world size 6 is not divisible by the tensor-parallel degree 4; launch a multiple of 4 processes "
         r"or change tensor_parallel.autotp_size"),
        (4, 1, 3, r"world size 4 is not divisible by the expert-parallel degree 3; .* expert_parallel.autoep_size"),
        (4, 0, 1, r"tensor-parallel degree must be >= 1, got 0; set tensor_parallel.autotp_size to 1 or more"),
        (0, 1, 1, r"world size must be >= 1 process, got 0"),
    ],
)  # fmt: skip
def test_refusals_name_the_setting_to_change(world, tp, ep, match):
    with pytest.raises(ValueError, match=match):
        RankLayout(world, tp, ep)


def test_data_parallel_size_is_the_layouts():
    assert data_parallel_size(8, 2) == 4 and data_parallel_size(4) == 4
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel degree 4"):
        data_parallel_size(6, 4)


def test_gather_without_a_process_group_is_this_rank_alone():
    assert not dist.is_initialized() and not distributed()
    record = {"seed": 42, "host": "h"}
    assert gather_objects(record) == [record]
    assert gather_objects(record)[0] is record  # no copy, no pickling
    assert gather_objects(None) == [None]
    assert gather_floats([1.0, 2.5, -1.0]) == [[1.0, 2.5, -1.0]]


@pytest.mark.parametrize("world,tp,ep", [(8, 1, 2), (8, 1, 4), (8, 2, 2), (8, 2, 4), (16, 2, 4), (4, 1, 1), (8, 4, 2)])
def test_expert_parallel_groups_are_deepspeeds(world, tp, ep):
    """Each rank's EP group as DeepSpeed 0.19.8 forms it without AutoTP folding (`deepspeed.utils.groups.
    _get_expert_parallel_ranks`, the generator `_create_expert_and_data_parallel` builds the groups from); a live
    AutoEP run compares the layer's own group: tests/distributed/test_expert_load_ranks.py."""
    from deepspeed.utils.groups import _get_expert_parallel_ranks

    groups, _ = _get_expert_parallel_ranks(world, tp, ep)
    theirs = {rank: sorted(group) for group in groups for rank in group}
    layout = RankLayout(world, tp, ep)
    assert {rank: layout.ep_group(rank) for rank in range(world)} == theirs
    assert RankLayout(8, 2, 2).ep_group(5) == [5, 7]  # by hand: rank 5's DP group is 1 3 5 7, in runs of 2
