"""Fast torch path: per-token softmax statistics and gradients, a few rows at a time.

Only a [rows, V] fp32 workspace exists at any moment (a few MiB, sized to stay in cache), never
a [tokens, V] fp32 copy of the logits. The same code runs on any device; on CPU it is the fast
path, on GPU the Triton kernels replace it.
"""
from __future__ import annotations

import torch

from mcore_rl.kernels.token_logprobs.vocab_parallel import VocabShard, local_labels

#: fp32 elements per row chunk: large enough to amortise per-op overhead, small enough that
#: the workspace (two of them with entropy) stays in the CPU's last-level cache.
_CHUNK_ELEMS = 1 << 21


def _chunk_rows(n_cols: int, n_rows: int) -> int:
    return max(1, min(n_rows, _CHUNK_ELEMS // max(n_cols, 1)))


def row_stats(
    x: torch.Tensor,
    labels: torch.Tensor,
    shard: VocabShard,
    temperature: float,
    need_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Local softmax statistics of z = x[:, :n_valid] / temperature, per row.

    x: [N, V_local] any float dtype (read only), labels: [N] global ids.
    Returns (max x, log sum exp((x - max) / T), entropy or None, x at the label), each [N] fp32
    (see ``vocab_parallel.combine_stats``); the target is 0 where this shard does not own the
    label. An empty shard gives max = -inf, log-sum = 0, entropy = 0.
    """
    n, v = x.shape[0], shard.n_valid
    dev = x.device
    row_max = torch.empty(n, dtype=torch.float32, device=dev)
    log_sum = torch.zeros(n, dtype=torch.float32, device=dev)
    target = torch.zeros(n, dtype=torch.float32, device=dev)
    ent = torch.zeros(n, dtype=torch.float32, device=dev) if need_entropy else None
    if v == 0 or n == 0:
        return row_max.fill_(float("-inf")), log_sum, ent, target
    local, owned = local_labels(labels, shard)
    rows = _chunk_rows(v, n)
    work = torch.empty(rows, v, dtype=torch.float32, device=dev)
    work2 = torch.empty_like(work) if need_entropy else None
    for s in range(0, n, rows):
        e = min(n, s + rows)
        xc = x[s:e, :v]
        # max on the input dtype (half the bytes for bf16), then (x - max) / T straight into
        # the fp32 workspace (fp32 because max is): one read of the chunk, no conversion pass
        m = xc.amax(dim=1, keepdim=True).float()
        d = torch.sub(xc, m, out=work[: e - s])
        if temperature != 1.0:
            d.div_(temperature)
        tgt = xc.gather(1, local[s:e, None]).squeeze(1).float()
        target[s:e] = torch.where(owned[s:e], tgt, torch.zeros_like(tgt))
        if need_entropy:
            p = torch.exp(d, out=work2[: e - s])
            sum_p = p.sum(dim=1)
            # sum_j p_j (z_j - m) as one batched dot product, without a [rows, V] temporary
            dot = torch.bmm(p.unsqueeze(1), d.unsqueeze(2)).view(-1)
            log_s = sum_p.log()
            ent[s:e] = log_s - dot / sum_p  # H = log S - E_p[z - m]
        else:
            log_s = d.exp_().sum(dim=1).log()
        row_max[s:e] = m.squeeze(1)
        log_sum[s:e] = log_s
    return row_max, log_sum, ent, target


def row_grad(
    x: torch.Tensor,
    labels: torch.Tensor,
    shard: VocabShard,
    temperature: float,
    row_max: torch.Tensor,
    log_sum: torch.Tensor,
    ent: torch.Tensor | None,
    grad_lp: torch.Tensor | None,
    grad_ent: torch.Tensor | None,
    out: torch.Tensor,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gradient w.r.t. x of sum(grad_lp * logp[label] + grad_ent * entropy), written into out.

    x, out: [N, V_local] (out may be x itself: each chunk is read before it is written);
    row_max, log_sum, ent: [N] global statistics from the forward; grad_lp, grad_ent: [N] or None.
    With p = softmax(z), z = x / T:  dz_j = grad_lp (1[j = label] - p_j) - grad_ent p_j (log p_j + H),
    dx = dz / T, and 0 on padded columns. With ``threshold`` [N] (a truncated distribution,
    see ``truncation.py``; log_sum and ent are then the kept set's) p_j is 0 where x_j is below it.
    """
    n, v = x.shape[0], shard.n_valid
    if v < x.shape[1]:
        out[:, v:].zero_()
    if v == 0 or n == 0:
        return out
    inv_t = 1.0 / temperature
    local, owned = local_labels(labels, shard)
    g_lp = grad_lp.float() * inv_t if grad_lp is not None else None
    g_ent = grad_ent.float() * inv_t if grad_ent is not None else None
    rows = _chunk_rows(v, n)
    work = torch.empty(rows, v, dtype=torch.float32, device=x.device)
    work2 = torch.empty_like(work) if g_ent is not None else None
    for s in range(0, n, rows):
        e = min(n, s + rows)
        xc = x[s:e, :v]
        # (x - max) / T as in the forward, in fp32 (max is fp32, so the subtraction is too)
        d = torch.sub(xc, row_max[s:e, None], out=work[: e - s])
        if temperature != 1.0:
            d.div_(temperature)
        if g_ent is not None:
            # log p = (z - max) - log_sum (two steps: exact where logits are huge);
            # dz_j = -p_j (grad_lp + grad_ent (log p_j + H)) (+ grad_lp at the label)
            logp = d.sub_(log_sum[s:e, None])
            coef = torch.mul(logp, g_ent[s:e, None], out=work2[: e - s])
            bias = g_ent[s:e] * ent[s:e]
            if g_lp is not None:
                bias = bias + g_lp[s:e]
            coef.add_(bias[:, None])
            grad = logp.exp_().mul_(coef).neg_()
        else:
            # -grad_lp p_j = -grad_lp exp(z - max) / S: the 1/S folds into the row factor
            scale = g_lp[s:e] * torch.exp(-log_sum[s:e])
            grad = d.exp_().mul_(scale.neg_()[:, None])
        if threshold is not None:
            grad.masked_fill_(xc < threshold[s:e, None], 0.0)
        if g_lp is not None:
            add = torch.where(owned[s:e], g_lp[s:e], torch.zeros_like(g_lp[s:e]))
            grad.scatter_add_(1, local[s:e, None], add[:, None])
        out[s:e, :v].copy_(grad)
    return out
