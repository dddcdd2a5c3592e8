"""Vocabulary-parallel (TP=2, gloo) results equal the unsharded (TP=1) computation."""
from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import TOL
from tests.world import shared_world

# (padded vocabulary, vocab_size): padding on the last rank only; and a last rank that holds
# nothing but padding (its shard contributes exp(-inf) = 0 to every sum)
VOCABS = [(64, 64), (64, 57), (64, 30)]


@pytest.fixture(scope="module")
def world():
    return shared_world(2)


def _check_token_logprobs(rank: int, world_size: int, seed: int):
    import torch
    import torch.distributed as dist

    from mcore_rl.kernels import token_logprobs
    from mcore_rl.kernels.token_logprobs import token_logprobs_reference
    from tests.kernels.helpers import make_labels, make_logits, output_weights

    errors = {}
    for padded, vocab_size in VOCABS:
        for dtype in (torch.float32, torch.bfloat16):
            lead = (5, 2)  # Megatron's [seq, batch, V / tp]
            full = make_logits(lead, padded, dtype, seed=seed + padded)
            labels = make_labels(lead, vocab_size, seed=seed)
            w = output_weights(2, lead, seed=seed)
            local = padded // world_size
            mine = full[..., rank * local:(rank + 1) * local].clone().requires_grad_(True)
            lp, ent = token_logprobs(mine, labels, vocab_size=vocab_size, tp_group=dist.group.WORLD,
                                     temperature=0.8, return_entropy=True, impl="cpu")
            ((lp * w[0]).sum() + (ent * w[1]).sum()).backward()
            ref = full.clone().requires_grad_(True)
            rlp, rent = token_logprobs_reference(ref, labels, vocab_size=vocab_size, temperature=0.8,
                                                 return_entropy=True)
            ((rlp * w[0]).sum() + (rent * w[1]).sum()).backward()
            errors[(padded, vocab_size, dtype)] = {
                "logp": (lp.detach(), rlp.detach()),
                "entropy": (ent.detach(), rent.detach()),
                "grad": (mine.grad, ref.grad[..., rank * local:(rank + 1) * local]),
            }
    return errors


def _check_linear(rank: int, world_size: int, seed: int):
    import torch
    import torch.distributed as dist

    from mcore_rl.kernels import linear_token_logprobs
    from mcore_rl.kernels.token_logprobs import token_logprobs_reference

    g = torch.Generator().manual_seed(seed)
    padded, vocab_size, lead, hidden = 48, 45, (4, 3), 16
    h = torch.randn(*lead, hidden, generator=g)
    weight = torch.randn(padded, hidden, generator=g) / 2
    labels = torch.randint(0, vocab_size, lead, generator=g)
    w = [torch.randn(*lead, generator=g), torch.randn(*lead, generator=g)]
    local = padded // world_size
    my_h = h.clone().requires_grad_(True)
    my_w = weight[rank * local:(rank + 1) * local].clone().requires_grad_(True)
    lp, ent = linear_token_logprobs(my_h, my_w, labels, vocab_size=vocab_size, tp_group=dist.group.WORLD,
                                    chunk_size=5, return_entropy=True, impl="cpu")
    ((lp * w[0]).sum() + (ent * w[1]).sum()).backward()
    # without the built-in all-reduce each rank keeps its partial hidden gradient
    part_h = h.clone().requires_grad_(True)
    lp2 = linear_token_logprobs(part_h, my_w.detach(), labels, vocab_size=vocab_size, tp_group=dist.group.WORLD,
                                chunk_size=5, impl="cpu", all_reduce_hidden_grad=False)
    (lp2 * w[0]).sum().backward()
    ref_h, ref_w = h.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    rlp, rent = token_logprobs_reference(ref_h @ ref_w.t(), labels, vocab_size=vocab_size, return_entropy=True)
    ((rlp * w[0]).sum() + (rent * w[1]).sum()).backward()
    ref_h_lp = h.clone().requires_grad_(True)
    (token_logprobs_reference(ref_h_lp @ weight.t(), labels, vocab_size=vocab_size) * w[0]).sum().backward()
    return {
        "logp": (lp.detach(), rlp.detach()),
        "entropy": (ent.detach(), rent.detach()),
        "grad_hidden": (my_h.grad, ref_h.grad),
        "grad_weight": (my_w.grad, ref_w.grad[rank * local:(rank + 1) * local]),
        # partial hidden gradients: they must sum over the ranks to the full one
        "partial_grad_hidden": (part_h.grad, ref_h_lp.grad),
    }


def test_token_logprobs_tp2_equals_tp1_with_padded_vocab_forward_and_backward(world):
    for rank, cases in enumerate(world.run(_check_token_logprobs, 0)):
        for (padded, vocab_size, dtype), outputs in cases.items():
            for name, (ours, ref) in outputs.items():
                rtol, atol = TOL[dtype]["grad" if name == "grad" else "logp"]
                torch.testing.assert_close(
                    ours.float(), ref.float(), rtol=rtol, atol=atol,
                    msg=lambda m: f"rank {rank}, V={padded}, vocab_size={vocab_size}, {dtype}, {name}: {m}")


