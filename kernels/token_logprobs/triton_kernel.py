"""Triton kernels for token log-probs: per-row softmax statistics and the logits gradient.

Same contract as ``cpu.py`` (``row_stats`` / ``row_grad``). Each program owns BLOCK_N rows and
walks the vocabulary in BLOCK_V tiles with an online (running-max) log-sum-exp, so logits are
read once in the forward and once in the backward, and nothing [N, V]-sized is allocated except
the gradient itself (or not even that with the in-place backward).
"""
from __future__ import annotations

import torch

from mcore_rl.kernels._triton import check_launchable, interpret_mode, require_triton
from mcore_rl.kernels.token_logprobs.vocab_parallel import VocabShard

require_triton()

from mcore_rl.kernels._triton import tl, triton  # noqa: E402


@triton.jit
def _row_stats_kernel(
    x_ptr, stride_x, lab_ptr, max_ptr, logsum_ptr, ent_ptr, tgt_ptr,
    n_rows, n_valid, vocab_start, temperature,
    NEED_ENT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    row_off = rows.to(tl.int64) * stride_x
    cols0 = tl.arange(0, BLOCK_V)
    # the running max starts finite (any real logit is far above -3e38), so that the first
    # tile's m - m_new is not -inf - (-inf) = nan
    m = tl.full([BLOCK_N], -3.0e38, tl.float32)  # running max of the raw logits x
    s = tl.zeros([BLOCK_N], dtype=tl.float32)  # sum exp(d), d = (x - m) / T
    u = tl.zeros([BLOCK_N], dtype=tl.float32)  # sum exp(d) d
    for v0 in range(0, n_valid, BLOCK_V):
        cols = v0 + cols0
        ok = row_ok[:, None] & (cols[None, :] < n_valid)
        x = tl.load(x_ptr + row_off[:, None] + cols[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        shift = (m - m_new) / temperature
        alpha = tl.exp(shift)
        d = (x - m_new[:, None]) / temperature  # exact subtraction, then the scaling
        p = tl.exp(d)
        if NEED_ENT:
            # rescale u to the new max: sum e^(d')(d') = alpha (u + shift s); before the first
            # tile s = u = 0 and shift may be -inf (from the -3e38 start): the term is 0
            rescaled = tl.where(s > 0, alpha * (u + shift * s), 0.0)
            u = rescaled + tl.sum(tl.where(ok, p * d, 0.0), axis=1)
        s = alpha * s + tl.sum(p, axis=1)
        m = m_new
    s = tl.where(row_ok, s, 1.0)  # rows past the end (never stored) stay finite
    log_s = tl.log(s)
    tl.store(max_ptr + rows, m, mask=row_ok)
    tl.store(logsum_ptr + rows, log_s, mask=row_ok)
    if NEED_ENT:
        tl.store(ent_ptr + rows, log_s - u / s, mask=row_ok)
    local = tl.load(lab_ptr + rows, mask=row_ok, other=0).to(tl.int64) - vocab_start
    owned = row_ok & (local >= 0) & (local < n_valid)
    tgt = tl.load(x_ptr + row_off + local, mask=owned, other=0.0).to(tl.float32)
    tl.store(tgt_ptr + rows, tgt, mask=row_ok)


@triton.jit
def _row_grad_kernel(
    x_ptr, stride_x, out_ptr, stride_out, lab_ptr, max_ptr, logsum_ptr, ent_ptr, glp_ptr, gent_ptr,
    thr_ptr, n_rows, n_cols, n_valid, vocab_start, temperature,
    HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr, HAS_THR: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    x_off = rows.to(tl.int64) * stride_x
    o_off = rows.to(tl.int64) * stride_out
    row_max = tl.load(max_ptr + rows, mask=row_ok, other=0.0)
    log_sum = tl.load(logsum_ptr + rows, mask=row_ok, other=0.0)
    inv_t = 1.0 / temperature
    if HAS_GLP:
        glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0).to(tl.float32) * inv_t
    if HAS_GENT:
        gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0).to(tl.float32) * inv_t
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
    if HAS_THR:  # a truncated distribution: p is 0 below the kept set's threshold
        thr = tl.load(thr_ptr + rows, mask=row_ok, other=0.0)
    local = tl.load(lab_ptr + rows, mask=row_ok, other=0).to(tl.int64) - vocab_start
    cols0 = tl.arange(0, BLOCK_V)
    for v0 in range(0, n_cols, BLOCK_V):
        cols = v0 + cols0
        real = row_ok[:, None] & (cols[None, :] < n_valid)
        x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=real, other=0.0).to(tl.float32)
        # as in the forward: (x - max) / T - log_sum, exact where logits are huge
        logp = (x - row_max[:, None]) / temperature - log_sum[:, None]
        p = tl.exp(logp)
        if HAS_THR:
            p = tl.where(x >= thr[:, None], p, 0.0)
        g = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
        if HAS_GLP:
            g = tl.where(cols[None, :] == local[:, None], glp[:, None], 0.0) - p * glp[:, None]
        if HAS_GENT:
            g -= p * gent[:, None] * (logp + ent[:, None])
        g = tl.where(real, g, 0.0)  # padded vocabulary columns get exactly 0
        store_ok = row_ok[:, None] & (cols[None, :] < n_cols)
        tl.store(out_ptr + o_off[:, None] + cols[None, :], g.to(out_ptr.dtype.element_ty), mask=store_ok)


def _blocks(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_V, num_warps)."""
    if interpret_mode():  # small tiles so that small test vocabularies still span several
        return 4, 64, 1
    return 1, min(4096, triton.next_power_of_2(max(n_cols, 16))), 8


def row_stats(x: torch.Tensor, labels: torch.Tensor, shard: VocabShard, temperature: float, need_entropy: bool):
    """See ``cpu.row_stats``."""
    check_launchable(x)
    n = x.shape[0]
    f32 = dict(dtype=torch.float32, device=x.device)
    row_max, log_sum, tgt = torch.empty(n, **f32), torch.zeros(n, **f32), torch.zeros(n, **f32)
    ent = torch.zeros(n, **f32) if need_entropy else None
    if shard.n_valid == 0 or n == 0:
        return row_max.fill_(float("-inf")), log_sum, ent, tgt
    block_n, block_v, warps = _blocks(shard.n_valid)
    _row_stats_kernel[(triton.cdiv(n, block_n),)](
        x, x.stride(0), labels, row_max, log_sum, ent if need_entropy else log_sum, tgt,
        n, shard.n_valid, shard.start, float(temperature),
        NEED_ENT=need_entropy, BLOCK_N=block_n, BLOCK_V=block_v, num_warps=warps,
    )
    return row_max, log_sum, ent, tgt


def row_grad(x, labels, shard: VocabShard, temperature: float, row_max, log_sum, ent, grad_lp, grad_ent, out,
             threshold=None):
    """See ``cpu.row_grad``; ``out`` may be ``x`` (each tile is read before it is written)."""
    check_launchable(x)
    n, n_cols = x.shape
    if n == 0:
        return out
    block_n, block_v, warps = _blocks(n_cols)
    _row_grad_kernel[(triton.cdiv(n, block_n),)](
        x, x.stride(0), out, out.stride(0), labels, row_max, log_sum,
        ent if grad_ent is not None else log_sum,
        grad_lp.contiguous() if grad_lp is not None else log_sum,
        grad_ent.contiguous() if grad_ent is not None else log_sum,
        threshold if threshold is not None else log_sum,
        n, n_cols, shard.n_valid, shard.start, float(temperature),
        HAS_GLP=grad_lp is not None, HAS_GENT=grad_ent is not None, HAS_THR=threshold is not None,
        BLOCK_N=block_n, BLOCK_V=block_v, num_warps=warps,
    )
    return out
