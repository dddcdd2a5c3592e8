"""HF <-> Megatron-Core tensor mapping of Llama-style decoders, as pure functions over tensors.

Megatron tensors are named by their *sharded-state-dict key* (``ShardedTensor.key``), which is
the same at every TP/PP layout and for the local and Transformer Engine specs; per-layer
tensors are stacked on a leading layer axis (global layer index). HF tensors are named as in
``model.safetensors``. Legend: nq query heads, ng key/value heads (query groups), d head_dim,
h hidden, f intermediate, V vocab, Vp padded vocab.

Fusions (Megatron layout on the left):
- ``linear_qkv`` [ng * (nq/ng + 2) * d, h] is *per query group interleaved*:
  [q_g0 (nq/ng heads), k_g0, v_g0, q_g1, k_g1, v_g1, ...]. TP rank t holds groups
  [t*ng/tp, (t+1)*ng/tp): a TP-local shard is the same layout with nq/tp, ng/tp heads, so
  `split_qkv` with local head counts unfuses it. The Q/K/V bias (Qwen2) is fused the same way.
- ``linear_fc1`` [2f, h] is [gate; up]. Each TP rank holds [gate_t; up_t] (its rows of both),
  so the *global* tensor is [gate; up] and a local shard is [gate_t; up_t].
- The embedding and an untied ``lm_head`` are padded from V to Vp rows with zeros.
- Qwen3's per-head ``q_norm`` / ``k_norm`` [d] are Megatron's ``q_layernorm`` /
  ``k_layernorm``, replicated on every TP rank.

Mixture of experts (E experts of inner size fe, `EXPERT_NAMINGS` for the HF names):
- the router ``mlp.router.weight`` [E, h] is HF's gate (``mlp.gate`` / Mixtral's
  ``block_sparse_moe.gate``), replicated on every TP rank;
- expert tensors are stacked on two leading axes, layer then *global* expert index
  (``mlp.experts.experts.linear_fc1.weight`` [L, E, 2fe, h], ``linear_fc2`` [L, E, h, fe]):
  Megatron's SequentialMLP keys every local expert by its global index, so the key and the
  expert axis are the same at every EP size. Per expert, fc1 is [gate; up] and TP-split
  like the dense fc1 (by the expert TP size); fc2 is row-parallel like the dense fc2;
- the norm before the experts keeps the dense key (``mlp.linear_fc1.layer_norm_weight``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mcore_rl.models.arch import ModelArch

PLAIN, QKV, GATE_UP, VOCAB = "plain", "qkv", "gate_up", "vocab"


@dataclass(frozen=True)
class TensorMapping:
    """One Megatron tensor and the HF tensor(s) it is made of."""

    mcore_key: str
    """Megatron sharded-state-dict key."""
    hf_names: tuple[str, ...]
    """HF names in fusion order; ``{layer}`` stands for the layer index."""
    per_layer: bool
    """Stacked over layers: the Megatron tensor has a leading axis of num_layers."""
    fusion: str
    """`PLAIN`, `QKV`, `GATE_UP` or `VOCAB` (row padding)."""
    tp_axis: int | None
    """Axis of the per-layer tensor that TP splits (None: replicated on every TP rank)."""
    per_expert: bool = False
    """Stacked over layers and then experts: two leading axes, num_layers and num_experts;
    ``{expert}`` in ``hf_names`` stands for the (global) expert index."""

    def hf_names_for(self, layer: int | None, expert: int | None = None) -> list[str]:
        return [name.format(layer=layer, expert=expert) for name in self.hf_names]

    def stack_shape(self, arch: ModelArch) -> tuple[int, ...]:
        """The leading axes the Megatron tensor is stacked on: (), (L,) or (L, E)."""
        if self.per_expert:
            return (arch.num_layers, arch.num_experts)
        return (arch.num_layers,) if self.per_layer else ()

    def instances(self, arch: ModelArch) -> list[tuple[int, ...]]:
        """Every index into the stacked axes: [()], [(layer,)...] or [(layer, expert)...]."""
        if self.per_expert:
            return [(l, e) for l in range(arch.num_layers) for e in range(arch.num_experts)]
        return [(l,) for l in range(arch.num_layers)] if self.per_layer else [()]

    def hf_names_at(self, index: tuple[int, ...]) -> list[str]:
        """HF names of one instance (an index from `instances`)."""
        return self.hf_names_for(*index) if index else self.hf_names_for(None)


@dataclass(frozen=True)
class ExpertNaming:
    """HF names of one layer's router and experts (``{layer}``, ``{expert}`` placeholders)."""

    router: str
    gate: str
    up: str
    down: str


