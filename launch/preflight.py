"""Before training: every rank joins one collective, so a broken node fails fast and by name.

`run_preflight` checks that the whole world answers (a barrier with a timeout, then one
all-reduce on the training backend) and gathers where every rank runs. A failure raises
`PreflightError` naming the node and rank that saw it; on gloo the barrier also names the
ranks that never arrived.
"""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta


class PreflightError(RuntimeError):
    """A rank could not complete the start-up collective; the message names node and rank."""


def node_name() -> str:
    """The SLURM node name when running under SLURM, else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def run_preflight(device=None, timeout_s: float = 300.0) -> list[tuple[str, int]]:
    """Collective over the default process group; returns ``(node, rank)`` for every rank.

    ``device``: where the all-reduce tensor lives (a CUDA device for NCCL).
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    local = os.environ.get("LOCAL_RANK", "0")
    where = f"node {node_name()} rank {rank} (of {world}, local rank {local})"
    t0 = time.monotonic()
    try:
        if dist.get_backend() == "gloo":
            # Names the ranks that did not arrive (reported on rank 0).
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        ones = torch.ones(1, device=device)
        work = dist.all_reduce(ones, async_op=True)
        if not work.wait(timeout=timedelta(seconds=timeout_s)):
            raise TimeoutError(f"all-reduce did not finish within {timeout_s:.0f}s")
        if int(ones.item()) != world:
            raise RuntimeError(f"all-reduce of ones gave {ones.item():g}, expected {world}")
        peers: list = [None] * world
        dist.all_gather_object(peers, (node_name(), rank))
    except Exception as err:  # noqa: BLE001 - any failure here is reported with its place
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PreflightError(f"preflight failed on {where} after {time.monotonic() - t0:.1f}s: "
                             f"{first}") from err
    return [tuple(p) for p in peers]


def describe(peers: list[tuple[str, int]]) -> str:
    """'2 ranks on 2 nodes (n1: 0; n2: 1)'."""
    by_node: dict[str, list[int]] = {}
    for node, rank in peers:
        by_node.setdefault(node, []).append(rank)
    nodes = "; ".join(f"{n}: {','.join(map(str, sorted(r)))}" for n, r in by_node.items())
    return f"{len(peers)} ranks on {len(by_node)} node(s) ({nodes})"
