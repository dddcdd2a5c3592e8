"""Weight syncs into SGLang engines over NCCL: ``reshard.transport=nccl`` with
``rollout.engine=sglang`` (separate placement).

SGLang's own update API for a trainer on other GPUs: each engine joins an NCCL group with
the trainer's controller rank (``init_weights_update_group``: the controller is rank 0, the
engine's TP workers follow), and ``update_weights_from_distributed(names, dtypes, shapes,
group_name)`` receives the tensors rank 0 broadcasts, in that order, and loads them with the
model's own ``load_weights`` (q/k/v and gate/up fused per TP shard). The controller's side of
the group is made with SGLang's helper (`mcore_rl.engines.sglang_shim.weight_update_group`),
the way the engine makes its own.

What is sent: the resharding plan's HF tensors, bucket by bucket, each gathered on the
controller rank's GPU from the trainer ranks that hold its pieces (TP shards, fused QKV and
gate/up cut as the plan says; `mcore_rl.reshard.gather.gather_tensor`, a collective of the
trainer's group). Per bucket and engine, the update call goes to the engine from a thread
while the controller broadcasts, since the engine receives inside that call. After the last
bucket each engine flushes its prefix cache and serves the new version.

While an engine takes the buckets it refuses to generate (no mix of old and new weights). A
failure on any rank fails the sync on every rank (`WeightSyncError`, one line): the
controller aborts its side of the engines' groups at once (a broadcast nobody receives
would otherwise hold its GPU stream), the engines drop theirs and refuse to generate until
a sync completes, and the next sync builds new groups. Every wait on an engine is bounded
(`JOIN_TIMEOUT_S`), so a stuck engine fails the sync instead of hanging the trainer.

Unverified: SGLang needs a GPU and does not run here. The calls, their order and what
arrives are checked on CPU against a stand-in engine over a gloo group
(``tests/reshard/test_stream_layouts.py``).
"""
from __future__ import annotations

import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from mcore_rl.reshard.engine_pass import agree, engines_ready, plan_for_config
from mcore_rl.reshard.gather import gather_tensor
from mcore_rl.reshard.plan import ReshardPlan
from mcore_rl.reshard.sync_stats import SyncStats
from mcore_rl.wire import WeightSyncError

GROUP_NAME = "mcore-rl-weights"
JOIN_TIMEOUT_S = 600.0
"""How long the controller waits for an engine to join its group or take a bucket."""

GroupFactory = Callable[..., Any]
"""``(backend=, init_method=, world_size=, rank=, group_name=, timeout=)`` -> a process
group with ``broadcast(tensor, root)``: the controller's side of an engine's group."""


