"""The shared transport: the trainer's parameters live in the file the engines map.

When the transport is opened, each writing rank moves the parameters it sends (their
``.data``) into its region of one file in ``reshard.shm_dir``, mapped by every trainer rank
and by the engines' processes. The optimizer keeps updating the same `Parameter` objects,
now backed by that file, and a sync publishes them where they lie: each rank checksums its
regions (the engine checks them before loading), the manifest points every piece at its part
of a parameter (a strided view for q, k and v, which Megatron interleaves per query group),
and the engine reads them in place. What a sync moves is then only what the engine itself
copies into its own weights. (The GPU analogue would hand the engine CUDA IPC handles of the
trainer's tensors.)

Possible (`shared_transport_problem`) when every writing rank's parameters are CPU tensors
that own their memory (Megatron's distributed optimizer makes them views of one flat buffer,
which this does not move), each sent holding is a contiguous part of one of them, their
dtype is the wire dtype, every rank is on the controller's node and its tmpfs has room.
Memory: the parameters move, they are not copied; the file's pages are allocated as each
parameter is moved in (no ``fallocate``) and its old memory is freed right after, so setting
up costs at most one parameter extra at a time.
"""
from __future__ import annotations

import ctypes
from dataclasses import replace

import torch

from mcore_rl.parallel.agreement import all_gather, barrier, group_ranks, raise_if_any
from mcore_rl.reshard.plan import Holding, Piece, ReshardPlan
from mcore_rl.reshard.sources import local_holdings, pointers
from mcore_rl.reshard.transports.base import Transport, TransportSetup
from mcore_rl.reshard.transports.shm_file import agree_on_path
from mcore_rl.reshard.writer import Copy
from mcore_rl.sizes import format_bytes, free_bytes
from mcore_rl.wire import ALIGN, align, create_bucket_file, map_bucket_file, remove_bucket_file

REGION_BYTES = 16 * 2**20
"""Longest run of bytes one checksum covers: short enough that writer threads share a
bucket evenly, long enough that the per-checksum overhead vanishes."""


class SharedFileTransport(Transport):
    """The parameters themselves, in one file in ``shm_dir`` (module doc)."""

    holds_all = True

    def __init__(self, plan, path, nbytes, buffer, rank: int, controller: int, moved: list):
        super().__init__(plan, path, nbytes, buffer)
        self.rank, self.controller = rank, controller
        self.moved_nbytes = nbytes
        self._moved = moved
        self._pointers_in_file = pointers(moved)

    @classmethod
    def problem(cls, setup: TransportSetup) -> str | None:
        need = 0
        try:
            views, params = setup.views(), setup.parameters()
            problem = shared_transport_problem(params, setup.holdings, views, setup.wire_dtype)
            if setup.is_remote:
                problem = ("it is on another node than the engine, whose tmpfs it cannot map "
                           "(its pieces travel over the process group)")
            if not problem:
                need = region_nbytes(sent_parameters(params, setup.holdings, views))
        except Exception as err:  # noqa: BLE001 - every rank decides the same below
            problem = f"{type(err).__name__}: {err}"
        answers = all_gather((problem, need, free_bytes(setup.shm_dir)), setup.group)
        ranks = group_ranks(setup.group)
        first = next((f"rank {ranks[r]}: {p}" for r, (p, _, _) in enumerate(answers) if p), None)
        if first is None:  # the controller's tmpfs holds the file
            total, free = sum(n for _, n, _ in answers), answers[ranks.index(setup.controller)][2]
            if free is not None and free < total:
                first = (f"{setup.shm_dir} has {format_bytes(free)} free, the parameters take "
                         f"{format_bytes(total)}")
        return first

    @classmethod
    def open(cls, setup: TransportSetup) -> "SharedFileTransport":
        path = agree_on_path(setup.shm_dir, setup.controller, setup.group)
        # no view of the parameters' old memory is kept: it is freed as they move
        sent = sent_parameters(setup.parameters(), setup.holdings, setup.views())
        sizes = all_gather(region_nbytes(sent), setup.group)
        mine = group_ranks(setup.group).index(setup.rank)
        start, nbytes = sum(sizes[:mine]), sum(sizes)
        if setup.rank == setup.controller:
            create_bucket_file(path, nbytes, allocate=False)
        barrier(setup.group)
        buffer, offsets, problem = None, {}, None
        try:  # a failure here is raised on every rank, not only this one (no rank hangs)
            buffer = map_bucket_file(path, nbytes)
            move_parameters(sent, buffer, start)
            offsets = _offsets_in_file(setup, buffer, start, start + sizes[mine])
        except Exception as err:  # noqa: BLE001
            problem = f"rank {setup.rank} moving its parameters into {path}: {err!r}"
        raise_if_any(problem, setup.group)
        plan, everyone = setup.build_plan(offsets)
        place_in_file(plan, everyone)
        return cls(plan, path, nbytes, buffer, setup.rank, setup.controller, sent)

    def on_engines_attached(self) -> None:
        if self.rank == self.controller:
            remove_bucket_file(self.path)

    def check_sources(self) -> None:
        if pointers(self._moved) != self._pointers_in_file:
            raise RuntimeError("the parameters moved out of the shared weight file after "
                               "WeightSync was built; build it after anything that "
                               "reallocates them (e.g. wrapping the model in DDP)")

    def copies(self, k: int, views: dict) -> list[Copy]:
        # the data is in place: writers checksum this rank's regions of the bucket
        return [Copy(at, self.buffer[at:at + n], None)
                for at, n, rank in self.plan.buckets[k].regions if rank == self.rank]

    def close(self) -> None:
        super().close()
        self._moved = []