EXPERT_NAMINGS: dict[str, ExpertNaming] = {
    "qwen3_moe": ExpertNaming(
        router="model.layers.{layer}.mlp.gate.weight",
        gate="model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
        up="model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
        down="model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"),
    # Mixtral: w1 is the gate, w3 the up projection, w2 the down projection.
    "mixtral": ExpertNaming(
        router="model.layers.{layer}.block_sparse_moe.gate.weight",
        gate="model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
        up="model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
        down="model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight"),
}


def tensor_mappings(arch: ModelArch, head: str) -> list[TensorMapping]:
    """Every Megatron tensor of a model with ``head`` ("lm" or "score"), in HF file order."""
    attn, mlp, layer = "decoder.layers.self_attention", "decoder.layers.mlp", "model.layers.{layer}"
    out = [TensorMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                         False, VOCAB, 0)]
    out.append(TensorMapping(f"{attn}.linear_qkv.layer_norm_weight",
                             (f"{layer}.input_layernorm.weight",), True, PLAIN, None))
    qkv = tuple(f"{layer}.self_attn.{p}_proj" for p in "qkv")
    out.append(TensorMapping(f"{attn}.linear_qkv.weight", tuple(n + ".weight" for n in qkv),
                             True, QKV, 0))
    if arch.qkv_bias:
        out.append(TensorMapping(f"{attn}.linear_qkv.bias", tuple(n + ".bias" for n in qkv),
                                 True, QKV, 0))
    if arch.qk_norm:
        out += [TensorMapping(f"{attn}.{p}_layernorm.weight", (f"{layer}.self_attn.{p}_norm.weight",),
                              True, PLAIN, None) for p in "qk"]
    out += [
        TensorMapping(f"{attn}.linear_proj.weight", (f"{layer}.self_attn.o_proj.weight",),
                      True, PLAIN, 1),
        TensorMapping(f"{mlp}.linear_fc1.layer_norm_weight",
                      (f"{layer}.post_attention_layernorm.weight",), True, PLAIN, None),
    ]
    if arch.is_moe:
        names, experts = EXPERT_NAMINGS[arch.expert_naming], f"{mlp}.experts.experts"
        out += [
            TensorMapping(f"{mlp}.router.weight", (names.router,), True, PLAIN, None),
            TensorMapping(f"{experts}.linear_fc1.weight", (names.gate, names.up), True, GATE_UP,
                          0, per_expert=True),
            TensorMapping(f"{experts}.linear_fc2.weight", (names.down,), True, PLAIN, 1,
                          per_expert=True),
        ]
    else:
        out += [
            TensorMapping(f"{mlp}.linear_fc1.weight",
                          (f"{layer}.mlp.gate_proj.weight", f"{layer}.mlp.up_proj.weight"),
                          True, GATE_UP, 0),
            TensorMapping(f"{mlp}.linear_fc2.weight", (f"{layer}.mlp.down_proj.weight",),
                          True, PLAIN, 1),
        ]
    out.append(TensorMapping("decoder.final_layernorm.weight", ("model.norm.weight",), False,
                             PLAIN, None))
    if head == "score":
        out.append(TensorMapping("output_layer.weight", ("score.weight",), False, PLAIN, None))
    elif not arch.tie_word_embeddings:
        out.append(TensorMapping("output_layer.weight", ("lm_head.weight",), False, VOCAB, 0))
    return out


EXTRA_STATE_KEYS = tuple(f"decoder.layers.{m}._extra_state" for m in (
    "self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2"))
"""Per-layer (empty) extra-state objects that Megatron's linear layers put in a checkpoint."""
EXPERT_EXTRA_STATE_KEYS = tuple(f"decoder.layers.mlp.experts.experts.{m}._extra_state"
                                for m in ("linear_fc1", "linear_fc2"))
"""The same per layer and expert, for the experts' linear layers."""


def ffn_size(m: TensorMapping, arch: ModelArch) -> int:
    """FFN inner size of a gate/up or down tensor: one expert's for expert tensors."""
    return arch.moe_intermediate_size if m.per_expert else arch.intermediate_size


