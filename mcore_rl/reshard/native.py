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
    if engine != "vllm":
        return (f"reshard.transport={transport} is a backend of vLLM's weight-transfer protocol; "
                f"rollout.engine={engine} does not speak it: use reshard.transport=auto")
    if not cuda:
        return (f"reshard.transport={transport} is vLLM's GPU backend (it needs CUDA); on CPU "
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
        def metadata(self) -> list:
            return [ParamMeta(t.hf_name, plan.wire_dtype, tuple(t.shape)) for t in tensors]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor | None]]:
            held = views()
            for t in tensors:
                full = gather_tensor(t, held, rank, sender, plan.wire_dtype, group, device)
                if everyone:
                    if full is None:
                        full = torch.empty(t.shape, dtype=plan.wire_dtype, device=device)
                    dist.broadcast(full, src=sender, group=group)
                yield t.hf_name, full

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
    proxy of an engine in another process): each call is one `VLLMEngine.transfer` call."""

    def __init__(self, engine, version: Callable[[], int]):
        self.engine, self.version = engine, version

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engine.transfer("init", init_info)

    def start_weight_update(self) -> None:
        self.engine.transfer("start", None)

    def update_weights(self, update_info) -> None:
        self.engine.transfer("update", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine.transfer("finish", self.version())


def trainer_init_info(backend: str, rank: int, *, address: str | None = None,
                      port: int | None = None, engine_ranks: int = 1):
    """vLLM's ``TrainerInitInfo`` of ``backend`` for trainer rank ``rank`` (0: the sender);
    NCCL backends rendezvous at ``address``:``port`` with the engine's ``engine_ranks``
    workers."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseNCCLTrainerInitInfo

    if backend == "ipc":
        return IPCTrainerInitInfo(rank=rank)
    cls = {"nccl": NCCLTrainerInitInfo, "sparse_nccl": SparseNCCLTrainerInitInfo}[backend]
    return cls(master_address=address, master_port=port, world_size=1 + engine_ranks, rank=rank)