def test_linear_token_logprobs_tp2_equals_tp1_forward_and_backward(world):
    # fp32; the all-reduced hidden gradient sums two partial GEMMs: summation-order rounding
    results = world.run(_check_linear, 0)
    for rank, outputs in enumerate(results):
        for name, (ours, ref) in outputs.items():
            if name != "partial_grad_hidden":
                torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank}, {name}: {m}")
    partial_sum = sum(out["partial_grad_hidden"][0] for out in results)
    torch.testing.assert_close(partial_sum, results[0]["partial_grad_hidden"][1], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(results[0]["partial_grad_hidden"][0], partial_sum), "not reduced when asked not to"


def _check_truncated(rank: int, world_size: int, seed: int):
    import torch
    import torch.distributed as dist

    from mcore_rl.kernels import linear_token_logprobs, token_logprobs
    from mcore_rl.kernels.token_logprobs import token_logprobs_reference, truncation

    truncation.INITIAL_CANDIDATES = 8  # flat rows then need several rounds of candidates
    g = torch.Generator().manual_seed(seed)
    padded, vocab_size, n, hidden = 96, 90, 24, 16
    local = padded // world_size
    out = {}
    for top_k, top_p in ((-1, 0.8), (20, 0.9), (7, 1.0), (-1, 0.97)):
        h = torch.randn(n, hidden, generator=g)
        weight = torch.randn(padded, hidden, generator=g) * (0.3 if top_p > 0.95 else 1.0)
        logits = h @ weight.t()
        labels = torch.randint(0, vocab_size, (n,), generator=g)
        labels[::2] = logits[::2, :vocab_size].argmax(-1)  # inside the kept set; the rest mostly not
        w = torch.randn(n, generator=g)
        kw = dict(vocab_size=vocab_size, temperature=0.9, top_k=top_k, top_p=top_p, return_entropy=True,
                  return_kept=True)
        mine = logits[:, rank * local:(rank + 1) * local].clone().requires_grad_(True)
        lp, ent, kept = token_logprobs(mine, labels, tp_group=dist.group.WORLD, impl="cpu", **kw)
        (lp * w + 0.5 * ent).sum().backward()
        my_h, my_w = h.clone().requires_grad_(True), weight[rank * local:(rank + 1) * local].clone().requires_grad_(True)
        flp, fent, fkept = linear_token_logprobs(my_h, my_w, labels, tp_group=dist.group.WORLD, chunk_size=5,
                                                 impl="cpu", **kw)
        (flp * w + 0.5 * fent).sum().backward()
        ref = logits.clone().requires_grad_(True)
        rlp, rent, rkept = token_logprobs_reference(ref, labels, **kw)
        (rlp * w + 0.5 * rent).sum().backward()
        ref_h = h.clone().requires_grad_(True)
        ref_w = weight.clone().requires_grad_(True)
        hlp, hent, _ = token_logprobs_reference(ref_h @ ref_w.t(), labels, **kw)
        (hlp * w + 0.5 * hent).sum().backward()
        # the same kept set as the engine would report it: replayed instead of found again
        from mcore_rl.kernels.token_logprobs.reference import truncate_reference

        in_set = torch.isfinite(truncate_reference(logits[:, :vocab_size] / 0.9, top_k, top_p))
        width = int(in_set.sum(1).max())
        kept_ids = torch.full((n, width), -1, dtype=torch.long)
        for i, row in enumerate(in_set):
            ids = row.nonzero()[:, 0]
            kept_ids[i, :len(ids)] = ids.flip(0)
        replay = logits[:, rank * local:(rank + 1) * local].clone().requires_grad_(True)
        plp, pent = token_logprobs(replay, labels, tp_group=dist.group.WORLD, impl="cpu", vocab_size=vocab_size,
                                   temperature=0.9, return_entropy=True, kept_ids=kept_ids)
        (plp * w + 0.5 * pent).sum().backward()
        rep_h = h.clone().requires_grad_(True)
        rep_w = weight[rank * local:(rank + 1) * local].clone().requires_grad_(True)
        qlp, qent = linear_token_logprobs(rep_h, rep_w, labels, tp_group=dist.group.WORLD, chunk_size=5, impl="cpu",
                                          vocab_size=vocab_size, temperature=0.9, return_entropy=True,
                                          kept_ids=kept_ids)
        (qlp * w + 0.5 * qent).sum().backward()
        key = f"top_k={top_k},top_p={top_p}"
        out[key] = {
            "replayed logp": (plp.detach(), rlp.detach()), "replayed entropy": (pent.detach(), rent.detach()),
            "replayed grad": (replay.grad, ref.grad[:, rank * local:(rank + 1) * local]),
            "replayed fused logp": (qlp.detach(), rlp.detach()),
            "replayed fused grad_hidden": (rep_h.grad, ref_h.grad),
            "replayed fused grad_weight": (rep_w.grad, ref_w.grad[rank * local:(rank + 1) * local]),
            "logp": (lp.detach(), rlp.detach()), "entropy": (ent.detach(), rent.detach()),
            "kept": (kept.float(), rkept.float()),
            "grad": (mine.grad, ref.grad[:, rank * local:(rank + 1) * local]),
            "fused logp": (flp.detach(), rlp.detach()), "fused kept": (fkept.float(), rkept.float()),
            "fused grad_hidden": (my_h.grad, ref_h.grad),
            "fused grad_weight": (my_w.grad, ref_w.grad[rank * local:(rank + 1) * local]),
        }
    return out


def test_truncated_logprobs_tp2_equal_tp1_for_the_logits_and_the_fused_head(world):
    for rank, cases in enumerate(world.run(_check_truncated, 3)):
        for key, outputs in cases.items():
            assert 0 < outputs["kept"][1].sum() < len(outputs["kept"][1]), f"{key}: labels all in or all out"
            for name, (ours, ref) in outputs.items():
                torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"rank {rank}, {key}, {name}: {m}")
