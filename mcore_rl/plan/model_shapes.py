"""Shapes of well-known models for planning (`mcore_rl.plan.memory`) without their weights:
the figures a model's ``config.json`` gives, by the name a user would write."""
from __future__ import annotations

from mcore_rl.models.arch import ModelArch

PRESETS: dict[str, ModelArch] = {
    "Qwen/Qwen2.5-7B": ModelArch(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                 num_layers=28, num_attention_heads=28, num_kv_heads=4,
                                 qkv_bias=True),
    "Qwen/Qwen2.5-32B": ModelArch(vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                                  num_layers=64, num_attention_heads=40, num_kv_heads=8,
                                  qkv_bias=True),
    "meta-llama/Llama-3.1-70B": ModelArch(vocab_size=128256, hidden_size=8192,
                                          intermediate_size=28672, num_layers=80,
                                          num_attention_heads=64, num_kv_heads=8),
    "Qwen/Qwen3-30B-A3B": ModelArch(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                    num_layers=48, num_attention_heads=32, num_kv_heads=4,
                                    head_dim=128, qk_norm=True, num_experts=128,
                                    experts_per_token=8, moe_intermediate_size=768),
    "HuggingFaceTB/SmolLM2-135M": ModelArch(vocab_size=49152, hidden_size=576,
                                            intermediate_size=1536, num_layers=30,
                                            num_attention_heads=9, num_kv_heads=3,
                                            tie_word_embeddings=True),
}


def preset(name: str) -> ModelArch | None:
    """The preset named ``name`` (the HF id, or its last part, any case), or None."""
    wanted = name.lower()
    for key, arch in PRESETS.items():
        if wanted in (key.lower(), key.split("/")[-1].lower()):
            return arch
    return None
