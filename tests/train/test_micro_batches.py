"""Splitting over DP ranks and packing micro-batches by token budget."""
import pytest
import torch

from mcore_rl.train.micro_batches import pack_micro_batches, split_for_data_parallel


def test_dp_split_covers_every_sequence_once_and_balances_tokens():
    lens = torch.tensor([50, 10, 40, 10, 30, 20, 20, 20])
    shards = split_for_data_parallel(lens, 2)
    assert sorted(i for s in shards for i in s) == list(range(8))
    loads = [int(lens[s].sum()) for s in shards]
    assert abs(loads[0] - loads[1]) <= 10, loads
    assert all(s == sorted(s) for s in shards)


def test_dp_split_with_fewer_sequences_than_ranks_is_an_error():
    with pytest.raises(ValueError, match="at least one sequence per rank"):
        split_for_data_parallel(torch.tensor([3]), 2)


def test_packing_respects_the_padded_token_budget():
    lens = torch.tensor([5, 17, 9, 12, 3, 20, 8, 14])
    groups = pack_micro_batches(lens, list(range(8)), token_budget=40)
    assert sorted(i for g in groups for i in g) == list(range(8))
    for g in groups:
        assert len(g) == 1 or max(int(lens[i]) for i in g) * len(g) <= 40


def test_a_sequence_longer_than_the_budget_gets_its_own_micro_batch():
    groups = pack_micro_batches(torch.tensor([100, 3, 3]), [0, 1, 2], token_budget=10)
    assert [0] in groups


def test_micro_batch_count_is_raised_to_a_multiple_of_the_pipeline_size():
    lens = torch.tensor([4] * 6)
    groups = pack_micro_batches(lens, list(range(6)), token_budget=1000, multiple_of=4)
    assert len(groups) == 4 and all(groups)
    with pytest.raises(ValueError, match="cannot fill 8 micro-batches"):
        pack_micro_batches(lens, list(range(6)), token_budget=1000, multiple_of=8)
