"""The shared transport: the trainer's parameters live in the file the engine maps.

With the bucket transport every sync copies the model into a shared-memory bucket and the
engine reads it from there. On a CPU trainer the copy can go: when `WeightSync` is built,
each writing rank moves the parameters it sends (their ``.data``) into its region of one
file in ``reshard.shm_dir``, mapped by every trainer rank and by the engine's processes.
The optimizer keeps updating the same `Parameter` objects, now backed by that file, and a
sync publishes them where they lie: each rank checksums its regions (the engine checks them
before loading), the manifest points every piece at its part of a parameter (a strided view
for q, k and v, which Megatron interleaves per query group), and the engine reads them in
place. What a sync moves is then only what the engine itself copies into its own weights.
(The GPU analogue hands the engine CUDA IPC handles of the trainer's tensors.)

Used (``reshard.transport: auto``) when every writing rank's parameters are CPU tensors that
own their memory (Megatron's distributed optimizer makes them views of one flat buffer, which
this does not move), each sent holding is a contiguous part of one of them, and their dtype
is the wire dtype; otherwise `shared_transport_problem` says why and the bucket transport
is used. Memory: the parameters move, they are not copied; the file's pages are allocated
as each parameter is moved in (no ``fallocate``) and its old memory is freed right after, so
setting up costs at most one parameter extra at a time.
"""
from __future__ import annotations

import ctypes

import torch

from mcore_rl.wire import align
from mcore_rl.reshard.plan import Holding


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def sent_parameters(params: list[torch.nn.Parameter], holdings: list[Holding],
                    views: dict) -> list[torch.nn.Parameter]:
    """The parameters behind this rank's main holdings (those it sends), in model order."""
    keys = {_storage_key(views[(h.key, h.layer, h.offsets)]) for h in holdings if h.main}
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
        view = views[(h.key, h.layer, h.offsets)]
        where = f"{h.key}" + (f" (layer {h.layer})" if h.layer is not None else "")
        if view.device.type != "cpu":
            return f"{where} is on {view.device}, not in CPU memory"
        if view.dtype != dtype:
            return f"{where} is {view.dtype}, the engine takes {dtype}"
        if not view.is_contiguous():
            return f"{where} is not contiguous"
        owner = owners.get(_storage_key(view))
        if owner is None:
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
