"""The buckets transport: every sync copies the weights into two reused buckets.

The file holds two buckets of at most ``bucket_mb / 2`` each, placed by `ReshardPlan` at the
front and the back, so that writers fill bucket k+1 while the engines load bucket k. It is
reused by every sync (allocating tmpfs pages costs more than copying into them). Writers
copy their pieces into it, casting to the wire dtype. Works for any parameters: on GPU,
views of Megatron's distributed-optimizer buffer, or in another dtype than the wire's.

Memory: the file is at most max(bucket_mb, largest tensor + bucket_mb / 2), within one
bucket budget plus the largest tensor (an engine module larger than half the budget,
typically the embedding, gets a bucket of its own).
"""
from __future__ import annotations

from mcore_rl.parallel.agreement import barrier, raise_if_any
from mcore_rl.reshard.sources import piece_source
from mcore_rl.reshard.transports.base import Transport, TransportSetup
from mcore_rl.reshard.transports.shm_file import agree_on_path, room_problem
from mcore_rl.reshard.writer import Copy
from mcore_rl.wire import create_bucket_file, map_bucket_file, piece_view, remove_bucket_file


class BucketsTransport(Transport):
    """Pieces copied into the two halves of one file in ``shm_dir`` (module doc)."""

    def __init__(self, plan, path, nbytes, buffer, rank: int, controller: int):
        super().__init__(plan, path, nbytes, buffer)
        self.rank, self.controller = rank, controller

    @classmethod
    def open(cls, setup: TransportSetup) -> "BucketsTransport":
        path = agree_on_path(setup.shm_dir, setup.controller, setup.group)
        plan, _ = setup.build_plan()
        nbytes = plan.file_nbytes
        raise_if_any(None if setup.is_remote else room_problem(
            setup.shm_dir, nbytes, "the bucket file",
            "lower reshard.bucket_mb or give the tmpfs more room"), setup.group)
        if setup.rank == setup.controller:
            create_bucket_file(path, nbytes)
        barrier(setup.group)
        buffer = None if setup.is_remote else map_bucket_file(path, nbytes)
        return cls(plan, path, nbytes, buffer, setup.rank, setup.controller)

    def on_engines_attached(self) -> None:
        if self.rank == self.controller:
            remove_bucket_file(self.path)

    def copies(self, k: int, views: dict) -> list[Copy]:
        dtype, out = self.plan.wire_dtype, []
        for key, p in self.plan.keyed_pieces(k, {self.rank}):
            src = piece_source(p, views)
            dst = piece_view(self.buffer, p.offset, p.nbytes(dtype), dtype, p.shape)
            out.append(Copy(key, dst.view(src.shape), src))
        return out
