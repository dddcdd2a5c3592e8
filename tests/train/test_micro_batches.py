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


def _pairs(n_pairs: int) -> list[list[int]]:
    """Rows 2k and 2k+1 form pair k."""
    return [[2 * k, 2 * k + 1] for k in range(n_pairs)]


def test_units_of_groups_rows_by_id_and_defaults_to_single_rows():
    from mcore_rl.train.micro_batches import units_of

    assert units_of(torch.tensor([3, 1, 3, 1, 7]), 5) == [[0, 2], [1, 3], [4]]
    assert units_of(None, 3) == [[0], [1], [2]]


def test_dp_split_and_packing_never_separate_the_rows_of_a_unit():
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(2, 30, (24,), generator=g)
    units = _pairs(12)
    for dp in (1, 2, 3):  # 12, 6 and 4 pairs per rank: room for any even micro-batch count
        shards = split_for_data_parallel(lens, dp, units)
        assert sorted(i for s in shards for i in s) == list(range(24))
        for shard in shards:
            for budget, multiple in ((40, 1), (64, 2), (1000, 2)):
                groups = pack_micro_batches(lens, shard, budget, multiple_of=multiple, units=units)
                assert sorted(i for gr in groups for i in gr) == shard
                assert len(groups) % multiple == 0
                for gr in groups:
                    assert all((2 * (i // 2) in gr) and (2 * (i // 2) + 1 in gr) for i in gr)


def test_a_pair_fills_a_budget_with_both_of_its_rows():
    lens = torch.tensor([10, 10, 10, 10])
    groups = pack_micro_batches(lens, [0, 1, 2, 3], token_budget=20, units=_pairs(2))
    assert groups == [[0, 1], [2, 3]]  # two rows of 10 each; a third row would exceed 20


def test_too_few_pairs_for_the_ranks_or_the_pipeline_is_an_error_naming_pairs():
    with pytest.raises(ValueError, match="packing units"):
        split_for_data_parallel(torch.tensor([3, 3]), 2, _pairs(1))
    with pytest.raises(ValueError, match="2 packing units .pairs. cannot fill 4 micro-batches"):
        pack_micro_batches(torch.tensor([3] * 4), [0, 1, 2, 3], 1000, multiple_of=4, units=_pairs(2))
