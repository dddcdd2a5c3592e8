"""Log-probs over a kept set the engine reported (its sampling mask), instead of one found
from the trainer's own logits.

An engine that returns, for every sampled token, the ids its top-k / top-p kept (vLLM's
``return_sampling_mask``) lets the trainer renormalise over exactly that set:
``log p~(y) = z_y - log sum_{j in K} exp(z_j)``, with z = logits / T. Only the K columns
of each row are read (a gather), so the forward is far cheaper than a pass over the
vocabulary, and the logits gradient is nonzero only on them: the untruncated form with p~
for p, scattered into a zero [N, V_local].

With tensor parallelism each rank gathers the kept ids it owns; one MAX and one SUM
all-reduce give the global values, and the backward needs no communication.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_rl.kernels.token_logprobs.function import outputs
from mcore_rl.kernels.token_logprobs.vocab_parallel import VocabShard, local_labels


def check_kept_ids(kept_ids: torch.Tensor, lead_shape, vocab: int) -> None:
    """Shape and dtype; on CPU (where it costs no device sync) also that the ids lie in
    [-1, vocab) and that no row names a token twice."""
    if tuple(kept_ids.shape[:-1]) != tuple(lead_shape) or kept_ids.dim() != len(lead_shape) + 1:
        raise ValueError(f"kept_ids must be [{', '.join(map(str, lead_shape))}, K] (the labels' shape "
                         f"and the kept ids of each token, -1 padded), got {tuple(kept_ids.shape)}")
    if kept_ids.dtype.is_floating_point or kept_ids.dtype == torch.bool:
        raise TypeError(f"kept_ids must be integer token ids, got {kept_ids.dtype}")
    if kept_ids.device.type == "cpu" and kept_ids.numel():
        lo, hi = int(kept_ids.min()), int(kept_ids.max())
        if lo < -1 or hi >= vocab:
            raise ValueError(f"kept_ids must lie in [0, {vocab}) (-1 for padding), got values in [{lo}, {hi}]")
        ordered = kept_ids.reshape(-1, kept_ids.shape[-1]).sort(dim=-1).values
        if bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any()):
            raise ValueError("kept_ids names a token twice in one row; give each kept set once")


def kept_columns(kept_ids: torch.Tensor, shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] local column of each kept id (clamped into range) and whether this rank owns it."""
    local = kept_ids.long() - shard.start
    owned = (kept_ids >= 0) & (local >= 0) & (local < shard.n_valid)
    return local.clamp(0, max(shard.n_valid - 1, 0)), owned


def kept_stats(values: torch.Tensor, owned: torch.Tensor, target: torch.Tensor, label_owned: torch.Tensor,
               shard: VocabShard, temperature: float):
    """From this rank's raw logits at its kept ids ([N, K], fp32): (z - max over K) / T per
    kept id ([N, K], -inf where not owned), log sum over K, entropy of p~, and the label's
    log-prob, each [N]; rows without a kept id give 0 (they are padding)."""
    v = values.masked_fill(~owned, float("-inf"))
    big = v.amax(dim=1) if v.shape[1] else torch.full(v.shape[:1], float("-inf"), device=v.device)
    if shard.group is not None:
        dist.all_reduce(big, op=dist.ReduceOp.MAX, group=shard.group)
    empty = torch.isinf(big)
    big = big.masked_fill(empty, 0.0)
    z = (v - big[:, None]) / temperature
    e = torch.exp(z)
    parts = torch.stack([e.sum(dim=1), (e * z.masked_fill(~owned, 0.0)).sum(dim=1),
                         torch.where(label_owned, target, torch.zeros_like(target))])
    if shard.group is not None:
        dist.all_reduce(parts, op=dist.ReduceOp.SUM, group=shard.group)
    total = parts[0].masked_fill(empty, 1.0)
    log_sum = torch.log(total)
    entropy = (log_sum - parts[1] / total).masked_fill(empty, 0.0)
    lp = ((parts[2] - big) / temperature - log_sum).masked_fill(empty, 0.0)
    return z, log_sum, entropy, lp


