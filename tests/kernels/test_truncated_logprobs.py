"""Log-probs under top-k / top-p truncation: against vLLM's own sampler masks, the closed form
of the untruncated ratio, and the plain torch reference (forward and backward)."""
from __future__ import annotations

import sys

import pytest
import torch

from mcore_rl.kernels import linear_token_logprobs, token_logprobs
from mcore_rl.kernels.token_logprobs import token_logprobs_reference
from mcore_rl.kernels.token_logprobs import truncation
from tests.kernels.helpers import TOL, forward_backward, output_weights

SETTINGS = [(-1, 0.8), (20, 1.0), (5, 1.0), (20, 0.8), (-1, 0.95)]


def _engine_processed_logprobs(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's ``processed_logprobs``: its sampler's top-k/top-p mask, then log_softmax."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    n = z.shape[0]
    k = torch.full((n,), top_k, dtype=torch.long) if top_k > 0 else None
    p = torch.full((n,), top_p) if top_p < 1 else None
    return apply_top_k_top_p_pytorch(z.clone(), k, p).log_softmax(dim=-1)


def _peaked_logits(n: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits shaped like a trained LM's: a few likely tokens over a long flat tail."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g)
    x += 6 * torch.rand(n, vocab, generator=g).pow(30)
    return x


def _sample(z: torch.Tensor, top_k: int, top_p: float, seed: int) -> torch.Tensor:
    probs = _engine_processed_logprobs(z, top_k, top_p).exp()
    return torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))[:, 0]


@pytest.mark.parametrize("top_k,top_p", SETTINGS)
def test_sampled_tokens_match_the_engine_and_the_untruncated_ratio_is_the_kept_mass(top_k, top_p):
    temperature = 0.9
    x = _peaked_logits(64, 1000, seed=top_k + int(top_p * 100))
    z = x / temperature
    labels = _sample(z, top_k, top_p, seed=1)
    engine = _engine_processed_logprobs(z, top_k, top_p)
    lp, kept = token_logprobs(x, labels, temperature=temperature, top_k=top_k, top_p=top_p,
                              return_kept=True, impl="cpu")
    assert bool(kept.all()), "a token the engine sampled is outside the kept set"
    torch.testing.assert_close(lp, engine.gather(1, labels[:, None])[:, 0], rtol=0, atol=1e-5)
    # TRL #6789: p(y) / p~(y) is the mass the truncation kept, for every sampled token
    full = token_logprobs(x, labels, temperature=temperature, impl="cpu")
    kept_mass = (torch.softmax(z, dim=-1) * torch.isfinite(engine)).sum(-1)
    torch.testing.assert_close(torch.exp(full - lp), kept_mass, rtol=1e-5, atol=0)
    assert float(kept_mass.max()) < 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k,top_p", SETTINGS + [(3, 0.5), (-1, 0.3)])
def test_cpu_path_matches_reference_forward_and_backward(top_k, top_p, dtype):
    x = (_peaked_logits(40, 300, seed=7) * 1.5).to(dtype)
    labels = _sample(x.float() / 0.8, top_k, top_p, seed=2)
    labels[::5] = torch.randint(0, 300, (8,), generator=torch.Generator().manual_seed(3))  # some outside
    w = output_weights(2, (40,), seed=5)
    kw = dict(temperature=0.8, return_entropy=True, top_k=top_k, top_p=top_p)
    (lp, ent), grad = forward_backward(token_logprobs, x, labels, w, impl="cpu", **kw)
    (rlp, rent), rgrad = forward_backward(token_logprobs_reference, x, labels, w, **kw)
    rtol, atol = TOL[dtype]["logp"]
    torch.testing.assert_close(lp, rlp, rtol=rtol, atol=atol)
    torch.testing.assert_close(ent, rent, rtol=rtol, atol=atol)
    rtol, atol = TOL[dtype]["grad"]
    torch.testing.assert_close(grad.float(), rgrad.float(), rtol=rtol, atol=atol)
    *_, kept = token_logprobs(x, labels, return_kept=True, impl="cpu", **kw)
    *_, rkept = token_logprobs_reference(x, labels, return_kept=True, **kw)
    assert torch.equal(kept, rkept)


