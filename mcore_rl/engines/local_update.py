"""`RolloutEngine.update_weights`: HF-named tensors of one process through a bucket session.

The distributed path (trainer ranks writing their shards) is `mcore_rl.reshard.stream`;
this is the same wire format for tensors that already sit whole in one process (an HF
state dict, a test). Tensors of one engine module stay in one bucket.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Iterable

import torch

from mcore_rl.wire import (DTYPE_NAMES, WeightSyncError, align, copy_and_checksum,
                           create_bucket_file, engine_module, map_bucket_file, piece_view,
                           remove_bucket_file)


def _group_into_buckets(named: list[tuple[str, torch.Tensor]],
                        bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    units: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        units.setdefault(engine_module(name), []).append((name, tensor))
    buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for unit in units.values():
        unit_bytes = sum(align(t.numel() * t.element_size()) for _, t in unit)
        if buckets[-1] and size + unit_bytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].extend(unit)
        size += unit_bytes
    return buckets


def update_from_tensors(engine, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                        bucket_bytes: int, shm_dir: str = "/dev/shm",
                        algorithm: str = "sum64") -> None:
    named = [(n, t.detach().contiguous()) for n, t in named_tensors]
    buckets = _group_into_buckets(named, bucket_bytes)
    capacity = max(sum(align(t.numel() * t.element_size()) for _, t in b) for b in buckets)
    path = Path(shm_dir) / f"mcore_rl_update_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    create_bucket_file(path, capacity)
    try:
        buffer = map_bucket_file(path, capacity)
        engine.attach_update_buffer(str(path), capacity)
        remove_bucket_file(path)  # lives on while mapped
        engine.begin_update(str(path), capacity, version)
        try:
            for k, bucket in enumerate(buckets):
                tensors, at = [], 0
                for name, t in bucket:
                    nbytes = t.numel() * t.element_size()
                    dst = piece_view(buffer, at, nbytes, t.dtype, t.shape)
                    sums = copy_and_checksum(dst, t, algorithm)
                    tensors.append([name, DTYPE_NAMES[t.dtype], list(t.shape), 0,
                                    [[at, nbytes, list(t.shape), sums]]])
                    at = align(at + nbytes)
                engine.load_bucket({"bucket": k, "num_buckets": len(buckets), "version": version,
                                    "checksum": algorithm, "tensors": tensors})
        except Exception as err:
            engine.abort_update(f"weight update to version {version} failed: {err}")
            raise WeightSyncError(str(err)) from err
        engine.finish_update(version)
    finally:
        engine.release_update_buffer()
        remove_bucket_file(path)