class SGLangBroadcastSync:
    """`mcore_rl.reshard.WeightSync`'s role for SGLang engines on other GPUs (module doc):
    built collectively on every trainer rank; `sync` sends the current weights to every
    engine as a version. ``make_group``: the controller's side of a group (SGLang's helper);
    ``address()``: where the groups rendezvous (default: this node's IP and a free port)."""

    def __init__(self, chunks: list, plan: ReshardPlan, *, engines: list,
                 make_group: GroupFactory, controller: int = 0, group=None,
                 device: torch.device | str | None = None, backend: str = "nccl",
                 address: Callable[[], tuple[str, int]] | None = None):
        from mcore_rl.parallel.agreement import broadcast

        self.chunks, self.plan, self.backend = chunks, plan, backend
        self.rank = dist.get_rank()
        self.controller, self.group = controller, group
        self.is_controller = self.rank == controller
        self.engines = list(engines) if self.is_controller else []
        self.drop_dead_engines = False
        self.dropped: list[str] = []
        self.device = device if device is not None else next(
            p for c in chunks for p in c.parameters()).device
        self.count = broadcast(len(self.engines), controller, group)
        self._make_group = make_group
        self._address = address or _free_address
        self.groups: list[tuple[str, Any]] | None = None
        self._joins = 0
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="sglang-sync") \
            if self.is_controller else None
        self._connect()

    @classmethod
    def from_config(cls, chunks: list, arch, cfg, *, make_group: GroupFactory,
                    engines: list | None = None, controller: int = 0,
                    group=None) -> "SGLangBroadcastSync":
        """From a `ReshardConfig` (``cfg.reshard``), as `WeightSync.from_config`."""
        plan = plan_for_config(chunks, arch, cfg, group)
        return cls(chunks, plan, engines=engines or [], make_group=make_group,
                   controller=controller, group=group)

    def _agree(self, error: str | None) -> str | None:
        return agree(error, self.group)

    def _connect(self) -> None:
        """One group per engine, the controller as rank 0 (collective: every rank learns
        whether it worked). Both sides block until all joined, so each runs in a thread."""
        self._joins += 1
        groups, error = [], None
        if self.is_controller:
            try:
                for k, engine in enumerate(self.engines):
                    name = f"{GROUP_NAME}-{self._joins}-{k}"
                    address, port = self._address()
                    size = 1 + int(engine.transfer("ranks"))
                    joined = self._pool.submit(engine.transfer, "init", {
                        "master_address": address, "master_port": port, "rank_offset": 1,
                        "world_size": size, "group_name": name, "backend": self.backend})
                    made = self._pool.submit(
                        self._make_group, backend=self.backend,
                        init_method=f"tcp://{address}:{port}", world_size=size, rank=0,
                        group_name=name, timeout=timedelta(seconds=JOIN_TIMEOUT_S))
                    done, _ = wait([joined, made], JOIN_TIMEOUT_S, FIRST_EXCEPTION)
                    for future in (joined, made):
                        if future not in done:
                            raise TimeoutError(f"no answer in {JOIN_TIMEOUT_S:.0f} s")
                        future.result()
                    groups.append((name, made.result()))
            except Exception as err:  # noqa: BLE001 - agreed on below
                error = f"weight sync into SGLang: joining engine {len(groups) + 1}'s group: {err}"
        error = self._agree(error)
        if error is not None:
            self.groups = groups
            self._abort(error)
            raise WeightSyncError(error)
        self.groups = groups

    def call_engines(self, call) -> None:
        """``call(engine)`` for every engine, in order."""
        for engine in list(self.engines):
            call(engine)

    @torch.no_grad()
    def sync(self, version: int, *, bucket_hook=None, wake: bool = False) -> SyncStats:
        """Send the current weights to every engine as ``version`` (collective). ``wake``:
        each engine's weights wake before and its KV cache after. ``bucket_hook`` (the
        shared-memory transports' per-bucket timing) does not apply."""
        if self.groups is None:  # dropped after a failure
            self._connect()
        stats = SyncStats(version, 0, self.plan.total_nbytes)
        start = time.perf_counter()
        error = self._agree(self._preflight(wake))
        sent = 0
        if error is None:
            error, sent = self._send(version, wake)
        if error is not None:
            self._abort(error)
            raise WeightSyncError(error)
        stats.total_s = stats.transfer_s = time.perf_counter() - start
        stats.nbytes = stats.relayed_full_nbytes = self.plan.total_nbytes * self.count
        stats.relayed_nbytes = sent
        return stats

    def _preflight(self, wake: bool) -> str | None:
        if not self.is_controller:
            return None
        return engines_ready(self.engines, wake, "weight sync into SGLang")

    def _send(self, version: int, wake: bool) -> tuple[str | None, int]:
        """Every bucket: gathered (every rank), then broadcast to each engine in turn while
        it receives (the controller); the engines then serve ``version``."""
        from mcore_rl.reshard.sources import local_holdings

        held = local_holdings(self.chunks, self.rank)[1]
        wire = str(self.plan.wire_dtype).removeprefix("torch.")
        error, sent = None, 0
        for k, bucket in enumerate(self.plan.buckets):
            tensors = [(t.hf_name, gather_tensor(t, held, self.rank, self.controller,
                                                 self.plan.wire_dtype, self.group, self.device))
                       for t in bucket.tensors]  # collective: every rank, every bucket
            if not self.is_controller or error is not None:
                continue
            update = {"names": [n for n, _ in tensors], "dtypes": [wire] * len(tensors),
                      "shapes": [list(x.shape) for _, x in tensors]}
            for e, (name, pg) in enumerate(self.groups):
                received = None
                try:
                    received = self._pool.submit(self.engines[e].transfer, "update",
                                                 {**update, "group_name": name})
                    for _, x in tensors:
                        pg.broadcast(x, 0).wait()
                    received.result(timeout=JOIN_TIMEOUT_S)
                except Exception as err:  # noqa: BLE001 - agreed on below
                    if received is not None and received.done() and received.exception():
                        err = received.exception()  # the engine's reason, not the wait's
                    error = (f"weight sync into SGLang, engine {e + 1}, bucket {k + 1}/"
                             f"{len(self.plan.buckets)}: {err}")
                    self._drop_groups()  # before any more work on this GPU
                    break
                sent += sum(x.numel() * x.element_size() for _, x in tensors)
        if self.is_controller and error is None:
            try:
                for engine in self.engines:
                    engine.transfer("finish", version)
                    if wake:
                        engine.wake_kv_cache()
            except Exception as err:  # noqa: BLE001 - agreed on below
                error = f"weight sync into SGLang (finishing): {err}"
        return self._agree(error), sent

    def _abort(self, error: str) -> None:
        """The controller's groups aborted; the engines drop theirs and refuse to generate
        until a sync completes."""
        self._drop_groups()
        for engine in self.engines:
            try:
                engine.transfer("abort", error)
            except Exception:  # noqa: BLE001 - the engine already refuses to generate
                pass

    def _drop_groups(self) -> None:
        """Abort and destroy the controller's side of every group (an NCCL communicator is
        unusable after a failed transfer, and aborting it ends what it has queued)."""
        for _, pg in self.groups or []:
            for end in (getattr(pg, "abort", None), lambda: dist.destroy_process_group(pg)):
                try:
                    if end is not None:
                        end()
                except Exception:  # noqa: BLE001 - a broken group may not come apart cleanly
                    pass
        self.groups = None

    def close(self) -> None:
        self._drop_groups()
        for engine in self.engines:
            try:
                engine.transfer("shutdown")
            except Exception:  # noqa: BLE001 - closing the others still matters
                pass
        if self._pool is not None:  # a call stuck in an engine is not waited for
            self._pool.shutdown(wait=False, cancel_futures=True)


def _free_address() -> tuple[str, int]:
    """This node's IP and a free port (the engines may run on other nodes)."""
    import socket

    from mcore_rl.parallel.ports import free_port

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: the route picks the IP
            host = s.getsockname()[0]
    except OSError:
        host = "127.0.0.1"
    return host, free_port()
