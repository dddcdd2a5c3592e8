"""Tiny random mixture-of-experts HF models (Qwen3-MoE with both ``norm_topk_prob`` settings,
Mixtral), saved with transformers: the parity oracles for expert layers.

8 experts, top-2, expert FFN 64, hidden 128 (vLLM's CPU MoE kernel wants a multiple of 32),
head_dim 32, GQA 4/2; norms random. transformers keeps the experts fused in memory and saves
them per expert (``mlp.experts.{e}.gate_proj`` / Mixtral's ``block_sparse_moe.experts.{e}.w1``).
"""
from __future__ import annotations

from pathlib import Path

import torch

from tests.models.tiny_hf import COMMON

MOE = dict(num_experts_per_tok=2)
MOE_VARIANTS = {
    # name: (HF config class, causal-LM class, config overrides)
    "qwen3moe": ("Qwen3Moe", dict(vocab_size=1001, num_experts=8, moe_intermediate_size=64,
                                  norm_topk_prob=False, rope_theta=40000.0)),
    "qwen3moe-norm": ("Qwen3Moe", dict(vocab_size=1001, num_experts=8, moe_intermediate_size=64,
                                       norm_topk_prob=True, rope_theta=40000.0)),
    "mixtral": ("Mixtral", dict(vocab_size=1003, num_local_experts=8, intermediate_size=64,
                                rope_theta=30000.0, sliding_window=None)),
}


def build_tiny_moe_model(variant: str, seed: int = 0, layers: int = 2):
    """A random HF MoE model (fp32, eager attention) of ``variant``."""
    import transformers as tf

    prefix, overrides = MOE_VARIANTS[variant]
    config = getattr(tf, f"{prefix}Config")(
        **{**COMMON, "num_hidden_layers": layers, **MOE, **overrides},
        tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(tf, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)
    return model


def save_tiny_moe_model(variant: str, out_dir: str | Path, seed: int = 0, layers: int = 2,
                        dtype: torch.dtype = torch.float32) -> Path:
    out_dir = Path(out_dir)
    build_tiny_moe_model(variant, seed, layers).to(dtype).save_pretrained(out_dir)
    return out_dir
