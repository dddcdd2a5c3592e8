"""Mistral (v0.2 and later: full attention; v0.1's 4096-token sliding window is refused)."""
from mcore_rl.models.families import ModelFamily, register_family


def sliding_window_problems(cfg: dict) -> list[str]:
    """Mistral/Mixtral: a sliding window shorter than the context, which mcore-rl does not
    reproduce."""
    window = cfg.get("sliding_window")
    # A window at least as long as the longest sequence never masks anything.
    if window is not None and window < cfg.get("max_position_embeddings", 0):
        return [f"sliding-window attention (sliding_window={window}; "
                "set it to null for full attention)"]
    return []


MISTRAL = register_family(ModelFamily(
    model_type="mistral", causal_lm="MistralForCausalLM",
    sequence_classification="MistralForSequenceClassification",
    qkv_bias=lambda cfg: False, unsupported_features=sliding_window_problems))
