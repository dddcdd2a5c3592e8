"""The bucket file: one file in a tmpfs that trainer ranks write and engine processes map.

Created once per `WeightSync` and reused by every bucket of every sync (allocating tmpfs
pages costs more than copying into them). Every mapper sees every write, so weights cross
the process boundary without a socket or a pickle.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch

ALIGN = 64  # piece offsets are cache-line aligned (and aligned for every dtype)


def align(n: int) -> int:
    """``n`` rounded up to a multiple of `ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def create_bucket_file(path: str | Path, nbytes: int, allocate: bool = True) -> None:
    """Create the bucket file with its tmpfs pages allocated up front (``posix_fallocate``:
    cheaper than faulting them in on the first write), or (``allocate=False``) as each page
    is first written."""
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
    """Remove the file's name (its memory lives on while some process maps it)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def piece_view(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype,
               shape) -> torch.Tensor:
    """A typed view [shape] of ``nbytes`` bytes at ``offset`` of a mapped bucket."""
    return buffer[offset:offset + nbytes].view(dtype).view(tuple(shape))


class BucketReader:
    """An engine process's mapping of the bucket file, kept from one sync to the next."""

    def __init__(self) -> None:
        self.key: tuple[str, int] | None = None
        self.buffer: torch.Tensor | None = None

    def open(self, path: str, nbytes: int) -> torch.Tensor:
        """The read-only mapping of ``path``, reused while (path, nbytes) stay the same."""
        if self.key != (path, nbytes):
            self.buffer, self.key = map_bucket_file(path, nbytes, writable=False), (path, nbytes)
        return self.buffer

    def close(self) -> None:
        self.buffer, self.key = None, None
