"""KL between the policy and the reference, per token, and its coefficient controllers."""
from __future__ import annotations

import math

import torch


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    k1: log p - log q (unbiased, can be negative). k3: (q/p - 1) - log(q/p) (unbiased,
    non-negative, lower variance; Schulman's "approximating KL").
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        neg = -log_ratio.clamp(-20.0, 20.0)
        return torch.expm1(neg) - neg
    raise ValueError(f"unknown KL estimator '{estimator}' (k1, k3)")


class KLController:
    """Fixed coefficient, or adaptive towards a target KL (proportional control, clipped)."""

    def __init__(self, init_coef: float, target: float | None = None, horizon: int = 10000):
        self.coef = init_coef
        self.target = target
        self.horizon = horizon

    def update(self, observed_kl: float, n_samples: int) -> float:
        if self.target is not None and self.coef > 0:
            error = max(-0.2, min(0.2, observed_kl / self.target - 1.0))
            self.coef *= 1.0 + error * n_samples / self.horizon
        return self.coef

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])
        assert math.isfinite(self.coef)
