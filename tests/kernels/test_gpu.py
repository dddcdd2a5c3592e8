"""The Triton kernels compiled for a real GPU match the references (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

from mcore_rl.kernels import gae, gae_packed, linear_token_logprobs, token_logprobs
from mcore_rl.kernels.gae import gae_packed_reference, gae_reference
from mcore_rl.kernels.token_logprobs import token_logprobs_reference
from tests.kernels.helpers import GAE_TOL, TOL, forward_backward, gae_inputs, make_labels, make_logits, output_weights

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lead,vocab,vocab_size,temperature", [((64, 2), 32000, 31990, 1.0), ((3,), 5000, 5000, 0.6)])
def test_gpu_token_logprobs_matches_reference(lead, vocab, vocab_size, temperature, dtype):
    x = make_logits(lead, vocab, dtype, seed=0).cuda()
    lab = make_labels(lead, vocab_size, seed=0).cuda()
    w = [t.cuda() for t in output_weights(2, lead, seed=0)]
    kw = dict(vocab_size=vocab_size, temperature=temperature, return_entropy=True)
    (lp, ent), grad = forward_backward(token_logprobs, x, lab, w, impl="auto", **kw)
    (rlp, rent), rgrad = forward_backward(token_logprobs_reference, x, lab, w, **kw)
    torch.testing.assert_close(lp, rlp, rtol=TOL[dtype]["logp"][0], atol=TOL[dtype]["logp"][1])
    torch.testing.assert_close(ent, rent, rtol=TOL[dtype]["logp"][0], atol=TOL[dtype]["logp"][1])
    torch.testing.assert_close(grad.float(), rgrad.float(), rtol=TOL[dtype]["grad"][0], atol=TOL[dtype]["grad"][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("top_k,top_p", [(-1, 0.8), (20, 1.0), (50, 0.9)])
def test_gpu_truncated_token_logprobs_match_reference(top_k, top_p, dtype):
    x = make_logits((64, 2), 32000, dtype, seed=1, extreme=False).cuda()
    lab = make_labels((64, 2), 31990, seed=1).cuda()
    lab[::2] = x[::2, :, :31990].float().argmax(-1)
    w = [t.cuda() for t in output_weights(2, (64, 2), seed=1)]
    kw = dict(vocab_size=31990, temperature=0.9, return_entropy=True, top_k=top_k, top_p=top_p)
    (lp, ent), grad = forward_backward(token_logprobs, x, lab, w, impl="auto", **kw)
    (rlp, rent), rgrad = forward_backward(token_logprobs_reference, x, lab, w, **kw)
    torch.testing.assert_close(lp, rlp, rtol=TOL[dtype]["logp"][0], atol=TOL[dtype]["logp"][1])
    torch.testing.assert_close(ent, rent, rtol=TOL[dtype]["logp"][0], atol=TOL[dtype]["logp"][1])
    torch.testing.assert_close(grad.float(), rgrad.float(), rtol=TOL[dtype]["grad"][0], atol=TOL[dtype]["grad"][1])


def test_gpu_auto_picks_triton_for_cuda_tensors():
    from mcore_rl.kernels import HAS_TRITON
    from mcore_rl.kernels._impl import resolve_impl

    assert resolve_impl("auto", torch.zeros(1, device="cuda")) == ("triton" if HAS_TRITON else "cpu")


def test_gpu_linear_token_logprobs_matches_reference():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 64, generator=g).cuda().requires_grad_(True)
    w = (torch.randn(5000, 64, generator=g) / 8).cuda().requires_grad_(True)
    lab = torch.randint(0, 4990, (300,), generator=g).cuda()
    lp = linear_token_logprobs(h, w, lab, vocab_size=4990, chunk_size=128)
    gh, gw = torch.autograd.grad(lp.sum(), (h, w))
    rlp = token_logprobs_reference(h @ w.t(), lab, vocab_size=4990)
    rgh, rgw = torch.autograd.grad(rlp.sum(), (h, w))
    for a, b in ((lp, rlp), (gh, rgh), (gw, rgw)):
        # TF32 may be on for the matmuls: relative 1e-3
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("pattern", ["right", "holes", "mixed"])
def test_gpu_gae_matches_reference(pattern):
    r, v, m = gae_inputs(64, 3000, pattern, seed=1)
    adv, ret = gae(r.cuda(), v.cuda(), m.cuda(), 0.99, 0.95)
    ref_adv, ref_ret = gae_reference(r.double(), v.double(), m, 0.99, 0.95)
    torch.testing.assert_close(adv.cpu(), ref_adv.float(), rtol=GAE_TOL[0], atol=GAE_TOL[1])
    torch.testing.assert_close(ret.cpu(), ref_ret.float(), rtol=GAE_TOL[0], atol=GAE_TOL[1])


def test_gpu_gae_packed_matches_reference():
    g = torch.Generator().manual_seed(2)
    cu = torch.tensor([0, 1000, 1000, 1001, 5000])
    r, v = torch.randn(5000, generator=g), torch.randn(5000, generator=g)
    adv, ret = gae_packed(r.cuda(), v.cuda(), cu.cuda(), 0.99, 0.95)
    ref_adv, ref_ret = gae_packed_reference(r.double(), v.double(), cu, 0.99, 0.95)
    torch.testing.assert_close(adv.cpu(), ref_adv.float(), rtol=GAE_TOL[0], atol=GAE_TOL[1])
    torch.testing.assert_close(ret.cpu(), ref_ret.float(), rtol=GAE_TOL[0], atol=GAE_TOL[1])
