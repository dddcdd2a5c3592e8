"""linear_token_logprobs: equal to materialising hidden @ weight.T and taking the reference."""
from __future__ import annotations

import pytest
import torch

from mcore_rl.kernels import linear_token_logprobs
from mcore_rl.kernels.token_logprobs import token_logprobs_reference

# bf16: the logits themselves are bf16 GEMM outputs, whose rounding depends on the GEMM's
# blocking (a chunk of rows vs all rows), and the weight gradient sums chunk contributions in
# bf16: compare with bf16-level tolerances.
TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _inputs(lead, hidden_size, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, hidden_size, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5 * 4).to(dtype)
    return h, w


def _run(fn, h, w, labels, weights, **kw):
    h = h.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    lp, ent = fn(h, w, labels, **kw)
    ((lp * weights[0]).sum() + (ent * weights[1]).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def _reference(h, w, labels, **kw):
    kw.pop("chunk_size", None)
    return token_logprobs_reference(h @ w.t(), labels, return_entropy=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "lead,vocab,vocab_size,chunk,temperature",
    [
        pytest.param((6, 2), 96, 90, 5, 1.0, id="seq-batch-padded-vocab-uneven-chunks"),
        pytest.param((1,), 33, 33, 4, 0.8, id="single-token-temperature"),
        pytest.param((9,), 64, 64, 64, 1.0, id="one-chunk"),
    ],
)
def test_linear_matches_reference_forward_and_backward(lead, vocab, vocab_size, chunk, temperature, dtype):
    h, w = _inputs(lead, 16, vocab, dtype, seed=vocab)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, vocab_size, lead, generator=g)
    weights = [torch.randn(*lead, generator=g), torch.randn(*lead, generator=g)]
    kw = dict(vocab_size=vocab_size, temperature=temperature)
    got = _run(linear_token_logprobs, h, w, labels, weights, chunk_size=chunk, return_entropy=True, impl="cpu", **kw)
    ref = _run(_reference, h, w, labels, weights, **kw)
    rtol, atol = TOL[dtype]
    for name, a, b in zip(("logp", "entropy", "grad_hidden", "grad_weight"), got, ref):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    assert torch.all(got[3][vocab_size:] == 0), "padded vocabulary rows of the weight get no gradient"


def test_linear_without_entropy_returns_logp_only_and_skips_unneeded_grads():
    h, w = _inputs((4,), 8, 20, torch.float32, seed=0)
    labels = torch.tensor([1, 2, 3, 19])
    w = w.requires_grad_(True)
    lp = linear_token_logprobs(h, w, labels, chunk_size=3, impl="cpu")
    assert isinstance(lp, torch.Tensor) and lp.shape == (4,)
    lp.sum().backward()
    expected = torch.autograd.grad(token_logprobs_reference(h @ w.t(), labels).sum(), w)[0]
    torch.testing.assert_close(w.grad, expected, rtol=1e-4, atol=1e-6)


def test_linear_rejects_mismatched_weight():
    with pytest.raises(ValueError):
        linear_token_logprobs(torch.zeros(2, 8), torch.zeros(10, 7), torch.zeros(2, dtype=torch.long))
