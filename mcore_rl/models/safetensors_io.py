"""Safetensors files, one tensor at a time: read with plain file reads, write as a stream.

The format is an 8-byte little-endian header length, a JSON header
(``name -> {dtype, shape, data_offsets}``) and the raw tensor bytes. Reading with ``pread``
instead of a memory map keeps the resident memory of a conversion at the tensors it holds
(a memory map makes every page it touched count as resident); writing the header first and
then each tensor keeps it at one tensor, where ``safetensors.torch.save_file`` needs all of
a file's tensors at once.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_rl.errors import UsageError

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies: file, dtype, shape and absolute byte range."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file; `UsageError` if it is unreadable or truncated."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise UsageError(f"{path} is truncated or not a safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise UsageError(f"{path} is truncated or not a safetensors file "
                             f"(header of {header_len} bytes, file of {size})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UsageError(f"{path} is not a valid safetensors file (bad header)") from None
    header.pop("__metadata__", None)
    base = 8 + header_len
    tensors, data_end = {}, base
    for name, info in header.items():
        if info["dtype"] not in SAFETENSORS_DTYPES:
            raise UsageError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        tensors[name] = StoredTensor(path, SAFETENSORS_DTYPES[info["dtype"]],
                                     tuple(info["shape"]), base + start, base + end)
        data_end = max(data_end, base + end)
    if data_end > size:
        raise UsageError(f"{path} is truncated ({size} bytes; its header needs {data_end})")
    return tensors


class SafetensorsCheckpoint:
    """The weights of an HF model directory (one file or a sharded index), read lazily.

    Opening checks that every file exists and is complete; tensors are read on demand.
    """

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE_FILE).is_file():
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise UsageError(f"no safetensors weights in {self.dir} (expected {SINGLE_FILE} or "
                             f"{INDEX_FILE})")
        missing = [f for f in files if not (self.dir / f).is_file()]
        if missing:
            raise UsageError(f"safetensors file(s) listed in {INDEX_FILE} are missing from "
                             f"{self.dir}: {', '.join(missing)}")
        self.tensors: dict[str, StoredTensor] = {}
        for name in files:
            self.tensors.update(read_header(self.dir / name))
        if weight_map is not None:
            absent = [n for n, f in weight_map.items() if n not in self.tensors]
            if absent:
                raise UsageError(f"{INDEX_FILE} lists {absent[0]} but its file does not hold it")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def read(self, name: str) -> torch.Tensor:
        """One tensor, read from disk into fresh memory."""
        info = self.tensors[name]
        buffer = bytearray(info.end - info.start)
        with open(info.path, "rb") as f:
            f.seek(info.start)
            if f.readinto(buffer) != len(buffer):
                raise UsageError(f"{info.path} is truncated while reading {name}")
        if not buffer:
            return torch.empty(info.shape, dtype=info.dtype)
        return torch.frombuffer(buffer, dtype=info.dtype).reshape(info.shape)


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor, in the order given at construction."""

    def __init__(self, path: str | Path, specs: list[tuple[str, tuple[int, ...], torch.dtype]]):
        self.path = Path(path)
        self._specs = list(specs)
        header, offset = {}, 0
        for name, shape, dtype in self._specs:
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected_name, shape, dtype = self._specs[self._next]
        if name != expected_name or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(f"expected {expected_name} {tuple(shape)} {dtype}, got {name} "
                             f"{tuple(tensor.shape)} {tensor.dtype}")
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(flat.numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._specs):
            self._file.close()
            raise ValueError(f"{self.path}: {len(self._specs) - self._next} tensors not written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
