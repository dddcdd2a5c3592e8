"""Shared prompts (`mcore_rl.train.shared_prompts`): the layout by hand, and the train
engine's outputs, losses and updates with it against the same engine without it (every row
whole, PyTorch's causal attention: an independent code path) at TP1, TP2 and PP2."""
import pytest
import torch

from mcore_rl.data.batch import Batch
from mcore_rl.models import ModelArch
from mcore_rl.train.shared_prompts import plan_rows, share_prompts, unshare
from tests.world import shared_world

VOCAB = 97


def test_layout_by_hand():
    # rows 0 and 2 share the prompt [5, 6, 7]; row 1 has its own; row 3 is that prompt
    # without a response (an empty continuation: its outputs are the prompt's)
    batch = Batch.from_sequences([[5, 6, 7, 1, 2], [9, 8, 3], [5, 6, 7, 4], [5, 6, 7]],
                                 prompt_lens=[3, 2, 3, 3])
    layout = share_prompts(batch, hidden_size=8)
    assert plan_rows(batch, hidden_size=8) == [(3, [0, 2, 3]), (2, [1])]
    S = 6  # the longest shared row: 5 6 7 | 1 2 | 4
    assert layout.input_ids.tolist() == [[5, 6, 7, 1, 2, 4], [9, 8, 3, 0, 0, 0]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 3], [0, 1, 2, 0, 0, 0]]
    allowed = ~layout.attention_mask[0, 0]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],  # row 0's first response token: the prompt and itself
        [1, 1, 1, 1, 1, 0],
        [1, 1, 1, 0, 0, 1],  # row 2's response token: the prompt, not row 0's tokens
    ], dtype=torch.bool)
    assert torch.equal(allowed, expected)
    # padding attends to itself only; real tokens never attend to padding
    pad = ~layout.attention_mask[1, 0]
    assert pad[3:].int().tolist() == [[0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]]
    assert not pad[:3, 3:].any()
    # where each token of the original [4, 5] batch sits in the flattened [2 * 6] layout
    # (padding: its shared row's first position)
    assert layout.index.tolist() == [[0, 1, 2, 3, 4], [S, S + 1, S + 2, S, S],
                                     [0, 1, 2, 5, 0], [0, 1, 2, 0, 0]]


def test_nothing_shared_gives_no_layout():
    batch = Batch.from_sequences([[1, 2, 3], [1, 4, 3], [7, 7]], prompt_lens=[1, 2, 1])
    assert share_prompts(batch, hidden_size=8) is None  # prompts [1], [1, 4], [7]: one row each


def test_rows_stop_growing_when_attention_would_cost_more():
    # one prompt token, long continuations: the squared row length outgrows what sharing one
    # token saves, so each continuation keeps a row of its own
    seqs = [[3] + [1] * 60, [3] + [2] * 60, [3] + [4] * 60]
    assert plan_rows(Batch.from_sequences(seqs, prompt_lens=[1] * 3), hidden_size=4) is None
    # a long prompt and short continuations share one row
    seqs = [[3] * 60 + [1], [3] * 60 + [2, 2], [3] * 60 + [4]]
    assert plan_rows(Batch.from_sequences(seqs, prompt_lens=[60] * 3), hidden_size=4) == [
        (60, [0, 1, 2])]


def test_unshare_gathers_outputs_and_sums_the_prompts_gradient():
    batch = Batch.from_sequences([[5, 6, 1], [5, 6, 2, 3]], prompt_lens=[2, 2])
    layout = share_prompts(batch, hidden_size=8)
    hidden = torch.arange(1.0, 6.0).reshape(1, 5, 1).requires_grad_()  # [R=1, S=5, 1]: 5 6 1 2 3
    out = unshare(hidden, layout)[..., 0]
    real = batch["attention_mask"].bool()
    assert out[real].tolist() == [1.0, 2.0, 3.0, 1.0, 2.0, 4.0, 5.0]
    (out * batch["attention_mask"]).sum().backward()
    assert hidden.grad[0, :, 0].tolist() == [2.0, 2.0, 1.0, 1.0, 1.0]  # the prompt serves both rows


# ----- the engine against itself without sharing ---------------------------------------