def _offsets_in_file(setup: TransportSetup, buffer: torch.Tensor, start: int,
                     end: int) -> dict[Holding, int]:
    """Byte offset in the file of each main holding of this rank, now that its parameters
    moved into [start, end)."""
    holdings, views = local_holdings(setup.chunks, setup.rank)
    base, offsets = buffer.data_ptr(), {}
    for h in holdings:
        if h.main:
            at = views[h.view_key].data_ptr() - base
            if not start <= at < end:
                raise RuntimeError(f"{h.key} did not move into the shared weight file")
            offsets[h] = at
    return offsets


# ----- which parameters, and moving them ----------------------------------------------------
def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def sent_parameters(params: list[torch.nn.Parameter], holdings: list[Holding],
                    views: dict) -> list[torch.nn.Parameter]:
    """The parameters behind this rank's main holdings (those it sends), in model order."""
    keys = {_storage_key(views[h.view_key]) for h in holdings if h.main}
    seen, out = set(), []
    for p in params:
        if id(p) not in seen and _storage_key(p) in keys:
            seen.add(id(p))
            out.append(p)
    return out


def shared_transport_problem(params: list[torch.nn.Parameter], holdings: list[Holding],
                             views: dict, dtype: torch.dtype) -> str | None:
    """Why this rank's parameters cannot be shared with the engine in place (None: they can)."""
    owners = {_storage_key(p): p for p in params}
    for h in holdings:
        if not h.main:
            continue
        view = views[h.view_key]
        where = f"{h.key}" + (f" (layer {h.layer})" if h.layer is not None else "") + (
            f" (expert {h.expert})" if h.expert is not None else "")
        if view.device.type != "cpu":
            return f"{where} is on {view.device}, not in CPU memory"
        if view.dtype != dtype:
            return f"{where} is {view.dtype}, the engine takes {dtype}"
        if not view.is_contiguous():
            return f"{where} is not contiguous"
        if owners.get(_storage_key(view)) is None:
            return f"{where} is not a parameter's own memory"
    for p in sent_parameters(params, holdings, views):
        if p.storage_offset() or p.untyped_storage().nbytes() != p.numel() * p.element_size():
            return ("the parameters are views of one flat buffer (Megatron's distributed "
                    "optimizer, or the shared file of an earlier WeightSync), which is not moved")
    return None


def region_nbytes(params: list[torch.nn.Parameter]) -> int:
    """Bytes this rank's parameters take in the shared file (each 64-byte aligned)."""
    return sum(align(p.numel() * p.element_size()) for p in params)


@torch.no_grad()
def move_parameters(params: list[torch.nn.Parameter], buffer: torch.Tensor, start: int) -> None:
    """Move each parameter's data into ``buffer`` (the mapped shared file) from byte
    ``start`` on, one after another; the old memory is freed as each one moves."""
    at = start
    for p in params:
        nbytes = p.numel() * p.element_size()
        dst = buffer[at:at + nbytes].view(p.dtype).view(p.shape)
        dst.copy_(p.data)
        p.data = dst
        at += align(nbytes)
    _return_freed_memory()


def _return_freed_memory() -> None:
    """Hand the parameters' old pages back to the system (glibc keeps freed heap pages)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# ----- where the pieces lie -----------------------------------------------------------------
def place_in_file(plan: ReshardPlan, offsets: dict[Holding, int]) -> None:
    """Point every piece of ``plan`` at its part of its holding, which lies at
    ``offsets[holding]`` (bytes) in the file. Buckets keep their tensors (units still never
    straddle buckets); each lists the regions of the file its pieces lie in."""
    size = torch.empty((), dtype=plan.wire_dtype).element_size()
    for bucket in plan.buckets:
        regions: dict[int, tuple[int, int, int]] = {}
        for t in bucket.tensors:
            t.pieces = [_in_holding(p, offsets[p.holding], size) for p in t.pieces]
            for p in t.pieces:
                h = p.holding
                at = offsets[h]
                regions.setdefault(at, (at, int(torch.Size(h.shape).numel()) * size, h.rank))
        bucket.regions = _runs(sorted(regions.values()))


def _runs(regions: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(offset, nbytes, rank) regions, sorted, merged where one follows the other (up to the
    alignment padding between parameters) and cut into runs of at most ``REGION_BYTES``."""
    merged: list[list[int]] = []
    for at, n, rank in regions:
        last = merged[-1] if merged else None
        if last and last[2] == rank and 0 <= at - (last[0] + last[1]) < ALIGN:
            last[1] = at + n - last[0]
        else:
            merged.append([at, n, rank])
    return [(at + s, min(REGION_BYTES, n - s), rank)
            for at, n, rank in merged for s in range(0, n, REGION_BYTES)]


def _in_holding(p: Piece, at: int, size: int) -> Piece:
    """``p`` placed in its holding, which starts at byte ``at`` of the shared file: where
    its cut of a (meta) tensor of the holding's shape lies, and its strides if not contiguous."""
    part = p.cut(torch.empty(p.holding.shape, device="meta"))
    layout = None if part.is_contiguous() else (tuple(part.shape), tuple(part.stride()))
    return replace(p, offset=at + part.storage_offset() * size, layout=layout)
