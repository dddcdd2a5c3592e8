"""Triton GAE: rows of the batch in parallel, time in tiles scanned with an associative scan.

Per row, with Y_t = m_t (r_t - V_t) + gamma m_{t+1} V_{t+1} and k_t = c if step t+1 is valid
else 1 (c = gamma * lam), the value B_t = Y_t + k_t B_{t+1} equals A_t at every valid step (a
masked step passes the next valid step's value through unchanged). Each step is the affine map
x -> k_t x + Y_t; composing maps is associative, so a tile of BLOCK_T steps is solved by one
``tl.associative_scan`` and tiles are chained through the carried value. Tiles are loaded in
reverse time order so the scan runs forward, which also lets rows of different lengths (the
packed layout) share a program: each row counts back from its own end.
"""
from __future__ import annotations

import torch

from mcore_rl.kernels._triton import check_launchable, interpret_mode, require_triton

require_triton()

from mcore_rl.kernels._triton import tl, triton  # noqa: E402


@triton.jit
def _compose(k_a, y_a, k_b, y_b):
    # a: maps already applied (later steps), b: the next (earlier) step -> b after a
    return k_b * k_a, y_b + k_b * y_a


@triton.jit
def _gae_kernel(
    r_ptr, v_ptr, m_ptr, adv_ptr, ret_ptr, start_ptr, len_ptr,
    n_rows, max_len, gamma, c,
    HAS_MASK: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < n_rows
    start = tl.load(start_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    length = tl.load(len_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    j = tl.arange(0, BLOCK_T)
    carry = tl.zeros([BLOCK_B], dtype=tl.float32)
    for t0 in range(0, max_len, BLOCK_T):
        t = length[:, None] - 1 - (t0 + j[None, :])  # reverse time, [BLOCK_B, BLOCK_T]
        ok = row_ok[:, None] & (t >= 0)
        has_next = ok & (t + 1 < length[:, None])
        off = start[:, None] + t
        r = tl.load(r_ptr + off, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + off, mask=ok, other=0.0).to(tl.float32)
        v_next = tl.load(v_ptr + off + 1, mask=has_next, other=0.0).to(tl.float32)
        if HAS_MASK:
            m = tl.load(m_ptr + off, mask=ok, other=0).to(tl.float32)
            m_next = tl.load(m_ptr + off + 1, mask=has_next, other=0).to(tl.float32)
        else:
            m = ok.to(tl.float32)
            m_next = has_next.to(tl.float32)
        y = m * (r - v) + gamma * m_next * v_next
        k = 1.0 + (c - 1.0) * m_next
        # steps before a row's start (t < 0) are identity maps: the carry passes through them
        y = tl.where(ok, y, 0.0)
        k = tl.where(ok, k, 1.0)
        k_scan, y_scan = tl.associative_scan((k, y), 1, _compose)
        b = y_scan + k_scan * carry[:, None]
        adv = m * b
        tl.store(adv_ptr + off, adv, mask=ok)
        tl.store(ret_ptr + off, adv + m * v, mask=ok)
        carry = tl.sum(tl.where(j[None, :] == BLOCK_T - 1, b, 0.0), axis=1)


def _blocks(max_len: int) -> tuple[int, int]:
    if interpret_mode():  # the interpreter pays per op, not per element: few, wide tiles
        return 16, min(32, triton.next_power_of_2(max(max_len, 1)))
    return 4, min(1024, triton.next_power_of_2(max(max_len, 16)))


def gae_rows_triton(rewards, values, mask, starts, lengths, gamma: float, lam: float):
    """GAE over rows given by (start offset, length) into flat rewards / values / mask.

    rewards, values: [total] (any float dtype); mask: [total] or None (all valid);
    starts, lengths: [rows] int64. Returns fp32 (advantages, returns), both [total].
    """
    check_launchable(rewards)
    adv = torch.empty(rewards.shape, dtype=torch.float32, device=rewards.device)
    ret = torch.empty_like(adv)
    n_rows = starts.numel()
    max_len = int(lengths.max()) if n_rows else 0
    if n_rows == 0 or max_len == 0:
        return adv.zero_(), ret.zero_()
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    block_b, block_t = _blocks(max_len)
    grid = (triton.cdiv(n_rows, block_b),)
    _gae_kernel[grid](
        rewards, values, mask if mask is not None else rewards, adv, ret, starts, lengths,
        n_rows, max_len, float(gamma), float(gamma * lam),
        HAS_MASK=mask is not None, BLOCK_B=block_b, BLOCK_T=block_t,
    )
    return adv, ret