def arch() -> ModelArch:
    return ModelArch(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=4,
                     num_attention_heads=4, num_kv_heads=2)


def group_batch() -> Batch:
    """Five prompts (one of them alone), 1-4 samples each of different lengths; one
    multi-turn row whose response has an observation in it; micro-batches split them."""
    g = torch.Generator().manual_seed(3)
    seqs, prompt_lens, groups, masks = [], [], [], []
    for gid, (p, samples) in enumerate([(6, 4), (3, 3), (9, 1), (5, 4), (4, 2)]):
        prompt = torch.randint(0, VOCAB, (p,), generator=g).tolist()
        for _ in range(samples):
            r = int(torch.randint(1, 7, (1,), generator=g))
            seqs.append(prompt + torch.randint(0, VOCAB, (r,), generator=g).tolist())
            prompt_lens.append(p)
            groups.append(gid)
    batch = Batch.from_sequences(seqs, prompt_lens=prompt_lens)
    resp = batch["response_mask"].clone()
    row = max(range(len(seqs)), key=lambda i: len(seqs[i]) - prompt_lens[i])
    resp[row, prompt_lens[row] + 1] = 0  # an observation between two response tokens
    adv = torch.randn(resp.shape, generator=g)
    return batch.with_tensors(response_mask=resp, group_id=torch.tensor(groups), advantages=adv)


def policy_loss(outputs, mb):
    mask = mb["response_mask"].float()
    ent = outputs.get("entropy", torch.zeros_like(mask))
    total = -(outputs["logprobs"] * mb["advantages"] * mask).sum() - 0.01 * (ent * mask).sum()
    return total, mask.sum(), {}


def value_loss(outputs, mb):
    mask = mb["attention_mask"].float()
    return ((outputs["values"] - mb["advantages"]) ** 2 * mask).sum(), mask.sum(), {}


def _run(rank, world_size, tp, pp, kind, fused, share):
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine

    ctx = initialize_parallel(tp=tp, pp=pp, seed=5)
    chunks = build_gpt_chunks(arch(), ctx, head="score" if kind == "value" else "lm")
    optim = OptimizerConfig(name="sgd", lr=0.5, clip_grad=0.0, micro_batch_tokens=60)
    engine = build_engine(chunks, ctx, kind=kind, vocab_size=VOCAB, optim=optim,
                          fused_lm_head=fused, share_prompts=share)
    batch = group_batch()
    micro = len(engine._plan(batch))
    before = engine.forward(batch, with_entropy=kind == "lm")
    result = engine.train_batch(batch, policy_loss if kind == "lm" else value_loss,
                                with_entropy=kind == "lm")
    after = engine.forward(batch)
    out = (engine.shares_prompts, micro, before, result.loss, after)
    destroy_parallel()
    return out


def _compare(unshared, shared):
    (flag0, micro0, before0, loss0, after0), (flag1, micro1, before1, loss1, after1) = unshared, shared
    assert (flag0, flag1) == (False, True)
    assert micro1 >= 2, "the batch must span several micro-batches"
    for name in before0:
        torch.testing.assert_close(before1[name], before0[name], rtol=0, atol=2e-5)
    assert loss1 == pytest.approx(loss0, rel=1e-5)
    moved = max((after0[n] - before0[n]).abs().max().item() for n in after0)
    assert moved > 1e-2, "the step must change the outputs visibly"
    for name in after0:  # the same update
        torch.testing.assert_close(after1[name], after0[name], rtol=0, atol=5e-5)


@pytest.mark.parametrize("kind,fused", [("lm", True), ("lm", False), ("value", True)],
                         ids=["lm-fused-head", "lm-full-logits", "value"])
def test_engine_with_shared_prompts_matches_the_unshared_engine(kind, fused):
    world = shared_world(1)
    unshared = world.run(_run, 1, 1, kind, fused, False)[0]
    shared = world.run(_run, 1, 1, kind, fused, True)[0]
    _compare(unshared, shared)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["TP2", "PP2"])
def test_shared_prompts_across_ranks(tp, pp):
    world = shared_world(2)
    unshared = world.run(_run, tp, pp, "lm", True, False)
    shared = world.run(_run, tp, pp, "lm", True, True)
    for u, s in zip(unshared, shared):
        _compare(u, s)
