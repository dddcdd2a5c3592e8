"""Padding-free packing (`mcore_rl.train.packing`): the layout and the micro-batch plan by
hand, the attention's cost, and the train engine's outputs, losses and updates packed
against the same engine on padded rows (an independent layout: PyTorch's batched causal
attention over right-padded rows) at TP1, TP2 with sequence parallelism, PP2 and EP2, with
shared prompts and a multi-turn row with a hole in its response."""
import pytest
import torch

from mcore_rl.data.batch import Batch
from mcore_rl.train.packing import pack, pack_by_tokens
from mcore_rl.train.shared_prompts import unshare
from tests.train.test_shared_prompts import VOCAB, arch, group_batch, policy_loss, value_loss
from tests.world import shared_world


def test_layout_by_hand():
    batch = Batch.from_sequences([[5, 6, 7, 1, 2], [9, 8, 3], [4, 4]], prompt_lens=[3, 2, 1])
    layout = pack(batch, hidden_size=8, multiple_of=4)
    assert layout.input_ids.tolist() == [[5, 6, 7, 1, 2, 9, 8, 3, 4, 4, 0, 0]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 0, 1]]
    # three rows, then the tail that rounds 10 tokens up to 12, a segment of its own
    assert layout.params.cu_seqlens_q.tolist() == [0, 5, 8, 10, 12]
    assert layout.params.qkv_format == "thd" and layout.params.max_seqlen_q == 5
    assert layout.padding.tolist() == [[False] * 10 + [True] * 2]
    assert layout.index.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 0, 0], [8, 9, 0, 0, 0]]
    hidden = torch.arange(12.0).reshape(1, 12, 1)
    back = unshare(hidden, layout)[..., 0] * batch["attention_mask"]
    assert back.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 0, 0], [8, 9, 0, 0, 0]]
    assert not layout.exact_positions and all(m is None for m in layout.params.segment_masks)


def test_shared_prompts_become_one_segment_with_its_own_mask():
    batch = Batch.from_sequences([[5, 6, 7, 1, 2], [9, 8, 3], [5, 6, 7, 4]], prompt_lens=[3, 2, 3])
    layout = pack(batch, hidden_size=8, share=True)
    assert layout.input_ids.tolist() == [[5, 6, 7, 1, 2, 4, 9, 8, 3]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 0, 1, 2]]
    assert layout.params.cu_seqlens_q.tolist() == [0, 6, 9]
    assert layout.exact_positions
    shared, alone = layout.params.segment_masks
    assert alone is None
    assert (~shared[0, 0])[5].int().tolist() == [1, 1, 1, 0, 0, 1]  # the prompt and itself
    assert layout.index.tolist() == [[0, 1, 2, 3, 4], [6, 7, 8, 0, 0], [0, 1, 2, 5, 0]]


def test_pack_to_a_fixed_length_and_an_empty_micro_batch():
    batch = Batch.from_sequences([[1, 2, 3]], prompt_lens=[1])
    assert pack(batch, 8, length=8).params.cu_seqlens_q.tolist() == [0, 3, 8]
    with pytest.raises(ValueError, match="cannot pack 3 tokens into 2"):
        pack(batch, 8, length=2)
    empty = pack(batch.select([]), 8, length=4)  # evens out ranks under expert parallelism
    assert empty.params.cu_seqlens_q.tolist() == [0, 4] and bool(empty.padding.all())


def test_the_plan_budgets_real_tokens_first_fit_decreasing():
    lens = torch.tensor([9, 2, 7, 3, 1, 6])
    plan = pack_by_tokens(lens, list(range(6)), token_budget=10)
    assert plan == [[0, 4], [1, 5], [2, 3]]  # 9+1, 6+2, 7+3: no micro-batch over 10 real tokens
    assert all(sum(int(lens[i]) for i in mb) <= 10 for mb in plan)
    assert len(pack_by_tokens(lens, list(range(6)), 10, multiple_of=2)) == 4
    assert pack_by_tokens(torch.tensor([30, 2]), [0, 1], 10) == [[0], [1]]  # too long: alone
    pairs = pack_by_tokens(lens, list(range(6)), 10, units=[[0, 1], [2, 3], [4, 5]])
    assert sorted(map(sorted, pairs)) == [[0, 1], [2, 3], [4, 5]]  # a pair is never split


def test_attention_costs_the_sum_of_squared_row_lengths():
    """Every attention call stays within one row: the pairs computed are the sum of the rows'
    squares, not the square of the packed length."""
    import torch.nn.functional as F

    from mcore_rl.models import sdpa_attention

    batch = group_batch()
    layout = pack(batch, hidden_size=64)
    lens = batch.seq_lens.tolist()
    calls = []
    original = F.scaled_dot_product_attention

    def record(q, k, v, **kwargs):
        calls.append(q.shape[-2] * k.shape[-2])
        return original(q, k, v, **kwargs)

    attention = sdpa_attention.SDPAttention.__new__(sdpa_attention.SDPAttention)
    torch.nn.Module.__init__(attention)
    attention.config = arch_config()
    attention.attention_dropout = torch.nn.Dropout(0.0)
    attention.softmax_scale = 0.25
    attention.num_attention_heads_per_partition = attention.num_query_groups_per_partition = 2
    attention.hidden_size_per_partition = 8
    attention.cp_group = None
    S = layout.num_tokens
    q = torch.randn(S, 2, 4)
    sdpa_attention.F.scaled_dot_product_attention = record
    try:
        out = attention(q, q, q, None, packed_seq_params=layout.params)
    finally:
        sdpa_attention.F.scaled_dot_product_attention = original
    assert out.shape == (S, 8)
    assert sum(calls) == sum(n * n for n in lens) < S * S / 4
    # and it is each row's causal attention
    start = lens[0]
    row = q[start:start + lens[1]].permute(1, 0, 2)[None]
    expected = original(row, row, row, is_causal=True, scale=0.25)[0].permute(1, 0, 2)
    torch.testing.assert_close(out[start:start + lens[1]], expected.reshape(lens[1], 8))


