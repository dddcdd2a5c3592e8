"""RMSNorm for Megatron's local (torch) layer spec that also runs under sequence
parallelism.

Megatron's torch norm (``WrappedTorchNorm``) refuses sequence parallelism, though the norm
itself is per token: only its weight's gradient needs the tensor-parallel ranks' sum, since
each rank normalises its own slice of the sequence. Megatron sums the gradients of every
parameter marked ``sequence_parallel`` across the TP group (``finalize_model_grads``), as
Transformer Engine's norms are marked; this norm marks its weight the same way.
"""
from __future__ import annotations

import torch


class LocalRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built as Megatron builds norms (``config, hidden_size, eps``),
    without ``WrappedTorchNorm``'s refusal of sequence parallelism: the per-head query/key
    norms, which see whole sequences (after the QKV projection gathered them) and whose
    gradients Megatron sums across TP ranks by name."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(normalized_shape=hidden_size, eps=eps)


class SequenceParallelRMSNorm(LocalRMSNorm):
    """A norm over the hidden states between the tensor-parallel blocks (each TP rank holds
    a slice of the sequence there): its weight is marked ``sequence_parallel``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(config, hidden_size, eps)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))
