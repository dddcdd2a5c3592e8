"""Weight syncs through vLLM's own GPU backends: ``reshard.transport`` nccl, ipc or sparse_nccl.

vLLM's weight-transfer protocol has a trainer side (``vllm.distributed.weight_transfer``:
``WeightTransferTrainerFactory.trainer_init`` and ``send_weights``) that drives the engine
through four calls (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``) and moves the bytes itself, GPU to GPU:

- ``nccl``: the controller rank broadcasts every tensor to the engine's workers over an NCCL
  group of its own (separate placement: the engine on other GPUs or nodes);
- ``ipc``: every trainer rank shares each full tensor from its own GPU as a CUDA IPC handle,
  and the engine worker on that GPU copies it (colocated placement);
- ``sparse_nccl``: only the elements that changed since the engine's last version, as
  ``(indices, values)`` patches over NCCL (``reshard.delta``); every ``reshard.full_every``-th
  sync, and the one after a failure, patches every element.

What they send is the resharding plan's HF tensors, gathered one at a time on the
trainer's devices (`GatheredSource`: each tensor's pieces, TP shards and fused QKV or
gate/up cut as the plan says, travel point to point to the controller over the trainer's
process group, NCCL on GPUs), in the plan's layerwise order, which vLLM checks. Nothing
goes through host memory. Each engine gets one trainer-side engine and one NCCL group
(`NativeWeightSync`); the engine's side is vLLM's own (`VLLMEngine(weight_transfer=...)`).

On CPU these backends cannot run (NCCL and CUDA IPC need CUDA); ``reshard.transport`` is
refused there in one line, and the CPU transports (`mcore_rl.reshard.transports`, received
by mcore-rl's own backend in vLLM's workers) serve instead. What is checked on CPU: the
gathered source against the HF checkpoint and vLLM's order check at TP2 x PP2, the sync's
calls into the protocol (through a stand-in trainer engine registered in vLLM's factory)
and the sparse patches against the full tensors. No GPU run of these backends exists yet:
they are unverified.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from mcore_rl.reshard.engine_pass import agree, engines_ready, plan_for_config
from mcore_rl.reshard.gather import gather_tensor
from mcore_rl.reshard.plan import ReshardPlan
from mcore_rl.reshard.sync_stats import SyncStats
from mcore_rl.wire import WeightSyncError

GPU_BACKENDS = ("nccl", "ipc", "sparse_nccl")
"""vLLM's weight-transfer backends that ``reshard.transport`` may name (GPU only)."""

NOT_WIRED = {"nccl_m2n": "it reshards trainer shards itself from a layout description "
                         "mcore-rl does not produce yet; use reshard.transport=nccl",
             "sharded_rdt": "it needs a Ray RDT plan of the trainer's shards; use "
                            "reshard.transport=nccl"}
"""vLLM backends ``reshard.transport`` refuses, and why."""


def is_native(transport: str) -> bool:
    """Whether ``reshard.transport`` names one of vLLM's GPU backends."""
    return transport in GPU_BACKENDS


def engine_options(reshard_cfg) -> dict:
    """What the rollout engine is started with for ``reshard`` (a `ReshardConfig`): vLLM's
    backend when ``reshard.transport`` names one, else nothing."""
    return {"weight_transfer": reshard_cfg.transport} if is_native(reshard_cfg.transport) else {}


