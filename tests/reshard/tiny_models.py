"""Tiny HF models for the reshard tests: those of tests/models/tiny_hf.py, with 4 layers
(so that PP2 x VPP2 has a layer per model chunk)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.models.tiny_hf import COMMON, VARIANTS, hf_classes


def save_model(variant: str, out_dir: str | Path, seed: int = 0, layers: int = 4) -> Path:
    """A random ``variant`` with ``layers`` layers (norms and biases random too), saved."""
    family, overrides = VARIANTS[variant]
    config_cls, lm_cls, _ = hf_classes(family)
    config = config_cls(**{**COMMON, "num_hidden_layers": layers}, **overrides,
                        attn_implementation="eager")
    torch.manual_seed(seed)
    model = lm_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.normal_(0.0, 0.1) if name.endswith("bias") else param.uniform_(0.5, 1.5)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir
