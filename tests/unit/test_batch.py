import pytest

from hf_dist_recipes.parallel.batch import data_parallel_size, fix_tp_batch_size

TP2 = {"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 3}}


def test_without_tp_nothing_changes():
    cfg = {"train_batch_size": "auto", "zero_optimization": {"stage": 3}}
    fix = fix_tp_batch_size(cfg, world_size=4, micro_batch=8, grad_accum=2)
    assert fix.change is None and fix.config is cfg and fix.tp == 1
    assert fix.global_batch == 8 * 2 * 4


def test_auto_under_tp_is_removed_and_global_batch_counts_data_parallel_ranks_only():
    cfg = {**TP2, "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"}
    fix = fix_tp_batch_size(cfg, world_size=8, micro_batch=4, grad_accum=3)
    assert "train_batch_size" not in fix.config
    assert cfg["train_batch_size"] == "auto"  # the caller's dict is not modified
    assert fix.global_batch == 4 * 3 * 4 and fix.tp == 2  # DP = 8 / 2
    assert "7298" in fix.change


def test_explicit_data_parallel_value_is_accepted():
    cfg = {**TP2, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    fix = fix_tp_batch_size(cfg, world_size=4, micro_batch=4, grad_accum=1)
    assert "train_batch_size" not in fix.config and fix.global_batch == 8


def test_world_size_value_under_tp_is_refused_with_the_right_number():
    cfg = {**TP2, "train_batch_size": 16}
    with pytest.raises(ValueError, match=r"set it to 8") as err:
        fix_tp_batch_size(cfg, world_size=4, micro_batch=4, grad_accum=1)
    assert "Remove" in str(err.value)


def test_tp_must_divide_world():
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel degree 4"):
        data_parallel_size(6, 4)