def transport_problem(transport: str, cuda: bool, engine: str) -> str | None:
    """Why ``reshard.transport`` cannot be used here (one line), or None."""
    if transport in NOT_WIRED:
        return f"reshard.transport={transport}: vLLM's {transport} backend is not supported ({NOT_WIRED[transport]})"
    if not is_native(transport):
        return None
    if engine == "sglang" and transport != "nccl":
        return (f"reshard.transport={transport} is a backend of vLLM's weight-transfer protocol; "
                "rollout.engine=sglang takes weights over NCCL through its own update API: use "
                "reshard.transport=nccl (separate placement) or reshard.transport=auto")
    if engine not in ("vllm", "sglang"):
        return (f"reshard.transport={transport} is a backend of vLLM's weight-transfer protocol; "
                f"rollout.engine={engine} does not speak it: use reshard.transport=auto")
    if not cuda:
        owner = "SGLang's NCCL update" if engine == "sglang" else "vLLM's GPU backend"
        return (f"reshard.transport={transport} is {owner} (it needs CUDA); on CPU "
                "use reshard.transport=auto, which streams through shared memory")
    return None


# ----- what is sent ---------------------------------------------------------------------------
def gathered_source(plan: ReshardPlan, views: Callable[[], dict], rank: int, sender: int,
                    group=None, device: torch.device | str = "cpu", everyone: bool = False):
    """The plan's HF tensors as vLLM's ``WeightSource``, gathered one at a time on ``device``
    to ``sender`` (a global rank) over ``group``: the full tensor there (``everyone``: on
    every rank, as CUDA IPC needs each GPU's own copy), None elsewhere. Collective: every rank
    iterates every name in the same order. ``views()`` gives this rank's holdings
    (`mcore_rl.reshard.sources.local_holdings`), asked for at the start of each pass."""
    from vllm.distributed.weight_transfer import ParamMeta, WeightSource

    tensors = [t for b in plan.buckets for t in b.tensors]

    class GatheredSource(WeightSource):
        """``position``: how many tensors this rank's current pass has gathered; `drain`
        gathers the rest of a pass that its consumer gave up, so that the other ranks,
        which go on, are not left waiting."""

        position = len(tensors)

        def metadata(self) -> list:
            return [ParamMeta(t.hf_name, plan.wire_dtype, tuple(t.shape)) for t in tensors]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
            self.position = 0
            return self.gather(tensors)

        def gather(self, some) -> Iterator[tuple[str, torch.Tensor | None]]:
            held = views()
            for t in some:
                full = gather_tensor(t, held, rank, sender, plan.wire_dtype, group, device)
                if everyone:
                    if full is None:
                        full = torch.empty(t.shape, dtype=plan.wire_dtype, device=device)
                    dist.broadcast(full, src=sender, group=group)
                self.position += 1
                yield t.hf_name, full

        def drain(self) -> None:
            for _ in self.gather(tensors[self.position:]):
                pass

    return GatheredSource()


@dataclass
class Patch:
    """The elements of one tensor that changed (flat int32 indices, new values)."""

    name: str
    indices: torch.Tensor
    values: torch.Tensor
    full_shape: tuple[int, ...]


