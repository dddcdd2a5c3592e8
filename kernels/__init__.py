"""Fused kernels for RL training, installed as ``mcore_rl.kernels``.

Each op has a plain torch reference, a fast torch path (what CPU users get; it runs on any
device) and a Triton kernel for GPUs; ``impl`` selects, "auto" picks the best available.
"""
from mcore_rl.kernels._triton import HAS_TRITON
from mcore_rl.kernels.gae import gae, gae_packed
from mcore_rl.kernels.linear_token_logprobs import linear_token_logprobs
from mcore_rl.kernels.token_logprobs import token_logprobs

__all__ = ["token_logprobs", "linear_token_logprobs", "gae", "gae_packed", "HAS_TRITON"]
