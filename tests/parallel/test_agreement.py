"""Agreement helpers: one rank's problem or verdict becomes every rank's, and a one-rank world
runs no collective at all."""
import pytest

from tests.world import shared_world


@pytest.fixture(scope="module")
def world():
    return shared_world(2)


def _agree(rank, world_size):
    import torch.distributed as dist

    from mcore_rl.parallel.agreement import (all_gather, broadcast, broadcast_verdict, gather_to,
                                             raise_if_any)

    out = {"gathered": all_gather(rank * 10), "to_1": gather_to(rank, 1),
           "from_1": broadcast(f"chosen by {rank}", 1),
           "fine": broadcast_verdict(None if rank == 0 else "ignored: only the source speaks", 0),
           "verdict": broadcast_verdict("bucket 3 failed" if rank == 0 else None, 0)}
    try:
        raise_if_any(f"rank {rank} has no room" if rank == 1 else None)
    except ValueError as err:
        out["problem"] = str(err)
    dist.barrier()
    return out


def test_every_rank_gets_the_same_answer_and_the_same_problem(world):
    results = world.run(_agree)
    for rank, r in enumerate(results):
        assert r["gathered"] == [0, 10]
        assert r["to_1"] == ([0, 1] if rank == 1 else None)
        assert r["from_1"] == "chosen by 1"
        assert r["fine"] is None
        assert r["verdict"] == "bucket 3 failed"
        assert r["problem"] == "rank 1 has no room"


def test_a_one_rank_world_needs_no_process_group():
    from mcore_rl.parallel.agreement import (all_gather, barrier, broadcast, broadcast_verdict,
                                             gather_to, raise_if_any)

    barrier()
    assert all_gather("x") == ["x"] and gather_to("x", 0) == ["x"] and broadcast("x", 0) == "x"
    assert broadcast_verdict("failed", 0) == "failed"
    raise_if_any(None)
    with pytest.raises(ValueError, match="no room"):
        raise_if_any("no room")
