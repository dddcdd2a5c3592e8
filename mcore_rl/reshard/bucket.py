"""The shared-memory bucket: the one wire format between trainer ranks and engine processes.

A sync streams the model through *one* file in ``/dev/shm`` (tmpfs: RAM, no disk), reused
for every bucket and every sync (allocating tmpfs pages costs more than copying into them). Trainer ranks write their pieces into it; the engine's processes map the
same file and read the tensors in place, so weights cross the process boundary without a
socket or a pickle. Each bucket is described by a *manifest*, plain Python (lists, ints,
strings), so it passes unchanged through ``collective_rpc`` to vLLM's worker processes::

    {"bucket": k, "num_buckets": n, "version": v, "checksum": "sum64" | "crc32",
     "tensors": [[hf_name, dtype, shape, axis, [[offset, nbytes, piece_shape, checksum], ...]], ...],
     "regions": [[offset, nbytes, checksum], ...]}        # shared transport only

A tensor is one or more *pieces*, each a contiguous byte range written by one trainer rank
(its TP shard of the tensor). Pieces along axis 0 lie back to back, so the tensor is a view
of the file; pieces along axis 1 (row-parallel weights split by a trainer TP > 1) are
concatenated by the reader. Every piece carries the checksum its writer computed after
writing; readers check all pieces of a bucket before using any of it.

With the *shared* transport (`mcore_rl.reshard.shared_weights`) the file holds the trainer's
parameters themselves and nothing is copied into it: a piece is then wherever its part of a
parameter lies, with a fifth entry ``[view_shape, view_strides]`` (elements) where that part
is strided (the q, k or v rows of Megatron's interleaved ``linear_qkv``), and its checksum
is None: the writers checksum *regions* instead (runs of the file's bytes that hold the
bucket's parameters, `mcore_rl.reshard.plan.REGION_BYTES` at most), listed under
``"regions"``, and readers check those.

Checksums (``reshard.checksum``):
- ``sum64`` (default): two 64-bit sums over the piece's 8-byte words, plain and weighted by
  the index of their 4 KiB block. Any change confined to one word (every single-bit flip,
  any corrupted byte) changes the first sum; data moved between blocks (a shifted or
  misplaced write) changes the second. ~20 GB/s on one core here from memory, ~60 GB/s
  from cache (torch reductions): writers sum each piece right after copying it into the
  bucket (`copy_and_checksum`; large pieces 1 MiB at a time), while it is still cached.
- ``crc32``: zlib CRC-32, also catches reorderings inside a block; ~4 GB/s, which on CPU
  costs more than the copy it protects (tmpfs writes run at ~13 GB/s once pages exist).
"""
from __future__ import annotations

import os
import warnings
import zlib
from pathlib import Path

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ALIGN = 64  # piece offsets are cache-line aligned (and aligned for every dtype)


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message says what and in which state the engine is."""


class BucketChecksumError(WeightSyncError):
    """A piece of a bucket does not have the checksum its writer computed."""


class BucketReader:
    """An engine process's mapping of the bucket file, kept from one sync to the next."""

    def __init__(self) -> None:
        self.key: tuple[str, int] | None = None
        self.buffer: torch.Tensor | None = None

    def open(self, path: str, nbytes: int) -> torch.Tensor:
        if self.key != (path, nbytes):
            self.buffer, self.key = map_bucket_file(path, nbytes, writable=False), (path, nbytes)
        return self.buffer

    def close(self) -> None:
        self.buffer, self.key = None, None


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


CHECKSUMS = ("sum64", "crc32")
_BLOCK_WORDS = 512  # 4 KiB blocks for the position-weighted sum
_BLOCK = 8 * _BLOCK_WORDS
_CHUNK = 256 * _BLOCK  # 1 MiB: copied, then summed while it is still in the core's cache
_CHUNKED_ABOVE = 16 * _CHUNK  # smaller pieces stay in the shared cache between copy and sum
_WEIGHTS: list[torch.Tensor] = [torch.ones(0, dtype=torch.int64)]


def _weights(n: int) -> torch.Tensor:
    """Block weights 1..n (int64), from one cached ``arange``."""
    if _WEIGHTS[0].numel() < n:
        _WEIGHTS[0] = torch.arange(1, max(n, 2 * _WEIGHTS[0].numel()) + 1, dtype=torch.int64)
    return _WEIGHTS[0][:n]


def _wrap64(x: int) -> int:
    """``x`` as a (wrapped-around) signed 64-bit integer, as torch's int64 sums give it."""
    return (x + 2**63) % 2**64 - 2**63


