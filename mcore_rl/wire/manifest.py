"""The manifest of a bucket, and reading the tensors it describes.

Each bucket is described by a *manifest*, plain Python (lists, ints, strings), so it passes
unchanged through ``collective_rpc`` to an engine's worker processes::

    {"bucket": k, "num_buckets": n, "version": v, "checksum": "sum64" | "crc32",
     "tensors": [[hf_name, dtype, shape, axis, [[offset, nbytes, piece_shape, checksum], ...]], ...],
     "regions": [[offset, nbytes, checksum], ...]}        # in-place (shared) pieces only

A tensor is one or more *pieces*, each a contiguous byte range written by one trainer rank
(its TP shard of the tensor). Pieces along axis 0 lie back to back, so the tensor is a view
of the file; pieces along axis 1 (row-parallel weights split by a trainer TP > 1) are
concatenated by the reader. Every piece carries the checksum its writer computed after
writing; readers check all pieces of a bucket before using any of it.

Where the file holds the trainer's parameters themselves (the shared transport), a piece is
wherever its part of a parameter lies, with a fifth entry ``[view_shape, view_strides]``
(elements) where that part is strided (the q, k or v rows of Megatron's interleaved
``linear_qkv``), and its checksum is None: the writers checksum *regions* instead (runs of
the file's bytes that hold the bucket's parameters), listed under ``"regions"``.
"""
from __future__ import annotations

import torch

from mcore_rl.wire.bucket_file import piece_view
from mcore_rl.wire.checksum import checksum
from mcore_rl.wire.errors import BucketChecksumError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


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
