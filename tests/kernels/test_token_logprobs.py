"""token_logprobs: the reference against textbook formulas, the fast torch path against the reference."""
from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.kernels import token_logprobs
from mcore_rl.kernels.token_logprobs import token_logprobs_reference
from tests.kernels.helpers import TOL, forward_backward, make_labels, make_logits, output_weights


def _close(actual, expected, dtype, what):
    rtol, atol = TOL[dtype][what]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


def test_reference_matches_log_softmax_gather_and_entropy_formula():
    x = make_logits((6,), 50, torch.float64, seed=0, extreme=False)
    lab = make_labels((6,), 47, seed=0)
    lp, ent = token_logprobs_reference(x, lab, vocab_size=47, temperature=0.5, return_entropy=True)
    z = x[:, :47] / 0.5
    expected_lp = torch.log_softmax(z, -1).gather(-1, lab[:, None]).squeeze(-1)
    p = torch.softmax(z, -1)
    expected_ent = -(p * p.log()).sum(-1)
    torch.testing.assert_close(lp.double(), expected_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent.double(), expected_ent, rtol=1e-6, atol=1e-6)


def test_reference_gradient_is_softmax_minus_onehot_over_temperature():
    x = make_logits((4,), 10, torch.float32, seed=1, extreme=False)
    lab = make_labels((4,), 10, seed=1)
    (lp,), grad = forward_backward(token_logprobs_reference, x, lab, [torch.ones(4)], temperature=2.0)
    expected = (torch.nn.functional.one_hot(lab, 10) - torch.softmax(x / 2.0, -1)) / 2.0
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)


