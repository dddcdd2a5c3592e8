"""HF checkpoint -> mcore-rl checkpoint (Megatron ``torch_dist``), streaming, in one process.

The Megatron checkpoint is written chunk by chunk, each chunk made from the HF tensors it
needs (fused and padded) at the moment the writer asks for it: peak memory is about the
largest layer tensor, whatever the model size. The chunks are those Megatron writes when
saving from TP ``tp`` (every layer is a chunk of its own, so PP does not change them); the
checkpoint loads at any layout that divides the model. Everything is checked before the
first byte is written, and the output appears only when complete.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from mcore_rl.convert.dcp_io import DCPWriter, TensorChunk
from mcore_rl.convert.output_dir import atomic_output_dir, check_output_dir
from mcore_rl.convert.progress import progress_bar
from mcore_rl.errors import UsageError
from mcore_rl.models.checkpoint import (DTYPE_NAMES, HF_DIR, MODEL_DIR, TORCH_DTYPES,
                                        CheckpointMeta, copy_hf_side_files, write_checkpoint_meta)
from mcore_rl.models.hf_config import ModelSpec, load_hf_spec
from mcore_rl.models.hf_weights import HFWeightSource
from mcore_rl.models.arch import ModelArch
from mcore_rl.models.mapping import (EXPERT_EXTRA_STATE_KEYS, EXTRA_STATE_KEYS, mcore_shape,
                                     tensor_mappings, tp_chunks)
from mcore_rl.models.provider import check_layout


def plan_chunks(spec: ModelSpec, tp: int, dtype: torch.dtype) -> list[TensorChunk]:
    """Every chunk of a checkpoint saved by Megatron at TP ``tp``, in HF file order."""
    arch, chunks = spec.arch, []
    for m in tensor_mappings(arch, spec.head):
        shape, stack = mcore_shape(m, arch), m.stack_shape(arch)
        for index in m.instances(arch):
            for offsets, sizes in tp_chunks(m, arch, tp):
                chunks.append(TensorChunk(m.mcore_key, (*stack, *shape), (*index, *offsets),
                                          (1,) * len(index) + tuple(sizes), dtype))
    return chunks


def extra_state_objects(arch: ModelArch) -> dict[str, object]:
    """Megatron's linear-layer extra states (empty: ``[None]``), by stored name: one per
    layer (``shard_{layer}_{L}``), and one per layer and expert for expert layers
    (``shard_{layer}.{expert}_{L}.{E}``)."""
    L, E = arch.num_layers, arch.num_experts
    keys = [k for k in EXTRA_STATE_KEYS if not (arch.is_moe and k.startswith("decoder.layers.mlp"))]
    out: dict[str, object] = {f"{key}/shard_{layer}_{L}": [None]
                              for layer in range(L) for key in keys}
    if arch.is_moe:
        out.update({f"{key}/shard_{layer}.{e}_{L}.{E}": [None]
                    for layer in range(L) for e in range(E) for key in EXPERT_EXTRA_STATE_KEYS})
    return out


def convert_hf_to_mcore(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1,
                        dtype: str | None = None, force: bool = False,
                        progress: bool = True) -> Path:
    """Convert the HF model in ``hf_dir`` into an mcore-rl checkpoint at ``out``.

    ``dtype``: ``fp32``, ``bf16`` or ``fp16`` (default: the dtype the HF weights are stored
    in). Raises `UsageError` (nothing written) on bad input.
    """
    hf_dir, out = Path(hf_dir), Path(out)
    if tp < 1 or pp < 1:
        raise UsageError("--tp and --pp must be positive")
    spec = load_hf_spec(hf_dir)
    spec = replace(spec, arch=spec.arch.with_vocab_multiple_for_tp(tp))
    check_layout(spec.arch, tp, pp)
    source = HFWeightSource(hf_dir, spec)
    source.check_matches_config()
    if dtype is None:
        dtype = DTYPE_NAMES.get(source.stored_dtype, "fp32")
    if dtype not in TORCH_DTYPES:
        raise UsageError(f"dtype {dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
    source.dtype = TORCH_DTYPES[dtype]
    check_output_dir(out, force)

    chunks = plan_chunks(spec, tp, source.dtype)
    with atomic_output_dir(out, force) as tmp:
        with progress_bar(sum(c.nbytes for c in chunks), f"hf-to-mcore {hf_dir.name}",
                          progress) as bar:
            DCPWriter(tmp / MODEL_DIR).write(
                chunks, lambda c: source.read(c.key, c.offsets, c.sizes),
                objects=extra_state_objects(spec.arch),
                on_chunk=lambda c: bar.update(c.nbytes))
        copy_hf_side_files(hf_dir, tmp / HF_DIR)
        write_checkpoint_meta(tmp, CheckpointMeta(spec=spec, dtype=dtype,
                                                  written_layout={"tp": tp, "pp": pp}))
    return out
