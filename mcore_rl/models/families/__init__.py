"""Model families: which HF architectures mcore-rl builds, registered by HF ``model_type``.

All supported families are Llama-style decoders and share one HF<->Megatron tensor mapping
(``mcore_rl.models.mapping``); a family adds what is its own: its HF class names, whether Q, K
and V carry a bias, whether queries and keys are RMS-normalised per head (Qwen3), its experts
(Qwen3-MoE, Mixtral), and which of its config options mcore-rl cannot reproduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ModelFamily:
    """One HF model family (``model_type``) that maps onto Megatron's GPTModel."""

    model_type: str
    causal_lm: str
    """HF class name of the causal LM, e.g. ``LlamaForCausalLM``."""
    sequence_classification: str
    """HF class name with a scalar ``score`` head, e.g. ``LlamaForSequenceClassification``."""
    qkv_bias: Callable[[dict], bool]
    """Whether Q, K and V projections carry a bias, from the HF config dict."""
    unsupported_features: Callable[[dict], list[str]]
    """Config options set to values mcore-rl cannot reproduce exactly (empty when fine)."""
    qk_norm: Callable[[dict], bool] = lambda cfg: False
    """Whether queries and keys pass an RMSNorm over each head before RoPE (Qwen3)."""
    moe_fields: Callable[[dict], dict] = lambda cfg: {}
    """The mixture-of-experts fields of `ModelArch` (``num_experts``...) from the HF config;
    empty for a dense family."""

    @property
    def architectures(self) -> tuple[str, str]:
        return self.causal_lm, self.sequence_classification


MODEL_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add a family to `MODEL_FAMILIES` (keyed by HF ``model_type``)."""
    MODEL_FAMILIES[family.model_type] = family
    return family


def supported_architectures() -> list[str]:
    return [name for family in MODEL_FAMILIES.values() for name in family.architectures]


def family_of_architecture(architecture: str) -> ModelFamily | None:
    """The family whose causal-LM or sequence-classification class is ``architecture``."""
    for family in MODEL_FAMILIES.values():
        if architecture in family.architectures:
            return family
    return None


from mcore_rl.models.families import llama, mistral, mixtral, qwen2, qwen3, qwen3_moe  # noqa: E402,F401  (registration)
