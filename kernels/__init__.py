"""Fused kernels for RL training, installed as ``mcore_rl.kernels``."""