def arch_config():
    from types import SimpleNamespace

    return SimpleNamespace(window_size=None, softmax_type="vanilla",
                           apply_query_key_layer_scaling=False)


# ----- the engine packed against itself on padded rows ------------------------------------

def _run(rank, world_size, tp, pp, kind, fused, share, packing, sp=False):
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine

    ctx = initialize_parallel(tp=tp, pp=pp, seed=5)
    chunks = build_gpt_chunks(arch(), ctx, head="score" if kind == "value" else "lm",
                              sequence_parallel=sp)
    optim = OptimizerConfig(name="sgd", lr=0.5, clip_grad=0.0, micro_batch_tokens=60)
    engine = build_engine(chunks, ctx, kind=kind, vocab_size=VOCAB, optim=optim,
                          fused_lm_head=fused, share_prompts=share, packing=packing)
    batch = group_batch()
    micro = len(engine._plan(batch))
    before = engine.forward(batch, with_entropy=kind == "lm")
    result = engine.train_batch(batch, policy_loss if kind == "lm" else value_loss,
                                with_entropy=kind == "lm")
    after = engine.forward(batch)
    destroy_parallel()
    return micro, before, result.loss, after


def _compare(padded, packed, atol=1e-5):
    (micro0, before0, loss0, after0), (micro1, before1, loss1, after1) = padded, packed
    assert micro1 >= 2, "the batch must span several packed micro-batches"
    for name in before0:
        torch.testing.assert_close(before1[name], before0[name], rtol=0, atol=atol)
    assert loss1 == pytest.approx(loss0, rel=1e-5)
    moved = max((after0[n] - before0[n]).abs().max().item() for n in after0)
    assert moved > 1e-2, "the step must change the outputs visibly"
    for name in after0:  # the same update
        torch.testing.assert_close(after1[name], after0[name], rtol=0, atol=atol)


@pytest.mark.parametrize("kind,fused,share", [("lm", True, False), ("lm", False, False),
                                              ("value", True, False), ("lm", True, True)],
                         ids=["lm-fused-head", "lm-full-logits", "value", "shared-prompts"])
def test_packed_engine_matches_padded_rows(kind, fused, share):
    world = shared_world(1)
    padded = world.run(_run, 1, 1, kind, fused, False, False)[0]
    packed = world.run(_run, 1, 1, kind, fused, share, True)[0]
    _compare(padded, packed)


@pytest.mark.parametrize("tp,pp,sp", [(2, 1, True), (1, 2, False)], ids=["TP2-SP", "PP2"])
def test_packing_across_ranks(tp, pp, sp):
    world = shared_world(2)
    padded = world.run(_run, tp, pp, "lm", True, False, False)
    packed = world.run(_run, tp, pp, "lm", True, True, True, sp)
    for u, s in zip(padded, packed):
        _compare(u, s)


def test_a_model_whose_attention_cannot_pack_is_refused_in_one_line():
    from mcore_rl.train.packing import check_packing_supported

    class DotProductAttention(torch.nn.Module):  # Megatron's local attention, by name
        pass

    model = torch.nn.Sequential(DotProductAttention())
    with pytest.raises(ValueError, match="cannot attend within packed rows.*train.packing: false"):
        check_packing_supported([model])


def _moe_routes(rank, world_size, packing):
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.routing_replay import ROUTES
    from tests.train.test_moe_layouts import _engine, uneven_batch
    from tests.train.test_shared_prompts import policy_loss

    ctx = initialize_parallel(seed=11)
    engine = _engine(ctx, "alltoall", packing=packing)
    batch = uneven_batch()
    batch = batch.with_tensors(advantages=torch.ones(batch["input_ids"].shape))
    recorded = engine.forward(batch, record_routes=True)
    result = engine.train_batch(batch.with_tensors(routes=recorded[ROUTES]), policy_loss)
    after = engine.forward(batch)
    destroy_parallel()
    return recorded, result.loss, after


def test_routing_replay_records_and_replays_packed_tokens_in_batch_order():
    """An MoE model's routes recorded packed are the padded run's, row by row, and replaying
    them gives the same update."""
    world = shared_world(1)
    padded, packed = world.run(_moe_routes, False)[0], world.run(_moe_routes, True)[0]
    assert int((padded[0]["routes"] > 0).sum()) > 100  # real tokens were recorded
    assert torch.equal(packed[0]["routes"], padded[0]["routes"])
    torch.testing.assert_close(packed[0]["logprobs"], padded[0]["logprobs"], rtol=0, atol=1e-5)
    assert packed[1] == pytest.approx(padded[1], rel=1e-5)
    torch.testing.assert_close(packed[2]["logprobs"], padded[2]["logprobs"], rtol=0, atol=1e-5)
