"""Agreement across a process group: every rank ends up with the same answer or the same error.

A collective operation that fails on one rank must fail on all of them: a rank that raises
alone leaves the others waiting in the next collective until the timeout. These helpers make
a local outcome (a problem found, a verdict reached) common to the whole group. Each takes
the process group explicitly (None: the default group) and runs no collective in a one-rank
world. Ranks (``src``, ``dst``) are global ranks, as in ``torch.distributed``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def world_size(group=None) -> int:
    """Ranks in ``group`` (1 without an initialised process group)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_ranks(group=None) -> list[int]:
    """Global ranks of ``group``, in the group's order."""
    if group is None:
        return list(range(world_size()))
    return dist.get_process_group_ranks(group)


def backend_device(group=None) -> torch.device:
    """Where the group's backend takes tensors: NCCL only the current GPU, gloo the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier(group=None) -> None:
    """Wait until every rank of ``group`` got here."""
    if world_size(group) > 1:
        dist.barrier(group=group)


def all_gather(item: Any, group=None) -> list:
    """Every rank's ``item``, in group order, on every rank."""
    if world_size(group) == 1:
        return [item]
    items: list = [None] * world_size(group)
    dist.all_gather_object(items, item, group=group)
    return items


def gather_to(item: Any, dst: int, group=None) -> list | None:
    """Every rank's ``item``, in group order, on rank ``dst`` (None elsewhere)."""
    if world_size(group) == 1:
        return [item]
    items = [None] * world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(item, items, dst=dst, group=group)
    return items


def broadcast(item: Any, src: int, group=None) -> Any:
    """Rank ``src``'s ``item`` on every rank."""
    if world_size(group) == 1:
        return item
    box = [item]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def raise_if_any(problem: str | None, group=None, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` with the first rank's ``problem`` (in group order) on every rank, if
    any rank has one; return on every rank otherwise."""
    first = next((p for p in all_gather(problem, group) if p), None)
    if first is not None:
        raise error(first)


def broadcast_verdict(verdict: str | None, src: int, group=None,
                      device: torch.device | None = None) -> str | None:
    """Rank ``src``'s ``verdict`` (None: all is well) on every rank. The common case costs a
    one-byte broadcast (a tensor on ``device``, `backend_device` by default); the message
    itself travels only when there is one."""
    if world_size(group) == 1:
        return verdict
    failed = torch.tensor([verdict is not None], dtype=torch.uint8,
                          device=device if device is not None else backend_device(group))
    dist.broadcast(failed, src=src, group=group)
    if not failed.item():
        return None
    return broadcast(verdict, src, group)
