"""Generalised advantage estimation over masked [batch, time] rows or packed sequences.

Convention (shared by every path): for a valid step t (mask 1) let t' be the next valid step in
the same row (none: V(t') = 0, A(t') = 0); delta_t = r_t + gamma V_t' - V_t,
A_t = delta_t + gamma lam A_t', returns_t = A_t + V_t. Masked steps get A = returns = 0 and
their rewards are ignored.
"""
from __future__ import annotations

import torch

from mcore_rl.kernels._impl import resolve_impl
from mcore_rl.kernels.gae.cpu import gae_cpu
from mcore_rl.kernels.gae.packed import check_cu_seqlens, pack_index, to_padded
from mcore_rl.kernels.gae.reference import gae_packed_reference, gae_reference

__all__ = ["gae", "gae_packed", "gae_reference", "gae_packed_reference", "gae_cpu"]


def _check(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, dims: int) -> None:
    if rewards.dim() != dims or values.shape != rewards.shape:
        raise ValueError(
            f"rewards and values must both be {dims}-D of one shape, got "
            f"{tuple(rewards.shape)} and {tuple(values.shape)}"
        )
    if mask is not None and mask.shape != rewards.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != rewards shape {tuple(rewards.shape)}")


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) for rewards, values, mask: [B, T]; outputs [B, T].

    mask holds 1 / True for valid steps and 0 / False for masked ones (other values are not
    allowed). Outputs are fp32 (fp64 when an input is fp64; the Triton path always computes in
    fp32). ``values[:, t]`` is the critic's output at the position that predicts token t.
    impl: "auto" (Triton on CUDA when available, else "cpu"), "reference", "cpu", "triton".
    Not differentiable (advantages are targets).
    """
    _check(rewards, values, mask, 2)
    which = resolve_impl(impl, rewards)
    if which == "reference":
        return gae_reference(rewards, values, mask, gamma, lam)
    if which == "cpu":
        return gae_cpu(rewards, values, mask, gamma, lam)
    from mcore_rl.kernels.gae.triton_kernel import gae_rows_triton

    batch, steps = rewards.shape
    starts = torch.arange(batch, device=rewards.device, dtype=torch.int64) * steps
    lengths = torch.full((batch,), steps, device=rewards.device, dtype=torch.int64)
    adv, ret = gae_rows_triton(
        rewards.contiguous().view(-1), values.contiguous().view(-1), mask.contiguous().view(-1),
        starts, lengths, gamma, lam,
    )
    return adv.view(batch, steps), ret.view(batch, steps)


@torch.no_grad()
def gae_packed(
    rewards: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    gamma: float,
    lam: float,
    mask: torch.Tensor | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over sequences concatenated along dim 0 (the packed / THD layout).

    rewards, values, mask (optional, default all valid): [total]; cu_seqlens: [S + 1] int with
    cu_seqlens[0] = 0 and cu_seqlens[-1] = total; sequence i is [cu_seqlens[i], cu_seqlens[i+1]).
    Returns (advantages, returns), both [total]; the same convention as ``gae`` per sequence.
    """
    _check(rewards, values, mask, 1)
    cu = check_cu_seqlens(cu_seqlens.to(rewards.device), rewards.shape[0])
    which = resolve_impl(impl, rewards)
    if which == "reference":
        return gae_packed_reference(rewards, values, cu, gamma, lam, mask)
    if which == "triton":
        from mcore_rl.kernels.gae.triton_kernel import gae_rows_triton

        return gae_rows_triton(
            rewards.contiguous(), values.contiguous(), None if mask is None else mask.contiguous(),
            cu[:-1].contiguous(), (cu[1:] - cu[:-1]).contiguous(), gamma, lam,
        )
    index, n_seq, max_len = pack_index(cu)
    valid = torch.ones_like(rewards, dtype=torch.float32) if mask is None else mask
    m_pad = to_padded(valid, index, n_seq, max_len, dtype=torch.float32)
    adv, ret = gae_cpu(
        to_padded(rewards, index, n_seq, max_len), to_padded(values, index, n_seq, max_len), m_pad, gamma, lam
    )
    return adv.view(-1)[index], ret.view(-1)[index]
