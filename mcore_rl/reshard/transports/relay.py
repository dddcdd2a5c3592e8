"""The relay: trainer ranks on other nodes than the engines send their pieces over the group.

The bucket file lives in the tmpfs of the controller's node (the engine's), so only ranks on
that node can map it. On a multi-node trainer, a rank elsewhere (a later pipeline stage, say)
copies its pieces of each bucket into a staging buffer of its own instead, casting to the
wire dtype and checksumming as it copies, exactly as local writers do into the file, and
sends them to the controller point to point. The controller receives them straight into the
bucket, in plan order, while the local writers fill in theirs. The checksums travel with
the other writers' and the engine checks them on arrival, so the network hop is verified end
to end. `RelayTransport` wraps the transport the other ranks use (buckets: the pieces lie at
their plan offsets in the file), and the remote ranks open that one too, without mapping its
file, so that every rank runs the same collectives.

With ``reshard.delta`` a remote rank sends only the words that changed since the last sync
(`mcore_rl.reshard.delta`): both ends keep the last-sent words of the relayed pieces, every
``reshard.full_every``-th sync and the one after a failed sync send every word, and the
engine still checks the checksums of the full values.

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

from mcore_rl.parallel.agreement import all_gather
from mcore_rl.reshard.delta import DeltaReceiver, DeltaSender, Traffic
from mcore_rl.reshard.sources import piece_source
from mcore_rl.reshard.transports.base import Transport, TransportSetup
from mcore_rl.reshard.transports.buckets import BucketsTransport
from mcore_rl.reshard.writer import Copy
from mcore_rl.wire import align, piece_view


def ranks_beside(controller: int, group=None) -> set[int]:
    """Global ranks on the controller's node (same host name). Collective."""
    hosts = dict(all_gather((dist.get_rank(), socket.gethostname()), group))
    return {rank for rank, host in hosts.items() if host == hosts[controller]}


class RelayTransport(Transport):
    """``inner`` on the controller's node; staged and sent from the ranks elsewhere (module doc)."""

    def __init__(self, inner: Transport, setup: TransportSetup):
        super().__init__(inner.plan, inner.path, inner.nbytes, inner.buffer)
        self.inner = inner
        self.moved_nbytes = inner.moved_nbytes
        self.rank, self.controller, self.remote = setup.rank, setup.controller, setup.remote
        self.sends = setup.is_remote
        # p2p over the trainer's group where it takes CPU tensors; a gloo twin otherwise
        # (creating it is collective: every rank builds the relay)
        group = setup.group
        self._own_group = dist.get_backend(group) != "gloo"
        self.group = group if not self._own_group else dist.new_group(
            ranks=None if group is None else dist.get_process_group_ranks(group), backend="gloo",
            use_local_synchronization=group is not None)
        self._staged = self._staging_views() if self.sends else {}
        """Remote rank: its pieces of each bucket as views of its staging buffer, in plan order."""
        self._received = ({k: self._bucket_views(k) for k in range(len(self.plan.buckets))}
                          if self.rank == self.controller else {})
        """Controller: where the remote ranks' pieces of each bucket land, in plan order."""
        self.delta, self.full_every = setup.delta, max(1, setup.full_every)
        self._sender, self._receiver = DeltaSender(), DeltaReceiver()
        self._syncs = 0  # syncs that ended well since the last full one
        self._traffic = Traffic()

    @classmethod
    def open(cls, setup: TransportSetup,
             inner: type[Transport] = BucketsTransport) -> "RelayTransport":
        """``inner`` opened on every rank (the remote ones do not map it), with a relay."""
        return cls(inner.open(setup), setup)

    def _staging_views(self) -> dict[int, list[tuple[tuple[int, int], torch.Tensor]]]:
        """One staging buffer, as large as this rank's share of the largest bucket."""
        dtype = self.plan.wire_dtype
        mine = {k: self.plan.keyed_pieces(k, {self.rank}) for k in range(len(self.plan.buckets))}
        largest = max(sum(align(p.nbytes(dtype)) for _, p in pieces) for pieces in mine.values())
        staging = torch.empty(max(largest, 1), dtype=torch.uint8)
        out = {}
        for k, pieces in mine.items():
            out[k], at = [], 0
            for key, p in pieces:
                n = p.nbytes(dtype)
                out[k].append((key, piece_view(staging, at, n, dtype, p.shape)))
                at += align(n)
        return out

    def _bucket_views(self, k: int) -> list[tuple[int, torch.Tensor]]:
        """(sending rank, view of the bucket) of the remote ranks' pieces of bucket k."""
        dtype = self.plan.wire_dtype
        return [(p.rank, piece_view(self.buffer, p.offset, p.nbytes(dtype), dtype, p.shape))
                for _, p in self.plan.keyed_pieces(k, self.remote)]

    def on_engines_attached(self) -> None:
        self.inner.on_engines_attached()

    def check_sources(self) -> None:
        self.inner.check_sources()

    def copies(self, k: int, views: dict) -> list[Copy]:
        if not self.sends:
            return self.inner.copies(k, views)
        pieces = dict(self.plan.keyed_pieces(k, {self.rank}))
        out = []
        for key, dst in self._staged[k]:
            src = piece_source(pieces[key], views)
            out.append(Copy(key, dst.view(src.shape), src))
        return out

    def deliver(self, k: int) -> None:
        self.inner.deliver(k)
        if self.sends:  # every piece, after copying it or failing to
            views = [view for _key, view in self._staged[k]]
            if self.delta and views:  # (the controller expects nothing from a rank without pieces)
                full = self._syncs % self.full_every == 0
                self._sender.send(k, views, self.controller, self.group, full)
            else:
                for view in views:
                    dist.send(view, dst=self.controller, group=self.group)
        elif self.delta:  # the controller: patched, then copied into the bucket
            by_sender: dict[int, list[torch.Tensor]] = {}
            for src, view in self._received.get(k, ()):
                by_sender.setdefault(src, []).append(view)
            problems = []
            for src, views in by_sender.items():  # every sender's message, read to its end
                try:
                    self._receiver.receive(k, src, views, self.group, self._traffic)
                except Exception as err:  # noqa: BLE001 - the first is raised below
                    problems.append(err)
            if problems:
                raise problems[0]
        else:  # the controller: straight into the bucket (nothing on the other local ranks)
            for src, view in self._received.get(k, ()):
                dist.recv(view, src=src, group=self.group)
                n = view.numel() * view.element_size()
                self._traffic.nbytes += n
                self._traffic.full_nbytes += n
                self._traffic.words += view.numel()

    def end_sync(self, ok: bool) -> Traffic:
        traffic, self._traffic = self._traffic, Traffic()
        if ok:
            self._syncs += 1
        else:  # the next sync sends every word
            self._syncs = 0
            self._sender.forget()
            self._receiver.forget()
        return traffic

    def close(self) -> None:
        self.inner.close()
        super().close()
        if self._own_group:
            dist.destroy_process_group(self.group)
        self._staged, self._received = {}, {}
