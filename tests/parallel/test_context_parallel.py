"""Context parallelism (`mcore_rl.parallel.context_parallel`): the chunk order and the chunked
causal attention by hand against PyTorch's causal attention over the whole sequence, and the
train engine at CP2, TP2 x CP2 and CP2 with packing against the same model on one rank (CP1): log-probs,
entropy, truncated log-probs and kept sets, values, the loss, its token count and the
update (SGD without clipping: the update is the gradient) within 1e-5."""
import pytest
import torch

from mcore_rl.parallel.context_parallel import causal_attention, chunk_positions, rank_order
from tests.train.test_shared_prompts import VOCAB, arch, group_batch, policy_loss, value_loss
from tests.world import shared_world


def test_chunks_in_load_balanced_order():
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert rank_order(12, 3).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="cannot split into 4 chunks"):
        chunk_positions(6, 2, 0)


@pytest.mark.parametrize("cp", [2, 3])
def test_chunked_attention_equals_causal_attention_over_the_whole_sequence(cp):
    g = torch.Generator().manual_seed(0)
    T = 4 * cp
    q = torch.randn(2, 4, T, 8, generator=g)
    k, v = torch.randn(2, 2, T, 8, generator=g), torch.randn(2, 2, T, 8, generator=g)
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3,
                                                             enable_gqa=True)
    for rank in range(cp):
        mine = chunk_positions(T, cp, rank)
        out = causal_attention(q[:, :, mine], k, v, mine, scale=0.3, enable_gqa=True)
        torch.testing.assert_close(out, whole[:, :, mine], rtol=0, atol=1e-6)


def _run(rank, world_size, tp, cp, kind, fused, packing=False):
    from mcore_rl.config import OptimizerConfig
    from mcore_rl.models.gpt import build_gpt_chunks
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from mcore_rl.train.build import build_engine

    ctx = initialize_parallel(tp=tp, cp=cp, seed=5)
    chunks = build_gpt_chunks(arch(), ctx, head="score" if kind == "value" else "lm")
    optim = OptimizerConfig(name="sgd", lr=0.5, clip_grad=0.0, micro_batch_tokens=60)
    engine = build_engine(chunks, ctx, kind=kind, vocab_size=VOCAB, optim=optim,
                          fused_lm_head=fused, packing=packing)
    batch = group_batch()
    out = {"before": engine.forward(batch, with_entropy=kind == "lm")}
    if kind == "lm":
        out["truncated"] = engine.forward(batch, top_k=5, top_p=0.9)
    result = engine.train_batch(batch, policy_loss if kind == "lm" else value_loss,
                                with_entropy=kind == "lm")
    out |= {"loss": result.loss, "units": result.units, "after": engine.forward(batch),
            "micro": len(engine._plan(batch))}
    destroy_parallel()
    return out


def _compare(one, split):
    assert one["micro"] >= 2, "the batch must span several micro-batches"
    for key in ("before", "truncated", "after"):
        for name in one.get(key, {}):
            torch.testing.assert_close(split[key][name], one[key][name], rtol=0, atol=1e-5,
                                       msg=lambda m: f"{key} {name}: {m}")
    if "truncated" in one:
        assert 0 < one["truncated"]["kept"].sum() < one["before"]["logprobs"].ne(0).sum() + 1
    assert split["units"] == one["units"]
    assert split["loss"] == pytest.approx(one["loss"], rel=1e-5)
    moved = max((one["after"][n] - one["before"][n]).abs().max().item() for n in one["after"])
    assert moved > 1e-2, "the step must change the outputs visibly"


@pytest.mark.parametrize("kind,fused", [("lm", True), ("lm", False), ("value", True)],
                         ids=["lm-fused-head", "lm-full-logits", "value"])
def test_cp2_matches_one_rank(kind, fused):
    one = shared_world(1).run(_run, 1, 1, kind, fused)[0]
    for split in shared_world(2).run(_run, 1, 2, kind, fused):
        _compare(one, split)


def test_tp2_cp2_matches_one_rank():
    one = shared_world(1).run(_run, 1, 1, "lm", True)[0]
    for split in shared_world(4).run(_run, 2, 2, "lm", True):
        _compare(one, split)


@pytest.mark.parametrize("kind,fused", [("lm", True), ("lm", False), ("value", True)],
                         ids=["lm-fused-head", "lm-full-logits", "value"])
def test_cp2_with_packing_matches_one_rank_on_padded_rows(kind, fused):
    """Every packed row split over the CP ranks (each row padded to 2 x CP chunks)."""
    one = shared_world(1).run(_run, 1, 1, kind, fused)[0]
    for split in shared_world(2).run(_run, 1, 2, kind, fused, True):
        _compare(one, split)