def _sum64_finish(rows: torch.Tensor | None, rest: int) -> list[int]:
    """[plain, weighted] sums from the full blocks' sums ``rows`` and ``rest``, the sum of
    what follows them (the last, partial block and the unaligned bytes), weighted last."""
    if rows is None or rows.numel() == 0:
        return [_wrap64(rest), _wrap64(rest)]
    plain, weighted = torch.stack([rows.sum(), torch.dot(rows, _weights(rows.numel()))]).tolist()
    return [_wrap64(plain + rest), _wrap64(weighted + rest * (rows.numel() + 1))]


def _sum64(data: torch.Tensor) -> list[int]:
    n = data.numel()
    head = min((-data.storage_offset()) % 8, n)  # bytes before 8-byte alignment
    end = head + (n - head) // 8 * 8
    if end == head:  # no whole aligned word
        return _sum64_finish(None, sum(data.tolist()))
    words = data[head:end].view(torch.int64)
    full = words.numel() // _BLOCK_WORDS * _BLOCK_WORDS
    rows = words[:full].view(-1, _BLOCK_WORDS).sum(1) if full else None
    rest = int(words[full:].sum()) if full < words.numel() else 0
    if head or end < n:  # unaligned bytes count as one word each
        rest += sum(data[:head].tolist()) + sum(data[end:].tolist())
    return _sum64_finish(rows, rest)


def checksum(view: torch.Tensor, algorithm: str = "sum64") -> list[int]:
    """Checksum of a contiguous tensor's bytes, as a list of ints (JSON/msgpack friendly)."""
    data = view.reshape(-1).view(torch.uint8)
    if algorithm == "crc32":
        return [zlib.crc32(memoryview(data.numpy()))]
    if algorithm == "sum64":
        return _sum64(data)
    raise ValueError(f"unknown checksum {algorithm!r} (known: {', '.join(CHECKSUMS)})")


