"""Trainer ranks on other nodes than the engine: their pieces travel over the process group.

The bucket file lives in the tmpfs of the controller's node (the engine's), so only ranks on
that node can map it. On a multi-node trainer, a rank elsewhere (a later pipeline stage, say)
copies its pieces of each bucket into a staging buffer of its own instead, casting to the
wire dtype and checksumming as it copies, exactly as local writers do into the file, and
sends them to the controller point to point. The controller receives them straight into the
bucket, in plan order, while the local writers fill in theirs. The checksums travel with
the other writers' and the engine checks them on arrival, so the network hop is verified end
to end.

The transfer runs over a gloo group (CPU tensors, whatever the trainer's backend): the
bucket is host memory at both ends. A rank that fails while copying still sends every piece
of the bucket, so the controller never waits for one that will not come; the failure
reaches every rank through the sync's verdict. Memory on a remote rank: one staging buffer,
as large as its share of the largest bucket.
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from mcore_rl.wire import align, piece_view
from mcore_rl.reshard.plan import Piece, ReshardPlan


def ranks_beside(controller: int, group=None) -> set[int]:
    """Global ranks on the controller's node (same host name). Collective."""
    hosts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, (dist.get_rank(), socket.gethostname()), group=group)
    here = dict(hosts)[controller]
    return {rank for rank, host in hosts if host == here}


class Relay:
    """Pieces of ranks off the controller's node, sent to it bucket by bucket (module doc)."""

    def __init__(self, plan: ReshardPlan, rank: int, controller: int, remote: set[int], group=None):
        self.plan, self.rank, self.controller = plan, rank, controller
        self.remote = frozenset(remote)
        # p2p over the trainer's group where it takes CPU tensors; a gloo twin otherwise
        # (creating it is collective: every rank builds the Relay)
        self._own_group = dist.get_backend(group) != "gloo"
        self.group = group if not self._own_group else dist.new_group(
            ranks=None if group is None else dist.get_process_group_ranks(group), backend="gloo",
            use_local_synchronization=group is not None)
        self._staging: torch.Tensor | None = None
        self._layout: dict[int, list[tuple[int, int, int, int]]] = {}

    def close(self) -> None:
        if self._own_group:
            dist.destroy_process_group(self.group)
        self._staging = None

    @property
    def sends(self) -> bool:
        return self.rank in self.remote

    def pieces(self, k: int, ranks) -> list[tuple[int, int, Piece]]:
        """(tensor index, piece index, piece) of bucket k written by ``ranks``, in plan order."""
        return [(ti, pi, p) for ti, t in enumerate(self.plan.buckets[k].tensors)
                for pi, p in enumerate(t.pieces) if p.rank in ranks]

    def staging_views(self, k: int) -> list[tuple[tuple[int, int], torch.Tensor]]:
        """This (remote) rank's pieces of bucket k as views of its staging buffer, in plan order."""
        if self._staging is None:
            largest = max(sum(align(p.nbytes(self.plan.wire_dtype)) for *_, p in self.pieces(b, {self.rank}))
                          for b in range(len(self.plan.buckets)))
            self._staging = torch.empty(max(largest, 1), dtype=torch.uint8)
        out, at = [], 0
        for ti, pi, p in self.pieces(k, {self.rank}):
            n = p.nbytes(self.plan.wire_dtype)
            out.append(((ti, pi), piece_view(self._staging, at, n, self.plan.wire_dtype, p.shape)))
            at += align(n)
        return out

    def send(self, k: int) -> None:
        """Remote rank: every piece of bucket k to the controller (after copying, or failing to)."""
        for _key, view in self.staging_views(k):
            dist.send(view, dst=self.controller, group=self.group)

    def receive(self, k: int, buffer: torch.Tensor) -> None:
        """Controller: the remote ranks' pieces of bucket k, straight into the bucket."""
        for _ti, _pi, p in self.pieces(k, self.remote):
            view = piece_view(buffer, p.offset, p.nbytes(self.plan.wire_dtype), self.plan.wire_dtype, p.shape)
            dist.recv(view, src=p.rank, group=self.group)
