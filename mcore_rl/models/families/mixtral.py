"""Mixtral: Mistral attention with routed experts in every layer; routing weights are always
the softmax over the top-k router logits."""
from mcore_rl.models.families import ModelFamily, register_family
from mcore_rl.models.families.mistral import sliding_window_problems


def _unsupported(cfg: dict) -> list[str]:
    found = sliding_window_problems(cfg)
    if cfg.get("router_jitter_noise"):
        found.append(f"router_jitter_noise={cfg['router_jitter_noise']} (set it to 0)")
    return found


def _moe_fields(cfg: dict) -> dict:
    return dict(num_experts=int(cfg.get("num_local_experts", 0)),
                experts_per_token=int(cfg.get("num_experts_per_tok", 0)),
                moe_intermediate_size=int(cfg.get("intermediate_size", 0)),
                norm_topk_prob=True, expert_naming="mixtral")


MIXTRAL = register_family(ModelFamily(
    model_type="mixtral", causal_lm="MixtralForCausalLM",
    sequence_classification="MixtralForSequenceClassification",
    qkv_bias=lambda cfg: False, unsupported_features=_unsupported, moe_fields=_moe_fields))
