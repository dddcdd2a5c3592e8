"""Inputs and tolerances shared by the kernel tests (and the Triton-interpreter case runner)."""
from __future__ import annotations

import torch

#: (rtol, atol) per output and logits dtype. Log-probs and entropies are computed in fp32 in
#: every path, so even bf16 logits give fp32-accurate values (only summation order differs);
#: bf16 gradients may differ by one bf16 ulp (at most 2^-7 relative) where two fp32 results round apart.
TOL = {
    torch.float32: {"logp": (1e-5, 1e-5), "grad": (1e-4, 1e-5)},
    torch.bfloat16: {"logp": (1e-5, 1e-4), "grad": (8e-3, 1e-5)},
}
#: GAE, fp32 inputs, compared with the fp64 reference: fp32 rounding of sums of O(100) terms.
GAE_TOL = (1e-5, 2e-5)


def make_logits(lead: tuple[int, ...], vocab: int, dtype: torch.dtype, seed: int, extreme: bool = True) -> torch.Tensor:
    """Random logits [*lead, vocab]; with ``extreme`` some rows hold +-1e4 (one-hot-like softmax)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, vocab, generator=g) * 3
    if extreme:
        flat = x.view(-1, vocab)
        flat[0, 0] = 1e4  # a row whose softmax is a single spike
        flat[-1, :] = -1e4
        flat[-1, vocab // 2] = 1e4  # and one of only extremes
    return x.to(dtype)


def make_labels(lead: tuple[int, ...], vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    lab = torch.randint(0, vocab_size, lead, generator=g)
    lab.view(-1)[0] = 0  # the label of the spiked row is the spike
    return lab


def output_weights(n_out: int, lead: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """Random upstream gradients for (logp[, entropy])."""
    g = torch.Generator().manual_seed(seed + 2)
    return [torch.randn(*lead, generator=g) for _ in range(n_out)]


def forward_backward(fn, logits: torch.Tensor, labels: torch.Tensor, weights, **kw):
    """Run fn on a fresh leaf copy of logits; return (outputs, logits.grad) with loss sum(w * out)."""
    x = logits.detach().clone().requires_grad_(True)
    out = fn(x, labels, **kw)
    outs = list(out) if isinstance(out, tuple) else [out]
    loss = sum((o * w).sum() for o, w in zip(outs, weights))
    loss.backward()
    return [o.detach() for o in outs], x.grad


def gae_inputs(batch: int, steps: int, pattern: str, seed: int):
    """rewards, values [B, T] fp32 and a 0/1 fp32 mask of the given pattern.

    pattern: "full", "right" (right padding, random lengths incl. 0 and T), "left" (left
    padding), "holes" (random holes), "mixed" (holes + a fully masked row + a row valid
    only at its last step).
    """
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(batch, steps, generator=g)
    v = torch.randn(batch, steps, generator=g)
    t = torch.arange(steps)
    lengths = torch.randint(0, steps + 1, (batch,), generator=g)
    lengths[0] = steps
    if pattern == "full":
        m = torch.ones(batch, steps)
    elif pattern == "right":
        m = (t < lengths[:, None]).float()
    elif pattern == "left":
        m = (t >= (steps - lengths)[:, None]).float()
    else:
        m = (torch.rand(batch, steps, generator=g) > 0.3).float()
        if pattern == "mixed" and batch >= 3:
            m[1] = 0
            m[2] = 0
            m[2, -1] = 1
    return r, v, m
