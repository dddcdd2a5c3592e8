"""Per-token log-probabilities (and entropy) of labels under logits, without a full fp32 copy.

Convention (shared by every path): log-probs are ``log_softmax(logits[..., :vocab_size] /
temperature)`` in fp32, read at the label; padded vocabulary columns (ids >= vocab_size) are
excluded. With ``top_k`` / ``top_p`` they are those of the truncated distribution an engine
samples from (``truncation.py``).
"""
from __future__ import annotations

import torch

from mcore_rl.kernels._impl import resolve_impl
from mcore_rl.kernels.token_logprobs import cpu as _cpu_backend
from mcore_rl.kernels.token_logprobs.function import TokenLogprobsFunction, as_rows
from mcore_rl.kernels.token_logprobs.reference import token_logprobs_reference
from mcore_rl.kernels.token_logprobs.replay import KeptSetLogprobs, check_kept_ids
from mcore_rl.kernels.token_logprobs.truncation import Truncation
from mcore_rl.kernels.token_logprobs.vocab_parallel import VocabShard, vocab_shard

__all__ = ["token_logprobs", "token_logprobs_reference", "backend_for", "check_inputs", "Truncation"]


def backend_for(which: str):
    """The module implementing ``row_stats`` / ``row_grad`` for "cpu" or "triton"."""
    if which == "triton":
        from mcore_rl.kernels.token_logprobs import triton_kernel

        return triton_kernel
    return _cpu_backend


def check_inputs(labels: torch.Tensor, lead_shape, shard: VocabShard, vocab_size: int | None, temperature: float):
    """Shape and range checks; label values are only checked on CPU, where it costs no sync."""
    if tuple(labels.shape) != tuple(lead_shape):
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal the logits' leading shape {tuple(lead_shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be integer token ids, got {labels.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if labels.device.type == "cpu" and labels.numel():
        real = shard.local_size * shard.world_size if vocab_size is None else vocab_size
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= real:
            raise ValueError(f"labels must lie in [0, {real}), got values in [{lo}, {hi}]")


def token_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int | None = None,
    tp_group=None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    impl: str = "auto",
    inplace_backward: bool = False,
    top_k: int = -1,
    top_p: float = 1.0,
    return_kept: bool = False,
    kept_ids: torch.Tensor | None = None,
):
    """log p(label) per token, fp32, differentiable w.r.t. ``logits``.

    logits: [..., V_local], any leading shape (Megatron's [seq, batch, V / tp] included), any
        float dtype; with ``tp_group`` each rank holds the contiguous vocabulary slice
        [rank * V_local, (rank + 1) * V_local), and results equal the unsharded computation.
    labels: [...] (the leading shape of logits) global token ids in [0, vocab_size).
    vocab_size: real vocabulary size; columns >= vocab_size (padding) are excluded.
        Default: all columns (V_local * tp size).
    temperature: logits are divided by it before the softmax.
    return_entropy: also return the entropy [...] (fp32, differentiable) of the same distribution.
    impl: "auto" (Triton on CUDA when available, else "cpu"), "reference", "cpu", "triton".
    inplace_backward: the backward writes the logits gradient into the logits buffer (which
        must be contiguous and not needed afterwards) instead of allocating another [N, V].
    top_k, top_p: the truncation the tokens were sampled with (after the temperature, top-k
        first, top-p over what it keeps); log-probs and entropy are then those of the kept
        set renormalised, and their gradient is 0 outside it. A label outside the kept set
        (one the sampler could not have picked from these logits) gets ``z_label - log sum
        over the kept set of exp(z)``, finite; mask such tokens out with ``return_kept``.
    return_kept: also return [...] bool, whether each label is in the kept set (all True
        without truncation).
    kept_ids: [..., K] global ids, -1 padded: the kept set of every token as the engine
        reported it (its sampling mask), used instead of one found from these logits
        (``replay.py``; top_k / top_p are then not used). A token with no kept id gets 0.

    Returns ``logp`` [...], then ``entropy`` and ``kept`` when asked for, as a tuple. The forward reads the logits without
    modifying them and never materialises a [N, V] fp32 log-softmax (except impl="reference").
    """
    which = resolve_impl(impl, logits)
    trunc = Truncation(int(top_k), float(top_p))
    shard = vocab_shard(logits.shape[-1], vocab_size, tp_group)
    check_inputs(labels, logits.shape[:-1], shard, vocab_size, temperature)
    if kept_ids is not None:
        check_kept_ids(kept_ids, labels.shape, vocab_size or shard.local_size * shard.world_size)
    if which == "reference":
        if shard.group is not None:
            raise ValueError("impl='reference' works on unsharded logits only (no tp_group of size > 1)")
        return token_logprobs_reference(
            logits, labels, vocab_size=vocab_size, temperature=temperature, return_entropy=return_entropy,
            top_k=trunc.top_k, top_p=trunc.top_p, return_kept=return_kept, kept_ids=kept_ids,
        )
    if kept_ids is not None:
        lead = labels.shape
        res = KeptSetLogprobs.apply(as_rows(logits), labels.reshape(-1).long(),
                                    kept_ids.reshape(-1, kept_ids.shape[-1]), shard, float(temperature),
                                    bool(return_entropy), bool(return_kept))
        res = res if isinstance(res, tuple) else (res,)
        res = tuple(r.view(lead) for r in res)
        return res[0] if len(res) == 1 else res
    return TokenLogprobsFunction.apply(
        logits, labels.long(), shard, float(temperature), bool(return_entropy), bool(inplace_backward),
        backend_for(which), trunc, bool(return_kept),
    )
