"""RoPE inverse frequencies exactly as HF computes them, installed into Megatron's rotary module.

Megatron-Core 0.16 knows plain RoPE and a Llama 3 scaling whose ``low_freq_factor`` (1),
``high_freq_factor`` (4) and ``original_max_position_embeddings`` (8192) are fixed. Models
declare other values (Llama 3.2 uses 32 for the factor, 8192 for the length; others differ),
so instead of Megatron's flag we compute the inverse frequencies from the HF parameters and
set them on ``model.rotary_pos_emb``; the rest of Megatron's RoPE path is unchanged.
"""
from __future__ import annotations

import math

import torch

from mcore_rl.models.arch import ModelArch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(arch: ModelArch) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (fp32) for ``arch``'s RoPE, as HF computes them."""
    dim = arch.kv_channels
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling.factor, scaling.low_freq_factor,
                              scaling.high_freq_factor, scaling.original_max_position_embeddings)
    raise ValueError(f"rope type {scaling.rope_type!r} is not supported "
                     f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _llama3_scaled(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                   high_freq_factor: float, original_max: int) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, short ones kept, a smooth
    interpolation between the two bands."""
    low_freq_wavelen = original_max / low_freq_factor
    high_freq_wavelen = original_max / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope_frequencies(model, arch: ModelArch) -> None:
    """Set HF's inverse frequencies on a Megatron ``GPTModel`` chunk (before its first forward:
    Megatron caches the rotary embedding per sequence length)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        return
    rotary.inv_freq = rope_inv_freq(arch).to(rotary.inv_freq.device)
