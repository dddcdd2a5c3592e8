"""Qwen2 / Qwen2.5: Llama-style with a bias on the Q, K and V projections (not on O)."""
from mcore_rl.models.families import ModelFamily, register_family


def sliding_window_problems(cfg: dict) -> list[str]:
    """Qwen2/Qwen3: sliding-window attention, which mcore-rl does not reproduce."""
    # Qwen2 and Qwen3 declare a sliding window that is only applied with use_sliding_window=true.
    sliding = cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None
    layer_types = set(cfg.get("layer_types") or ["full_attention"])
    if sliding or layer_types != {"full_attention"}:
        return ["sliding-window attention (use_sliding_window=true)"]
    return []


QWEN2 = register_family(ModelFamily(
    model_type="qwen2", causal_lm="Qwen2ForCausalLM",
    sequence_classification="Qwen2ForSequenceClassification",
    qkv_bias=lambda cfg: True, unsupported_features=sliding_window_problems))