def mcore_shape(m: TensorMapping, arch: ModelArch) -> tuple[int, ...]:
    """Global shape of one layer's (one expert's; or a non-layer) Megatron tensor."""
    h, d, f = arch.hidden_size, arch.kv_channels, ffn_size(m, arch)
    key = m.mcore_key
    if m.fusion == QKV:
        rows = (arch.num_attention_heads + 2 * arch.num_kv_heads) * d
        return (rows, h) if key.endswith("weight") else (rows,)
    if m.fusion == GATE_UP:
        return (2 * f, h)
    if m.fusion == VOCAB:
        return (arch.padded_vocab_size, h)
    if key.endswith("linear_proj.weight"):
        return (h, arch.num_attention_heads * d)
    if key.endswith("linear_fc2.weight"):
        return (h, f)
    if key == "output_layer.weight":
        return (1, h)
    if key.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return (d,)
    if key.endswith("router.weight"):
        return (arch.num_experts, h)
    return (h,)


def hf_shapes(m: TensorMapping, arch: ModelArch) -> list[tuple[int, ...]]:
    """Shapes of the HF tensors of ``m`` (in ``hf_names`` order)."""
    shape = mcore_shape(m, arch)
    d = arch.kv_channels
    if m.fusion == QKV:
        rows = [arch.num_attention_heads * d, arch.num_kv_heads * d, arch.num_kv_heads * d]
        return [(r, *shape[1:]) for r in rows]
    if m.fusion == GATE_UP:
        return [(ffn_size(m, arch), shape[1])] * 2
    if m.fusion == VOCAB:
        return [(arch.vocab_size, shape[1])]
    return [shape]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """HF q/k/v projections (weights [rows, h] or biases [rows]) -> Megatron ``linear_qkv``."""
    rest = q.shape[1:]
    groups = [t.reshape(num_kv_heads, -1, *rest) for t in (q, k, v)]
    return torch.cat(groups, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron ``linear_qkv`` -> (q, k, v); pass TP-local head counts for a TP shard."""
    rest = qkv.shape[1:]
    q_rows = num_heads // num_kv_heads * head_dim
    grouped = qkv.reshape(num_kv_heads, q_rows + 2 * head_dim, *rest)
    q, k, v = grouped.split([q_rows, head_dim, head_dim], dim=1)
    return tuple(t.reshape(-1, *rest) for t in (q, k, v))  # type: ignore[return-value]


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF gate/up projections -> Megatron ``linear_fc1`` ([gate; up])."""
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron ``linear_fc1`` (global, or one TP shard) -> (gate, up)."""
    gate, up = fc1.chunk(2, dim=0)
    return gate, up


def to_mcore(m: TensorMapping, hf_tensors: list[torch.Tensor], arch: ModelArch) -> torch.Tensor:
    """HF tensors of one mapping (one layer) -> the Megatron tensor (global, unstacked)."""
    if m.fusion == QKV:
        return fuse_qkv(*hf_tensors, num_kv_heads=arch.num_kv_heads)
    if m.fusion == GATE_UP:
        return fuse_gate_up(*hf_tensors)
    (tensor,) = hf_tensors
    if m.fusion == VOCAB and tensor.shape[0] != arch.padded_vocab_size:
        padded = tensor.new_zeros(arch.padded_vocab_size, *tensor.shape[1:])
        padded[: tensor.shape[0]] = tensor
        return padded
    return tensor


def to_hf(m: TensorMapping, tensor: torch.Tensor, arch: ModelArch) -> list[torch.Tensor]:
    """The Megatron tensor of one mapping (one layer, global) -> its HF tensors."""
    if m.fusion == QKV:
        return list(split_qkv(tensor, arch.num_attention_heads, arch.num_kv_heads,
                              arch.kv_channels))
    if m.fusion == GATE_UP:
        return list(split_gate_up(tensor))
    if m.fusion == VOCAB:
        return [tensor[: arch.vocab_size]]
    return [tensor]


Region = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of a box inside a tensor."""


def tp_chunks(m: TensorMapping, arch: ModelArch, tp: int) -> list[Region]:
    """(offsets, sizes) of the pieces Megatron stores of one layer's tensor when saved at TP
    ``tp`` (the expert TP size for expert tensors): one per TP rank, two for ``linear_fc1``
    (each rank's gate rows and up rows)."""
    shape = mcore_shape(m, arch)
    if m.tp_axis is None:
        return [((0,) * len(shape), shape)]
    if m.fusion == GATE_UP:
        f = ffn_size(m, arch)
        rows = f // tp
        return [((half * f + t * rows, 0), (rows, shape[1])) for t in range(tp) for half in (0, 1)]
    axis, size = m.tp_axis, shape[m.tp_axis] // tp
    chunks = []
    for t in range(tp):
        offsets = tuple(t * size if a == axis else 0 for a in range(len(shape)))
        sizes = tuple(size if a == axis else n for a, n in enumerate(shape))
        chunks.append((offsets, sizes))
    return chunks
