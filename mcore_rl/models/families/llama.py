"""Llama 2/3 (incl. Llama 3.1+ RoPE scaling) and models saved as Llama (SmolLM2, ...)."""
from mcore_rl.models.families import ModelFamily, register_family


def _unsupported(cfg: dict) -> list[str]:
    found = []
    if cfg.get("attention_bias"):
        found.append("attention_bias=true (bias on every attention projection)")
    if cfg.get("mlp_bias"):
        found.append("mlp_bias=true")
    return found


LLAMA = register_family(ModelFamily(
    model_type="llama", causal_lm="LlamaForCausalLM",
    sequence_classification="LlamaForSequenceClassification",
    qkv_bias=lambda cfg: False, unsupported_features=_unsupported))