CASES = [
    # (leading shape, V, vocab_size, temperature)
    pytest.param((5, 3), 100, 100, 1.0, id="seq-batch-layout"),
    pytest.param((7,), 1000, 997, 1.0, id="padded-vocab"),
    pytest.param((9,), 333, 333, 0.7, id="temperature-0.7"),
    pytest.param((2, 2, 2), 64, 60, 1.6, id="3-leading-dims-padded-temp-1.6"),
    pytest.param((1,), 5, 5, 1.0, id="single-token-tiny-vocab"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("return_entropy", [False, True], ids=["logp", "logp+entropy"])
@pytest.mark.parametrize("lead,vocab,vocab_size,temperature", CASES)
def test_cpu_path_matches_reference_forward_and_backward(lead, vocab, vocab_size, temperature, return_entropy, dtype):
    x = make_logits(lead, vocab, dtype, seed=vocab)
    lab = make_labels(lead, vocab_size, seed=vocab)
    w = output_weights(2 if return_entropy else 1, lead, seed=vocab)
    kw = dict(vocab_size=vocab_size, temperature=temperature, return_entropy=return_entropy)
    out, grad = forward_backward(token_logprobs, x, lab, w, impl="cpu", **kw)
    ref_out, ref_grad = forward_backward(token_logprobs_reference, x, lab, w, **kw)
    for o, r in zip(out, ref_out):
        assert o.dtype == torch.float32 and o.shape == lab.shape
        _close(o, r, dtype, "logp")
    assert grad.dtype == dtype
    _close(grad, ref_grad, dtype, "grad")
    assert torch.all(grad[..., vocab_size:] == 0), "padded vocabulary columns must get no gradient"


def test_cpu_path_is_exact_on_extreme_logits():
    # one +1e4 logit among -1e4: log p = 0 for it, -2e4 for the others, entropy 0
    x = torch.full((3, 40), -1e4)
    x[:, 7] = 1e4
    lab = torch.tensor([7, 0, 39])
    lp, ent = token_logprobs(x, lab, return_entropy=True, impl="cpu")
    torch.testing.assert_close(lp, torch.tensor([0.0, -2e4, -2e4]), rtol=0, atol=1e-3)
    torch.testing.assert_close(ent, torch.zeros(3), rtol=0, atol=1e-6)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()


def test_forward_does_not_modify_logits():
    x = make_logits((4, 2), 300, torch.bfloat16, seed=3)
    before = x.clone()
    token_logprobs(x, make_labels((4, 2), 300, seed=3), temperature=0.5, return_entropy=True, impl="cpu")
    assert torch.equal(x, before)


def test_inplace_backward_writes_the_gradient_into_the_logits_buffer():
    x0 = make_logits((6,), 130, torch.float32, seed=4)
    lab = make_labels((6,), 128, seed=4)
    w = output_weights(2, (6,), seed=4)
    _, expected = forward_backward(token_logprobs_reference, x0, lab, w, vocab_size=128, return_entropy=True)
    logits = x0.clone().requires_grad_(True)
    buffer = logits.detach()  # same storage as the leaf
    lp, ent = token_logprobs(logits, lab, vocab_size=128, return_entropy=True, inplace_backward=True, impl="cpu")
    grad, = torch.autograd.grad((lp * w[0]).sum() + (ent * w[1]).sum(), logits)
    assert grad.data_ptr() == buffer.data_ptr(), "the gradient must live in the logits buffer"
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5)


def test_gradient_of_unused_entropy_output_equals_logp_only_gradient():
    x = make_logits((5,), 70, torch.float32, seed=5)
    lab = make_labels((5,), 70, seed=5)
    logits = x.clone().requires_grad_(True)
    lp, _ = token_logprobs(logits, lab, return_entropy=True, impl="cpu")
    lp.sum().backward()
    _, expected = forward_backward(token_logprobs_reference, x, lab, [torch.ones(5)])
    torch.testing.assert_close(logits.grad, expected, rtol=1e-4, atol=1e-5)


def test_cpu_path_spans_several_row_chunks(monkeypatch):
    from mcore_rl.kernels.token_logprobs import cpu

    monkeypatch.setattr(cpu, "_CHUNK_ELEMS", 3 * 50)  # 3 rows per chunk, 11 rows: 4 chunks
    x = make_logits((11,), 50, torch.float32, seed=6)
    lab = make_labels((11,), 50, seed=6)
    w = output_weights(2, (11,), seed=6)
    out, grad = forward_backward(token_logprobs, x, lab, w, return_entropy=True, impl="cpu")
    ref_out, ref_grad = forward_backward(token_logprobs_reference, x, lab, w, return_entropy=True)
    for o, r in zip(out, ref_out):
        _close(o, r, torch.float32, "logp")
    _close(grad, ref_grad, torch.float32, "grad")


def test_uniform_logits_give_log_vocab_entropy():
    lp, ent = token_logprobs(torch.zeros(2, 3, 1000), torch.zeros(2, 3, dtype=torch.long), vocab_size=800,
                             return_entropy=True, impl="cpu")
    torch.testing.assert_close(lp, torch.full((2, 3), -math.log(800)))
    torch.testing.assert_close(ent, torch.full((2, 3), math.log(800)))


def test_auto_never_picks_triton_for_cpu_tensors():
    from mcore_rl.kernels._impl import resolve_impl

    assert resolve_impl("auto", torch.zeros(1)) == "cpu"


@pytest.mark.parametrize(
    "kwargs,labels,error",
    [
        (dict(impl="fast"), [0], ValueError),
        (dict(vocab_size=11), [0], ValueError),
        (dict(vocab_size=8), [8], ValueError),
        (dict(), [-1], ValueError),
        (dict(temperature=0.0), [0], ValueError),
    ],
    ids=["unknown-impl", "vocab-larger-than-logits", "label-in-padding", "negative-label", "zero-temperature"],
)
def test_invalid_arguments_raise(kwargs, labels, error):
    with pytest.raises(error):
        token_logprobs(torch.zeros(1, 10), torch.tensor(labels), **kwargs)


def test_triton_impl_on_cpu_tensors_outside_the_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from mcore_rl.kernels import HAS_TRITON

    with pytest.raises(RuntimeError if HAS_TRITON else ImportError, match="triton|CUDA"):
        token_logprobs(torch.zeros(1, 10), torch.tensor([0]), impl="triton")
