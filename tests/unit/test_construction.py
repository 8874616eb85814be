"""The unpartitioned-model check by itself; through RecipeTrainer under a real ZeRO-3 launch in
tests/distributed/test_setup_checks.py."""

import pytest
import torch

from hf_dist_recipes.parallel.construction import check_partitioned, unpartitioned_bytes


def test_counts_the_bytes_of_parameters_zero_init_did_not_partition():
    model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.Linear(50, 10, dtype=torch.bfloat16))
    expected = (100 * 50 + 50) * 4 + (50 * 10 + 10) * 2  # fp32 and bf16 elements, by hand
    assert unpartitioned_bytes(model) == expected
    model[0].weight.ds_id = 0  # what zero.Init leaves on a partitioned parameter
    assert unpartitioned_bytes(model) == expected - 100 * 50 * 4


def test_stops_above_the_limit_with_the_fix_and_passes_below():
    model = torch.nn.Linear(1000, 1000)  # (1000 x 1000 weight + 1000 bias) x 4 B fp32 = 4,004,000 bytes
    with pytest.raises(
        ValueError, match=r"without ZeRO-3 partitioning: 3.8 MiB .*\(8 full copies, 30.5 MiB.*model_init"
    ):
        check_partitioned(model, limit_bytes=4_000_000, world_size=8)
    assert check_partitioned(model, limit_bytes=4_004_000, world_size=8) == 4_004_000
    assert check_partitioned(model, limit_bytes=None, world_size=8) == 4_004_000