def copy_and_checksum(dst: torch.Tensor, src: torch.Tensor, algorithm: str = "sum64") -> list[int]:
    """``dst.copy_(src)`` (casting to ``dst``'s dtype) and the checksum of ``dst`` afterwards,
    equal to ``checksum(dst, algorithm)``. ``dst`` is a contiguous view of a bucket. With
    ``sum64``, a large piece (over 16 MiB: an embedding) with a contiguous ``src`` and an
    8-byte aligned ``dst`` is copied 1 MiB at a time, each MiB summed right after its copy
    while it is still in the core's cache: one pass over memory instead of two."""
    nbytes = dst.numel() * dst.element_size()
    if (algorithm != "sum64" or nbytes <= _CHUNKED_ABOVE or not src.is_contiguous()
            or (dst.storage_offset() * dst.element_size()) % 8):
        dst.copy_(src.view(dst.shape) if src.shape != dst.shape else src)
        return checksum(dst, algorithm)
    out, flat = dst.reshape(-1), src.reshape(-1)
    step = _CHUNK // dst.element_size()
    words = out.view(torch.uint8)[:nbytes // 8 * 8].view(torch.int64)
    full = words.numel() // _BLOCK_WORDS * _BLOCK_WORDS
    rows, chunk_words = [], _CHUNK // 8
    for k, at in enumerate(range(0, out.numel(), step)):
        out[at:at + step].copy_(flat[at:at + step])
        w0 = k * chunk_words
        w1 = min(w0 + chunk_words, full)
        if w1 > w0:
            rows.append(words[w0:w1].view(-1, _BLOCK_WORDS).sum(1))
    rest = int(words[full:].sum()) if full < words.numel() else 0
    if nbytes % 8:
        rest += sum(out.view(torch.uint8)[nbytes // 8 * 8:].tolist())
    return _sum64_finish(torch.cat(rows), rest)


def create_bucket_file(path: str | Path, nbytes: int, allocate: bool = True) -> None:
    """Create the bucket file with its tmpfs pages allocated up front (``posix_fallocate``:
    cheaper than faulting them in on the first write, which runs at ~1.4 GB/s here), or
    (``allocate=False``) as each page is first written."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    try:
        try:
            if not allocate:
                raise OSError
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError:  # file systems without fallocate: pages come on first write
            os.ftruncate(fd, max(nbytes, 1))
    finally:
        os.close(fd)


def map_bucket_file(path: str | Path, nbytes: int, writable: bool = True) -> torch.Tensor:
    """The file as a shared uint8 tensor [nbytes] (writes are visible to every mapper).
    ``writable=False`` (engines): a read-only mapping, where a stray write faults instead of
    changing the weights, which with the shared transport are the trainer's parameters."""
    if writable:
        return torch.from_file(str(path), shared=True, size=max(nbytes, 1), dtype=torch.uint8)
    array = np.memmap(path, dtype=np.uint8, mode="r", shape=(max(nbytes, 1),))
    with warnings.catch_warnings():  # torch warns that the array is not writable: intended
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def remove_bucket_file(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def piece_view(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype,
               shape) -> torch.Tensor:
    """A typed view [shape] of ``nbytes`` bytes at ``offset`` of a mapped bucket."""
    return buffer[offset:offset + nbytes].view(dtype).view(tuple(shape))


def check_manifest(buffer: torch.Tensor, manifest: dict) -> None:
    """Raise `BucketChecksumError` naming the first piece (or region) whose checksum does not
    match."""
    algorithm = manifest["checksum"]
    where = f"bucket {manifest['bucket'] + 1}/{manifest['num_buckets']} of weight version " \
            f"{manifest['version']}"
    for name, _dtype, _shape, _axis, pieces in manifest["tensors"]:
        for i, (offset, nbytes, _pshape, expected, *_view) in enumerate(pieces):
            if expected is None:  # covered by a region
                continue
            got = checksum(buffer[offset:offset + nbytes], algorithm)
            if got != list(expected):
                raise BucketChecksumError(
                    f"{where}: piece {i} of {name} has {algorithm} checksum {got}, its writer "
                    f"computed {list(expected)} (corrupted in transit)")
    for offset, nbytes, expected in manifest.get("regions", ()):
        got = checksum(buffer[offset:offset + nbytes], algorithm)
        if got != list(expected):
            names = [name for name, dtype, *_, pieces in manifest["tensors"]
                     if any(p[0] < offset + nbytes and offset < p[0] + _span(p, DTYPES[dtype])
                            for p in pieces)]
            raise BucketChecksumError(
                f"{where}: the parameter region at byte {offset} ({nbytes} bytes, holding "
                f"{', '.join(names) or 'no piece'}) has {algorithm} checksum {got}, its writer "
                f"computed {list(expected)} (changed after it was published)")


def _span(entry: list, dtype: torch.dtype) -> int:
    """Bytes from a manifest piece's first element to the end of its last."""
    layout = entry[4] if len(entry) > 4 else None
    if layout is None:
        return entry[1]
    size = torch.empty((), dtype=dtype).element_size()
    return (sum((n - 1) * s for n, s in zip(*layout)) + 1) * size


def _piece(buffer: torch.Tensor, entry: list, dtype: torch.dtype) -> torch.Tensor:
    """One manifest piece as a view of ``buffer`` (strided where the entry says so)."""
    offset, nbytes, shape = entry[:3]
    layout = entry[4] if len(entry) > 4 else None
    if layout is None:
        return piece_view(buffer, offset, nbytes, dtype, shape)
    span = _span(entry, dtype)
    return buffer[offset:offset + span].view(dtype).as_strided(tuple(layout[0]), tuple(layout[1]))


def back_to_back(parts: list[torch.Tensor]) -> bool:
    """Contiguous tensors lying one right after the other in memory."""
    return all(t.is_contiguous() for t in parts) and all(
        b.data_ptr() == a.data_ptr() + a.numel() * a.element_size()
        for a, b in zip(parts, parts[1:]))


def read_tensors(buffer: torch.Tensor, manifest: dict) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of a checked bucket: views of the file where the pieces are
    contiguous and back to back, a concatenation otherwise (row-parallel weights arriving in
    column blocks; with the shared transport, pieces from different parameters or strided
    q/k/v rows)."""
    out = []
    for name, dtype_name, shape, axis, pieces in manifest["tensors"]:
        dtype = DTYPES[dtype_name]
        parts = [_piece(buffer, entry, dtype) for entry in pieces]
        if len(parts) == 1:
            tensor = parts[0].reshape(tuple(shape))
        elif axis == 0 and back_to_back(parts):
            start, end = pieces[0][0], pieces[-1][0] + pieces[-1][1]
            tensor = piece_view(buffer, start, end - start, dtype, shape)
        else:
            tensor = torch.cat([part.reshape(entry[2]) for part, entry in zip(parts, pieces)],
                               dim=axis)
        out.append((name, tensor.view(tuple(shape))))
    return out
