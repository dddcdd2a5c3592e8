"""`WeightSync`: after every optimizer step, stream the trainer's weights into the engine(s).

Collective over the trainer world: every rank constructs one `WeightSync` at start (the
`ReshardPlan` is built once from all ranks' holdings) and calls `sync` after each step. The
*controller* (global rank 0 by default) holds the engine replicas; the other ranks only
write. Weights reach the engines through one file in ``reshard.shm_dir`` (tmpfs), created
and mapped by every process once, when `WeightSync` is built, and unlinked at once, so it
lives as long as its mappings. Two transports (``reshard.transport``):

- **shared** (auto's choice for CPU parameters that own their memory, in the wire dtype):
  the file holds the trainer's parameters themselves, moved there when `WeightSync` is built
  (`mcore_rl.reshard.shared_weights`). A sync copies nothing on the trainer side: writers
  checksum their parameter regions and the engine reads the pieces where they lie;
- **buckets** (otherwise, e.g. GPU parameters, Megatron's distributed optimizer, or a wire
  dtype other than the parameters'): the file holds two buckets, reused by every sync
  (allocating tmpfs pages costs more than copying into them, ~0.7 s per GB here), and
  writers copy their pieces into them, casting to the wire dtype. Trainer ranks on other
  nodes than the controller cannot map the file: they copy their pieces into a staging
  buffer of their own and send them to the controller over the process group, which
  receives them straight into the bucket (`mcore_rl.reshard.relay`; auto then picks
  buckets).

One sync is one engine update session:

1. controller: ``engine.begin_update`` with the file;
2. per bucket k (the engine modules it completes): each writer copies its pieces into the
   bucket (buckets transport; the list of copies is built once per bucket and shared out
   among ``writer_threads`` threads, `default_writer_threads`) and checksums each piece
   right after copying it, while it is still in cache (`copy_and_checksum`), or checksums
   its parameter regions in place (shared), and sends the checksums to the controller
   (``gather_object``, a few hundred bytes). The controller waits until the engines have
   loaded bucket k-1, hands bucket k to a loader thread (every replica checks, then loads
   it) and broadcasts the verdict on k-1, which frees k-1's half of the file: writers fill
   bucket k+1 while the engines load bucket k;
3. controller: after the last load, ``engine.finish_update`` (pending layers processed,
   prefix cache reset, new weight version).

Any failure (a writer raising, a checksum mismatch, an engine error, parameters that moved
out of the shared file) ends the session on every engine (``abort_update``: the engine marks
itself as holding mixed weight versions and refuses to generate) and raises
`WeightSyncError` with the same message on every rank, so no rank hangs in a collective
and no engine is left half-updated silently.

Overlapping writes and loads (``reshard.overlap``, default on) hides the shorter of the two
where writer and engine have cores of their own; on 2 shared cores they also compete for
them. Measured (``mcore-rl bench reshard``, SmolLM2-135M fp32, 0.54 GB, into vLLM on CPU,
2 cores, trainer TP1 or PP2): a sync takes 0.25-0.29 s. The transfer takes 0.03-0.06 s
shared (checksums only; 0.09-0.11 s through buckets, copying with two writer threads); the
engine's loading 0.21-0.24 s, of which ~0.17 s is the CPU backend repacking linear
weights, which any load pays (`mcore_rl.engines.vllm_direct_load`). The naive path
(gather, write an HF checkpoint, let vLLM reload it) takes 0.6-1.2 s: its write alone runs
at 0.20-0.25 s or at ~0.44 s from one run to the next on this machine, and vLLM's reload
takes 0.35-0.41 s. Engine and trainer log-probs then agree to 5e-6.

Memory: shared, the file is the parameters (moved, not copied) and a sync allocates
nothing on the trainer side. Buckets: the file holds two buckets of at most
``bucket_mb / 2`` each (an engine module larger than that, typically the embedding, gets a
bucket of its own), so it is at most max(bucket_mb, largest tensor + bucket_mb / 2): within
one bucket budget plus the largest tensor. The engine adds what its loading costs: with
vLLM, the repacked copy of one module at a time (and, where pieces are not already the
engine's tensor, one fused parameter gathered from them).
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from mcore_rl.wire import (WeightSyncError, copy_and_checksum, create_bucket_file,
                           map_bucket_file, piece_view, remove_bucket_file)
from mcore_rl.wire import checksum as checksum_of
from mcore_rl.reshard.plan import Holding, Piece, ReshardPlan
from mcore_rl.reshard.relay import Relay, ranks_beside
from mcore_rl.reshard.shared_weights import (move_parameters, region_nbytes, sent_parameters,
                                             shared_transport_problem)

TRANSPORTS = ("auto", "shared", "buckets")
log = logging.getLogger(__name__)

# (bucket index, mapped bucket [nbytes] uint8, manifest) -> None; called by the controller
# after the writers' checksums are in and before the engines read the bucket (tests).
BucketHook = Callable[[int, torch.Tensor, dict], None]


@dataclass
class SyncStats:
    """Timings of one sync, measured on the controller (seconds)."""

    version: int
    buckets: int
    nbytes: int
    transfer_s: float = 0.0
    """Writers copying and checksumming their pieces, until the controller has all checksums
    (summed over buckets)."""
    apply_s: float = 0.0
    """Engines checking and loading buckets and finishing the session (summed over buckets;
    with ``overlap`` it overlaps the transfer of the next bucket)."""
    total_s: float = 0.0
    """Wall time of the whole sync."""
    per_bucket_apply_s: list[float] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.total_s / 1e9 if self.total_s else 0.0


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def default_writer_threads(group=None) -> int:
    """Threads each trainer rank copies with during a sync: its share of this machine's cores
    (the trainer computes nothing meanwhile) divided by its torch intra-op threads, which
    each writer's copies use in turn."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size(group)))
    return max(1, cores // max(1, local) // max(1, torch.get_num_threads()))


def local_holdings(chunks: list, rank: int) -> tuple[list[Holding], dict[tuple, torch.Tensor]]:
    """What this rank holds (per Megatron's sharded state dict) and views of those tensors."""
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    from mcore_rl.models.hf_weights import iter_sharded_tensors

    holdings, views = [], {}
    for chunk in chunks:
        for sh in iter_sharded_tensors(_unwrap(chunk)):
            n = sh.prepend_axis_num
            layer = int(sh.global_offset[0]) if n else None
            offsets = tuple(int(o) for o in sh.global_offset[n:])
            h = Holding(rank, sh.key, layer, offsets, tuple(int(s) for s in sh.local_shape),
                        is_main_replica(sh.replica_id))
            holdings.append(h)
            views[(h.key, h.layer, h.offsets)] = sh.data.reshape(h.shape)
    return holdings, views


def piece_source(piece: Piece, views: dict) -> torch.Tensor:
    """The part of a holding's tensor (``views``: `local_holdings`) that ``piece`` is made of."""
    h = piece.holding
    return piece.cut(views[(h.key, h.layer, h.offsets)])


def _pointers(params) -> tuple:
    """Where each parameter's data lies (it moved if this changed)."""
    return tuple(p.data_ptr() for p in params)


def _free_bytes(directory: str) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _room_problem(directory: str, nbytes: int, what: str, fix: str) -> str | None:
    """Why ``directory`` cannot take ``nbytes`` more (None: it can): a clear error now rather
    than a SIGBUS when a tmpfs page cannot be allocated later."""
    if not Path(directory).is_dir():
        return f"reshard.shm_dir {directory} is not a directory: point it at a tmpfs such as /dev/shm"
    free = _free_bytes(directory)
    if free is not None and free < nbytes:
        return (f"{what} needs {nbytes / 2**30:.2f} GiB in {directory}, which has "
                f"{free / 2**30:.2f} GiB free: {fix} (docker: --shm-size)")
    return None


class WeightSync:
    """The plan (built once, collectively) and the per-step `sync` (see module doc)."""

    def __init__(self, chunks: list, arch, *, engines: list | None = None, bucket_mb: float = 256.0,
                 wire_dtype: torch.dtype | None = None, shm_dir: str = "/dev/shm",
                 checksum: str = "sum64", overlap: bool = True, writer_threads: int | None = None,
                 transport: str = "auto", controller: int = 0, group=None,
                 local_ranks: set[int] | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown reshard transport {transport!r} (known: {', '.join(TRANSPORTS)})")
        self.chunks = chunks
        self.overlap = overlap
        self.threaded_above = 8 * 2**20
        """Buckets smaller than this (bytes of this rank) are written by one thread: handing
        them out costs more than it saves."""
        self.writer_threads = writer_threads or default_writer_threads(group)
        # With several writers, all of them are pool threads and this one waits, holding no
        # GIL: a writer running here would keep the others waiting for it between copies.
        self._writer_pool: ThreadPoolExecutor | None = None  # started by the first sync
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size(group)
        # where the group's backend takes tensors (NCCL: only the current GPU)
        self._flag_device = (torch.device("cuda", torch.cuda.current_device())
                             if dist.get_backend(group) == "nccl" else torch.device("cpu"))
        self.controller = controller
        self.group = group
        self.engines = list(engines or [])
        self.checksum = checksum
        self._raise_if_any("the controller rank needs at least one engine to sync into"
                           if self.rank == controller and not self.engines else None)
        # ranks that can map a file in the controller's tmpfs (None: those on its host); the
        # others relay their pieces over the process group (`mcore_rl.reshard.relay`)
        self._ranks = (dist.get_process_group_ranks(group) if group is not None
                       else list(range(self.world_size)))
        """Global ranks, in the group's order."""
        local = set(local_ranks) if local_ranks is not None else ranks_beside(controller, group)
        if controller not in local:
            raise ValueError(f"local_ranks {sorted(local)} must include the controller "
                             f"(rank {controller}), which holds the engines")
        self.remote = set(self._ranks) - local
        holdings, views = local_holdings(chunks, self.rank)
        dtype = wire_dtype or next(_unwrap(chunks[0]).parameters()).dtype
        params = [p for c in chunks for p in _unwrap(c).parameters()]
        self.transport = self._choose_transport(transport, params, holdings, views, dtype, shm_dir)
        name = [f"mcore_rl_reshard_{os.getpid()}_{uuid.uuid4().hex[:8]}"]
        dist.broadcast_object_list(name, src=controller, group=group)
        self.path = str(Path(shm_dir) / name[0])
        # Created, mapped by every trainer rank and engine process, then unlinked: the memory
        # lives exactly as long as someone maps it, so a crashed process leaves nothing behind.
        offsets: dict = {}
        self.moved_nbytes = 0
        """Shared transport: bytes of parameters moved into the file (all ranks)."""
        if self.transport == "shared":
            self._moved = sent_parameters(params, holdings, views)
            views = None  # no reference to the parameters' old memory: it is freed as they move
            holdings, offsets = self._share(self._moved)
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, (holdings, offsets), group=group)
        self.plan = ReshardPlan.build([h for hs, _ in everyone for h in hs], arch,
                                      int(bucket_mb * 2**20) // 2, dtype)  # two in flight
        if self.transport == "shared":
            self.plan.place_in_shared_file({h: at for _, o in everyone for h, at in o.items()},
                                           self.moved_nbytes)
            self._pointers_in_file = _pointers(self._moved)
        else:
            self._raise_if_any(None if self.rank in self.remote else _room_problem(
                shm_dir, self.plan.file_nbytes, "the bucket file",
                "lower reshard.bucket_mb or give the tmpfs more room"))
            if self.rank == controller:
                create_bucket_file(self.path, self.plan.file_nbytes)
            dist.barrier(group=group)
            self.buffer = (None if self.rank in self.remote
                           else map_bucket_file(self.path, self.plan.file_nbytes))
        self._relay = (Relay(self.plan, self.rank, controller, self.remote, group)
                       if self.remote else None)
        error = None
        if self.rank == controller:
            try:
                for engine in self.engines:
                    engine.attach_update_buffer(self.path, self.plan.file_nbytes)
            except Exception as err:  # noqa: BLE001 - raised on every rank below
                error = f"the engine could not map the bucket file {self.path}: {err}"
        dist.barrier(group=group)
        if self.rank == controller:
            remove_bucket_file(self.path)
        self._verdict(error)

    def _choose_transport(self, transport: str, params: list, holdings: list[Holding],
                          views: dict, dtype: torch.dtype, shm_dir: str) -> str:
        """"shared" or "buckets", the same on every rank (collective)."""
        if transport == "buckets":
            return "buckets"
        need = 0
        try:
            problem = shared_transport_problem(params, holdings, views, dtype)
            if self.rank in self.remote:
                problem = ("it is on another node than the engine, whose tmpfs it cannot map "
                           "(its pieces travel over the process group)")
            if not problem:
                need = region_nbytes(sent_parameters(params, holdings, views))
        except Exception as err:  # noqa: BLE001 - every rank decides the same below
            problem = f"{type(err).__name__}: {err}"
        answers: list = [None] * self.world_size
        dist.all_gather_object(answers, (problem, need, _free_bytes(shm_dir)), group=self.group)
        first = next((f"rank {self._ranks[r]}: {p}" for r, (p, _, _) in enumerate(answers) if p),
                     None)
        if first is None:  # the controller's tmpfs holds the file
            total = sum(n for _, n, _ in answers)
            free = answers[self._ranks.index(self.controller)][2]
            if free is not None and free < total:
                first = (f"{shm_dir} has {free / 2**30:.2f} GiB free, the parameters take "
                         f"{total / 2**30:.2f} GiB")
        if first is None:
            return "shared"
        if transport == "shared":
            raise ValueError(f"reshard.transport=shared is not possible here ({first}); use "
                             "reshard.transport=auto, which then streams through buckets")
        if self.rank == self.controller:
            log.info("weight sync through shared-memory buckets: the parameters stay where they "
                     "are (%s)", first)
        return "buckets"

    def _share(self, sent: list) -> tuple[list, dict]:
        """Shared transport: move the parameters this rank sends (``sent``) into its region
        of the file; its holdings again (now views of the file) and their byte offsets in it."""
        sizes: list = [None] * self.world_size
        dist.all_gather_object(sizes, region_nbytes(sent), group=self.group)
        my_rank = dist.get_rank(self.group)
        start, self.moved_nbytes = sum(sizes[:my_rank]), sum(sizes)
        if self.rank == self.controller:
            create_bucket_file(self.path, self.moved_nbytes, allocate=False)
        dist.barrier(group=self.group)
        holdings, offsets, problem = [], {}, None
        try:  # a failure here is raised on every rank, not only this one (no rank hangs)
            self.buffer = map_bucket_file(self.path, self.moved_nbytes)
            move_parameters(sent, self.buffer, start)
            holdings, views = local_holdings(self.chunks, self.rank)
            base = self.buffer.data_ptr()
            for h in holdings:
                if h.main:
                    at = views[(h.key, h.layer, h.offsets)].data_ptr() - base
                    if not start <= at < start + sizes[my_rank]:
                        raise RuntimeError(f"{h.key} did not move into the shared weight file")
                    offsets[h] = at
        except Exception as err:  # noqa: BLE001
            problem = f"rank {self.rank} moving its parameters into {self.path}: {err!r}"
        self._raise_if_any(problem)
        return holdings, offsets


    @classmethod
    def from_config(cls, chunks: list, arch, cfg, *, engines: list | None = None,
                    group=None) -> "WeightSync":
        """From a `ReshardConfig` (``cfg.reshard``)."""
        from mcore_rl.models.gpt import DTYPES

        return cls(chunks, arch, engines=engines, bucket_mb=cfg.bucket_mb,
                   wire_dtype=DTYPES.get(cfg.wire_dtype), shm_dir=cfg.shm_dir,
                   checksum=cfg.checksum, overlap=cfg.overlap,
                   writer_threads=cfg.writer_threads, transport=cfg.transport, group=group)

    def close(self) -> None:
        """Free the bucket file: every process unmaps it. Collective."""
        self.buffer, self._write_cache = None, None
        if self._writer_pool is not None:
            self._writer_pool.shutdown(wait=True)
            self._writer_pool = None
        if self.rank == self.controller:
            for engine in self.engines:
                engine.release_update_buffer()
        dist.barrier(group=self.group)
        if self._relay is not None:
            self._relay.close()
            self._relay = None

    def __enter__(self) -> "WeightSync":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def local_views(self) -> dict:
        """Views of this rank's parameters by holding; rebuilt only when a parameter's storage
        moved (e.g. the chunks were wrapped in DDP after this object was built)."""
        pointers = _pointers(p for c in self.chunks for p in _unwrap(c).parameters())
        if pointers != getattr(self, "_pointers", None):
            self._pointers, self._cached_views = pointers, local_holdings(self.chunks, self.rank)[1]
        return self._cached_views

    # ----- collective helpers -------------------------------------------------------
    def _raise_if_any(self, problem: str | None) -> None:
        """Raise ValueError on every rank if any rank has a ``problem`` (the first one)."""
        problems: list = [None] * self.world_size
        dist.all_gather_object(problems, problem, group=self.group)
        first = next((p for p in problems if p), None)
        if first is not None:
            raise ValueError(first)

    def _verdict(self, error: str | None) -> None:
        """The controller's ``error`` (None: carry on) raised on every rank: a one-byte
        broadcast, and the message itself only when there is one."""
        if self.world_size > 1:
            failed = torch.tensor([error is not None], dtype=torch.uint8, device=self._flag_device)
            dist.broadcast(failed, src=self.controller, group=self.group)
            if not failed.item():
                return
            box = [error]
            dist.broadcast_object_list(box, src=self.controller, group=self.group)
            error = box[0]
        if error is not None:
            raise WeightSyncError(error)

    def _gather_to_controller(self, item) -> list | None:
        """Every rank's ``item``, on the controller (None elsewhere)."""
        if self.world_size == 1:
            return [item]
        gathered = [None] * self.world_size if self.rank == self.controller else None
        dist.gather_object(item, gathered, dst=self.controller, group=self.group)
        return gathered

    def _abort(self, version: int, what: str) -> str:
        message = (f"weight sync to version {version} failed at {what}; the engine holds a mix "
                   f"of weight versions and refuses to generate until a sync succeeds")
        for engine in self.engines:
            try:
                engine.abort_update(message)
            except Exception as err:  # noqa: BLE001 - the first failure is the one to report
                message += f" (ending the session also failed: {err})"
        return message

    # ----- one sync -------------------------------------------------------------------
    @torch.no_grad()
    def sync(self, version: int, *, bucket_hook: BucketHook | None = None) -> SyncStats:
        """Stream the current weights into every engine as ``version`` (collective)."""
        plan, is_controller = self.plan, self.rank == self.controller
        stats = SyncStats(version, len(plan.buckets), plan.total_nbytes)
        start = time.perf_counter()
        error = None
        if is_controller:
            try:
                for engine in self.engines:
                    engine.begin_update(self.path, plan.file_nbytes, version)
            except Exception as err:  # noqa: BLE001
                error = self._abort(version, f"the start of the session ({err})")
        loader = ThreadPoolExecutor(1, thread_name_prefix="reshard-load") if is_controller else None
        try:
            self._verdict(error)
            buffer = self.buffer
            views = self.local_views()
            loading: Future | None = None
            for k in range(len(plan.buckets)):
                loading = self._one_bucket(k, buffer, views, version, stats, bucket_hook,
                                           loader, loading)
            error = None
            if is_controller:
                error = self._wait(loading, version, len(plan.buckets), stats)
                if error is None:
                    t0 = time.perf_counter()
                    try:
                        for engine in self.engines:
                            engine.finish_update(version)
                    except Exception as err:  # noqa: BLE001
                        error = self._abort(version, f"the end of the session ({err})")
                    stats.apply_s += time.perf_counter() - t0
            self._verdict(error)
        finally:
            if is_controller:
                loader.shutdown(wait=True)
        stats.total_s = time.perf_counter() - start
        return stats

    def _load(self, manifest: dict) -> float:
        """Loader thread (controller): every replica checks and loads one bucket."""
        start = time.perf_counter()
        for engine in self.engines:
            engine.load_bucket(manifest)
        return time.perf_counter() - start

    def _wait(self, loading: Future | None, version: int, bucket: int, stats: SyncStats) -> str | None:
        """Wait for the load of ``bucket`` (1-based) to end; the abort message if it failed."""
        if loading is None:
            return None
        try:
            elapsed = loading.result()
        except Exception as err:  # noqa: BLE001
            return self._abort(version, f"bucket {bucket}/{len(self.plan.buckets)} ({err})")
        stats.apply_s += elapsed
        stats.per_bucket_apply_s.append(elapsed)
        return None

    def _writes(self, k: int, buffer: torch.Tensor, views: dict) -> list[list]:
        """This rank's work on bucket k as (checksum key, destination view, source view):
        its pieces, copied into the bucket (key: tensor index, piece index), or with the
        shared transport its parameter regions, only checksummed (key: offset; no source).
        Split into one list per writer thread with about equal bytes (one list below
        ``threaded_above`` bytes); built once per bucket and kept while ``views`` stays the
        same."""
        cache = getattr(self, "_write_cache", None)
        if cache is None or cache[0] is not views or cache[1] is not buffer:
            cache = self._write_cache = (views, buffer, {})
        if k not in cache[2]:
            dtype, writes = self.plan.wire_dtype, []
            if self.plan.shared:
                writes = [(at, buffer[at:at + n], None)
                          for at, n, rank in self.plan.buckets[k].regions if rank == self.rank]
            else:  # into the bucket, or (off the controller's node) into staging, then sent
                relayed = self._relay is not None and self._relay.sends
                staging = dict(self._relay.staging_views(k)) if relayed else {}
                for ti, t in enumerate(self.plan.buckets[k].tensors):
                    for pi, p in enumerate(t.pieces):
                        if p.rank == self.rank:
                            dst = (staging[(ti, pi)] if relayed else
                                   piece_view(buffer, p.offset, p.nbytes(dtype), dtype, p.shape))
                            src = piece_source(p, views)
                            writes.append(((ti, pi), dst.view(src.shape), src))
            nbytes = sum(dst.numel() * dst.element_size() for _, dst, _ in writes)
            threads = self.writer_threads if nbytes >= self.threaded_above else 1
            shares: list[list] = [[] for _ in range(threads)]
            load = [0] * len(shares)
            for w in sorted(writes, key=lambda w: -w[1].nbytes):  # largest first, to the least loaded
                i = load.index(min(load))
                shares[i].append(w)
                load[i] += w[1].nbytes
            cache[2][k] = [share for share in shares if share]
        return cache[2][k]

    def _write(self, share: list) -> dict:
        """Copy (unless shared) and checksum one writer thread's share of a bucket."""
        # Plain tensor ops: no autograd, no torch-function handlers (e.g. a mode that redirects
        # Megatron's CUDA calls) between this loop and the copies it runs (both per thread).
        with torch.no_grad(), torch._C.DisableTorchFunction():
            return {key: checksum_of(dst, self.checksum) if src is None
                    else copy_and_checksum(dst, src, self.checksum) for key, dst, src in share}

    def _one_bucket(self, k: int, buffer: torch.Tensor, views: dict, version: int,
                    stats: SyncStats, hook: BucketHook | None, loader, loading: Future | None):
        """Write bucket k, hand it to the loader; returns the (controller's) pending load."""
        t0 = time.perf_counter()
        mine, failure = {}, None
        try:
            if k == 0 and self.plan.shared and _pointers(self._moved) != self._pointers_in_file:
                raise RuntimeError("the parameters moved out of the shared weight file after "
                                   "WeightSync was built; build it after anything that "
                                   "reallocates them (e.g. wrapping the model in DDP)")
            shares = self._writes(k, buffer, views)
            if len(shares) > 1 and self._writer_pool is None:
                self._writer_pool = ThreadPoolExecutor(self.writer_threads,
                                                       thread_name_prefix="reshard-write")
            if len(shares) < 2:
                for share in shares:
                    mine.update(self._write(share))
            else:
                jobs = [self._writer_pool.submit(self._write, share) for share in shares]
                wait(jobs)  # every job ended (no thread still writing) before any is read
                for job in jobs:
                    mine.update(job.result())
        except Exception as err:  # noqa: BLE001 - reported through the controller
            failure = f"rank {self.rank} writing bucket {k + 1}: {err!r}"
        if self._relay is not None:  # even after a failure: nobody waits for a missing piece
            try:
                if self._relay.sends:
                    self._relay.send(k)
                elif self.rank == self.controller:
                    self._relay.receive(k, buffer)
            except Exception as err:  # noqa: BLE001
                failure = failure or f"rank {self.rank} relaying bucket {k + 1}: {err!r}"
        gathered = self._gather_to_controller((mine, failure))
        error = None
        if self.rank == self.controller:
            stats.transfer_s += time.perf_counter() - t0
            error = self._wait(loading, version, k, stats)  # frees bucket k-1's half
            loading = None
            failures = [f for _, f in gathered if f]
            if error is None and failures:
                error = self._abort(version, f"bucket {k + 1}/{len(self.plan.buckets)} "
                                             f"({failures[0]})")
            if error is None:
                try:
                    sums = {key: value for m, _ in gathered for key, value in m.items()}
                    manifest = self.plan.manifest(k, sums, version, self.checksum)
                    if hook is not None:
                        hook(k, buffer, manifest)
                    loading = loader.submit(self._load, manifest)
                except Exception as err:  # noqa: BLE001 - raised on every rank below
                    error = self._abort(version, f"bucket {k + 1}/{len(self.plan.buckets)} "
                                                 f"({err!r})")
                else:
                    if not self.overlap:  # bucket k is loaded before anyone writes k+1
                        error = self._wait(loading, version, k + 1, stats)
                        loading = None
        self._verdict(error)
        return loading
