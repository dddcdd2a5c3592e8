"""HF safetensors -> Megatron tensors: any region of any Megatron tensor, one layer at a time.

`HFWeightSource` answers "give me rows a..b of layer 7's ``linear_qkv.weight``" from an HF
checkpoint (reading q, k and v, fusing, padding the vocabulary). `load_hf_weights` fills the
model chunks of a rank at any TP/PP layout with it, through the chunks' own
``sharded_state_dict()`` (which says which region of which global tensor each parameter
holds), so no layout arithmetic is repeated here. The converter (`mcore_rl.convert`) uses the
same source to write a Megatron checkpoint without building a model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch

from mcore_rl.errors import UsageError
from mcore_rl.models.hf_config import ModelSpec
from mcore_rl.models.mapping import TensorMapping, hf_shapes, tensor_mappings, to_mcore
from mcore_rl.models.safetensors_io import SafetensorsCheckpoint

# Tensors some HF checkpoints carry that the model recomputes (RoPE buffers).
IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)


class HFWeightSource:
    """Global Megatron tensors built from an HF checkpoint, region by region.

    ``dtype`` converts on read (None keeps the stored dtype). One fused layer tensor is cached,
    so reading the TP pieces of one layer in a row reads its HF tensors once.
    """

    def __init__(self, hf_dir: str | Path, spec: ModelSpec, dtype: torch.dtype | None = None):
        self.checkpoint = SafetensorsCheckpoint(hf_dir)
        self.spec = spec
        self.arch = spec.arch
        self.dtype = dtype
        self.mappings: dict[str, TensorMapping] = {
            m.mcore_key: m for m in tensor_mappings(spec.arch, spec.head)}
        self._cached: tuple[tuple[str, int | None], torch.Tensor] | None = None

    def check_matches_config(self) -> None:
        """`UsageError` unless the weights are exactly those the config describes."""
        expected: dict[str, tuple[int, ...]] = {}
        for m in self.mappings.values():
            for index in m.instances(self.arch):
                expected.update(zip(m.hf_names_at(index), hf_shapes(m, self.arch)))
        problem = None
        for name, shape in expected.items():
            if name not in self.checkpoint:
                problem = f"{name} is missing from the weights"
            elif self.checkpoint.tensors[name].shape != shape:
                problem = (f"{name} has shape {list(self.checkpoint.tensors[name].shape)}, "
                           f"the config implies {list(shape)}")
            if problem:
                break
        if problem is None:
            extra = [n for n in self.checkpoint.names() if n not in expected
                     and not n.endswith(IGNORED_HF_SUFFIXES)
                     and not (n == "lm_head.weight" and self.arch.tie_word_embeddings)]
            if extra:
                problem = f"the weights hold {extra[0]}, which the config does not describe"
        if problem:
            raise UsageError(f"config.json does not match the weights: {problem}")

    @property
    def stored_dtype(self) -> torch.dtype:
        return self.checkpoint.tensors["model.embed_tokens.weight"].dtype

    def layer_tensor(self, key: str, index: tuple[int, ...] | int | None) -> torch.Tensor:
        """The whole Megatron tensor ``key`` of one instance: ``(layer,)`` or
        ``(layer, expert)`` (an int is a layer; None or () for non-layer keys)."""
        if index is None or isinstance(index, int):
            index = () if index is None else (index,)
        if self._cached is not None and self._cached[0] == (key, index):
            return self._cached[1]
        m = self.mappings.get(key)
        if m is None:
            raise KeyError(f"{key} is not made from HF tensors of a {self.spec.hf_architecture}")
        hf = [self.checkpoint.read(name) for name in m.hf_names_at(index)]
        if self.dtype is not None:
            hf = [t.to(self.dtype) for t in hf]
        tensor = to_mcore(m, hf, self.arch)
        self._cached = ((key, index), tensor)
        return tensor

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """Region ``offsets``/``sizes`` of global tensor ``key`` (stacked axes first: layer,
        then expert for expert tensors; one index of each at a time)."""
        m = self.mappings.get(key)
        if m is None:
            raise KeyError(f"{key} is not made from HF tensors of a {self.spec.hf_architecture}")
        stacked = len(m.stack_shape(self.arch))
        if any(n != 1 for n in sizes[:stacked]):
            raise ValueError(f"read one layer (and expert) of {key} at a time, not {sizes[:stacked]}")
        tensor = self.layer_tensor(key, tuple(offsets[:stacked]))
        index = tuple(slice(o, o + s) for o, s in zip(offsets[stacked:], sizes[stacked:]))
        return tensor[index].reshape(sizes)


def iter_sharded_tensors(chunk) -> Iterator:
    """The ``ShardedTensor``s of a model chunk (factories such as fc1's gate/up split built);
    their ``data`` are views of the parameters."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = chunk.sharded_state_dict()
    apply_factories(sharded)
    for value in nested_values(sharded):
        if isinstance(value, ShardedTensor):
            yield value


@torch.no_grad()
def load_hf_weights(chunks: list, source: HFWeightSource, skip_keys: tuple[str, ...] = ()) -> None:
    """Fill this rank's model chunks (any TP/PP/VPP layout) from an HF checkpoint.

    ``skip_keys``: Megatron keys left as they are (a critic's fresh head). Every other
    parameter is overwritten; a parameter the source cannot provide raises.
    """
    for chunk in chunks:
        for sh in iter_sharded_tensors(chunk):
            if sh.key in skip_keys:
                continue
            sizes = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
            region = source.read(sh.key, tuple(sh.global_offset), sizes)
            sh.data.copy_(region.reshape(sh.data.shape))
