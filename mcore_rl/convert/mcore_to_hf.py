"""mcore-rl checkpoint -> HF model directory (safetensors, config, tokenizer), streaming.

Each Megatron tensor is read one layer at a time from the distributed checkpoint (whatever
layout wrote it), unfused (QKV, gate/up), stripped of vocabulary padding and streamed into
safetensors files of at most ``max_shard_bytes`` (with ``model.safetensors.index.json`` when
there is more than one): peak memory is about the largest layer tensor. A tied embedding is
written once (``model.embed_tokens.weight``), as HF stores it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mcore_rl.convert.dcp_io import DCPReader
from mcore_rl.convert.output_dir import atomic_output_dir, check_output_dir
from mcore_rl.convert.progress import progress_bar
from mcore_rl.errors import UsageError
from mcore_rl.models.arch import ModelArch
from mcore_rl.models.checkpoint import (HF_DIR, HF_DTYPE_NAMES, MODEL_DIR, CheckpointMeta,
                                        copy_hf_side_files, read_checkpoint_meta)
from mcore_rl.models.hf_config import SCORE_HEAD
from mcore_rl.models.mapping import TensorMapping, hf_shapes, mcore_shape, tensor_mappings, to_hf
from mcore_rl.models.safetensors_io import INDEX_FILE, SINGLE_FILE, SafetensorsWriter

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


@dataclass
class _Group:
    """The HF tensors made from one Megatron tensor of one layer or expert (one file)."""

    mapping: TensorMapping
    index: tuple[int, ...]
    """(), (layer,) or (layer, expert)."""
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        size = torch.empty((), dtype=self.dtype).element_size()
        return sum(size * int(torch.Size(s).numel()) for s in self.shapes)


def _plan_groups(meta: CheckpointMeta, reader: DCPReader) -> list[_Group]:
    """HF tensors in file order, after checking the checkpoint holds what its metadata says."""
    arch: ModelArch = meta.spec.arch
    stored = reader.tensor_metadata()
    groups = []
    for m in tensor_mappings(arch, meta.spec.head):
        shape = mcore_shape(m, arch)
        expected = (*m.stack_shape(arch), *shape)
        if m.mcore_key not in stored:
            raise UsageError(f"checkpoint does not match its {meta.spec.hf_architecture} "
                             f"metadata: {m.mcore_key} is missing")
        if tuple(stored[m.mcore_key].size) != expected:
            raise UsageError(f"checkpoint does not match its metadata: {m.mcore_key} has shape "
                             f"{list(stored[m.mcore_key].size)}, expected {list(expected)}")
        dtype = stored[m.mcore_key].properties.dtype
        for index in m.instances(arch):
            groups.append(_Group(m, index, m.hf_names_at(index), hf_shapes(m, arch), dtype))
    return groups


def _shard(groups: list[_Group], max_shard_bytes: int) -> list[list[_Group]]:
    shards: list[list[_Group]] = [[]]
    size = 0
    for group in groups:
        if shards[-1] and size + group.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(group)
        size += group.nbytes
    return shards


def hf_config_for_export(meta: CheckpointMeta) -> dict:
    """The original HF config with the architecture, dtype and head of this checkpoint."""
    spec = meta.spec
    config = dict(spec.hf_config)
    config["architectures"] = [spec.hf_architecture]
    config["tie_word_embeddings"] = spec.arch.tie_word_embeddings
    config["dtype"] = HF_DTYPE_NAMES[meta.dtype]
    config.pop("torch_dtype", None)
    config.pop("quantization_config", None)
    if spec.head == SCORE_HEAD:
        config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
        config.pop("num_labels", None)
    return config


def convert_mcore_to_hf(mcore_dir: str | Path, out: str | Path, force: bool = False,
                        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                        progress: bool = True) -> Path:
    """Export the mcore-rl checkpoint ``mcore_dir`` as an HF model directory ``out``."""
    mcore_dir, out = Path(mcore_dir), Path(out)
    meta = read_checkpoint_meta(mcore_dir)
    reader = DCPReader(mcore_dir / MODEL_DIR)
    groups = _plan_groups(meta, reader)
    check_output_dir(out, force)
    shards = _shard(groups, max_shard_bytes)
    names = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    with atomic_output_dir(out, force) as tmp:
        with progress_bar(sum(g.nbytes for g in groups), f"mcore-to-hf {mcore_dir.name}",
                          progress) as bar:
            for file_name, shard in zip(names, shards):
                _write_shard(tmp / file_name, shard, reader, meta.spec.arch, bar)
        if len(shards) > 1:
            weight_map = {n: f for f, shard in zip(names, shards) for g in shard for n in g.names}
            index = {"metadata": {"total_size": sum(g.nbytes for g in groups)},
                     "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        copy_hf_side_files(mcore_dir / HF_DIR, tmp)
        (tmp / "config.json").write_text(json.dumps(hf_config_for_export(meta), indent=2) + "\n")
    return out


def _write_shard(path: Path, shard: list[_Group], reader: DCPReader, arch: ModelArch, bar) -> None:
    specs = [(n, s, g.dtype) for g in shard for n, s in zip(g.names, g.shapes)]
    with SafetensorsWriter(path, specs) as writer:
        for group in shard:
            key = group.mapping.mcore_key
            if not group.index:
                tensor = reader.read(key)
            else:
                shape, n = mcore_shape(group.mapping, arch), len(group.index)
                tensor = reader.read(key, (*group.index, *[0] * len(shape)),
                                     (1,) * n + shape).reshape(shape)
            for name, part in zip(group.names, to_hf(group.mapping, tensor, arch)):
                writer.write(name, part)
            bar.update(group.nbytes)
