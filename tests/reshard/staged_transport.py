"""A transport defined by the tests alone, to show that one module and one registry entry
make a new transport: `WeightSync` and the factory know nothing of it.

Each rank copies its pieces of bucket k into a private staging buffer of its own (the
`PieceWriter` checksums them there), and `deliver` then puts them into a shared file with
plain torch copies. The file holds every bucket at once, one after the other (nothing is
reused), so the transport also lays the pieces out itself. The engine checks the checksums
computed in staging against the file: a wrong offset or a lost copy fails the sync.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from mcore_rl.parallel.agreement import barrier, raise_if_any
from mcore_rl.reshard.plan import ReshardPlan
from mcore_rl.reshard.sources import piece_source
from mcore_rl.reshard.transports import TRANSPORTS, Transport, TransportSetup
from mcore_rl.reshard.transports.shm_file import agree_on_path, room_problem
from mcore_rl.reshard.writer import Copy
from mcore_rl.wire import align, create_bucket_file, map_bucket_file, piece_view, remove_bucket_file

NAME = "staged-test"


def _place_one_after_another(plan: ReshardPlan) -> int:
    """Move every bucket to its own range of the file; the file's size."""
    at = 0
    for bucket in plan.buckets:
        shift = at - min(t.offset for t in bucket.tensors)
        for t in bucket.tensors:
            t.offset += shift
            t.pieces = [replace(p, offset=p.offset + shift) for p in t.pieces]
        at += align(bucket.nbytes)
    return at


class StagedTransport(Transport):
    """Private staging, then plain copies into a file holding every bucket (module doc)."""

    def __init__(self, plan, path, nbytes, buffer, setup: TransportSetup):
        super().__init__(plan, path, nbytes, buffer)
        self.rank, self.controller = setup.rank, setup.controller
        dtype = plan.wire_dtype
        self.pieces = {k: plan.keyed_pieces(k, {self.rank}) for k in range(len(plan.buckets))}
        self.staged = {k: [torch.empty(p.shape, dtype=dtype) for _, p in pieces]
                       for k, pieces in self.pieces.items()}

    @classmethod
    def open(cls, setup: TransportSetup) -> "StagedTransport":
        path = agree_on_path(setup.shm_dir, setup.controller, setup.group)
        plan, _ = setup.build_plan()
        nbytes = _place_one_after_another(plan)
        raise_if_any(room_problem(setup.shm_dir, nbytes, "the staged file", "use less"),
                     setup.group)
        if setup.rank == setup.controller:
            create_bucket_file(path, nbytes)
        barrier(setup.group)
        return cls(plan, path, nbytes, map_bucket_file(path, nbytes), setup)

    def on_engines_attached(self) -> None:
        if self.rank == self.controller:
            remove_bucket_file(self.path)

    def copies(self, k: int, views: dict) -> list[Copy]:
        out = []
        for (key, p), staged in zip(self.pieces[k], self.staged[k]):
            src = piece_source(p, views)  # may be strided (q/k/v rows): the copy lays it out
            out.append(Copy(key, staged.view(src.shape), src))
        return out

    def deliver(self, k: int) -> None:
        dtype = self.plan.wire_dtype
        for (_, p), staged in zip(self.pieces[k], self.staged[k]):
            piece_view(self.buffer, p.offset, p.nbytes(dtype), dtype, p.shape).copy_(staged)


TRANSPORTS.register(NAME)(StagedTransport)