def test_labels_outside_the_kept_set_are_flagged_finite_and_get_no_probability_mass():
    x = _peaked_logits(16, 200, seed=3)
    labels = x.argmin(dim=1)  # never in a top-20 set
    lp, kept = token_logprobs(x, labels, top_k=20, return_kept=True, impl="cpu")
    assert not bool(kept.any()) and bool(torch.isfinite(lp).all())
    leaf = x.clone().requires_grad_(True)
    inside = x.argmax(dim=1)
    token_logprobs(leaf, inside, top_k=20, impl="cpu").sum().backward()
    outside = x < x.topk(20, dim=1).values[:, -1:]
    assert bool((leaf.grad[outside] == 0).all()), "a token outside the kept set got gradient"
    torch.testing.assert_close(leaf.grad.sum(1), torch.zeros(16), atol=1e-6, rtol=0)


def test_flat_rows_grow_the_candidates_until_the_nucleus_fits(monkeypatch):
    monkeypatch.setattr(truncation, "INITIAL_CANDIDATES", 4)
    calls = []
    real = truncation.top_candidates

    def counting(x, k, *a):
        calls.append((k, x.shape[0]))
        return real(x, k, *a)

    monkeypatch.setattr(sys.modules["mcore_rl.kernels.token_logprobs.function"], "top_candidates", counting)
    x = torch.randn(6, 500) * 0.1  # the 0.9 nucleus holds most of the vocabulary
    x[:3, 0] = 20.0  # except in three peaked rows, which one pass settles
    labels = torch.arange(6)
    lp = token_logprobs(x, labels, top_p=0.9, impl="cpu")
    assert calls[0] == (5, 6) and len(calls) >= 3, calls
    assert all(rows == 3 for _, rows in calls[1:]), "only the flat rows ask for more candidates"
    torch.testing.assert_close(lp, token_logprobs_reference(x, labels, top_p=0.9), rtol=0, atol=1e-5)


def test_ties_at_the_top_k_threshold_are_all_kept_as_the_engine_keeps_them():
    x = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0, 0.0, 2.0]] * 2)
    labels = torch.tensor([4, 5])
    lp, kept = token_logprobs(x, labels, top_k=3, return_kept=True, impl="cpu")
    assert kept.tolist() == [True, False]
    engine = _engine_processed_logprobs(x, 3, 1.0)
    torch.testing.assert_close(lp[0], engine[0, 4], rtol=0, atol=1e-6)


def test_top_k_covering_the_vocabulary_is_no_truncation():
    x = _peaked_logits(8, 50, seed=1)
    labels = torch.randint(0, 50, (8,))
    torch.testing.assert_close(token_logprobs(x, labels, top_k=50, impl="cpu"),
                               token_logprobs(x, labels, impl="cpu"), rtol=0, atol=0)


@pytest.mark.parametrize("top_k,top_p", [(-1, 0.8), (20, 0.9), (-1, 0.97)])
def test_fused_head_matches_reference_forward_and_backward(top_k, top_p):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(30, 16, generator=g)
    weight = torch.randn(600, 16, generator=g) * 0.4
    labels = _sample(h @ weight[:590].t() / 0.9, top_k, top_p, seed=4)
    labels[::6] = 3
    outs = []
    for impl in ("cpu", "reference"):
        hh, ww = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        kw = dict(chunk_size=7) if impl == "cpu" else {}
        lp, ent, kept = linear_token_logprobs(hh, ww, labels, vocab_size=590, temperature=0.9, top_k=top_k,
                                              top_p=top_p, return_entropy=True, return_kept=True, impl=impl, **kw)
        (lp * torch.linspace(-1, 1, 30)).sum().add(0.5 * ent.sum()).backward()
        outs.append((lp.detach(), ent.detach(), kept.float(), hh.grad, ww.grad))
    for name, o, r in zip(("logp", "entropy", "kept", "grad_hidden", "grad_weight"), *outs):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_bad_truncation_is_refused():
    x, labels = torch.randn(2, 10), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="top_p must be in"):
        token_logprobs(x, labels, top_p=0.0)
    with pytest.raises(ValueError, match="top_k must be"):
        token_logprobs(x, labels, top_k=-3)


