"""Plain torch GAE: one step at a time from the end, vectorised over the batch.

This is how most RL frameworks write GAE and it is the definition the fast paths are held to.
"""
from __future__ import annotations

import torch


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 when an input is fp64, fp32 otherwise (bf16 / fp16 rewards are upcast)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def gae_reference(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked GAE over [batch, time]; returns (advantages, returns), both [B, T].

    For a valid step t (mask 1) with t' the next valid step of its row (none: V = A = 0):
    delta_t = r_t + gamma V_t' - V_t, A_t = delta_t + gamma lam A_t', returns_t = A_t + V_t.
    Masked steps get A = returns = 0 and their rewards are ignored.
    """
    dt = compute_dtype(rewards, values)
    r, v = rewards.to(dt), values.to(dt)
    valid = mask.bool()
    batch, steps = r.shape
    adv = torch.zeros_like(r)
    next_v = torch.zeros(batch, dtype=dt, device=r.device)
    next_a = torch.zeros(batch, dtype=dt, device=r.device)
    for t in range(steps - 1, -1, -1):
        m = valid[:, t]
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
        # a masked step is skipped: the "next valid" values pass through it unchanged
        next_v = torch.where(m, v[:, t], next_v)
        next_a = torch.where(m, a, next_a)
    returns = torch.where(valid, adv + v, torch.zeros_like(adv))
    return adv, returns


def gae_packed_reference(
    rewards: torch.Tensor,
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    gamma: float,
    lam: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over sequences concatenated along dim 0; sequence i is [cu_seqlens[i], cu_seqlens[i+1])."""
    if mask is None:
        mask = torch.ones_like(rewards, dtype=torch.bool)
    dt = compute_dtype(rewards, values)
    adv = torch.zeros(rewards.shape, dtype=dt, device=rewards.device)
    ret = torch.zeros_like(adv)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            a, r = gae_reference(rewards[None, s:e], values[None, s:e], mask[None, s:e], gamma, lam)
            adv[s:e], ret[s:e] = a[0], r[0]
    return adv, ret
