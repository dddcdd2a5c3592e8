"""Qwen3 (dense): Llama-style without Q/K/V biases, with an RMSNorm over each query and key
head before RoPE (``q_norm`` / ``k_norm``, Megatron's ``q_layernorm`` / ``k_layernorm``)."""
from mcore_rl.models.families import ModelFamily, register_family
from mcore_rl.models.families.qwen2 import sliding_window_problems


def _unsupported(cfg: dict) -> list[str]:
    found = sliding_window_problems(cfg)
    if cfg.get("attention_bias"):
        found.append("attention_bias=true (bias on every attention projection)")
    return found


QWEN3 = register_family(ModelFamily(
    model_type="qwen3", causal_lm="Qwen3ForCausalLM",
    sequence_classification="Qwen3ForSequenceClassification",
    qkv_bias=lambda cfg: False, unsupported_features=_unsupported, qk_norm=lambda cfg: True))
