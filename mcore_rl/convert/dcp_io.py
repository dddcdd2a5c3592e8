"""Megatron distributed checkpoints (``torch_dist`` format), read and written piece by piece.

Megatron's ``dist_checkpointing`` stores a model as a PyTorch Distributed Checkpoint (DCP):
each tensor is a *global* tensor (layers stacked on a leading axis, TP shards put back
together) stored as chunks, plus ``metadata.json`` naming the backend and an (empty for a
model) ``common.pt``. The chunks are what each rank of the saving layout held.

- `DCPWriter` writes such a checkpoint from a list of chunks and a function that makes each
  chunk's tensor when the writer asks for it, so only one chunk is in memory at a time. Given
  the chunks Megatron itself writes at a layout (`mcore_rl.models.mapping.tp_chunks`), the
  result is the checkpoint Megatron would write from that layout; Megatron's own loader reads
  it at any layout.
- `DCPReader` reads any region of any tensor (e.g. one layer), touching only the chunks
  that overlap it.
Only public DCP types are used (planners, metadata, ``FileSystemReader/Writer``).
"""
from __future__ import annotations

import io
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem,
                                                  SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)

MEGATRON_CHECKPOINT_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                              "common_backend": "torch", "common_backend_version": 1}


@dataclass(frozen=True)
class TensorChunk:
    """One stored piece of a global tensor."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.sizes:
            n *= s
        return n


class _StreamingSavePlanner(DefaultSavePlanner):
    """Plans the given chunks and produces each one's data only when the writer asks."""

    def __init__(self, items: list[WriteItem], resolve: Callable[[WriteItem], object]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items, self._resolve = items, resolve

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        super().set_up_planner({}, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        return self._resolve(write_item)


class DCPWriter:
    """Writes a Megatron ``torch_dist`` checkpoint one chunk at a time (single process)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def write(self, chunks: list[TensorChunk], make_chunk: Callable[[TensorChunk], torch.Tensor],
              objects: dict[str, object] | None = None,
              on_chunk: Callable[[TensorChunk], None] | None = None) -> None:
        """Write ``chunks`` (data from ``make_chunk``) and pickled ``objects`` (name -> value).

        ``on_chunk`` is called after each chunk's data was produced (progress reporting).
        """
        by_index = {(c.key, tuple(c.offsets)): c for c in chunks}
        items = [WriteItem(index=MetadataIndex(c.key, torch.Size(c.offsets)),
                           type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(torch.Size(c.offsets),
                                                          torch.Size(c.sizes)),
                               properties=TensorProperties(dtype=c.dtype),
                               size=torch.Size(c.global_shape)))
                 for c in chunks]
        objects = objects or {}
        items += [WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO)
                  for name in objects]

        def resolve(item: WriteItem):
            if item.type == WriteItemType.BYTE_IO:
                buffer = io.BytesIO()
                torch.save(objects[item.index.fqn], buffer)
                buffer.seek(0)
                return buffer
            chunk = by_index[(item.index.fqn, tuple(item.index.offset))]
            data = make_chunk(chunk).to(chunk.dtype).contiguous()
            if tuple(data.shape) != tuple(chunk.sizes):
                raise ValueError(f"{chunk.key} chunk at {chunk.offsets}: made {tuple(data.shape)}, "
                                 f"planned {chunk.sizes}")
            if on_chunk is not None:
                on_chunk(chunk)
            return data

        self.path.mkdir(parents=True, exist_ok=True)
        writer = dcp.FileSystemWriter(str(self.path), single_file_per_rank=True, thread_count=1,
                                      overwrite=True)
        with warnings.catch_warnings():  # single-process save is the intent, not a mistake
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp.save({}, storage_writer=writer, planner=_StreamingSavePlanner(items, resolve),
                         no_dist=True)
            except CheckpointException as err:
                # DCP wraps what went wrong (a bad input file, a full disk): re-raise that.
                for exc, _trace in err.failures.values():
                    raise exc from None
                raise
        (self.path / "metadata.json").write_text(json.dumps(MEGATRON_CHECKPOINT_CONFIG))
        torch.save({}, self.path / "common.pt")


class _RegionLoadPlanner(LoadPlanner):
    """Copies what the reader loads into one destination tensor."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        pass

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.out
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, offset, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class DCPReader:
    """Reads regions of the tensors of a ``torch_dist`` checkpoint, chunk by chunk."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._reader = dcp.FileSystemReader(str(self.path))
        self.metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)

    def tensor_metadata(self) -> dict[str, TensorStorageMetadata]:
        """Global shape, dtype and chunks of every tensor."""
        return {k: v for k, v in self.metadata.state_dict_metadata.items()
                if isinstance(v, TensorStorageMetadata)}

    def read(self, key: str, offsets: tuple[int, ...] | None = None,
             sizes: tuple[int, ...] | None = None) -> torch.Tensor:
        """Region ``offsets``/``sizes`` of global tensor ``key`` (the whole tensor by default)."""
        md = self.metadata.state_dict_metadata[key]
        offsets = tuple(offsets) if offsets is not None else (0,) * len(md.size)
        sizes = tuple(sizes) if sizes is not None else tuple(md.size)
        out = torch.empty(sizes, dtype=md.properties.dtype)
        items, covered = [], 0
        for chunk in md.chunks:
            lo = [max(o, c) for o, c in zip(offsets, chunk.offsets)]
            hi = [min(o + s, c + n)
                  for o, s, c, n in zip(offsets, sizes, chunk.offsets, chunk.sizes)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            lengths = [b - a for a, b in zip(lo, hi)]
            items.append(ReadItem(
                type=LoadItemType.TENSOR, dest_index=MetadataIndex(key, torch.Size(offsets)),
                dest_offsets=torch.Size(a - o for a, o in zip(lo, offsets)),
                storage_index=MetadataIndex(key, chunk.offsets),
                storage_offsets=torch.Size(a - c for a, c in zip(lo, chunk.offsets)),
                lengths=torch.Size(lengths)))
            covered += math.prod(lengths)
        if covered != out.numel():
            raise ValueError(f"{self.path}: the stored chunks of {key} do not cover "
                             f"{offsets}+{sizes}")
        self._reader.read_data(LoadPlan(items), _RegionLoadPlanner(out)).wait()
        return out
