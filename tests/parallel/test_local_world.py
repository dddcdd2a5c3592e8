"""The shared local world: a failing or hung rank fails the test quickly instead of hanging."""
import time

import pytest

from tests.world import RankFailure, SharedWorld


def _sum_of_ranks(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _rank1_raises_while_rank0_waits_in_a_collective(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 is gone


def test_failing_rank_reports_its_traceback_and_the_world_restarts():
    with SharedWorld(2) as world:
        assert world.run(_sum_of_ranks) == [1.0, 1.0]
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="boom on rank 1"):
            world.run(_rank1_raises_while_rank0_waits_in_a_collective, timeout_s=120)
        assert time.monotonic() - t0 < 60, "a hung peer must not cost the full timeout"
        assert world.run(_sum_of_ranks) == [1.0, 1.0]  # a fresh world for the next test
