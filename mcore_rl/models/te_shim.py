"""The one import point of Transformer Engine (optional; GPU only)."""
from __future__ import annotations

import importlib.util

import torch


def transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_engine_usable() -> bool:
    """TE spec is used only where TE is installed and a CUDA device is present."""
    return torch.cuda.is_available() and transformer_engine_installed()
