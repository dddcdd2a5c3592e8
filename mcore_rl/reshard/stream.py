"""`WeightSync`: after every optimizer step, stream the trainer's weights into the engines.

Collective over the trainer world: every rank builds one `WeightSync` at start
(`WeightSync.build`: the `ReshardPlan` from all ranks' holdings, the transport, the engines
attached) and calls `sync` after each step. The *controller* (global rank 0 by default)
holds the engines; the other ranks only write. How the bytes reach the engines is the
transport's business (`mcore_rl.reshard.transports`); this module runs the session:

1. per bucket k (the engine modules it completes): each rank runs its copies of bucket k
   (`PieceWriter`, checksumming as it copies) and the transport delivers them; the
   checksums go to the controller (a few hundred bytes). The controller waits until the
   engines have loaded bucket k-1, hands bucket k to a loader thread (every engine checks,
   then loads it) and broadcasts the verdict on k-1, which frees k-1's half of the file:
   writers fill bucket k+1 while the engines load bucket k (``overlap``);
2. each engine gets one call per bucket (`RolloutEngine.apply_update`): the first also
   starts the session on the transport's file, the last also ends it; where the transport
   keeps every bucket in its file (the shared transport), one call loads them all, so a
   sync is one round trip into an engine of another process.

Any failure (a writer raising, a checksum mismatch, an engine error, parameters that moved
out of the transport's memory) ends the session on every engine (``abort_update``: the
engine marks itself as holding mixed weight versions and refuses to generate) and raises
`WeightSyncError` with the same message on every rank, so no rank hangs in a collective
and no engine is left half-updated silently. Measured figures: ``mcore-rl bench reshard``
(`mcore_rl.benchmarks.reshard`).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
import torch.distributed as dist

from mcore_rl.parallel.agreement import (backend_device, barrier, broadcast_verdict, gather_to,
                                         group_ranks, raise_if_any)
from mcore_rl.reshard.plan import ReshardPlan
from mcore_rl.reshard.sources import local_holdings, parameters, pointers
from mcore_rl.reshard.sync_stats import SyncStats
from mcore_rl.reshard.transports import Transport, TransportSetup, open_transport, ranks_beside
from mcore_rl.reshard.writer import PieceWriter, default_writer_threads
from mcore_rl.wire import WeightSyncError

# (bucket index, mapped bucket [nbytes] uint8, manifest) -> None; called by the controller
# after the writers' checksums are in and before the engines read the bucket (tests).
BucketHook = Callable[[int, torch.Tensor, dict], None]

__all__ = ["BucketHook", "SyncStats", "WeightSync", "local_holdings"]


class WeightSync:
    """One engine update session per `sync`, over a `Transport` (module doc)."""

    def __init__(self, chunks: list, channel: Transport, transport: str, *, engines: list,
                 writer: PieceWriter, controller: int = 0, group=None, overlap: bool = True):
        self.chunks = chunks
        self.channel = channel
        """How the bytes reach the engines."""
        self.transport = transport
        """The channel's name (``reshard.transport``)."""
        self.plan: ReshardPlan = channel.plan
        self.path = channel.path
        self.engines = list(engines)
        """Every engine the controller updates (empty on the other ranks)."""
        self.drop_dead_engines = False
        """An engine found dead during a call is dropped from ``engines`` and the others go
        on (replicas that stand in for each other); the last one is never dropped."""
        self.dropped: list[str] = []
        """Why each dropped engine was dropped."""
        self.writer = writer
        self.controller, self.group = controller, group
        self.rank = dist.get_rank()
        self.overlap = overlap
        """Write bucket k+1 while the engines load bucket k (False: one bucket at a time)."""
        self._flag_device = backend_device(group)
        self._views: dict = {}
        self._views_pointers: tuple | None = None
        """Where the parameters lay when ``_views`` was built."""

    @classmethod
    def build(cls, chunks: list, arch, *, engines: list | None = None, bucket_mb: float = 256.0,
              wire_dtype: torch.dtype | None = None, shm_dir: str = "/dev/shm",
              checksum: str = "sum64", overlap: bool = True, writer_threads: int | None = None,
              transport: str = "auto", controller: int = 0, group=None,
              local_ranks: set[int] | None = None, delta: bool = False,
              full_every: int = 10) -> "WeightSync":
        """Collective over the trainer ranks: plan, transport (`open_transport`), engines
        attached to it. ``engines``: the controller's (None elsewhere); ``bucket_mb``: the
        budget of two buckets in flight; ``wire_dtype``: default the parameters';
        ``local_ranks``: global ranks that can map the controller's memory (default: those
        on its host; the others relay); ``delta``, ``full_every``: the others relay only the
        words that changed, every ``full_every``-th sync in full (`mcore_rl.reshard.delta`)."""
        rank = dist.get_rank()
        engines = list(engines or [])
        raise_if_any("the controller rank needs at least one engine to sync into"
                     if rank == controller and not engines else None, group)
        local = set(local_ranks) if local_ranks is not None else ranks_beside(controller, group)
        if controller not in local:
            raise ValueError(f"local_ranks {sorted(local)} must include the controller "
                             f"(rank {controller}), which holds the engines")
        setup = TransportSetup(
            chunks=chunks, arch=arch, wire_dtype=wire_dtype or parameters(chunks)[0].dtype,
            bucket_bytes=int(bucket_mb * 2**20) // 2, shm_dir=shm_dir, rank=rank,
            controller=controller, group=group, remote=frozenset(group_ranks(group)) - local,
            holdings=local_holdings(chunks, rank)[0], delta=delta, full_every=full_every)
        name, channel = open_transport(transport, setup)
        _attach(engines, channel, setup)
        writer = PieceWriter(writer_threads or default_writer_threads(group), checksum)
        return cls(chunks, channel, name, engines=engines, writer=writer, controller=controller,
                   group=group, overlap=overlap)

    @classmethod
    def from_config(cls, chunks: list, arch, cfg, *, engines: list | None = None,
                    controller: int = 0, group=None, engine: str = "vllm",
                    sglang_group=None) -> "WeightSync":
        """From a `ReshardConfig` (``cfg.reshard``); ``controller``: the global rank that
        holds the engines, ``group``: the trainer's ranks, ``engine``: their kind
        (``rollout.engine``); ``sglang_group``: SGLang's helper that makes the trainer's
        side of an engine's NCCL group (`mcore_rl.engines.sglang_shim.weight_update_group`),
        for ``transport: nccl`` into SGLang."""
        from mcore_rl.models.gpt import DTYPES
        from mcore_rl.reshard.native import NativeWeightSync, is_native

        if engine == "sglang" and cfg.transport == "nccl":  # SGLang's own update API
            from mcore_rl.reshard.sglang_broadcast import SGLangBroadcastSync

            return SGLangBroadcastSync.from_config(chunks, arch, cfg, make_group=sglang_group,
                                                   engines=engines, controller=controller,
                                                   group=group)
        if is_native(cfg.transport):  # vLLM's own GPU backends move the bytes
            return NativeWeightSync.from_config(chunks, arch, cfg, engines=engines,
                                                controller=controller, group=group)
        return cls.build(chunks, arch, engines=engines, bucket_mb=cfg.bucket_mb,
                         wire_dtype=DTYPES.get(cfg.wire_dtype), shm_dir=cfg.shm_dir,
                         checksum=cfg.checksum, overlap=cfg.overlap,
                         writer_threads=cfg.writer_threads, transport=cfg.transport,
                         controller=controller, group=group, delta=cfg.delta,
                         full_every=cfg.full_every)

    def close(self) -> None:
        """Free the transport's memory: every process lets go of it. Collective."""
        self.writer.close()
        if self.rank == self.controller:
            self.call_engines(lambda engine: engine.release_update_buffer())
        barrier(self.group)
        self.channel.close()

    def __enter__(self) -> "WeightSync":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def local_views(self) -> dict:
        """Views of this rank's parameters by holding; rebuilt only when a parameter's storage
        moved (e.g. the chunks were wrapped in DDP after this object was built)."""
        now = pointers(parameters(self.chunks))
        if now != self._views_pointers:
            self._views_pointers, self._views = now, local_holdings(self.chunks, self.rank)[1]
        return self._views

    def call_engines(self, call) -> None:
        """``call(engine)`` for every engine, in order (`drop_dead_engines`: one found dead
        is dropped, unless it is the last)."""
        for engine in list(self.engines):
            try:
                call(engine)
            except Exception as err:  # noqa: BLE001 - re-raised unless the engine is dead
                if not (self.drop_dead_engines and engine_is_dead(err) and len(self.engines) > 1):
                    raise
                self.engines.remove(engine)
                self.dropped.append(str(err).splitlines()[0] if str(err) else type(err).__name__)

    # ----- one sync -------------------------------------------------------------------
    @torch.no_grad()
    def sync(self, version: int, *, bucket_hook: BucketHook | None = None,
             wake: bool = False) -> SyncStats:
        """Stream the current weights into every engine as ``version`` (collective);
        ``wake``: the engines' weights are woken first and their KV caches last (colocated).
        Each engine gets one call per bucket, the session's start and end folded into the
        first and last; a transport that keeps every bucket (`Transport.holds_all`) one call
        for the whole sync."""
        plan, is_controller = self.plan, self.rank == self.controller
        stats = SyncStats(version, len(plan.buckets), plan.total_nbytes)
        start = time.perf_counter()
        session = _Session(self, version, wake)
        loader = ThreadPoolExecutor(1, thread_name_prefix="reshard-load") if is_controller else None
        ok = False
        try:
            views = self.local_views()
            loading: Future | None = None
            for k in range(len(plan.buckets)):
                loading = self._one_bucket(k, views, session, stats, bucket_hook, loader, loading)
            error = None
            if is_controller:
                error = self._wait(loading, version, len(plan.buckets), stats)
                if error is None and session.held:  # every bucket, in one call per engine
                    loading = loader.submit(session.load, session.held, True)
                    session.held = []
                    error = self._wait(loading, version, None, stats)
            self._verdict(error)
            ok = True
        finally:
            if loader is not None:
                loader.shutdown(wait=True)
            traffic = self.channel.end_sync(ok)
        if traffic is not None:
            stats.relayed_nbytes, stats.relayed_full_nbytes = traffic.nbytes, traffic.full_nbytes
            stats.changed_fraction = traffic.changed_fraction
        stats.total_s = time.perf_counter() - start
        return stats

    def _one_bucket(self, k: int, views: dict, session: "_Session", stats: SyncStats,
                    hook: BucketHook | None, loader, loading: Future | None) -> Future | None:
        """Write bucket k, hand it to the loader (or hold it for the one call at the end);
        returns the (controller's) pending load."""
        t0 = time.perf_counter()
        version = session.version
        gathered = self.write_bucket(k, views)
        error = None
        if self.rank == self.controller:
            stats.transfer_s += time.perf_counter() - t0
            error = self._wait(loading, version, k, stats)  # frees bucket k-1's half
            loading = None
            where = f"bucket {k + 1}/{len(self.plan.buckets)}"
            failures = [f for _, f in gathered if f]
            if error is None and failures:
                error = self._abort(version, f"{where} ({failures[0]})")
            if error is None:
                try:
                    sums = {key: value for m, _ in gathered for key, value in m.items()}
                    manifest = self.plan.manifest(k, sums, version, self.writer.algorithm)
                    if hook is not None:
                        hook(k, self.channel.buffer, manifest)
                    if self.channel.holds_all:
                        session.held.append(manifest)
                    else:
                        loading = loader.submit(session.load, [manifest],
                                                k == len(self.plan.buckets) - 1)
                except Exception as err:  # noqa: BLE001 - raised on every rank below
                    error = self._abort(version, f"{where} ({err!r})")
                else:
                    if loading is not None and not self.overlap:  # loaded before k+1 is written
                        error = self._wait(loading, version, k + 1, stats)
                        loading = None
        self._verdict(error)
        return loading

    def write_bucket(self, k: int, views: dict) -> list | None:
        """Every rank writes and delivers its pieces of bucket k (collective); on the
        controller, each rank's (checksums by piece, failure or None), else None. A rank that
        fails still delivers, so nobody waits for a missing piece."""
        mine, failure = {}, None
        try:
            if k == 0:
                self.channel.check_sources()
            mine = self.writer.write(k, views, self.channel.copies)
        except Exception as err:  # noqa: BLE001 - reported through the controller
            failure = f"rank {self.rank} writing bucket {k + 1}: {err!r}"
        try:
            self.channel.deliver(k)
        except Exception as err:  # noqa: BLE001
            failure = failure or f"rank {self.rank} delivering bucket {k + 1}: {err!r}"
        return gather_to((mine, failure), self.controller, self.group)

    def _wait(self, loading: Future | None, version: int, bucket: int | None,
              stats: SyncStats) -> str | None:
        """Wait for the load of ``bucket`` (1-based; None: of every bucket, whose error names
        the one that failed) to end; the abort message if it failed."""
        if loading is None:
            return None
        try:
            elapsed = loading.result()
        except Exception as err:  # noqa: BLE001
            where = str(err) if bucket is None else f"bucket {bucket}/{len(self.plan.buckets)} ({err})"
            return self._abort(version, where)
        stats.apply_s += elapsed
        stats.per_bucket_apply_s.append(elapsed)
        return None

    def _abort(self, version: int, what: str) -> str:
        """End the session on every engine; the message every rank raises."""
        message = (f"weight sync to version {version} failed at {what}; the engine holds a mix "
                   f"of weight versions and refuses to generate until a sync succeeds")
        for engine in self.engines:
            try:
                engine.abort_update(message)
            except Exception as err:  # noqa: BLE001 - the first failure is the one to report
                message += f" (ending the session also failed: {err})"
        return message

    def _verdict(self, error: str | None) -> None:
        """The controller's ``error`` (None: carry on) raised on every rank."""
        error = broadcast_verdict(error, self.controller, self.group, self._flag_device)
        if error is not None:
            raise WeightSyncError(error)


DEAD = ("EngineDiedError", "ActorDiedError")
"""Errors that say the engine (or the process that owns it) is gone for good, by class name
(Ray's are not imported here, and an engine's own error comes back wrapped by Ray); Ray's
transient ``ActorUnavailableError`` is not one."""


def engine_is_dead(err: BaseException) -> bool:
    return any(cls.__name__ in DEAD for cls in type(err).__mro__)


class _Session:
    """One sync's calls into the engines (controller): the first carries the session's start
    (and the weights' wake), the last its end (and the KV cache's wake)."""

    def __init__(self, sync: WeightSync, version: int, wake: bool):
        self.sync, self.version, self.wake = sync, version, wake
        self.begun = False
        self.held: list[dict] = []
        """Manifests kept for the one call at the end (`Transport.holds_all`)."""

    def load(self, manifests: list[dict], last: bool) -> float:
        """Loader thread: every engine checks and loads ``manifests``; seconds spent."""
        sync = self.sync
        begin = None if self.begun else (sync.path, sync.channel.nbytes)
        self.begun = True
        start = time.perf_counter()
        sync.call_engines(lambda engine: engine.apply_update(
            self.version, manifests, begin=begin, finish=last, wake=self.wake))
        return time.perf_counter() - start


def _attach(engines: list, channel: Transport, setup: TransportSetup) -> None:
    """Every engine maps the transport's memory and keeps it mapped (collective); a failure
    closes the transport and is raised on every rank."""
    error = None
    if setup.rank == setup.controller:
        try:
            for engine in engines:
                engine.attach_update_buffer(channel.path, channel.nbytes)
        except Exception as err:  # noqa: BLE001 - raised on every rank below
            error = f"the engine could not map the bucket file {channel.path}: {err}"
    barrier(setup.group)
    channel.on_engines_attached()
    error = broadcast_verdict(error, setup.controller, setup.group, backend_device(setup.group))
    if error is not None:
        channel.close()
        raise WeightSyncError(error)
