"""Fast torch GAE: a handful of whole-tensor passes instead of one Python step per time step.

Rewriting the recurrence. With n_t the number of valid steps up to t and c = gamma * lam, for
a valid step t
    A_t = sum_{s >= t} c^(n_s - n_t) Y_s,   Y_s = m_s (r_s - V_s) + gamma m_{s+1} V_{s+1},
because each valid step s contributes its own r_s - V_s, and the gamma V term of a valid step
is the value of the *next valid* step, carried by whichever step sits right before it.

When the valid steps of every row are contiguous (right or left padding: the usual response
mask), n_s - n_t = s - t and A is a discounted suffix sum with one constant factor c, which
is computed blockwise: a [16, 16] matrix of powers of c does the sums inside blocks of 16
steps as one GEMM, the values at block starts follow the same recurrence with factor c^16 on a
16x shorter problem (recursion), and each block then adds its successor's contribution (c^1
for its last step, so this carry is skipped only when c itself is negligible).

Rows with holes (masked steps between valid ones, e.g. tool outputs in a multi-turn response)
use the same sum written as a per-step recurrence, H_t = Y_t + d_{t+1} H_{t+1} with d = c on a
valid step and 1 on a masked one (it passes H on unchanged), and A_t = m_t H_t. Within a block
of 16 steps, with q_t the running product of d from the block's start, H_t =
(sum_{s >= t} q_s Y_s + carry) / q_t: a cumprod, one GEMM with a triangle of ones and a
division. The block starts obey the same kind of recurrence on a 16x shorter problem, solved in
one pass in fp64 (running products and a cumsum, in reversed block order) when all its
products stay in fp64's range (c^T >= 1e-270: rows up to ~10k steps at c = 0.94), else
blockwise again (recursion). Rounding stays like the loop's, whose coefficients are products of
rounded factors too: q_s / q_t is off by about one rounding per factor between t and s. The one
limit is range: a block's product c^16 must stay a normal fp32 number with room to spare, so
for c < 0.18 (c^16 < 1e-12) the scan runs in fp64, with a discount below 1e-17 raised to 1e-17
(a change below fp64 rounding).

Cost on two CPU cores (`mcore-rl bench kernels`, median of 20 calls, on a quiet machine):
[256 x 2048] right-padded ~0.5 ms, with a hole every 7 steps ~0.75-0.9 ms, against ~50 ms for
the per-step loop (~95x and ~60x); [64 x 16384] ~1.0 ms and ~1.7-2.1 ms against ~400 ms. Holes
add about six passes over the data: the discounts and their cumprod (~0.1 ms at [256 x 2048]),
the multiply and divide by q, and the block starts (~0.15 ms: strided reads of block sums and
products, small fp64 scans). Fresh allocations are kept to the outputs and one scratch buffer
because first-touch page faults cost as much as the arithmetic here.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mcore_rl.kernels.gae.reference import compute_dtype

_BLOCK = 16  # GEMM cost grows with the block, the next level's size shrinks with it
_TINY = 1e-30  # discount factors below this are negligible next to the undiscounted term;
# dropping them keeps denormals out of the GEMMs, where they are very slow on CPUs
_LINK_FLOOR = 1e-17  # links (per-step discounts with holes) are raised to this: 16 of them stay
# a normal fp64 number, and the change is below fp64 rounding of the term they multiply
_FP32_RANGE = 1e-12  # the smallest block product of discounts the fp32 hole scan accepts:
# products times |Y| stay normal (full fp32 precision) for |Y| down to ~1e-26
_FP64_RANGE = 1e-270  # the same for fp64 products (block starts solved in one pass)


@functools.lru_cache(maxsize=64)
def _block_matrices(c: float, block: int, dtype: torch.dtype, device: str):
    """powers[j, i] = c^(j - i) for j >= i (else 0) and tail[i] = c^(block - i)."""
    idx = torch.arange(block, dtype=torch.float64)
    gap = idx[:, None] - idx[None, :]
    powers = torch.where(gap >= 0, torch.pow(c, gap.clamp(min=0)), torch.zeros(()))
    tail = torch.pow(c, block - idx)
    powers = torch.where(powers < _TINY, torch.zeros(()), powers)
    tail = torch.where(tail < _TINY, torch.zeros(()), tail)
    return powers.to(dtype=dtype, device=device), tail.to(dtype=dtype, device=device)


def discounted_suffix_sum(y: torch.Tensor, c: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """S_t = sum_{s >= t} c^(s - t) y_s along dim 1 of y: [B, T] -> [B, T], 0 <= c <= 1.

    Blocks of 16 steps are summed by one GEMM with the matrix of powers of c; the values at
    block starts then obey the same recurrence with factor c^16, solved by recursion on a
    16x shorter problem, and each block adds its successor's start value times c^(16 - i).
    ``out`` (contiguous [B, T], not aliasing y) receives the result when given.
    """
    batch, steps = y.shape
    block = min(_BLOCK, steps)
    if steps % block:
        padded = -(-steps // block) * block
        res = discounted_suffix_sum(torch.nn.functional.pad(y, (0, padded - steps)), c)[:, :steps]
        return res.contiguous() if out is None else out.copy_(res)
    nb = steps // block
    powers, tail = _block_matrices(float(c), block, y.dtype, str(y.device))
    rows = y.reshape(batch * nb, block)
    # sums inside each block; exact for c = 0 too (0^0 = 1 on the diagonal)
    local = torch.matmul(rows, powers) if out is None else torch.matmul(rows, powers, out=out.view(batch * nb, block))
    local = local.view(batch, nb, block)
    # a block's last step gets c times its successor's start value: the carry matters unless c
    # itself is negligible, however small c^16 (the next level's factor) is
    if nb > 1 and c >= _TINY:
        starts = discounted_suffix_sum(local[:, :, 0].contiguous(), float(c) ** block)
        local[:, :-1].addcmul_(starts[:, 1:, None], tail)
    return local.view(batch, steps)


def _has_holes(mask_f: torch.Tensor, scratch: torch.Tensor) -> bool:
    """True when some row has a masked step between two valid ones.

    mask_f: [B, T] 0/1 floats; scratch: a [B, T] buffer that may be overwritten (reusing one
    saves a fresh allocation, whose page faults cost as much as the arithmetic here).
    """
    if mask_f.shape[1] < 3:
        return False
    # rising edges m_t (1 - m_{t-1}) (counting a valid first step): a contiguous run has one
    edges = torch.addcmul(mask_f[:, 1:], mask_f[:, 1:], mask_f[:, :-1], value=-1, out=scratch[:, 1:])
    rises = edges.sum(1).add_(mask_f[:, 0])
    return bool((rises > 1).any())


@functools.lru_cache(maxsize=64)
def _suffix_ones(block: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """ones[s, t] = 1 for s >= t: rows @ ones sums each row from column t to its end."""
    return torch.ones(block, block, dtype=dtype, device=device).tril_()


def linked_suffix_sum(y: torch.Tensor, d: torch.Tensor, floor: float, out: torch.Tensor) -> torch.Tensor:
    """H_t = y_t + d_{t+1} H_{t+1} along dim 1 (zero after the end) into ``out``: [B, n] -> [B, n].

    d in [floor, 1] (d[:, 0] is not used but must be in that range too), with floor^16 >=
    _FP32_RANGE for fp32 and floor >= _LINK_FLOOR for fp64, so that products of d over a block
    stay normal numbers. y and d are overwritten (d by its blockwise running products).

    With q_t the product of d from its block's start to t, a block's H_t is
    (sum_{s >= t} q_s y_s + C) / q_t, C = q_last d_next H_next: one GEMM with a triangle of
    ones does the sums, and the block starts' values, which give C, obey the same kind of
    recurrence on a 16x shorter problem.
    """
    batch, n = y.shape
    block = min(_BLOCK, n)
    if n % block:
        pad = -n % block
        res = linked_suffix_sum(F.pad(y, (0, pad)), F.pad(d, (0, pad), value=1.0), floor,
                                out.new_empty(batch, n + pad))
        return out.copy_(res[:, :n])
    nb = n // block
    q = d.view(-1, block).cumprod_(1)
    sums = torch.matmul(y.view(-1, block).mul_(q), _suffix_ones(block, y.dtype, str(y.device)),
                        out=out.view(-1, block))
    if nb > 1:
        sums, q = sums.view(batch, nb, block), q.view(batch, nb, block)
        if floor**n >= _FP64_RANGE:
            carry = _carries_in_one_pass(sums[:, :, 0], q[:, :, -1])
        else:
            carry = _carries_by_recursion(sums, q, floor)
        sums[:, :-1].add_(carry.to(y.dtype)[:, :, None])
    return out.div_(q.view(batch, n))


def _carries_in_one_pass(start_sums: torch.Tensor, products: torch.Tensor) -> torch.Tensor:
    """Carries [B, nb - 1] from each block's sum S_b (at its start) and product Q_b of d: [B, nb].

    G_b = q_first H_start of block b obeys G_b = S_b + Q_b G_{b+1} and the carry of block b is
    Q_b G_{b+1}. Solved at once in fp64 (the caller checks that all products of Q fit its
    range), in reversed block order, where it runs forwards: with R the running product of
    the reversed Q, G = R x cumsum(S / R).
    """
    s_rev, q_rev = start_sums.flip(1), products.flip(1)
    r = torch.cumprod(q_rev, 1, dtype=torch.float64)
    g_rev = torch.div(s_rev, r).cumsum_(1).mul_(r)
    carry_rev = torch.mul(q_rev[:, 1:], g_rev[:, :-1], out=torch.empty_like(q_rev[:, 1:]))
    return carry_rev.flip(1)


def _carries_by_recursion(sums: torch.Tensor, q: torch.Tensor, floor: float) -> torch.Tensor:
    """Carries [B, nb - 1] from blockwise sums and running products q: [B, nb, block].

    The values at block starts obey H_b = S_b / q_b,first + link_{b+1} H_{b+1}, with link the
    product of d from one start to the next (q_last d_next / q_first), solved by
    linked_suffix_sum on the nb starts: in fp64 once 16 links could multiply past fp32's range,
    with links below _LINK_FLOOR raised to it (a change below rounding of the term they scale).
    """
    batch, nb, block = q.shape
    link_floor = max(floor**block, _LINK_FLOOR)
    dt = q.dtype if link_floor**_BLOCK >= _FP32_RANGE else torch.float64
    ends = q[:, :, :: block - 1].to(dt).contiguous()  # first and last q of each block, one pass
    first, last = ends[:, :, 0], ends[:, :, 1]
    starts = torch.div(sums[:, :, 0], first)
    across = last[:, :-1] * first[:, 1:]  # q_last d_next
    link = F.pad(across / first[:, :-1], (1, 0), value=1.0)
    if link_floor > floor**block:
        link.clamp_(min=link_floor)
    h_starts = linked_suffix_sum(starts, link, link_floor, torch.empty_like(starts))
    return across.mul_(h_starts[:, 1:])


def gae_cpu(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``gae_reference``; see the module docstring for the method."""
    dt = compute_dtype(rewards, values)
    r, v, m = rewards.to(dt), values.to(dt), mask.to(dt)
    batch, steps = r.shape
    # one allocation for both outputs: a fresh allocation's first-touch page faults cost as
    # much as the arithmetic here, and one block is recycled by malloc more readily than two
    adv, ret = torch.empty(2, batch, steps, dtype=dt, device=r.device).unbind(0)
    if steps == 0:
        return adv, ret
    holes = _has_holes(m, adv)
    # Y_t = m_t (r_t - V_t) + gamma m_{t+1} V_{t+1}, built in the returns buffer
    y = torch.sub(r, v, out=ret).mul_(m)
    y[:, :-1].addcmul_(v[:, 1:], m[:, 1:], value=gamma)
    c = gamma * lam
    if not holes:
        discounted_suffix_sum(y, c, out=adv)
        adv.mul_(m)  # only changes steps before a row's first valid one (left padding)
        return adv, torch.addcmul(adv, v, m, out=ret)
    # H_t = Y_t + c^(m_{t+1}) H_{t+1} is A_t on valid steps (a masked step passes H on)
    if c**_BLOCK >= _FP32_RANGE:
        floor, d = c, torch.add(1.0, m, alpha=c - 1, out=adv)  # c^(m_t)
    else:
        # 16 discounts could multiply past fp32's range: fp64, with a discount below
        # _LINK_FLOOR raised to it (a change below rounding); c m + (1 - m) keeps a tiny c
        # that 1 + (c - 1) m would round away
        floor, m_w = max(c, _LINK_FLOOR), m.to(torch.float64)
        d, y = torch.mul(m_w, floor).add_(1 - m_w), y.to(torch.float64)
    h = linked_suffix_sum(y, d, floor, torch.empty_like(y))
    torch.mul(h, m, out=adv)
    return adv, torch.addcmul(adv, v, m, out=ret)