class PatchBaseline:
    """The sender's last-sent tensors (the wire dtype, on the device: 2 bytes per parameter
    in bf16), from which `patches` finds what changed. Empty after `forget` (a failure), and
    then the next patches carry every element."""

    def __init__(self) -> None:
        self.sent: dict[str, torch.Tensor] = {}

    def forget(self) -> None:
        self.sent.clear()

    def patches(self, pairs, full: bool) -> Iterator[Patch]:
        """A patch per tensor of ``pairs`` (name, tensor): its changed elements, compared
        bit for bit (NaN included), or every element when ``full`` or never sent. Each tensor
        becomes the new baseline."""
        for name, tensor in pairs:
            flat = tensor.reshape(-1)
            if flat.numel() >= 2**31:
                raise ValueError(f"{name} has {flat.numel()} elements, more than the int32 "
                                 "indices of a sparse patch address")
            before = self.sent.get(name)
            if full or before is None or before.shape != flat.shape:
                idx = torch.arange(flat.numel(), dtype=torch.int32, device=flat.device)
            else:
                words = _words(flat)
                idx = (words != _words(before)).nonzero().reshape(-1).to(torch.int32)
            self.sent[name] = flat.clone()
            yield Patch(name, idx, flat[idx.long()], tuple(tensor.shape))


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its width (equal words: the same value bit for bit)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# ----- the engine's side, seen from the trainer ------------------------------------------------
class EngineClient:
    """vLLM's ``VLLMWeightSyncClient`` over one of mcore-rl's engines (the object, or the
    proxy of an engine in another process): each call is one `VLLMEngine.transfer` call.
    CUDA IPC handles travel pickled (``ipc_handles_pickled``): vLLM's message encoder to its
    engine process takes no tensor classes or dtypes."""

    def __init__(self, engine, version: Callable[[], int]):
        self.engine, self.version = engine, version

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engine.transfer("init", init_info)

    def start_weight_update(self) -> None:
        self.engine.transfer("start")

    def update_weights(self, update_info) -> None:
        self.engine.transfer("update", _encodable(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine.transfer("finish", self.version())


def _encodable(update_info):
    """``update_info`` with CUDA IPC handles pickled and base64-coded, as vLLM's workers
    read them (with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, set for an ipc engine)."""
    if isinstance(update_info, list):
        return [_encodable(u) for u in update_info]
    if not isinstance(update_info, dict) or update_info.get("ipc_handles") is None:
        return update_info
    import base64
    import pickle

    out = {k: v for k, v in update_info.items() if k != "ipc_handles"}
    out["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(update_info["ipc_handles"])).decode()
    return out


def trainer_init_info(backend: str, rank: int, *, address: str | None = None,
                      port: int | None = None, engine_ranks: int = 1):
    """vLLM's ``TrainerInitInfo`` of ``backend`` for trainer rank ``rank`` (0: the sender);
    NCCL backends rendezvous at ``address``:``port`` with the engine's ``engine_ranks``
    workers."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLTrainerInitInfo

    if backend == "ipc":  # packed: GPU memory bounded by the buffer, not the model
        return IPCTrainerInitInfo(rank=rank, packed=True)
    cls = {"nccl": NCCLTrainerInitInfo, "sparse_nccl": SparseNCCLTrainerInitInfo}[backend]
    return cls(master_address=address, master_port=port, world_size=1 + engine_ranks, rank=rank)


class NativeWeightSync:
    """`mcore_rl.reshard.WeightSync`'s role over vLLM's GPU backends: one trainer-side
    engine per rollout engine, built collectively on every trainer rank; `sync` sends the
    current weights to every engine as a version. ``init_info(backend, rank, engine_ranks)``
    gives each trainer engine its init info (default: `trainer_init_info` with a free port
    on the controller).

    Failures: every rank learns of a failure on any rank (one verdict per engine, after its
    send; a controller that gave up its pass gathers the rest of it first, so nobody waits),
    raises `WeightSyncError`, and the engines' sessions are ended; the trainer-side engines
    are then rebuilt (an NCCL group is unusable after a failed transfer) and the next sync
    is full."""

    def __init__(self, chunks: list, plan: ReshardPlan, transport: str, *, engines: list,
                 controller: int = 0, group=None, full_every: int = 10,
                 device: torch.device | str | None = None,
                 init_info: Callable[..., Any] | None = None):
        from mcore_rl.reshard.sources import local_holdings

        self.chunks, self.plan, self.transport = chunks, plan, transport
        self.rank = dist.get_rank()
        self.controller, self.group = controller, group
        self.is_controller = self.rank == controller
        self.engines = list(engines) if self.is_controller else []
        self.drop_dead_engines = False
        self.dropped: list[str] = []
        self.full_every = full_every
        self._syncs = 0
        self._version = 0
        device = device if device is not None else next(
            p for c in chunks for p in c.parameters()).device
        views = lambda: local_holdings(self.chunks, self.rank)[1]  # noqa: E731
        self.source = gathered_source(plan, views, self.rank, controller, group, device,
                                      everyone=transport == "ipc")
        self.baseline = PatchBaseline()
        """sparse_nccl: the last-sent tensors, one copy for every engine (each sync sends
        the same patches to all of them)."""
        self._init_info = init_info or self._default_init_info
        self.trainers: list | None = None
        self._init_trainers()

    def _init_trainers(self) -> None:
        """One trainer-side engine per rollout engine (collective)."""
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from mcore_rl.parallel.agreement import broadcast

        sizes = broadcast([e.transfer("ranks") for e in self.engines], self.controller, self.group)
        # vLLM's trainer rank: 0 sends (the controller); every other trainer rank is nonzero
        vllm_rank = 0 if self.is_controller else 1 + self.rank
        trainers, error = [], None
        for k, engine_ranks in enumerate(sizes):
            info = self._init_info(self.transport, vllm_rank, engine_ranks)
            try:
                if error is None:
                    client = EngineClient(self.engines[k], lambda: self._version) \
                        if self.is_controller else _NoClient()
                    source = None if self.transport == "sparse_nccl" else self.source
                    trainers.append(WeightTransferTrainerFactory.trainer_init(
                        info, client=client, source=source))
            except Exception as err:  # noqa: BLE001 - agreed on below
                error = f"starting vLLM's {self.transport} backend for engine {k + 1}: {err}"
        error = self._agree(error)
        if error is not None:
            for trainer in trainers:
                trainer.shutdown()
            raise WeightSyncError(error)
        self.trainers = trainers

    @classmethod
    def from_config(cls, chunks: list, arch, cfg, *, engines: list | None = None,
                    controller: int = 0, group=None) -> "NativeWeightSync":
        """From a `ReshardConfig` (``cfg.reshard``), as `WeightSync.from_config`."""
        plan = plan_for_config(chunks, arch, cfg, group)
        return cls(chunks, plan, cfg.transport, engines=engines or [], controller=controller,
                   group=group, full_every=cfg.full_every if cfg.delta else 1)

    def _default_init_info(self, backend: str, rank: int, engine_ranks: int):
        from mcore_rl.parallel.agreement import broadcast
        from mcore_rl.parallel.ports import free_port

        where = None
        if self.is_controller and backend != "ipc":
            from vllm.utils.network_utils import get_ip

            where = (get_ip(), free_port())
        where = broadcast(where, self.controller, self.group)
        address, port = where if where else (None, None)
        return trainer_init_info(backend, rank, address=address, port=port,
                                 engine_ranks=engine_ranks)

    def _agree(self, error: str | None) -> str | None:
        return agree(error, self.group)

    def call_engines(self, call) -> None:
        """``call(engine)`` for every engine, in order."""
        for engine in list(self.engines):
            call(engine)

    @torch.no_grad()
    def sync(self, version: int, *, bucket_hook=None, wake: bool = False) -> SyncStats:
        """Send the current weights to every engine as ``version`` (collective). ``wake``:
        each engine's weights wake before and its KV cache after (colocated)."""
        if self.trainers is None:  # rebuilt after a failure
            self._init_trainers()
        self._version = version
        stats = SyncStats(version, 0, self.plan.total_nbytes)
        start = time.perf_counter()
        error = self._agree(self._preflight(wake))
        if error is None:
            if self.transport == "sparse_nccl":
                error, sent, changed = self._send_patches(wake)
            else:
                error, sent = self._send_full(wake)
        if error is not None:
            self._fail(error)
        self._syncs += 1
        stats.total_s = stats.transfer_s = time.perf_counter() - start
        # every byte crosses from the trainer's GPUs to the engines': sent_nbytes is `sent`
        stats.nbytes = stats.relayed_full_nbytes = self.plan.total_nbytes * len(self.trainers)
        stats.relayed_nbytes = sent
        if self.transport == "sparse_nccl":
            elements = sum(math.prod(t.shape) for b in self.plan.buckets for t in b.tensors)
            stats.changed_fraction = changed / max(elements, 1)
        return stats

    def _preflight(self, wake: bool) -> str | None:
        """The controller's engines, ready to receive (woken, alive); why not, or None."""
        if not self.is_controller:
            return None
        return engines_ready(self.engines, wake,
                             f"weight sync through vLLM's {self.transport} backend")

    def _send_full(self, wake: bool) -> tuple[str | None, int]:
        """Every tensor to each engine in turn, vLLM's trainer driving the pass."""
        sent = 0
        for k, trainer in enumerate(self.trainers):
            error = None
            try:
                trainer.send_weights()
                if wake and self.is_controller:
                    self.engines[k].wake_kv_cache()
            except Exception as err:  # noqa: BLE001 - agreed on below
                error = f"weight sync through vLLM's {self.transport} backend, engine {k + 1}: {err}"
                self.source.drain()
            error = self._agree(error)
            if error is not None:
                return error, sent
            sent += self.plan.total_nbytes
        return None, sent

    def _send_patches(self, wake: bool) -> tuple[str | None, int, int]:
        """sparse_nccl: bucket by bucket, the changed elements of its tensors, the same patches
        to every engine within one weight update each; every rank gathers every bucket, so a
        failure on the controller stops the sending only."""
        full = self._syncs % self.full_every == 0 or not self.baseline.sent
        error, sent, changed = None, 0, 0

        def attempt(what, fn):
            nonlocal error
            if error is None:
                try:
                    fn()
                except Exception as err:  # noqa: BLE001 - agreed on below
                    error = f"weight sync through vLLM's sparse_nccl backend ({what}): {err}"

        clients = [t.client for t in self.trainers] if self.is_controller else []
        for client in clients:
            attempt("start", client.start_weight_update)
        for bucket in self.plan.buckets:
            pairs = [(n, t) for n, t in self.source.gather(bucket.tensors) if t is not None]
            if not self.is_controller:
                continue
            patches = [p for p in self.baseline.patches(pairs, full) if p.indices.numel()]
            if not patches:
                continue
            chunk = _vllm_patches(patches)
            for trainer in self.trainers:
                attempt("send", lambda: trainer.send_weight_chunk(chunk))
            per_engine = sum(p.indices.numel() * 4 + p.values.numel() * p.values.element_size()
                             for p in patches)
            sent += per_engine * len(self.trainers)
            changed += sum(p.indices.numel() for p in patches)
        for k, client in enumerate(clients):
            attempt("finish", client.finish_weight_update)
            if wake:
                attempt("wake", self.engines[k].wake_kv_cache)
        if self.is_controller and torch.cuda.is_available():  # the broadcasts landed
            attempt("landed", torch.cuda.current_stream().synchronize)
        return self._agree(error), sent, changed

    def _fail(self, error: str) -> None:
        """After a failed sync (every rank): end the engines' sessions, drop the trainer-side
        engines and the sparse baseline (the next sync rebuilds them and is full), raise."""
        self.baseline.forget()
        for k, engine in enumerate(self.engines):
            try:
                engine.transfer("abort", error)
            except Exception:  # noqa: BLE001 - the engine already refuses to generate
                pass
        for trainer in self.trainers or []:
            try:
                trainer.shutdown()
            except Exception:  # noqa: BLE001
                pass
        self.trainers = None
        raise WeightSyncError(error)

    def close(self) -> None:
        for trainer in self.trainers or []:
            trainer.shutdown()
        for engine in self.engines:
            engine.transfer("shutdown")
        self.trainers = None


def _vllm_patches(patches: list[Patch]) -> list:
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch

    return [SparseWeightPatch(p.name, p.indices, p.values, p.full_shape) for p in patches]


class _NoClient:
    """The client of a trainer rank that does not send: vLLM never calls it there."""

    def __getattr__(self, name):
        raise RuntimeError(f"a non-sending trainer rank called the engine ({name})")