def _kept_ids_of(x: torch.Tensor, top_k: int, top_p: float, temperature: float, width: int) -> torch.Tensor:
    """The engine's sampling mask as ids per row ([N, width], -1 padded), from vLLM's sampler."""
    kept = torch.isfinite(_engine_processed_logprobs(x.float() / temperature, top_k, top_p))
    out = torch.full((x.shape[0], width), -1, dtype=torch.long)
    for i, row in enumerate(kept):
        ids = row.nonzero()[:, 0]
        out[i, :len(ids)] = ids[torch.randperm(len(ids), generator=torch.Generator().manual_seed(i))]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_reported_kept_set_gives_what_recomputing_it_gives(dtype):
    x = _peaked_logits(30, 400, seed=9).to(dtype)
    labels = _sample(x.float() / 0.8, 20, 0.9, seed=6)
    kept_ids = _kept_ids_of(x, 20, 0.9, 0.8, width=24)
    w = output_weights(2, (30,), seed=2)
    (lp, ent), grad = forward_backward(token_logprobs, x, labels, w, temperature=0.8, return_entropy=True,
                                       kept_ids=kept_ids, impl="cpu")
    (rlp, rent), rgrad = forward_backward(token_logprobs, x, labels, w, temperature=0.8, return_entropy=True,
                                          top_k=20, top_p=0.9, impl="cpu")
    rtol, atol = TOL[dtype]["logp"]
    torch.testing.assert_close(lp, rlp, rtol=rtol, atol=atol)
    torch.testing.assert_close(ent, rent, rtol=rtol, atol=atol)
    rtol, atol = TOL[dtype]["grad"]
    torch.testing.assert_close(grad.float(), rgrad.float(), rtol=rtol, atol=atol)


def test_reported_kept_sets_match_reference_with_strays_and_empty_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 50, generator=g) * 2
    labels = torch.randint(0, 50, (12,), generator=g)
    kept_ids = torch.full((12, 5), -1)
    for i in range(12):
        ids = torch.randperm(50, generator=g)[:4]
        if i % 3 and labels[i] not in ids:
            ids[0] = labels[i]  # the label among them, as for a sampled token
        kept_ids[i, :4] = ids
    kept_ids[5] = -1  # a token without a kept set (padding): 0 and no gradient
    w = output_weights(2, (12,), seed=3)
    kw = dict(temperature=0.7, return_entropy=True, kept_ids=kept_ids)
    (lp, ent), grad = forward_backward(token_logprobs, x, labels, w, impl="cpu", **kw)
    (rlp, rent), rgrad = forward_backward(token_logprobs_reference, x, labels, w, **kw)
    torch.testing.assert_close(lp, rlp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, rent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, rgrad, rtol=1e-4, atol=1e-5)
    assert lp[5] == 0 and bool((grad[5] == 0).all())
    *_, kept = token_logprobs(x, labels, return_kept=True, impl="cpu", **kw)
    assert kept.tolist() == [bool((kept_ids[i] == labels[i]).any()) for i in range(12)]
    g_lin = torch.Generator().manual_seed(1)
    h, weight = torch.randn(12, 8, generator=g_lin), torch.randn(50, 8, generator=g_lin)
    outs = []
    for impl in ("cpu", "reference"):
        hh, ww = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        flp, fent = linear_token_logprobs(hh, ww, labels, impl=impl, **kw, **({"chunk_size": 5} if impl == "cpu" else {}))
        (flp * w[0] + fent * w[1]).sum().backward()
        outs.append((flp.detach(), fent.detach(), hh.grad, ww.grad))
    for o, r in zip(*outs):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-5)


def test_kept_ids_of_the_wrong_shape_range_or_with_repeats_are_refused():
    x, labels = torch.randn(4, 10), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="kept_ids must be"):
        token_logprobs(x, labels, kept_ids=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"kept_ids must lie in \[0, 10\)"):
        token_logprobs(x, labels, kept_ids=torch.tensor([[0, 10]] * 4))
    with pytest.raises(ValueError, match="names a token twice"):
        token_logprobs(x, labels, kept_ids=torch.tensor([[0, 3, 3, -1]] * 4))
    token_logprobs(x, labels, kept_ids=torch.tensor([[0, 3, -1, -1]] * 4))  # padding may repeat


def test_ties_of_the_kth_value_beyond_the_first_candidates_count_in_top_ps_renormalisation():
    # top-k=4 keeps 7 tokens (four tie at the k-th value); top-p=0.815 then keeps the third token
    # only if all 7 count in the mass (before it: 0.803 of 7, 0.853 of the first 5 candidates)
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0, -4.0, -5.0, -6.0]])
    labels = torch.tensor([2])
    lp, kept = token_logprobs(x, labels, top_k=4, top_p=0.815, return_kept=True, impl="cpu")
    engine = _engine_processed_logprobs(x, 4, 0.815)
    assert bool(kept.all()) and torch.isfinite(engine[0, 2])
    torch.testing.assert_close(lp[0], engine[0, 2], rtol=0, atol=1e-6)
