"""The pure parts of hf_dist_recipes.reproducibility.rank_agreement; the cross-rank behaviour is in
tests/distributed/test_seed_agreement.py (real 2-rank runs)."""

from __future__ import annotations

import logging

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler
from torch.utils.data import BatchSampler

from hf_dist_recipes.reproducibility.rank_agreement import (
    ZERO_INIT_BROADCAST,
    Mismatch,
    RankAgreementCallback,
    apply_policy,
    checksum,
    dropout_seed,
    find_mismatches,
    first_batches,
    validate_policy,
    validate_rank_check_steps,
    weights_checksum,
)
from hf_dist_recipes.runtime import RecipeRuntime


def test_dropout_seed_is_shared_unless_per_rank():
    assert {dropout_seed(42, r, False) for r in range(4)} == {42}
    per_rank = [dropout_seed(42, r, True) for r in range(4)]
    assert len(set(per_rank)) == 4 and 42 not in per_rank
    assert all(0 <= s < 2**32 for s in per_rank)


def test_find_mismatches_names_the_odd_rank_and_passes_agreement():
    assert find_mismatches([1, 1, 1, 1], [[0, 1, 2, 3]], "x", "fix") == []
    (m,) = find_mismatches(["a", "a", "b", "a"], [[0, 1, 2, 3]], "the weights", "seed first")
    assert m.ranks == (2,) and m.group == (0, 1, 2, 3)
    assert "rank(s) 2 disagree" in m.message(7) and "at step 7" in m.message(7) and "seed first" in m.message()
    # Groups are independent: TP group [2, 3] disagrees, [0, 1] agrees.
    (m,) = find_mismatches([5, 5, 1, 2], [[0, 1], [2, 3]], "the loss", "fix")
    assert m.group == (2, 3) and m.ranks == (3,)  # tie: the group's first rank is the reference


def test_policies():
    m = Mismatch("the seed", (1,), (0, 1), {0: 1, 1: 2}, "pass the same seed")
    with pytest.raises(RuntimeError, match=r"rank\(s\) 1 disagree.*pass the same seed"):
        apply_policy("error", [m])
    apply_policy("off", [m])
    apply_policy("error", [])


def test_warn_policy_logs(caplog):
    m = Mismatch("the seed", (1,), (0, 1), {0: 1, 1: 2}, "pass the same seed")
    with caplog.at_level(logging.WARNING, logger="hf_dist_recipes.reproducibility.rank_agreement"):
        apply_policy("warn", [m], step=3)
    assert "rank(s) 1 disagree" in caplog.text and "at step 3" in caplog.text


@pytest.mark.parametrize("bad", ["strict", None, 1])
def test_bad_policy_is_refused(bad):
    with pytest.raises(ValueError, match="seed_check"):
        validate_policy(bad)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_rank_check_steps_refused(bad):
    with pytest.raises(ValueError, match="rank_check_steps"):
        validate_rank_check_steps(bad)


def test_weights_checksum_tells_rng_states_apart():
    torch.manual_seed(1)
    a = weights_checksum(torch.nn.Linear(8, 8))
    torch.manual_seed(1)
    b = weights_checksum(torch.nn.Linear(8, 8))
    torch.manual_seed(2)
    c = weights_checksum(torch.nn.Linear(8, 8))
    assert a == b and a != c
    model = torch.nn.Linear(2, 2)
    by_hand = float(model.weight.detach().double().sum() + model.bias.detach().double().sum())
    assert weights_checksum(model)[0] == pytest.approx(by_hand, rel=1e-12)


def test_weights_partitioned_by_zero_init_are_not_checksummed():
    model = torch.nn.Linear(2, 2)
    for i, p in enumerate(model.parameters()):
        p.ds_id = i  # what zero.Init marks its parameters with; their values are rank 0's by construction
    assert weights_checksum(model) == ZERO_INIT_BROADCAST


class _Loader:
    def __init__(self, batch_sampler):
        self.batch_sampler = batch_sampler


def test_first_batches_reads_the_sampler_without_consuming_it():
    n, batch, seed = 50, 4, 123
    data = list(range(n))
    sampler = SeedableRandomSampler(data, data_seed=seed)
    shards = [
        BatchSamplerShard(BatchSampler(sampler, batch, drop_last=False), num_processes=2, process_index=r)
        for r in (0, 1)
    ]
    # Independently: RandomSampler draws torch.randperm(n) from a generator seeded with the sampler's seed.
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    g0, own0, s0 = first_batches(_Loader(shards[0]))
    g1, own1, s1 = first_batches(_Loader(shards[1]))
    assert s0 == s1 == seed
    assert g0 == g1 == checksum(perm[: 2 * batch])
    assert own0 == checksum(perm[:batch]) and own1 == checksum(perm[batch : 2 * batch])
    assert sampler.epoch == 0 and next(iter(shards[0])) == perm[:batch]  # nothing consumed
    other = BatchSamplerShard(
        BatchSampler(SeedableRandomSampler(data, data_seed=seed + 1), batch, drop_last=False),
        num_processes=2,
        process_index=0,
    )
    assert first_batches(_Loader(other))[0] != g0
    assert first_batches(object()) == (None, None, None)


class _State:
    def __init__(self, step):
        self.global_step = step


class _Args:
    world_size, process_index = 1, 0


def test_single_process_callback_reseeds_and_logs_its_keys():
    cb = RankAgreementCallback(seed=9, rank_check_steps=2, weights=(1.0, 2.0))
    cb.set_runtime(runtime := RecipeRuntime())
    torch.manual_seed(0)
    cb.on_train_begin(_Args(), _State(0), None)
    after = torch.rand(3)
    torch.manual_seed(9)
    assert torch.equal(after, torch.rand(3))  # the dropout stream is the seed's
    # The train-begin report goes to the per-rank TensorBoard, not log_history: only the first log of a train()
    # call would carry it, so a resumed run would log it where the uninterrupted one did not.
    record = runtime.logs.take()
    assert record.history == {}
    logs = record.rank
    assert runtime.logs.take().rank == {}  # logged once
    assert logs["rank_check/seed_ok"] == 1.0 and logs["rank_check/weights_ok"] == 1.0
    cb.on_micro_step(_Args(), _State(1), None, loss=torch.tensor(2.5), inputs={"input_ids": torch.tensor([[1, 2]])})
    cb.on_step_end(_Args(), _State(1), None)  # not a check step
    assert cb.last_agreed_step is None
    cb.on_step_end(_Args(), _State(2), None)
    assert cb.last_agreed_step == 2


def test_first_batches_reads_through_the_sequence_parallel_adapter():
    # Under Ulysses SP the Trainer hands DeepSpeed's adapter, which keeps the accelerate loader it shards as `dl`
    # (and has no batch sampler): the check reads that loader, instead of switching itself off.
    import inspect

    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    assert "self.dl = dl" in inspect.getsource(UlyssesSPDataLoaderAdapter.__init__), "upstream renamed its loader"
    data = list(range(20))
    shard = BatchSamplerShard(
        BatchSampler(SeedableRandomSampler(data, data_seed=5), 2, drop_last=False), num_processes=2, process_index=1
    )
    adapter = UlyssesSPDataLoaderAdapter.__new__(UlyssesSPDataLoaderAdapter)
    adapter.dl = _Loader(shard)
    assert first_batches(adapter) == first_batches(_Loader(shard)) != (None, None, None)
