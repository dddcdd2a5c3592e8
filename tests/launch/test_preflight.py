"""Preflight: every rank joins one collective; a rank that cannot is named with its node."""
import socket

from mcore_rl.launch.preflight import PreflightError, describe, run_preflight
from tests.world import SharedWorld


def _preflight(rank, world_size, absent_rank):
    if rank == absent_rank:
        return "absent"
    try:
        return run_preflight(timeout_s=3)
    except PreflightError as err:
        return f"PreflightError: {err}"


def test_preflight_gathers_every_rank_and_names_a_missing_one():
    with SharedWorld(2) as world:
        ok = world.run(_preflight, None)
        host = socket.gethostname()
        assert ok == [[(host, 0), (host, 1)]] * 2
        assert describe(ok[0]) == f"2 ranks on 1 node(s) ({host}: 0,1)"
        # A rank that never joins: the others fail within the timeout, naming where they run
        # and which rank did not arrive.
        failed = world.run(_preflight, 1, timeout_s=60)
    assert failed[1] == "absent"
    assert failed[0].startswith(f"PreflightError: preflight failed on node {host} rank 0 (of 2")
    assert "Ranks 1 failed to pass monitoredBarrier" in failed[0]
