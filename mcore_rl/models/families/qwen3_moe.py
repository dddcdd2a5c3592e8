"""Qwen3-MoE (Qwen3-30B-A3B class): Qwen3 attention (QK norm) with routed experts in every
layer and no shared expert. Routing follows ``norm_topk_prob`` (False by default: the top-k
softmax probabilities are used as they are)."""
from mcore_rl.models.families import ModelFamily, register_family
from mcore_rl.models.families.qwen2 import sliding_window_problems


def _unsupported(cfg: dict) -> list[str]:
    found = sliding_window_problems(cfg)
    if cfg.get("attention_bias"):
        found.append("attention_bias=true (bias on every attention projection)")
    if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
        found.append("dense layers between expert layers (decoder_sparse_step != 1 or "
                     "mlp_only_layers); every layer must have experts")
    return found


def _moe_fields(cfg: dict) -> dict:
    return dict(num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
                experts_per_token=int(cfg.get("num_experts_per_tok", 0)),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0)),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                expert_naming="qwen3_moe")


QWEN3_MOE = register_family(ModelFamily(
    model_type="qwen3_moe", causal_lm="Qwen3MoeForCausalLM",
    sequence_classification="Qwen3MoeForSequenceClassification",
    qkv_bias=lambda cfg: False, unsupported_features=_unsupported, qk_norm=lambda cfg: True,
    moe_fields=_moe_fields))
