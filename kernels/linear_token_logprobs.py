"""LM head fused with token log-probs: [tokens, hidden] -> log p(label), chunk by chunk.

Only [chunk_size, V_local] logits exist at any time, in the forward and in the backward (which
recomputes each chunk's logits, turns them into their gradient in place and feeds it straight
into the two gradient GEMMs), instead of [tokens, V] logits plus their fp32 log-softmax.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.kernels._impl import resolve_impl
from mcore_rl.kernels.token_logprobs import backend_for, check_inputs
from mcore_rl.kernels.token_logprobs.function import outputs, truncated_stats
from mcore_rl.kernels.token_logprobs.replay import LinearKeptSetLogprobs, check_kept_ids
from mcore_rl.kernels.token_logprobs.truncation import Truncation, first_candidates, top_candidates
from mcore_rl.kernels.token_logprobs.vocab_parallel import combine_stats, vocab_shard

__all__ = ["linear_token_logprobs"]


class _LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, shard, temperature, chunk_size, return_entropy, backend, reduce_grad,
                trunc=Truncation(), return_kept=False):
        h = hidden.reshape(-1, hidden.shape[-1])
        lab = labels.reshape(-1).contiguous()  # kernels index labels with unit stride
        n = h.shape[0]
        f32 = dict(dtype=torch.float32, device=h.device)
        active = trunc.active_for(shard.local_size * shard.world_size)
        stats_entropy = return_entropy and not active  # a truncated entropy comes from the kept set
        row_max, log_sum, tgt = torch.empty(n, **f32), torch.empty(n, **f32), torch.empty(n, **f32)
        ent = torch.empty(n, **f32) if stats_entropy else None
        first = first_candidates(trunc, shard) if active else 0
        cand = torch.empty(n, first, **f32) if first else None
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            logits = torch.matmul(h[s:e], weight.t())  # [chunk, V_local], freed each iteration
            c_max, c_log_sum, c_ent, c_tgt = backend.row_stats(logits, lab[s:e], shard, temperature, stats_entropy)
            row_max[s:e], log_sum[s:e], tgt[s:e] = c_max, c_log_sum, c_tgt
            if ent is not None:
                ent[s:e] = c_ent
            if cand is not None:  # the kept set's first candidates, from the logits at hand
                cand[s:e] = top_candidates(logits[:, :shard.n_valid], first)
            del logits  # before the next chunk's GEMM: one chunk of logits alive, not two
        row_max, log_sum, ent, tgt = combine_stats(row_max, log_sum, ent, tgt, shard, temperature)

        def candidates(k: int, rows) -> torch.Tensor:
            if k == first and rows is None:
                return cand
            # more than the first pass took: the GEMMs of the chunks holding those rows again,
            # chunked as the forward and the backward chunk, so the logits match bit for bit
            # (the kept set's threshold is compared with them)
            wanted = torch.ones(n, dtype=torch.bool, device=h.device) if rows is None else \
                torch.zeros(n, dtype=torch.bool, device=h.device).index_fill_(0, rows, True)
            parts = []
            for s in range(0, n, chunk_size):
                sel = wanted[s:s + chunk_size].nonzero()[:, 0]
                if len(sel):
                    logits = torch.matmul(h[s:s + chunk_size], weight.t())
                    parts.append(top_candidates(logits[sel][:, :shard.n_valid], k))
            return torch.cat(parts) if parts else torch.empty(0, k, **f32)

        log_sum, ent, threshold, kept = truncated_stats(candidates, shard, trunc, temperature, row_max,
                                                        log_sum, ent, tgt, return_entropy)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, lab, row_max, log_sum, ent, threshold)
        ctx.cfg = (shard, temperature, chunk_size, backend, reduce_grad, return_entropy)
        lp = (tgt - row_max).div_(temperature).sub_(log_sum)
        return outputs(lp, ent, kept, labels.shape, return_entropy, return_kept, ctx)

    @staticmethod
    def backward(ctx, grad_lp, *more):
        hidden, weight, lab, row_max, log_sum, ent, threshold = ctx.saved_tensors
        shard, temperature, chunk_size, backend, reduce_grad, return_entropy = ctx.cfg
        grad_ent = more[0] if return_entropy else None  # a kept-flags output has no gradient
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_lp is None and grad_ent is None) or not (need_h or need_w):
            return (None,) * 11
        h = hidden.reshape(-1, hidden.shape[-1])
        g_lp = grad_lp.reshape(-1) if grad_lp is not None else None
        g_ent = grad_ent.reshape(-1) if grad_ent is not None else None
        n = h.shape[0]
        grad_h = torch.empty_like(h) if need_h else None
        # accumulated across chunks in the weight's dtype (each GEMM accumulates in fp32)
        grad_w = torch.zeros_like(weight) if need_w else None
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            logits = torch.matmul(h[s:e], weight.t())
            grad_logits = backend.row_grad(
                logits, lab[s:e], shard, temperature, row_max[s:e], log_sum[s:e], None if ent is None else ent[s:e],
                None if g_lp is None else g_lp[s:e], None if g_ent is None else g_ent[s:e], out=logits,
                threshold=None if threshold is None else threshold[s:e],
            )
            if need_h:
                torch.matmul(grad_logits, weight, out=grad_h[s:e])
            if need_w:
                grad_w.addmm_(grad_logits.t(), h[s:e])
            del logits, grad_logits
        if need_h and reduce_grad and shard.group is not None:
            # hidden is replicated across the group and each rank saw only its vocabulary
            # slice: the input gradient is the sum (what ColumnParallelLinear's backward does)
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=shard.group)
        return (
            grad_h.view(hidden.shape) if need_h else None, grad_w, None, None, None, None, None, None, None,
            None, None,
        )


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int | None = None,
    tp_group=None,
    chunk_size: int = 1024,
    temperature: float = 1.0,
    return_entropy: bool = False,
    impl: str = "auto",
    all_reduce_hidden_grad: bool = True,
    top_k: int = -1,
    top_p: float = 1.0,
    return_kept: bool = False,
    kept_ids: torch.Tensor | None = None,
):
    """log p(label) of ``hidden @ weight.T`` per token without materialising all the logits.

    hidden: [..., H] (e.g. Megatron's [seq, batch, H]), replicated across ``tp_group``.
    weight: [V_local, H], the (vocab-parallel) output layer; rank r holds vocabulary rows
        [r * V_local, (r + 1) * V_local). Same dtype as hidden.
    labels: [...] token ids in [0, vocab_size); vocab_size: real vocabulary (padding excluded).
    chunk_size: tokens per chunk; peak extra memory is about chunk_size x V_local logits.
    Returns logp [...] fp32 (and entropy [...] with ``return_entropy``), equal to
    ``token_logprobs(hidden @ weight.T, labels, ...)``. Gradients flow to hidden and weight.
    With tp_group each rank's hidden gradient only covers its vocabulary slice: by default it is
    all-reduced over the group here; pass ``all_reduce_hidden_grad=False`` when hidden comes
    through a region whose backward already reduces it (Megatron's
    copy_to_tensor_model_parallel_region / sequence-parallel gather). The weight gradient is
    accumulated over chunks in the weight's dtype.
    top_k, top_p, return_kept: the sampling truncation, as for ``token_logprobs`` (its first
    candidates per row are taken from each chunk's logits in the same pass).
    kept_ids: [..., K] an engine's kept set per token, as for ``token_logprobs``.
    """
    which = resolve_impl(impl, hidden)
    if which == "reference":
        logits = torch.matmul(hidden, weight.t())
        from mcore_rl.kernels.token_logprobs import token_logprobs

        return token_logprobs(
            logits, labels, vocab_size=vocab_size, tp_group=tp_group, temperature=temperature,
            return_entropy=return_entropy, impl="reference", top_k=top_k, top_p=top_p,
            return_kept=return_kept, kept_ids=kept_ids,
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V_local, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    trunc = Truncation(int(top_k), float(top_p))
    shard = vocab_shard(weight.shape[0], vocab_size, tp_group)
    check_inputs(labels, hidden.shape[:-1], shard, vocab_size, temperature)
    if kept_ids is not None:
        check_kept_ids(kept_ids, labels.shape, vocab_size or shard.local_size * shard.world_size)
        lead = labels.shape
        res = LinearKeptSetLogprobs.apply(
            hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1).long(),
            kept_ids.reshape(-1, kept_ids.shape[-1]), shard, float(temperature), int(chunk_size),
            bool(return_entropy), bool(return_kept), bool(all_reduce_hidden_grad))
        res = tuple(r.view(lead) for r in (res if isinstance(res, tuple) else (res,)))
        return res[0] if len(res) == 1 else res
    return _LinearTokenLogprobs.apply(
        hidden, weight, labels.long(), shard, float(temperature), int(chunk_size), bool(return_entropy),
        backend_for(which), bool(all_reduce_hidden_grad), trunc, bool(return_kept),
    )
