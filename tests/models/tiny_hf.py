"""Tiny random HF models (Llama, Qwen2, Qwen3, Mistral) saved with transformers: the parity oracles.

head_dim 32 (so the same models run in vLLM on CPU), GQA (4 heads, 2 KV heads), a vocabulary
that is no multiple of 64, non-default RoPE theta and RMSNorm epsilon. Every parameter is
random, norms and biases included (all-ones norms would hide a swapped norm mapping).
"""
from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=3e-5,
              initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0, "low_freq_factor": 2.0,
               "high_freq_factor": 8.0, "original_max_position_embeddings": 64}

VARIANTS = {
    # name: (family, config overrides)
    "llama-untied": ("llama", dict(vocab_size=1003, tie_word_embeddings=False, rope_theta=50000.0)),
    "llama-tied": ("llama", dict(vocab_size=250, tie_word_embeddings=True,
                                 rope_parameters=dict(LLAMA3_ROPE))),
    "qwen2-tied": ("qwen2", dict(vocab_size=997, tie_word_embeddings=True, rope_theta=20000.0)),
    "qwen3-untied": ("qwen3", dict(vocab_size=1001, tie_word_embeddings=False, rope_theta=40000.0)),
    "mistral-untied": ("mistral", dict(vocab_size=1010, tie_word_embeddings=False,
                                       rope_theta=30000.0, sliding_window=None)),
}


def hf_classes(family: str):
    import transformers as tf

    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
    return (getattr(tf, f"{names}Config"), getattr(tf, f"{names}ForCausalLM"),
            getattr(tf, f"{names}ForSequenceClassification"))


def build_tiny_hf_model(variant: str, head: str = "lm", seed: int = 0):
    """A random HF model (fp32, eager attention) of ``variant``; ``head="score"`` for the
    single-label sequence-classification class."""
    family, overrides = VARIANTS[variant]
    config_cls, lm_cls, cls_cls = hf_classes(family)
    config = config_cls(**COMMON, **overrides, attn_implementation="eager")
    if head == "score":
        config.num_labels = 1
    torch.manual_seed(seed)
    model = (lm_cls if head == "lm" else cls_cls)(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                if name.endswith("bias"):
                    param.normal_(0.0, 0.1)
                else:
                    param.uniform_(0.5, 1.5)
    return model


def save_tiny_hf_model(variant: str, out_dir: str | Path, head: str = "lm", seed: int = 0) -> Path:
    """Build and ``save_pretrained`` a tiny model (with a generation config); its directory."""
    model = build_tiny_hf_model(variant, head, seed)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    (out_dir / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}\n')
    return out_dir


def load_hf(hf_dir: str | Path, head: str = "lm"):
    """The HF model in ``hf_dir`` (fp32, eager attention), for reference outputs."""
    import transformers as tf

    cls = tf.AutoModelForCausalLM if head == "lm" else tf.AutoModelForSequenceClassification
    return cls.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32).eval()


def tokens(vocab_size: int, batch: int = 2, seq: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
