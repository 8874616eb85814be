"""The comparison of the ranks' environment fingerprints (environment/fingerprint.py) on hand-made fingerprints."""

from __future__ import annotations

import importlib.metadata
import platform

import pytest
import torch

from hf_dist_recipes.environment.fingerprint import (
    check_ranks_agree,
    environment_fingerprint,
    fingerprint_differences,
)

BASE = {
    "host": "node0",
    "python": "3.11.7",
    "torch": "2.13.0+cu130",
    "torch_cuda": "13.0",
    "nccl_compiled": "2.29.7",
    "nccl_installed": "nvidia-nccl-cu13==2.29.7",
    "deepspeed": "0.19.8",
    "transformers": "5.24.0",
    "accelerate": "1.16.0",
    "datasets": "5.2.0",
    "hf-dist-recipes": "0.1.0",
    "driver": "580.65.06",
}


def _ranks(n: int, **odd) -> list[dict]:
    """n ranks, 8 per host, all with BASE; `odd` maps rank -> the fields that differ on it."""
    return [{**BASE, "host": f"node{r // 8}", **odd.get(f"r{r}", {})} for r in range(n)]


def test_all_equal_passes_though_hosts_differ():
    ranks = _ranks(16)
    assert fingerprint_differences(ranks) == {}
    assert check_ranks_agree(gathered=ranks) == ranks


def test_one_odd_rank_is_named_with_host_fields_and_both_values():
    ranks = _ranks(16, r11={"nccl_installed": "nvidia-nccl-cu13==2.28.9", "driver": "570.26"})
    assert fingerprint_differences(ranks) == {
        11: {
            "driver": ("570.26", "580.65.06"),
            "nccl_installed": ("nvidia-nccl-cu13==2.28.9", "nvidia-nccl-cu13==2.29.7"),
        }
    }
    with pytest.raises(RuntimeError) as err:
        check_ranks_agree(gathered=ranks)
    message = str(err.value)
    assert (
        "rank 11 on host node1: driver 570.26 (the other ranks: 580.65.06), nccl_installed "
        "nvidia-nccl-cu13==2.28.9 (the other ranks: nvidia-nccl-cu13==2.29.7)"
    ) in message
    assert message.count(" on host ") == 1  # no other rank named


def test_two_odd_ranks_and_a_missing_package():
    ranks = _ranks(4, r2={"torch": "2.13.0+cu126"}, r3={"deepspeed": None})
    assert fingerprint_differences(ranks) == {
        2: {"torch": ("2.13.0+cu126", "2.13.0+cu130")},
        3: {"deepspeed": (None, "0.19.8")},
    }


def test_tie_of_two_names_the_second_rank():
    ranks = _ranks(2, r1={"datasets": "9.9.9"})
    assert fingerprint_differences(ranks) == {1: {"datasets": ("9.9.9", "5.2.0")}}


def test_fingerprint_of_this_process_and_single_process_check():
    fp = environment_fingerprint()
    assert fp["python"] == platform.python_version() and fp["torch"] == torch.__version__
    assert fp["datasets"] == importlib.metadata.version("datasets")
    assert fp["deepspeed"] == importlib.metadata.version("deepspeed")
    assert check_ranks_agree() == [fp]  # no process group here: nothing to compare, nothing raised
