"""Critic and reward model: the GPT backbone with a scalar head, checked against HF.

- Reward model from an HF ``*ForSequenceClassification`` (num_labels=1): its score of each
  sequence of a right-padded batch equals HF's, at TP2 and PP2, from the HF directory and
  from a converted checkpoint.
- Critic from a causal LM: a fresh head, the same on every rank; its values equal the HF
  backbone's final hidden states times that head. Saved and exported, it loads in HF as a
  ``*ForSequenceClassification`` that scores like it.
"""
import pytest
import torch

from mcore_rl.convert import convert_hf_to_mcore, convert_mcore_to_hf
from mcore_rl.errors import UsageError
from mcore_rl.models.provider import build_model
from tests.models.tiny_hf import load_hf, save_tiny_hf_model, tokens
from tests.world import shared_world

ATOL = 1e-4
PAD = 0


@pytest.fixture(scope="module")
def world():
    return shared_world(2)


def _right_padded(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    toks = tokens(vocab_size, batch=3, seq=10, seed=1)
    mask = torch.ones_like(toks)
    for row, length in enumerate((10, 6, 3)):
        toks[row, length:] = PAD
        mask[row, length:] = 0
    return toks, mask


def _scores_at_layouts(rank, world_size, sources, toks, mask, role, save_dir=None):
    from mcore_rl.models.checkpoint import save_mcore_checkpoint
    from mcore_rl.models.value_head import sequence_scores
    from mcore_rl.parallel import destroy_parallel, initialize_parallel
    from tests.models.megatron_forward import forward_all_stages

    results = {}
    for tp, pp in ((2, 1), (1, 2)):
        ctx = initialize_parallel(tp=tp, pp=pp)
        for name, source in sources.items():
            built = build_model(source, ctx, role=role)
            values = forward_all_stages(ctx, built.chunks, toks, gather_vocab=False)
            if values is not None:
                head = built.chunks[-1].output_layer.weight.detach().clone()
                results[(tp, pp, name, rank)] = (values, sequence_scores(values, mask), head)
            if save_dir and (tp, pp) == (2, 1):
                save_mcore_checkpoint(built.chunks, save_dir, built.spec, source,
                                      {"tp": tp, "pp": pp})
        destroy_parallel()
    return results


def _merge(per_rank):
    merged = {}
    for r in per_rank:
        merged.update(r)
    return merged


@pytest.mark.parametrize("variant", ["llama-untied", "qwen2-tied"])
def test_reward_scores_equal_hf_sequence_classification_on_padded_batch(world, tmp_path, variant):
    hf_dir = save_tiny_hf_model(variant, tmp_path / "hf", head="score")
    ckpt = convert_hf_to_mcore(hf_dir, tmp_path / "mcore", tp=2, progress=False)
    hf = load_hf(hf_dir, head="score")
    toks, mask = _right_padded(hf.config.vocab_size)
    with torch.no_grad():
        reference = hf(toks, attention_mask=mask).logits[:, 0]
    results = _merge(world.run(_scores_at_layouts, {"hf": str(hf_dir), "mcore": str(ckpt)},
                               toks, mask, "reward"))
    assert {(tp, pp, s) for tp, pp, s, _ in results} == {
        (tp, pp, s) for tp, pp in ((2, 1), (1, 2)) for s in ("hf", "mcore")}
    for (tp, pp, source, rank), (_, scores, _) in results.items():
        diff = (scores - reference).abs().max().item()
        where = f"{variant} TP{tp} PP{pp} {source} rank {rank}"
        assert diff <= ATOL, f"{where}: |score - HF| {diff:.3g}"


def test_critic_from_causal_lm_has_fresh_head_and_values_of_hf_backbone(world, tmp_path):
    hf_dir = save_tiny_hf_model("llama-tied", tmp_path / "hf")
    hf = load_hf(hf_dir)
    toks, mask = _right_padded(hf.config.vocab_size)
    saved = tmp_path / "critic"
    results = _merge(world.run(_scores_at_layouts, {"hf": str(hf_dir)}, toks, mask, "critic",
                               str(saved)))
    heads = [head for _, _, head in results.values()]
    assert all(torch.equal(heads[0], h) for h in heads), "ranks drew different fresh heads"
    assert heads[0].shape == (1, hf.config.hidden_size) and heads[0].abs().max() > 0
    with torch.no_grad():
        hidden = hf.model(toks).last_hidden_state
    expected = (hidden @ heads[0].T).squeeze(-1)
    for (tp, pp, _, rank), (values, _, _) in results.items():
        diff = (values - expected).abs().max().item()
        where = f"critic TP{tp} PP{pp} rank {rank}"
        assert diff <= ATOL, f"{where}: |value - HF backbone . head| {diff:.3g}"

    exported = convert_mcore_to_hf(saved, tmp_path / "critic-hf", progress=False)
    classifier = load_hf(exported, head="score")
    assert type(classifier).__name__ == "LlamaForSequenceClassification"
    with torch.no_grad():
        hf_scores = classifier(toks, attention_mask=mask).logits[:, 0]
    (_, scores, _) = results[next(k for k in results if k[:2] == (2, 1))]
    assert (hf_scores - scores).abs().max().item() <= ATOL


def test_reward_model_from_causal_lm_is_refused_in_one_line(tmp_path):
    hf_dir = save_tiny_hf_model("llama-untied", tmp_path / "hf")
    with pytest.raises(UsageError, match="reward model needs a trained score head") as err:
        build_model(hf_dir, ctx=None, role="reward")
    assert "\n" not in str(err.value)


def test_actor_from_sequence_classifier_is_refused(tmp_path):
    hf_dir = save_tiny_hf_model("llama-untied", tmp_path / "hf", head="score")
    with pytest.raises(UsageError, match="needs a causal LM"):
        build_model(hf_dir, ctx=None, role="actor")