def kept_grad(z: torch.Tensor, owned: torch.Tensor, log_sum: torch.Tensor, entropy: torch.Tensor,
              grad_lp: torch.Tensor | None, grad_ent: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """[N, K] gradient w.r.t. the raw logits at the kept ids (without the label's +grad_lp):
    dz_j = -p~_j (grad_lp + grad_ent (log p~_j + H)), dx = dz / T, 0 where not owned."""
    logp = (z - log_sum[:, None]).masked_fill(~owned, 0.0)
    p = torch.exp(logp).masked_fill(~owned, 0.0)
    coef = torch.zeros_like(p)
    if grad_lp is not None:
        coef = coef + grad_lp.float()[:, None]
    if grad_ent is not None:
        coef = coef + grad_ent.float()[:, None] * (logp + entropy[:, None])
    return -(p * coef) / temperature


def scatter_grad(out: torch.Tensor, cols: torch.Tensor, owned: torch.Tensor, grad_k: torch.Tensor,
                 kept_ids: torch.Tensor, labels: torch.Tensor, shard: VocabShard,
                 grad_lp: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """``out`` [N, V_local]: zero but for the kept ids' gradient, with the label's grad_lp / T
    folded in (in fp32, so each column is rounded to ``out``'s dtype once)."""
    out.zero_()
    if grad_lp is not None:
        g = grad_lp.float()[:, None] / temperature
        at_label = (kept_ids == labels[:, None]) & owned
        grad_k = grad_k + torch.where(at_label, g, torch.zeros_like(g))
        # a label outside the kept set (a row with a kept set that lacks it)
        lab, lab_owned = local_labels(labels, shard)
        stray = lab_owned & ~at_label.any(dim=1) & (kept_ids >= 0).any(dim=1)
        if bool(stray.any()):
            out.scatter_add_(1, lab[:, None], torch.where(stray[:, None], g, torch.zeros_like(g)).to(out.dtype))
    out.scatter_add_(1, cols, grad_k.masked_fill(~owned, 0.0).to(out.dtype))
    return out


class KeptSetLogprobs(torch.autograd.Function):
    """logits [N, V_local], labels [N], kept ids [N, K] -> log p~(label) [N] (and entropy,
    and whether the label is in the kept set)."""

    @staticmethod
    def forward(ctx, x, labels, kept_ids, shard, temperature, return_entropy, return_kept):
        cols, owned = kept_columns(kept_ids, shard)
        values = x.gather(1, cols).float()
        lab, lab_owned = local_labels(labels, shard)
        target = x.gather(1, lab[:, None])[:, 0].float()
        z, log_sum, ent, lp = kept_stats(values, owned, target, lab_owned, shard, temperature)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, labels, kept_ids, cols, owned, z, log_sum, ent)
        ctx.cfg = (shard, temperature, return_entropy)
        return outputs(lp, ent, (kept_ids == labels[:, None]).any(dim=1), labels.shape, return_entropy,
                       return_kept, ctx)

    @staticmethod
    def backward(ctx, grad_lp, *more):
        x, labels, kept_ids, cols, owned, z, log_sum, ent = ctx.saved_tensors
        shard, temperature, return_entropy = ctx.cfg
        grad_ent = more[0] if return_entropy else None
        if grad_lp is None and grad_ent is None:
            return (None,) * 7
        grad_k = kept_grad(z, owned, log_sum, ent, grad_lp, grad_ent, temperature)
        out = scatter_grad(torch.empty_like(x), cols, owned, grad_k, kept_ids, labels, shard, grad_lp,
                           temperature)
        return out, None, None, None, None, None, None


class LinearKeptSetLogprobs(torch.autograd.Function):
    """The fused LM head over a reported kept set: hidden [N, H], weight [V_local, H] ->
    log p~(label) [N] (and entropy, and the kept flags), one chunk of logits at a time."""

    @staticmethod
    def forward(ctx, h, weight, labels, kept_ids, shard, temperature, chunk_size, return_entropy,
                return_kept, reduce_grad):
        cols, owned = kept_columns(kept_ids, shard)
        lab, lab_owned = local_labels(labels, shard)
        n = h.shape[0]
        values = torch.empty(cols.shape, dtype=torch.float32, device=h.device)
        target = torch.empty(n, dtype=torch.float32, device=h.device)
        for s in range(0, n, chunk_size):
            logits = torch.matmul(h[s:s + chunk_size], weight.t())
            values[s:s + chunk_size] = logits.gather(1, cols[s:s + chunk_size]).float()
            target[s:s + chunk_size] = logits.gather(1, lab[s:s + chunk_size, None])[:, 0].float()
            del logits
        z, log_sum, ent, lp = kept_stats(values, owned, target, lab_owned, shard, temperature)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h, weight, labels, kept_ids, cols, owned, z, log_sum, ent)
        ctx.cfg = (shard, temperature, chunk_size, return_entropy, reduce_grad)
        return outputs(lp, ent, (kept_ids == labels[:, None]).any(dim=1), labels.shape, return_entropy,
                       return_kept, ctx)

    @staticmethod
    def backward(ctx, grad_lp, *more):
        h, weight, labels, kept_ids, cols, owned, z, log_sum, ent = ctx.saved_tensors
        shard, temperature, chunk_size, return_entropy, reduce_grad = ctx.cfg
        grad_ent = more[0] if return_entropy else None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_lp is None and grad_ent is None) or not (need_h or need_w):
            return (None,) * 10
        grad_k = kept_grad(z, owned, log_sum, ent, grad_lp, grad_ent, temperature)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        n = h.shape[0]
        for s in range(0, n, chunk_size):
            e = min(n, s + chunk_size)
            chunk = torch.empty(e - s, weight.shape[0], dtype=h.dtype, device=h.device)
            scatter_grad(chunk, cols[s:e], owned[s:e], grad_k[s:e], kept_ids[s:e], labels[s:e], shard,
                         None if grad_lp is None else grad_lp[s:e], temperature)
            if need_h:
                torch.matmul(chunk, weight, out=grad_h[s:e])
            if need_w:
                grad_w.addmm_(chunk.t(), h[s:e])
        if need_h and reduce_grad and shard.group is not None:
            dist.all_reduce(grad_h, op=dist.ReduceOp.SUM, group=shard.group)
        return grad_h, grad_w, None, None, None, None, None, None, None, None
