"""Checksums of bucket pieces, computed by their writers and checked by the engine.

- ``sum64`` (default): two 64-bit sums over the piece's 8-byte words, plain and weighted by
  the index of their 4 KiB block. Any change confined to one word (every single-bit flip,
  any corrupted byte) changes the first sum; data moved between blocks (a shifted or
  misplaced write) changes the second. Torch reductions, so it runs at memory speed; writers
  sum each piece right after copying it into the bucket (`copy_and_checksum`; large pieces
  1 MiB at a time), while it is still in the core's cache.
- ``crc32``: zlib CRC-32, also catches reorderings inside a block; several times slower,
  which on CPU costs more than the copy it protects.
"""
from __future__ import annotations

import zlib

import torch

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
