"""Runs the Triton kernels under TRITON_INTERPRET=1 and saves their outputs next to the references.

Started in a subprocess by ``test_triton_interpret.py``: the interpreter flag must be set before
the kernels are decorated (imported), and it must not leak into the rest of the test session.
Usage: python -m tests.kernels.triton_interpret_cases OUT.pt
"""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from mcore_rl.kernels import gae, gae_packed, linear_token_logprobs, token_logprobs  # noqa: E402
from mcore_rl.kernels.gae import gae_packed_reference, gae_reference  # noqa: E402
from mcore_rl.kernels.token_logprobs import token_logprobs_reference  # noqa: E402
from tests.kernels.helpers import forward_backward, gae_inputs, make_labels, make_logits, output_weights  # noqa: E402

# (name, leading shape, V, vocab_size, temperature); the interpreter tiles are 4 rows x 64 columns
LOGPROB_CASES = [
    ("seq-batch-padded-vocab", (3, 2), 100, 97, 1.0),
    ("temperature-0.7-three-tiles", (5,), 150, 150, 0.7),
    ("single-token", (1,), 33, 33, 2.0),
]


def logprob_cases(results: dict) -> None:
    for name, lead, vocab, vocab_size, temp in LOGPROB_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            for ent in (False, True):
                x = make_logits(lead, vocab, dtype, seed=vocab)
                lab = make_labels(lead, vocab_size, seed=vocab)
                w = output_weights(2 if ent else 1, lead, seed=vocab)
                kw = dict(vocab_size=vocab_size, temperature=temp, return_entropy=ent)
                ours = forward_backward(token_logprobs, x, lab, w, impl="triton", **kw)
                ref = forward_backward(token_logprobs_reference, x, lab, w, **kw)
                key = f"logprobs/{name}/{str(dtype)[6:]}/{'entropy' if ent else 'logp'}"
                for i, (o, r) in enumerate(zip(ours[0], ref[0])):
                    results[f"{key}/out{i}"] = (o, r, dtype, "logp")
                results[f"{key}/grad"] = (ours[1], ref[1], dtype, "grad")
    # in-place backward: the gradient lands in the logits buffer
    x = make_logits((6,), 80, torch.float32, seed=7)
    lab = make_labels((6,), 77, seed=7)
    leaf = x.clone().requires_grad_(True)
    lp = token_logprobs(leaf, lab, vocab_size=77, inplace_backward=True, impl="triton")
    grad, = torch.autograd.grad(lp.sum(), leaf)
    _, ref_grad = forward_backward(token_logprobs_reference, x, lab, [torch.ones(6)], vocab_size=77)
    results["logprobs/inplace-backward/grad"] = (grad, ref_grad, torch.float32, "grad")
    results["logprobs/inplace-backward/same-buffer"] = (
        torch.tensor(float(grad.data_ptr() == leaf.data_ptr())), torch.tensor(1.0), torch.float32, "exact")


# (name, top_k, top_p): the backward masks p outside the kept set; the forward's statistics
# are the untruncated kernel's, the kept set's come from torch (any device)
TRUNCATION_CASES = [("top-p-0.8", -1, 0.8), ("top-k-7", 7, 1.0), ("top-k-20-top-p-0.9", 20, 0.9)]


def truncated_cases(results: dict) -> None:
    for name, top_k, top_p in TRUNCATION_CASES:
        for dtype in (torch.float32, torch.bfloat16):
            x = make_logits((5, 2), 150, dtype, seed=11, extreme=False)
            lab = make_labels((5, 2), 147, seed=11)
            w = output_weights(2, (5, 2), seed=11)
            kw = dict(vocab_size=147, temperature=0.8, return_entropy=True, top_k=top_k, top_p=top_p)
            ours = forward_backward(token_logprobs, x, lab, w, impl="triton", **kw)
            ref = forward_backward(token_logprobs_reference, x, lab, w, **kw)
            key = f"truncated/{name}/{str(dtype)[6:]}"
            for i, (o, r) in enumerate(zip(ours[0], ref[0])):
                results[f"{key}/out{i}"] = (o, r, dtype, "logp")
            results[f"{key}/grad"] = (ours[1], ref[1], dtype, "grad")


def linear_cases(results: dict) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 3, 16, generator=g)
    weight = torch.randn(70, 16, generator=g) / 2
    lab = torch.randint(0, 66, (4, 3), generator=g)
    outs = []
    for impl in ("triton", "reference"):
        hh, ww = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        kw = dict(chunk_size=5) if impl == "triton" else {}
        lp, ent = linear_token_logprobs(hh, ww, lab, vocab_size=66, temperature=0.9, return_entropy=True,
                                        impl=impl, **kw)
        (lp.sum() + 0.5 * ent.sum()).backward()
        outs.append((lp.detach(), ent.detach(), hh.grad, ww.grad))
    for name, o, r in zip(("logp", "entropy", "grad_hidden", "grad_weight"), *outs):
        results[f"linear/{name}"] = (o, r, torch.float32, "linear")


GAE_SHAPES = [("T=1", 3, 1, 0.99, 0.95), ("T=70-three-tiles", 5, 70, 0.99, 0.95), ("lam=0", 4, 20, 0.9, 0.0)]


def gae_cases(results: dict) -> None:
    for name, batch, steps, gamma, lam in GAE_SHAPES:
        for pattern in ("full", "right", "left", "holes", "mixed"):
            r, v, m = gae_inputs(batch, steps, pattern, seed=steps)
            ours = gae(r, v, m, gamma, lam, impl="triton")
            ref = gae_reference(r.double(), v.double(), m, gamma, lam)
            for what, o, e in zip(("adv", "ret"), ours, ref):
                results[f"gae/{name}/{pattern}/{what}"] = (o, e.float(), torch.float32, "gae")
    r, v, m = gae_inputs(20, 1, "holes", seed=0)
    r, v, m = r.view(-1), v.view(-1), m.view(-1).bool()
    cu = torch.tensor([0, 3, 3, 4, 20])  # includes an empty sequence and a single-step one
    for with_mask in (False, True):
        mm = m if with_mask else None
        ours = gae_packed(r, v, cu, 0.99, 0.95, mask=mm, impl="triton")
        ref = gae_packed_reference(r.double(), v.double(), cu, 0.99, 0.95, mask=mm)
        for what, o, e in zip(("adv", "ret"), ours, ref):
            results[f"gae_packed/{'mask' if with_mask else 'no-mask'}/{what}"] = (o, e.float(), torch.float32, "gae")


def main(argv: list[str]) -> int:
    results: dict = {}
    logprob_cases(results)
    truncated_cases(results)
    linear_cases(results)
    gae_cases(results)
    torch.save(results, argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
