"""`ModelArch`: the architecture of a decoder-only LM, in HuggingFace terms.

The one description of a model that the rest of mcore-rl reads: built from an HF
``config.json`` (see ``mcore_rl.models.hf_config``) or from the inline fields of
``ModelConfig`` for built-in tiny models. Megatron's ``TransformerConfig`` is derived from
it in ``mcore_rl.models.gpt``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as HF's ``rope_parameters`` describe it (non-default types)."""

    rope_type: str
    """``linear`` (positions divided by ``factor``) or ``llama3`` (Llama 3.1 wavelength bands)."""
    factor: float
    low_freq_factor: float | None = None
    """llama3 only: wavelengths above ``original_max_position_embeddings / low_freq_factor``
    are divided by ``factor``."""
    high_freq_factor: float | None = None
    """llama3 only: wavelengths below ``original_max_position_embeddings / high_freq_factor``
    are kept; those in between are interpolated."""
    original_max_position_embeddings: int | None = None
    """llama3 only: the context length the model was pretrained with."""


@dataclass(frozen=True)
class ModelArch:
    """Shape and numerics of a Llama-style decoder (RMSNorm, SwiGLU, RoPE, GQA)."""

    vocab_size: int
    """Real vocabulary size (the tokenizer's); the embedding is padded beyond it."""
    hidden_size: int
    intermediate_size: int
    """FFN inner size (per gate/up projection)."""
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    """Key/value heads (GQA groups); equal to num_attention_heads for plain MHA."""
    head_dim: int | None = None
    """Per-head size; None means hidden_size // num_attention_heads."""
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    """None for plain RoPE."""
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    """Bias on the Q, K and V projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm (weight [head_dim], eps ``rms_norm_eps``) over each query and key head before
    RoPE (Qwen3)."""
    num_experts: int = 0
    """Routed experts per layer (mixture of experts in every layer); 0: a dense FFN."""
    experts_per_token: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """FFN inner size of one expert."""
    norm_topk_prob: bool = True
    """Routing weights: softmax over the top-k router logits (True; Mixtral always), or
    softmax over all experts with the top-k probabilities kept as they are (False)."""
    expert_naming: str = ""
    """How the HF checkpoint names expert tensors, a key of
    ``mcore_rl.models.mapping.EXPERT_NAMINGS`` (``qwen3_moe``, ``mixtral``)."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities in training (HF's value; Megatron's default is 0.1)."""
    vocab_pad_multiple: int = 128
    """The embedding has ceil(vocab_size / multiple) * multiple rows, independent of TP.
    Stored with every checkpoint, so a checkpoint keeps its padded size at any TP."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_pad_multiple
        return -(-self.vocab_size // m) * m

    def with_vocab_multiple_for_tp(self, tp: int) -> "ModelArch":
        """This arch, with the pad multiple raised to a multiple of ``tp`` when needed.

        The padded vocabulary must split evenly over TP ranks. 128 covers every power of two
        up to 128; TP3 or TP6 raise it (to 384), which a checkpoint then keeps.
        """
        if self.padded_vocab_size % tp == 0:
            return self
        multiple = self.vocab_pad_multiple * tp // math.gcd(self.vocab_pad_multiple, tp)
        return replace(self, vocab_pad_multiple=multiple)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelArch":
        data = dict(data)
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        return cls(**data)