class NativeWeightSync:
    """`mcore_rl.reshard.WeightSync`'s role over vLLM's GPU backends: one trainer-side
    engine per rollout engine, built collectively on every trainer rank; `sync` sends the
    current weights to every engine as a version. ``init_info(backend, rank, engine_ranks)``
    gives each trainer engine its init info (default: `trainer_init_info` with a free port
    on the controller)."""

    def __init__(self, chunks: list, plan: ReshardPlan, transport: str, *, engines: list,
                 controller: int = 0, group=None, full_every: int = 10,
                 device: torch.device | str | None = None,
                 init_info: Callable[..., Any] | None = None):
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from mcore_rl.parallel.agreement import broadcast
        from mcore_rl.reshard.sources import local_holdings

        self.chunks, self.plan, self.transport = chunks, plan, transport
        self.rank = dist.get_rank()
        self.controller, self.group = controller, group
        is_controller = self.rank == controller
        self.engines = list(engines) if is_controller else []
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
        self._baselines: list[PatchBaseline] = []
        sizes = broadcast([e.transfer("ranks", None) for e in self.engines], controller, group)
        init_info = init_info or self._default_init_info
        # vLLM's trainer rank: 0 sends (the controller); every other trainer rank is nonzero
        vllm_rank = 0 if is_controller else 1 + self.rank
        self.trainers = []
        for k, engine_ranks in enumerate(sizes):
            info = init_info(transport, vllm_rank, engine_ranks)
            client = EngineClient(self.engines[k], lambda: self._version) if is_controller \
                else _NoClient()
            source = None if transport == "sparse_nccl" else self.source
            self.trainers.append(WeightTransferTrainerFactory.trainer_init(
                info, client=client, source=source))
            self._baselines.append(PatchBaseline())

    @classmethod
    def from_config(cls, chunks: list, arch, cfg, *, engines: list | None = None,
                    controller: int = 0, group=None) -> "NativeWeightSync":
        """From a `ReshardConfig` (``cfg.reshard``), as `WeightSync.from_config`."""
        from mcore_rl.models.gpt import DTYPES
        from mcore_rl.parallel.agreement import all_gather
        from mcore_rl.reshard.sources import local_holdings, parameters

        holdings = all_gather(local_holdings(chunks, dist.get_rank())[0], group)
        wire = DTYPES.get(cfg.wire_dtype) or parameters(chunks)[0].dtype
        plan = ReshardPlan.build([h for hs in holdings for h in hs], arch,
                                 int(cfg.bucket_mb * 2**20) // 2, wire)
        return cls(chunks, plan, cfg.transport, engines=engines or [], controller=controller,
                   group=group, full_every=cfg.full_every if cfg.delta else 1)

    def _default_init_info(self, backend: str, rank: int, engine_ranks: int):
        from mcore_rl.parallel.agreement import broadcast
        from mcore_rl.parallel.ports import free_port

        where = None
        if self.rank == self.controller and backend != "ipc":
            from vllm.utils.network_utils import get_ip

            where = (get_ip(), free_port())
        where = broadcast(where, self.controller, self.group)
        address, port = where if where else (None, None)
        return trainer_init_info(backend, rank, address=address, port=port,
                                 engine_ranks=engine_ranks)

    def call_engines(self, call) -> None:
        """``call(engine)`` for every engine, in order."""
        for engine in list(self.engines):
            call(engine)

    @torch.no_grad()
    def sync(self, version: int, *, bucket_hook=None, wake: bool = False):
        """Send the current weights to every engine as ``version`` (collective). ``wake``:
        each engine's weights wake before and its KV cache after (colocated)."""
        self._version = version
        stats = SyncStats(version, 0, self.plan.total_nbytes)
        full = self._syncs % self.full_every == 0
        start = time.perf_counter()
        sent = changed = 0
        try:
            for k, trainer in enumerate(self.trainers):
                if wake and self.rank == self.controller:
                    self.engines[k].wake_weights()
                if self.transport == "sparse_nccl":
                    patches = list(self._baselines[k].patches(self._pairs(), full))
                    trainer.send_weights(_vllm_patches(patches) if self.rank == self.controller else None)
                    sent += sum(p.indices.numel() * 4 + p.values.numel() * p.values.element_size()
                                for p in patches)
                    changed += sum(p.indices.numel() for p in patches)
                else:
                    trainer.send_weights()
                    sent += self.plan.total_nbytes
                if wake and self.rank == self.controller:
                    self.engines[k].wake_kv_cache()
        except Exception as err:
            for baseline in self._baselines:
                baseline.forget()
            raise WeightSyncError(f"weight sync through vLLM's {self.transport} backend: {err}") from err
        self._syncs += 1
        stats.total_s = stats.transfer_s = time.perf_counter() - start
        # every byte crosses from the trainer's GPUs to the engines': sent_nbytes is `sent`
        stats.nbytes = stats.relayed_full_nbytes = self.plan.total_nbytes * len(self.trainers)
        stats.relayed_nbytes = sent
        if self.transport == "sparse_nccl":
            elements = sum(math.prod(t.shape) for b in self.plan.buckets for t in b.tensors)
            stats.changed_fraction = changed / max(elements * len(self.trainers), 1)
        return stats

    def _pairs(self):
        """The sender's (name, tensor) pairs of one pass; the other ranks take part in the
        gathers and get none."""
        for name, tensor in self.source:
            if tensor is not None:
                yield name, tensor

    def close(self) -> None:
        for trainer in self.trainers:
            trainer.shutdown()
        self.trainers = []


def _vllm_patches(patches: list[Patch]) -> list:
    from vllm.distributed.weight_transfer.sparse_nccl_engine import SparseWeightPatch

    return [SparseWeightPatch(p.name, p.indices, p.values, p.full_shape) for p in patches]


class _NoClient:
    """The client of a trainer rank that does not send: vLLM never calls it there."""

    def __getattr__(self, name):
        raise RuntimeError(f"a non-sending trainer rank called the engine ({name})")
