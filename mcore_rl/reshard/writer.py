"""`PieceWriter`: one trainer rank's copies of a bucket, shared out among writer threads.

A transport says what this rank writes for bucket k (`Copy`: where to, from where); the
writer runs those copies and returns their checksums. The list of copies of each bucket is
built once and kept while the rank's views of its parameters stay the same, split into one
share per thread with about equal bytes. Each piece is checksummed right after its copy,
while it is still in cache (`mcore_rl.wire.copy_and_checksum`).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, NamedTuple

import torch

from mcore_rl.parallel.agreement import world_size
from mcore_rl.wire import checksum, copy_and_checksum


class Copy(NamedTuple):
    """One write of a bucket: ``dst`` is a contiguous view of the transport's memory."""

    key: object
    """What the manifest knows its checksum by (`ReshardPlan.manifest`)."""
    dst: torch.Tensor
    src: torch.Tensor | None
    """Copied into ``dst``, cast to its dtype; None: ``dst`` already holds the data and is
    only checksummed."""


def default_writer_threads(group=None) -> int:
    """Threads each trainer rank copies with during a sync: its share of this machine's cores
    (the trainer computes nothing meanwhile) divided by its torch intra-op threads, which
    each writer's copies use in turn."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size(group)))
    return max(1, cores // max(1, local) // max(1, torch.get_num_threads()))


class PieceWriter:
    """Copies and checksums this rank's share of each bucket (module doc)."""

    def __init__(self, threads: int, algorithm: str = "sum64"):
        self.threads = threads
        self.algorithm = algorithm
        self.threaded_above = 8 * 2**20
        """Buckets smaller than this (bytes of this rank) are written by one thread: handing
        them out costs more than it saves."""
        # With several writers, all of them are pool threads and the caller waits, holding no
        # GIL: a writer running in the caller would keep the others waiting for it between
        # copies. The pool starts its threads on first use.
        self._pool = (ThreadPoolExecutor(threads, thread_name_prefix="reshard-write")
                      if threads > 1 else None)
        self._shares: dict[int, list[list[Copy]]] = {}
        self._shares_views: dict | None = None
        """The views the cached shares were built from."""

    def write(self, k: int, views: dict, copies: Callable[[int, dict], list[Copy]]) -> dict:
        """Run this rank's copies of bucket k (``copies(k, views)``, built once per bucket
        and ``views``); their checksums by key."""
        if views is not self._shares_views:
            self._shares, self._shares_views = {}, views
        shares = self._shares.get(k)
        if shares is None:
            shares = self._shares[k] = self._split(copies(k, views))
        if len(shares) < 2:
            return self.run(shares[0]) if shares else {}
        jobs = [self._pool.submit(self.run, share) for share in shares]
        wait(jobs)  # every job ended (no thread still writing) before any is read
        out: dict = {}
        for job in jobs:
            out.update(job.result())
        return out

    def run(self, share: list[Copy]) -> dict:
        """Copy (where there is a source) and checksum one thread's share of a bucket."""
        # Plain tensor ops: no autograd, no torch-function handlers (e.g. a mode that redirects
        # Megatron's CUDA calls) between this loop and the copies it runs (both per thread).
        algorithm = self.algorithm
        with torch.no_grad(), torch._C.DisableTorchFunction():
            return {key: checksum(dst, algorithm) if src is None
                    else copy_and_checksum(dst, src, algorithm) for key, dst, src in share}

    def _split(self, copies: list[Copy]) -> list[list[Copy]]:
        """One list per writer thread with about equal bytes (one list below
        ``threaded_above`` bytes)."""
        nbytes = sum(c.dst.nbytes for c in copies)
        threads = self.threads if nbytes >= self.threaded_above and self._pool is not None else 1
        shares: list[list[Copy]] = [[] for _ in range(threads)]
        load = [0] * threads
        for c in sorted(copies, key=lambda c: -c.dst.nbytes):  # largest first, to the least loaded
            i = load.index(min(load))
            shares[i].append(c)
            load[i] += c.dst.nbytes
        return [share for share in shares if share]

    def close(self) -> None:
        """Stop the writer threads and forget the cached copies."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._shares, self._shares_views = {}, None
